"""Attention in JAX layouts: ``jax_nkilib.attention`` (prefill, on ``attention_cte``) and
``jax_nkilib.decode_attention`` (a few new tokens against a KV cache, on ``attention_tkg``)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..attention.attention_bwd import LSE_TILE
from ..attention.attention_cte import attention_cte
from ..attention.attention_tkg import attention_tkg, valid_block_entries
from ..attention.checks import check_qkv_layout, require_float_dtypes
from ..framework.arguments import array_argument
from ..framework.runtime_checks import check_all
from ..framework.validation import check_operand_layouts, static_float, static_int
from ..sharding import auto
from .layouts import KV_CACHE_LAYOUT, PAGED_KV_CACHE_LAYOUT

_WHERE = "jax_nkilib.attention"


def _heads_into_batch(x, seq_last: bool = False):
    """[batch, S, H, d] -> [batch * H, S, d] (row b * H + h), or [batch * H, d, S] with ``seq_last``: one
    transpose either way."""
    batch, seq, heads, d = x.shape
    if seq_last:
        return jnp.transpose(x, (0, 2, 3, 1)).reshape(batch * heads, d, seq)
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(batch * heads, seq, d)


def _cache_rows(cache):
    """A KV cache ``[batch, kv_heads, L, d]`` as the kernels' rows ``[batch * kv_heads, L, d]`` (a reshape)."""
    batch, kv_heads, length, d = cache.shape
    return cache.reshape(batch * kv_heads, length, d)


def _check(q, k, v, sinks, prefix, causal, scale, sliding_window):
    """Validate :func:`attention`'s arguments; returns the static ``(scale, sliding_window, prior_len)`` as Python
    values (``prior_len`` an int when static, else an int32 array of shape ``(1,)``; ``None`` without a prefix)."""
    check_qkv_layout(_WHERE, q, k, v)
    if causal is None:
        raise TypeError(
            f"{_WHERE}: pass causal=True or causal=False (there is no default; for jax.nn.dot_product_attention's "
            "signature and non-causal default use jax_nkilib.dot_product_attention)"
        )
    if not isinstance(causal, bool):
        raise TypeError(f"{_WHERE}: `causal` must be a Python bool; got {causal!r}")
    scale = None if scale is None else static_float(_WHERE, "scale", scale)
    if sliding_window is not None:
        sliding_window = static_int(_WHERE, "sliding_window", sliding_window, minimum=1)
        if not causal:
            raise ValueError(
                f"{_WHERE}: sliding_window needs causal=True; got sliding_window={sliding_window}, causal={causal}"
            )
    batch, _, heads, head_dim = q.shape
    check_operand_layouts(
        _WHERE, {"sinks": ("heads", "batch, heads")}, known={"batch": batch, "heads": heads}, sinks=sinks
    )
    prior_len = None
    if prefix is not None:
        if not (isinstance(prefix, (tuple, list)) and len(prefix) == 3):
            raise TypeError(f"{_WHERE}: `prefix` must be (k_prior, v_prior, prior_len)")
        k_prior, v_prior, prior_len = prefix
        check_operand_layouts(
            _WHERE,
            dict.fromkeys(("k_prior", "v_prior"), KV_CACHE_LAYOUT.replace("max_len", "prior_len_max")),
            dtypes=None,  # q's dtype, below
            positive=("prior_len_max",),
            known={"batch": batch, "kv_heads": k.shape[2], "head_dim": head_dim},
            k_prior=k_prior,
            v_prior=v_prior,
        )
        require_float_dtypes(_WHERE, {"q": q, "k_prior": k_prior, "v_prior": v_prior}, same=True)
        prior_len = _prior_len(prior_len, k_prior.shape[2])
    return scale, sliding_window, prior_len


def _prior_len(value, max_prior: int):
    """A static prior length as a checked Python int, or a run-time one as an int32 ``(1,)`` array."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        return static_int(_WHERE, "prefix prior_len", value, maximum=max_prior)
    if not hasattr(value, "dtype") or not jnp.issubdtype(value.dtype, jnp.integer) or jnp.size(value) != 1:
        raise TypeError(
            f"{_WHERE}: prefix prior_len must be an int or an integer array of one element (possibly "
            f"traced); got {getattr(value, 'dtype', type(value).__name__)} "
            f"{getattr(value, 'shape', value)!r}"
        )
    return jnp.asarray(value).astype(jnp.int32).reshape(1)


ATTENTION_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.attention",
        free={"b": "batch", "n": "heads"},
        collective={
            "s": (
                "sequence",
                "ring attention over the mesh axis (K/V blocks travel by ppermute; q, k and v "
                "split alike, contiguous layout; no sliding window, sinks or prefix)",
            )
        },
        note="query and kv heads split over the same mesh axis (kv_heads divisible by its size)",
    )
)
DECODE_ATTENTION_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.decode_attention",
        free={"b": "batch", "n": "heads"},
        note="sinks split with the heads (and the batch); with a block_table (paged caches shared by the batch) "
        "only heads shard",
    )
)


def sinks_argument(sinks) -> auto.ShardedArgument:
    """The planner's view of attention sinks, ``[heads]`` or ``[batch, heads]``: they split with heads and batch."""
    return auto.ShardedArgument("sinks", sinks, None if sinks is None else "bn"[2 - jnp.ndim(sinks) :])


def _plan_attention(q, k, v, sinks, prefix, sliding_window):
    """The shard_map plan of :func:`attention`: batch and heads free; a sharded sequence selects ring attention."""
    operands = [
        auto.ShardedArgument("q", q, "bsnd"),
        auto.ShardedArgument("k", k, "bsnd"),
        auto.ShardedArgument("v", v, "bsnd"),
        sinks_argument(sinks),
    ]
    operands.append(auto.ShardedArgument("prefix", None if prefix is None else tuple(prefix), ("bn_d", "bn_d", None)))
    sharded = auto.plan(ATTENTION_SHARDING, operands)
    if sharded and "s" in sharded.axes:
        if sliding_window or sinks is not None or prefix is not None:
            axis = auto.spec_entry(sharded.axes["s"])
            raise ValueError(
                f"jax_nkilib.attention: a sequence sharded over mesh axis {axis!r} runs ring attention, "
                "which supports no sliding_window, sinks or prefix; replicate the sequence axis"
            )
    return sharded


def attention(
    q,
    k,
    v,
    *,
    causal: bool | None = None,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks=None,
    prefix=None,
):
    """Multi-head attention ``softmax(scale * q k^T + mask [‖ sinks]) v`` for prefill.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``.
      k, v: ``[batch, seq_kv, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA/MQA: query head ``h`` uses kv
        head ``h // (heads / kv_heads)``).
      causal: required, ``True`` or ``False``: query ``i`` sees keys at positions ``<= i``. (There is no default:
        ``jax.nn.dot_product_attention`` is non-causal by default and this op used to be causal by default, so
        either default would silently change someone's model. :func:`jax_nkilib.dot_product_attention` is the
        drop-in with JAX's signature and defaults.)
      scale: defaults to ``1/sqrt(head_dim)``.
      sliding_window: with ``causal``, query ``i`` sees only keys at positions ``> i - sliding_window``.
      sinks: ``[heads]`` or ``[batch, heads]`` extra softmax logits (attention sinks), differentiable.
      prefix: ``(k_prior, v_prior, prior_len)``: cached keys/values ``[batch, kv_heads, prior_len_max, head_dim]``
        (the KV-cache layout of ``qkv_projection(kv_cache=)`` and :func:`decode_attention`) of which the first
        ``prior_len`` (an int, possibly traced) precede ``k``/``v``; they sit at positions ``-prior_len .. -1``, so
        every query sees them (within the sliding window).

    Returns ``[batch, seq_q, heads, head_dim]`` in ``q``'s dtype; differentiable in ``q``, ``k``, ``v``, ``sinks``
    and the prefix keys/values. Rows that see no key give 0. On Neuron this is the ``attention_cte`` kernel (and
    ``attention_bwd`` in reverse mode); elsewhere a blockwise reference that never forms the score matrix.

    NaN propagates as in ``jax.nn.dot_product_attention``: a NaN in a query row, in a key or value that row sees,
    or in its sink makes the row's output (and gradients) NaN, never 0. Prefix slots at or past ``prior_len`` never
    influence the result, whatever they hold (stale cache memory, NaN, inf). ``causal``, ``scale`` and
    ``sliding_window`` are static (Python values, checked while tracing: ``scale`` a finite real, ``sliding_window``
    an int in ``[1, 2**31 - 1]``); ``prior_len`` may be a run-time value: outside ``[0, prior_len_max]`` the whole
    output is NaN (and ``jax_nkilib.config(runtime_checks=True)`` under ``jax.experimental.checkify`` reports it).
    On Neuron the kernel loads every prefix slot and multiplies the values past ``prior_len`` by zero
    probabilities, so NaN or inf garbage there would reach the output on the device (per the kernel's source;
    not verified on Trainium).
    """
    scale, sliding_window, prior_len = _check(q, k, v, sinks, prefix, causal, scale, sliding_window)
    sharded = _plan_attention(q, k, v, sinks, prefix, sliding_window)
    if sharded:

        def local(q, k, v, sinks, prefix, axes):
            if "s" in axes:
                from .ring_attention import ring_attention

                return ring_attention(
                    q, k, v, axis_name=auto.spec_entry(axes["s"]), causal=causal, layout="contiguous", scale=scale
                )
            return attention(
                q, k, v, causal=causal, scale=scale, sliding_window=sliding_window, sinks=sinks, prefix=prefix
            )

        return sharded.run(local, "bsnd")
    return attention_on_kernel(
        q,
        k,
        v,
        causal=causal,
        scale=scale,
        sliding_window=sliding_window,
        sinks=sinks,
        prefix=prefix,
        prior_len=prior_len,
    )


def attention_on_kernel(
    q, k, v, *, causal, scale, sliding_window, sinks=None, prefix=None, prior_len=None, bound_min=None, bound_max=None
):
    """:func:`attention` on one device, checked arguments: ``attention_cte`` on heads folded into its batch.

    ``bound_min``/``bound_max`` ``[batch, seq_q]`` (int32, optional, not with ``prefix``) restrict query ``i`` of
    sequence ``b`` to keys ``bound_min[b, i] <= j < bound_max[b, i]`` (the kernel's sequence packing, whose bounds
    are per call: one kernel call per sequence)."""
    if bound_min is None:
        return _kernel_call(q, k, v, causal, scale, sliding_window, sinks, prefix, prior_len)
    one = lambda x: None if x is None else x[None]  # noqa: E731
    per_sequence = lambda q, k, v, sinks, low, high: _kernel_call(  # noqa: E731
        one(q), one(k), one(v), causal, scale, sliding_window, one(sinks), bounds=(low[:, None], high[:, None])
    )[0]
    sink_axis = None if sinks is None or jnp.ndim(sinks) == 1 else 0
    return jax.vmap(per_sequence, in_axes=(0, 0, 0, sink_axis, 0, 0))(q, k, v, sinks, bound_min, bound_max)


def _kernel_call(q, k, v, causal, scale, sliding_window, sinks, prefix=None, prior_len=None, bounds=(None, None)):
    """One ``attention_cte`` call; ``bounds``: its packing bounds ``[seq_q, 1]``, shared by the batch.

    Layouts (the kernel's flags): q, k and v reach the kernel as rows ``[B * H, S, d]`` (``tp_q=True``,
    ``tp_k=True``; a prefix's cache rows ``[B * kv_heads, L, d]`` are the ``tp_k=True`` layout), which are
    ``[batch, seq, heads, head_dim]`` moved by one transpose, and no transpose when the heads come first (``qkv``'s
    ``NBSd`` output at batch 1). Where attention_bwd can differentiate the call (no ``prefix``, ``seq_q % 128 ==
    0``), the output is ``[B * H, d, S]`` (``tp_out=True``), whose transpose to ``[batch, seq, heads, head_dim]`` is
    the exact inverse of the one that gives ``output_projection_cte`` its ``[B, N, D, S]`` (XLA cancels the pair
    when one feeds the other); and when such a call is differentiated, q and k take attention_bwd's own layouts
    ``[B * H, d, S]`` (``tp_q=False``, ``tp_k=False``) instead, so that the backward adds no transposes.
    """
    native = prefix is None and q.shape[1] % LSE_TILE == 0
    call = functools.partial(
        _kernel_call_in_layout,
        causal=causal,
        scale=scale,
        sliding_window=sliding_window,
        prefix=prefix,
        prior_len=prior_len,
        tp_out=native,
    )
    if not native:
        return call(q, k, v, sinks, bounds, qk_rows=True)
    return _rows_unless_differentiated(call, q, k, v, sinks, bounds)


def _rows_unless_differentiated(call, *args):
    """``call(*args, qk_rows=True)``; differentiated, ``call(*args, qk_rows=False)``'s derivative (same values)."""

    @jax.custom_vjp
    def attend(*args):
        return call(*args, qk_rows=True)

    def forward(*args):
        return jax.vjp(functools.partial(call, qk_rows=False), *args)

    attend.defvjp(forward, lambda pullback, cotangent: pullback(cotangent))
    return attend(*args)


def _kernel_call_in_layout(
    q, k, v, sinks, bounds, *, causal, scale, sliding_window, prefix, prior_len, tp_out: bool, qk_rows: bool
):
    """The ``attention_cte`` call of :func:`_kernel_call`, with q and k as rows (``qk_rows``) or ``[B * H, d, S]``,
    the output ``[B * H, d, S]`` (``tp_out``) or rows."""
    batch, seq_q, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    q_rows = _heads_into_batch(q, seq_last=not qk_rows)
    kernel_scale = scale
    if sliding_window or prefix is not None:  # the kernel's contract: pre-scale q, pass scale=1.0
        q_rows, kernel_scale = (q_rows * scale).astype(q.dtype), 1.0
    sink = None
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks), (batch, heads)).reshape(batch * heads, 1).astype(q.dtype)
    k_prior = v_prior = prior_used_len = None
    if prefix is not None:
        k_prior, v_prior = (_cache_rows(jnp.asarray(cache)) for cache in prefix[:2])
        prior_used_len = jnp.asarray(prior_len, jnp.int32).reshape(1)
    out = attention_cte(
        q_rows,
        _heads_into_batch(k, seq_last=not qk_rows),
        _heads_into_batch(v),
        k_prior,
        v_prior,
        prior_used_len,
        sink,
        scale=kernel_scale,
        causal_mask=causal,
        sliding_window=sliding_window,
        tp_q=qk_rows,
        tp_k=qk_rows,
        tp_out=tp_out,
        bound_min=bounds[0],
        bound_max=bounds[1],
    )
    if tp_out:
        out = jnp.transpose(out.reshape(batch, heads, head_dim, seq_q), (0, 3, 1, 2))
    else:
        out = jnp.transpose(out.reshape(batch, heads, seq_q, head_dim), (0, 2, 1, 3))
    if prefix is not None and not isinstance(prior_len, int):  # a run-time length: out of range gives NaN
        max_prior = k_prior.shape[1]  # the kernel's [batch * kv_heads, prior_len_max, head_dim]
        valid = (prior_len >= 0) & (prior_len <= max_prior)
        check_all(
            valid,
            f"{_WHERE}: prefix prior_len = {{}} is outside [0, {max_prior}] (prior_len_max); the output is NaN",
            prior_len,
        )
        out = jnp.where(valid[0], out, jnp.nan)
    return out


_DECODE = "jax_nkilib.decode_attention"


def _as_arrays(named: dict) -> dict:
    """The decode arguments as JAX arrays; ``TypeError`` naming the argument for anything that is not an array
    (checked before ``jnp.asarray``, so ``None`` or a string gets this op's message, not JAX's)."""
    arrays = {}
    for name, x in named.items():
        if x is None and name in ("block_table", "sinks"):
            arrays[name] = None
        else:
            arrays[name] = array_argument(_DECODE, name, x, dtypes=None)
    return arrays


def _check_decode(q, k_new, v_new, k_cache, v_cache, cache_len, block_table, sinks) -> None:
    paged = block_table is not None
    cache = PAGED_KV_CACHE_LAYOUT if paged else KV_CACHE_LAYOUT
    layouts = {
        "q": "batch, s_new, heads, head_dim",
        "k_new": "batch, s_new, kv_heads, head_dim",
        "v_new": "batch, s_new, kv_heads, head_dim",
        "k_cache": cache,
        "v_cache": cache,
        "cache_len": "batch",
        "block_table": "batch, max_blocks",
        "sinks": ("heads", "batch, heads"),
    }
    operands = dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache)
    dims = check_operand_layouts(
        _DECODE,
        layouts,
        # float operands: below; cache_len and block_table: integers; sinks: a kernel float dtype
        dtypes={name: "kernel" if name == "sinks" else None for name in layouts},
        positive=(
            "batch",
            "s_new",
            "heads",
            "head_dim",
            "kv_heads",
            "max_len",
            "num_blocks",
            "block_len",
            "max_blocks",
        ),
        **operands,
        cache_len=cache_len,
        block_table=block_table,
        sinks=sinks,
    )
    require_float_dtypes(_DECODE, operands, same=False)
    s_new, heads, kv_heads = dims["s_new"], dims["heads"], dims["kv_heads"]
    if heads % kv_heads:
        raise ValueError(f"{_DECODE}: query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    if paged and not jnp.issubdtype(block_table.dtype, jnp.integer):
        raise ValueError(
            f"{_DECODE}: `block_table` must be an integer array [batch, max_blocks]; got {block_table.dtype}"
        )
    max_len = dims["max_blocks"] * dims["block_len"] if paged else dims["max_len"]
    if max_len < 2 * s_new:
        raise ValueError(
            f"{_DECODE}: the cache capacity {max_len} must leave room for the s_new={s_new} new tokens "
            "and the kernel's scratch tail"
        )
    if not jnp.issubdtype(cache_len.dtype, jnp.integer):
        raise TypeError(f"{_DECODE}: `cache_len` must be an integer array [batch]; got {cache_len.dtype}")


def _decode_window(sliding_window, s_new: int) -> int | None:
    """The checked static window (``None``: no window)."""
    if sliding_window is None:
        return None
    sliding_window = static_int(_DECODE, "sliding_window", sliding_window, minimum=1)
    if sliding_window < s_new:
        raise ValueError(
            f"{_DECODE}: `sliding_window` must be at least s_new={s_new} (the kernel's mask over the new tokens "
            f"is causal, not windowed); got sliding_window={sliding_window}"
        )
    return sliding_window


def decode_attention(
    q,
    k_new,
    v_new,
    k_cache,
    v_cache,
    cache_len,
    *,
    scale: float | None = None,
    block_table=None,
    sliding_window: int | None = None,
    sinks=None,
):
    """Attention of ``s_new`` new tokens per sequence against a KV cache with per-sequence lengths.

    Args:
      q: ``[batch, s_new, heads, head_dim]``; new token ``i`` of sequence ``b`` has position ``cache_len[b] + i``.
      k_new, v_new: ``[batch, s_new, kv_heads, head_dim]`` (``heads % kv_heads == 0``).
      k_cache, v_cache: a flat cache ``[batch, kv_heads, max_len, head_dim]``, or with ``block_table`` a paged
        cache ``[num_blocks, kv_heads, block_len, head_dim]``. The first ``cache_len[b]`` positions of sequence ``b``
        are valid. The last ``s_new`` positions of the capacity are the kernel's scratch: keep
        ``cache_len + s_new <= capacity - s_new``.
      cache_len: int ``[batch]``, the tokens already cached per sequence (a runtime value).
      scale: defaults to ``1/sqrt(head_dim)``; static (a finite Python real).
      block_table: int ``[batch, max_blocks]``: sequence ``b``'s positions ``j * block_len ...`` live in block
        ``block_table[b, j]`` (capacity ``max_blocks * block_len``). Every entry must name a block of the caches,
        unused ones included (the kernel loads the whole table): pad with any valid block, e.g. 0.
      sliding_window: as in :func:`attention`: the token at position ``p`` sees only keys at positions
        ``> p - sliding_window`` (and ``<= p``), so at most ``sliding_window`` keys (Mistral, GPT-OSS). A static
        int in ``[s_new, 2**31 - 1]``: the kernel windows the cache, while among the new tokens its mask is causal
        only. The cache keeps every position; slots before the window are simply not read.
      sinks: ``[heads]`` or ``[batch, heads]`` extra softmax logits per query head (attention sinks, as in
        :func:`attention`), differentiable; rounded to ``q``'s dtype.

    Returns ``(out [batch, s_new, heads, head_dim], k_cache, v_cache)``: each new token attends to its sequence's
    cached tokens and to the new tokens up to itself (within the window); the returned caches hold the new keys and
    values at positions ``cache_len[b] + i`` (a functional update). Differentiable in ``q``, ``k_new``, ``v_new``,
    the caches and ``sinks`` (reverse mode differentiates the kernel's JAX reference). On Neuron the attention is the
    NKI ``attention_tkg`` kernel with its in-kernel position mask (``use_pos_id``; the window as its per-query
    ``start_pos_ids``) and, for a paged cache, its block KV cache.

    Kernel calls: one, except with ``[batch, heads]`` sinks and ``batch > 1``, where the kernel's one sink
    ``[H, 1]`` shared by all its rows cannot hold per-sequence values: then the kernel runs once per sequence
    (``lax.map``; a flat cache is sliced per sequence, a paged one passes whole). The kernel folds each (sequence,
    kv head) into one row with the ``heads / kv_heads`` query heads of that kv head; with sinks and
    ``kv_heads > 1`` each row carries all ``heads`` query heads instead (those of other kv heads zero, their outputs
    dropped) so that the one sink vector fits every row: ``kv_heads`` times the score work, the same cache reads.

    Invalid run-time indices: a sequence ``b`` whose ``cache_len[b]`` is outside ``[0, capacity - 2 * s_new]`` or
    whose ``block_table`` row names a block outside ``[0, num_blocks)`` writes nothing anywhere (both caches keep
    their contents) and gets NaN output rows; the other sequences are unaffected. The kernel receives a harmless
    length and table for such a row, so the device never reads out of bounds. Under
    ``jax_nkilib.config(runtime_checks=True)``, ``jax.experimental.checkify.checkify(f,
    errors=checkify.user_checks)`` reports the first invalid index as an error.

    Cache slots past ``cache_len[b]`` (stale memory, e.g. an overflowed FP8 value), and those before a token's
    window, never influence the result off Neuron. On Neuron the kernel loads them and multiplies their values by
    zero probabilities, so NaN or inf garbage there would reach the output on the device (per the kernel's source;
    not verified on Trainium). NaN in ``q``, in a key or value a token sees, or in its sink makes that token's output
    NaN, as in ``jax.nn.dot_product_attention``.
    """
    arrays = _as_arrays(
        dict(
            q=q,
            k_new=k_new,
            v_new=v_new,
            k_cache=k_cache,
            v_cache=v_cache,
            cache_len=cache_len,
            block_table=block_table,
            sinks=sinks,
        )
    )
    q, k_new, v_new, k_cache, v_cache, cache_len, block_table, sinks = arrays.values()
    _check_decode(q, k_new, v_new, k_cache, v_cache, cache_len, block_table, sinks)
    scale = None if scale is None else static_float(_DECODE, "scale", scale)
    sliding_window = _decode_window(sliding_window, q.shape[1])
    cache_dims = "bn_d" if block_table is None else "_n_d"
    sharded = auto.plan(
        DECODE_ATTENTION_SHARDING,
        [
            auto.ShardedArgument("q", q, "bsnd"),
            auto.ShardedArgument("k_new", k_new, "bsnd"),
            auto.ShardedArgument("v_new", v_new, "bsnd"),
            auto.ShardedArgument("k_cache", k_cache, cache_dims),
            auto.ShardedArgument("v_cache", v_cache, cache_dims),
            auto.ShardedArgument("cache_len", cache_len, "b"),
            auto.ShardedArgument("block_table", block_table, "b_"),
            sinks_argument(sinks),
        ],
    )
    if sharded:
        if block_table is not None and "b" in sharded.axes:
            axis = auto.spec_entry(sharded.axes["b"])
            raise ValueError(
                "jax_nkilib.decode_attention: with a block_table the paged caches are shared by the "
                f"whole batch, so the batch cannot be split over mesh axis {axis!r}; shard the heads, or "
                "replicate the batch"
            )

        def local(q, k_new, v_new, k_cache, v_cache, cache_len, block_table, sinks, axes):
            return decode_attention(
                q,
                k_new,
                v_new,
                k_cache,
                v_cache,
                cache_len,
                scale=scale,
                block_table=block_table,
                sliding_window=sliding_window,
                sinks=sinks,
            )

        return sharded.run(local, ("bsnd", cache_dims, cache_dims))
    s_new, d = q.shape[1], q.shape[3]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    capacity = k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2]
    if sliding_window is not None and sliding_window >= capacity - s_new:
        sliding_window = None  # a valid token's position is < capacity - s_new: such a window hides no key
    lengths, table, valid = _valid_indices(cache_len, block_table, capacity, s_new, k_cache.shape[0])
    # The new tokens are written first and the kernel reads the written caches: its prior, positions < cache_len,
    # is unchanged by the write, and with the caches' only reader after their update, XLA updates a donated cache
    # in place (reading the old cache beside its update would make it copy the whole cache every step).
    k_cache, v_cache = (
        _write_new_tokens(cache, new, lengths, table, valid) for cache, new in ((k_cache, k_new), (v_cache, v_new))
    )
    out = _attend(q, k_new, v_new, k_cache, v_cache, lengths, table, scale, capacity, sliding_window, sinks)
    return jnp.where(valid[:, None, None, None], out, jnp.nan), k_cache, v_cache


def _attend(q, k_new, v_new, k_cache, v_cache, lengths, table, scale, capacity, sliding_window, sinks):
    """``out [batch, s_new, heads, d]`` from ``attention_tkg`` for safe ``lengths`` and ``table``: one kernel row per
    (sequence, kv head), the row's query heads as the kernel's heads."""
    batch, s_new, heads, d = q.shape
    kv_heads = k_new.shape[2]
    groups = heads // kv_heads
    rows = batch * kv_heads
    queries = (q * scale).astype(q.dtype).reshape(batch, s_new, kv_heads, groups, d)
    queries = jnp.transpose(queries, (0, 2, 3, 1, 4))  # [batch, kv_heads, groups, s_new, d]
    # The kernel's sink [H, 1] is shared by all its rows. With sinks and several kv heads, every row carries all the
    # query heads (its own at their places, zeros elsewhere), so that one sink vector [heads] fits every row.
    all_heads = sinks is not None and kv_heads > 1
    if all_heads:
        own = jnp.eye(kv_heads, dtype=bool)[None, :, :, None, None, None]
        queries = jnp.where(own, queries[:, :, None], jnp.zeros((), q.dtype))  # [b, kv, kv', groups, s_new, d]
    new_rows = lambda x: jnp.transpose(x, (0, 2, 1, 3)).reshape(rows, 1, s_new, d)  # noqa: E731
    # Prior slots [start, end) are visible. end = cache_len for every new token: the new tokens are the kernel's
    # active tail, not cache slots (slots cache_len.. hold stale memory). With a window, token i at position
    # p = cache_len + i sees positions > p - window: start = cache_len + i - window + 1, clipped at 0 (the cache is
    # not circular); window >= s_new keeps start <= end and the causal tail inside the window.
    ends = jnp.broadcast_to(jnp.repeat(lengths, kv_heads)[:, None], (rows, s_new))
    operands = dict(
        q=queries.reshape(rows, -1, s_new, d),
        k_active=new_rows(k_new),
        v_active=new_rows(v_new),
        rope_pos_ids=ends,
        start_pos_ids=None,
        sink=None,
        active_blocks_table=None,
    )
    if sliding_window is not None:
        operands["start_pos_ids"] = jnp.maximum(ends + jnp.arange(s_new, dtype=jnp.int32) - (sliding_window - 1), 0)
    if table is None:
        caches = tuple(c.reshape(rows, 1, capacity, d) for c in (k_cache, v_cache))
        operands.update(k_prior=caches[0], v_prior=caches[1])
        block_len = 0
    else:  # pools [num_blocks * kv_heads, block_len, d]; row (b, h) uses blocks table[b, j] * kv_heads + h
        block_len = k_cache.shape[2]
        pools = tuple(c.reshape(-1, block_len, d) for c in (k_cache, v_cache))
        pooled = table[:, None, :] * kv_heads + jnp.arange(kv_heads, dtype=jnp.int32)[None, :, None]
        operands["active_blocks_table"] = pooled.reshape(rows, -1).astype(jnp.uint32)
    call = functools.partial(_call_attention_tkg, capacity=capacity, block_len=block_len)
    if sinks is not None and sinks.ndim == 2 and batch > 1:
        # per-sequence sinks: one kernel call per sequence (lax.map through the kernel's batching rule)
        operands = {k: None if x is None else x.reshape(batch, kv_heads, *x.shape[1:]) for k, x in operands.items()}
        operands["sink"] = sinks.astype(q.dtype)[:, :, None]
        in_axes = dict.fromkeys(operands, 0)
        if table is not None:  # the pools pass whole
            operands.update(k_prior=pools[0], v_prior=pools[1])
            in_axes.update(k_prior=None, v_prior=None)
        out = jax.vmap(call, in_axes=(in_axes,))(operands).reshape(rows, -1, d, s_new)
    else:
        if sinks is not None:  # [heads] or [1, heads]
            operands["sink"] = sinks.reshape(-1, heads)[0].astype(q.dtype)[:, None]
        if table is not None:
            operands.update(k_prior=pools[0], v_prior=pools[1])
        out = call(operands)  # [rows, kernel heads, d, s_new]
    if all_heads:  # row (b, kv) keeps its own heads: the diagonal kv == kv'
        out = jnp.diagonal(out.reshape(batch, kv_heads, kv_heads, groups, d, s_new), axis1=1, axis2=2)
        return jnp.transpose(out, (0, 3, 4, 1, 2)).reshape(q.shape)  # [b, groups, d, s_new, kv] -> [b, s_new, ...]
    return jnp.transpose(out.reshape(batch, kv_heads, groups, d, s_new), (0, 4, 1, 2, 3)).reshape(q.shape)


def _call_attention_tkg(operands, *, capacity: int, block_len: int):
    """``attention_tkg`` with its in-kernel position mask on ``operands`` by name; ``out [rows, H, d, s_new]``."""
    rows, heads, s_new, _ = operands["q"].shape
    # The kernel's reference makes the new tokens causal, but the kernel itself loads this mask over them
    # (gen_mask_tkg's active_mask): the causal one, [key j, row, head, query i] = j <= i.
    causal = jnp.arange(s_new)[:, None] <= jnp.arange(s_new)[None, :]
    active_mask = jnp.broadcast_to(causal[:, None, None, :], (s_new, rows, heads, s_new)).astype(jnp.uint8)
    return attention_tkg(
        operands["q"],
        operands["k_active"],
        operands["v_active"],
        operands["k_prior"],
        operands["v_prior"],
        active_mask,
        rope_pos_ids=operands["rope_pos_ids"],
        start_pos_ids=operands["start_pos_ids"],
        sink=operands["sink"],
        active_blocks_table=operands["active_blocks_table"],
        use_pos_id=True,
        tp_k_prior=True,
        curr_sprior=capacity,
        block_len=block_len,
    )


def _valid_indices(cache_len, block_table, capacity: int, s_new: int, num_blocks: int):
    """``(lengths, table, valid)``: int32 lengths and table safe to use (0 where invalid), and ``valid [batch]``,
    whether sequence ``b``'s length is in ``[0, capacity - 2 s_new]`` and its table names only existing blocks."""
    lengths = cache_len.astype(jnp.int32)
    max_len = capacity - 2 * s_new
    length_ok = (cache_len >= 0) & (cache_len <= max_len)
    check_all(
        length_ok,
        f"{_DECODE}: cache_len[{{index}}] = {{}} is outside [0, {max_len}] (the capacity {capacity} "
        f"minus 2 * s_new = {2 * s_new}: room for the new tokens and the kernel's scratch tail); that sequence "
        "writes nothing and its output is NaN",
        cache_len,
    )
    valid, table = length_ok, None
    if block_table is not None:
        entry_ok = valid_block_entries(block_table, num_blocks)
        check_all(
            entry_ok,
            f"{_DECODE}: block_table entry (sequence, block) {{index}} is {{}}, not a block of the "
            f"caches (0 <= block < {num_blocks}); that sequence writes nothing and its output is NaN",
            block_table,
        )
        valid = valid & jnp.all(entry_ok, axis=1)
        table = jnp.where(entry_ok, block_table, 0).astype(jnp.int32)
    return jnp.where(valid, lengths, 0), table, valid


def _write_new_tokens(cache, new, lengths, table, valid):
    """The cache with ``new [batch, s_new, kv_heads, d]`` stored at positions ``lengths[b] + i`` of the valid
    sequences (an invalid one's write goes to an out-of-bounds index and is dropped)."""
    positions = lengths[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)  # [batch, s_new]
    new = new.astype(cache.dtype)
    if table is None:
        positions = jnp.where(valid[:, None], positions, cache.shape[2])
        rows = jnp.arange(new.shape[0])[:, None]
        return cache.at[rows, :, positions].set(new, mode="drop")
    block_len = cache.shape[2]
    blocks = jnp.take_along_axis(table, positions // block_len, axis=1)
    blocks = jnp.where(valid[:, None], blocks, cache.shape[0])
    return cache.at[blocks, :, positions % block_len].set(new, mode="drop")
