"""``jax_nkilib.dot_product_attention``: ``jax.nn.dot_product_attention``'s signature and semantics, on the NKI
attention kernels wherever the call maps onto them.

Per sequence ``b`` and query head ``n`` (kv head ``n // (N / K)``)::

    logits = scale * q k^T                                   [T, S], float32 (float64 for float64 inputs)
    logits = soft_cap * tanh(logits / soft_cap)              with logits_soft_cap
    logits = logits + bias                                   with bias
    out    = softmax(logits over the allowed keys [‖ sinks]) v

A key ``j`` is allowed for query ``i`` when every given rule holds: ``mask[b, n, i, j]``; causal ``j <= i``; the
local window ``i - left <= j <= i + right``; ``j < key_value_seq_lengths[b]``; equal segment ids. Query rows at or
past ``query_seq_lengths[b]`` are 0 (as in JAX).

Routes. With no bias, dense mask, soft cap or residual, and a window that is causal, the call is the
``attention_cte`` kernel on Neuron (``jax_nkilib.attention``): padding lengths and self-attention segment ids become
the kernel's sequence-packing bounds (one kernel call per sequence, as its bounds are per call). Anything else runs
the blockwise JAX engine (:mod:`..attention.blockwise`: no score matrix is formed, forward or backward); lowered for
Neuron that warns naming the reason (or raises under ``jax_nkilib.config(on_unsupported="error")``).
``implementation="xla"`` calls ``jax.nn.dot_product_attention`` itself. Lowered for ``cuda`` on a GPU machine, the
default and ``implementation="cudnn"`` are JAX's cuDNN flash attention when the call has none of our additions
(segment ids, soft cap, sinks), no dense mask (cuDNN takes one as a bias: a row it hides entirely would average the
values rather than give 0) and JAX's cuDNN path takes it (bf16/fp16, its head sizes, ...); otherwise, and lowered for
any other platform, the routes above. On a GPU, float32 matmuls follow JAX's default precision (TF32 on recent
GPUs); ``jax.default_matmul_precision("highest")`` gives full float32.

Differences from JAX, on purpose: a query row that sees no key (and no sink) gives 0 and a residual of ``+inf``,
where JAX's finite masking value gives the mean of all values (FlashAttention's and cuDNN's convention is 0).
Segment ids on the kernel route must be contiguous runs (packing); non-contiguous ones give NaN for that sequence
(reported by ``jax_nkilib.config(runtime_checks=True)`` under ``checkify``), never a silently different mask.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..attention.blockwise import attention_backward, attention_forward, log_sum_exp
from ..attention.checks import require_float_dtypes
from ..attention.masks import MaskRule
from ..framework import compat, registry
from ..framework.checkpoint_policies import name_operands, name_outputs
from ..framework.runtime_checks import check_all
from ..framework.validation import check_operand_layouts, static_float, static_int
from ..neuron.reference_only import reference_only
from ..sharding import auto
from .attention import attention, attention_on_kernel, sinks_argument

_WHERE = "jax_nkilib.dot_product_attention"
IMPLEMENTATIONS = (None, "nki", "xla", "cudnn")

DOT_PRODUCT_ATTENTION_SHARDING = auto.register_rule(
    auto.ShardingRule(
        _WHERE,
        free={"b": "batch", "n": "heads"},
        note="bias, mask, lengths, segment ids and sinks split with batch and heads where they have those axes; "
        "a sharded sequence is an error here (jax_nkilib.attention runs ring attention for one)",
    )
)


def _plan(query, key, value, bias, mask, lengths, segments, sinks):
    """The shard_map plan of the call (batch and heads free), or ``None`` when nothing is split. Its operands are
    in :func:`_ours`'s order, so the plan's body is ``_ours`` on the local shards."""
    broadcast = lambda x, letters: (
        None
        if x is None
        else "".join(  # noqa: E731
            letter if size > 1 else "_" for letter, size in zip(letters, x.shape)
        )
    )
    return auto.plan(
        DOT_PRODUCT_ATTENTION_SHARDING,
        [
            auto.ShardedArgument("query", query, "b_n_"),
            auto.ShardedArgument("key", key, "b_n_"),
            auto.ShardedArgument("value", value, "b_n_"),
            auto.ShardedArgument("bias", bias, broadcast(bias, "bn__")),
            auto.ShardedArgument("mask", mask, broadcast(mask, "bn__")),
            *(auto.ShardedArgument(name, x, "b") for name, x in lengths.items()),
            *(auto.ShardedArgument(name, x, "b_") for name, x in segments.items()),
            sinks_argument(sinks),
        ],
    )


def _ensure_4d(x):
    """JAX's rule for bias and mask: leading axes of size 1 up to rank 4."""
    return None if x is None else jnp.reshape(x, (1,) * (4 - jnp.ndim(x)) + jnp.shape(x))


def _window(value) -> tuple[int, int] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"{_WHERE}: `local_window_size` must be an int or (left, right); got {value!r}")
        return tuple(static_int(_WHERE, f"local_window_size[{i}]", v) for i, v in enumerate(value))
    size = static_int(_WHERE, "local_window_size", value)
    return size, size


def _check(query, key, value, bias, mask, lengths, segments, sinks):
    """Layouts and dtypes of the (4-d) arguments; returns the bound sizes."""
    dims = check_operand_layouts(
        _WHERE,
        {
            "query": "B, T, N, H",
            "key": "B, S, K, H",
            "value": "B, S, K, H",
            "query_seq_lengths": "B",
            "key_value_seq_lengths": "B",
            "query_segment_ids": "B, T",
            "key_value_segment_ids": "B, S",
            "sinks": ("N", "B, N"),
        },
        dtypes={
            "query_seq_lengths": None,
            "key_value_seq_lengths": None,
            "query_segment_ids": None,
            "key_value_segment_ids": None,
            "sinks": "floating",
            "query": None,
            "key": None,
            "value": None,
        },
        positive=("B", "T", "N", "H", "S", "K"),
        query=query,
        key=key,
        value=value,
        **lengths,
        **segments,
        sinks=sinks,
    )
    require_float_dtypes(_WHERE, {"query": query, "key": key, "value": value}, same=True)
    if dims["N"] % dims["K"]:
        raise ValueError(f"{_WHERE}: query heads ({dims['N']}) must be a multiple of key/value heads ({dims['K']})")
    for name, x in {**lengths, **segments}.items():
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise TypeError(f"{_WHERE}: `{name}` must be an integer array; got {x.dtype}")
    target = (dims["B"], dims["N"], dims["T"], dims["S"])
    for name, x in (("bias", bias), ("mask", mask)):
        if x is None:
            continue
        if jnp.ndim(x) > 4 or any(size not in (1, full) for size, full in zip(x.shape, target)):
            raise ValueError(
                f"{_WHERE}: `{name}` must broadcast to [batch, heads, seq_q, seq_kv] = {list(target)} (each axis 1 or "
                f"full; fewer than 4 axes gain leading 1s); got shape {tuple(x.shape)}"
            )
    if mask is not None and mask.dtype != jnp.bool_:
        raise TypeError(f"{_WHERE}: `mask` must be a boolean array (True: attend); got {mask.dtype}")
    if bias is not None and not jnp.issubdtype(bias.dtype, jnp.floating):
        raise TypeError(f"{_WHERE}: `bias` must be a floating array (added to the logits); got {bias.dtype}")
    return dims


def _kernel_obstacles(bias, mask, soft_cap, window, causal, segments, return_residual, seq_q, seq_kv):
    """Why the call cannot run as ``attention_cte`` (empty: it can)."""
    reasons = []
    if bias is not None:
        reasons.append("a dense `bias` (attention_cte adds no bias to the logits)")
    if mask is not None:
        reasons.append("a dense boolean `mask` (attention_cte masks by rule: causal, window, packing bounds)")
    if soft_cap is not None:
        reasons.append("`logits_soft_cap` (attention_cte has no soft-capping)")
    if window is not None and not causal:
        reasons.append(f"local_window_size={window} with a right side and no causal mask (its window is causal)")
    q_ids, kv_ids = segments["query_segment_ids"], segments["key_value_segment_ids"]
    if q_ids is not None and (kv_ids is not None and kv_ids is not q_ids or seq_q != seq_kv):
        reasons.append("separate key/value segment ids (packing bounds are for self-attention)")
    if return_residual:
        reasons.append("return_residual (attention_cte returns no log-sum-exp)")
    return reasons


def dot_product_attention(
    query,
    key,
    value,
    bias=None,
    mask=None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths=None,
    key_value_seq_lengths=None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    query_segment_ids=None,
    key_value_segment_ids=None,
    logits_soft_cap: float | None = None,
    sinks=None,
):
    """Scaled dot-product attention with ``jax.nn.dot_product_attention``'s arguments and semantics.

    Args (as ``jax.nn.dot_product_attention``):
      query: ``[B, T, N, H]`` (or unbatched ``[T, N, H]``); key, value: ``[B, S, K, H]`` with ``N % K == 0``
        (grouped-query attention); one floating dtype.
      bias: broadcastable to ``[B, N, T, S]`` (each axis 1 or full; fewer axes gain leading 1s), added to the
        logits; differentiable. mask: boolean, broadcastable likewise; ``True`` attends.
      scale: defaults to ``1/sqrt(H)``. is_causal: key ``j`` is visible to query ``i`` when ``j <= i``.
      query_seq_lengths, key_value_seq_lengths: int ``[B]``: right padding; query rows past the length are 0.
      local_window_size: ``w`` or ``(left, right)``: query ``i`` sees keys ``i - left .. i + right``.
      implementation: ``None`` (the NKI kernel where the call maps onto one, else the blockwise engine), ``"nki"``
        (the kernel, or a ``ValueError`` naming what prevents it), ``"xla"`` (``jax.nn``'s), ``"cudnn"`` (JAX's cuDNN
        attention where it takes the call, else the blockwise engine; also the default on a GPU).
      return_residual: also return the softmax log-sum-exp ``[B, T, N]`` (in the key's dtype, not differentiated).

    Beyond ``jax.nn``:
      query_segment_ids, key_value_segment_ids: int ``[B, T]`` / ``[B, S]``: packed sequences; query ``i`` sees key
        ``j`` only when their ids are equal (key/value ids default to the query's).
      logits_soft_cap: ``c > 0``: logits become ``c * tanh(logits / c)`` before bias and masking (Gemma 2).
      sinks: ``[N]`` or ``[B, N]`` extra softmax logits (attention sinks, GPT-OSS), differentiable.

    Returns ``[B, T, N, H]`` (the query's shape) in the query's dtype, and with ``return_residual`` the log-sum-exp.
    See the module docstring for the routes on Neuron and the two deliberate differences from JAX.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"{_WHERE}: `implementation` must be one of {IMPLEMENTATIONS}; got {implementation!r}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"{_WHERE}: `is_causal` must be a Python bool; got {is_causal!r}")
    if not isinstance(return_residual, bool):
        raise TypeError(f"{_WHERE}: `return_residual` must be a Python bool; got {return_residual!r}")
    ours_only = {
        "query_segment_ids": query_segment_ids,
        "key_value_segment_ids": key_value_segment_ids,
        "logits_soft_cap": logits_soft_cap,
        "sinks": sinks,
    }
    ours_only = [name for name, v in ours_only.items() if v is not None]
    jax_nn = functools.partial(
        jax.nn.dot_product_attention,
        query,
        key,
        value,
        bias,
        mask,
        scale=scale,
        is_causal=is_causal,
        query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths,
        local_window_size=local_window_size,
        return_residual=return_residual,
    )
    if implementation == "xla":
        if ours_only:
            raise ValueError(f"{_WHERE}: implementation='xla' (jax.nn's) does not take {ours_only}")
        return jax_nn(implementation="xla")
    ours = functools.partial(
        _ours,
        scale=scale,
        is_causal=is_causal,
        local_window_size=local_window_size,
        implementation=implementation,
        return_residual=return_residual,
        logits_soft_cap=logits_soft_cap,
    )
    arrays = (query, key, value, bias, mask, query_seq_lengths, key_value_seq_lengths, query_segment_ids)
    arrays += (key_value_segment_ids, sinks)
    # A dense mask reaches cuDNN as a bias, so a row it hides entirely would average every value there instead of
    # giving 0 as everywhere else: such calls stay ours.
    wants_cudnn = implementation == "cudnn" or (implementation is None and jax.default_backend() == "gpu")
    if wants_cudnn and not ours_only and mask is None and _cudnn_traces(jax_nn, query):
        # lowered for cuda: cuDNN's flash attention; for any other platform (Neuron, CPU): ours
        cudnn = lambda *_: jax_nn(implementation="cudnn")  # noqa: E731
        return jax.lax.platform_dependent(*arrays, cuda=cudnn, default=ours)
    return ours(*arrays)


def _cudnn_traces(jax_nn, query) -> bool:
    """Whether JAX's cuDNN attention takes the call on this machine: a bf16/fp16 call (cuDNN's types, which JAX
    checks only when lowering) that JAX's cuDNN path traces (it refuses off a GPU, and shapes or options it lacks)."""
    if jnp.result_type(query) not in (jnp.bfloat16, jnp.float16):
        return False
    try:
        jax.eval_shape(lambda: jax_nn(implementation="cudnn"))
    except (ValueError, NotImplementedError, RuntimeError, TypeError):
        return False
    return True


def _ours(
    query,
    key,
    value,
    bias,
    mask,
    query_seq_lengths,
    key_value_seq_lengths,
    query_segment_ids,
    key_value_segment_ids,
    sinks,
    *,
    scale,
    is_causal,
    local_window_size,
    implementation,
    return_residual,
    logits_soft_cap,
):
    """The NKI-kernel route or the blockwise engine (see the module docstring)."""
    unbatched = jnp.ndim(query) == 3
    if unbatched:
        if jnp.ndim(key) != 3 or jnp.ndim(value) != 3:
            raise ValueError(f"{_WHERE}: an unbatched `query` [T, N, H] needs unbatched `key` and `value` [S, K, H]")
        query, key, value = (jnp.asarray(x)[None] for x in (query, key, value))
    lengths = {"query_seq_lengths": query_seq_lengths, "key_value_seq_lengths": key_value_seq_lengths}
    lengths = {name: None if x is None else jnp.asarray(x) for name, x in lengths.items()}
    segments = {"query_segment_ids": query_segment_ids, "key_value_segment_ids": key_value_segment_ids}
    segments = {name: None if x is None else jnp.asarray(x) for name, x in segments.items()}
    if unbatched:
        segments = {name: None if x is None else x[None] for name, x in segments.items()}
    bias = None if bias is None else _ensure_4d(jnp.asarray(bias))
    mask = None if mask is None else _ensure_4d(jnp.asarray(mask))
    dims = _check(query, key, value, bias, mask, lengths, segments, sinks)
    scale = 1.0 / math.sqrt(dims["H"]) if scale is None else static_float(_WHERE, "scale", scale)
    soft_cap = None
    if logits_soft_cap is not None:
        soft_cap = static_float(_WHERE, "logits_soft_cap", logits_soft_cap, minimum=0.0, exclusive=True)
    window = _window(local_window_size)
    sharded = _plan(query, key, value, bias, mask, lengths, segments, sinks)
    if sharded:
        statics = dict(
            scale=scale,
            is_causal=is_causal,
            local_window_size=window,
            implementation=implementation,
            return_residual=return_residual,
            logits_soft_cap=soft_cap,
        )
        result = sharded.run(
            lambda *local, axes: _ours(*local, **statics), ("b_n_", "b_n") if return_residual else "b_n_"
        )
        return jax.tree.map(lambda x: x[0], result) if unbatched else result
    causal = is_causal or (window is not None and window[1] == 0)
    obstacles = _kernel_obstacles(bias, mask, soft_cap, window, causal, segments, return_residual, dims["T"], dims["S"])
    if implementation == "nki" and obstacles:
        raise ValueError(f"{_WHERE}: implementation='nki' cannot run this call as a kernel: {'; '.join(obstacles)}")
    if obstacles:
        out, lse = _blockwise(
            query, key, value, bias, mask, sinks, lengths, segments, scale, is_causal, window, soft_cap, obstacles
        )
        result = (out, lax.stop_gradient(lse).astype(key.dtype)) if return_residual else out
    else:
        result = _on_kernel(query, key, value, sinks, lengths, segments, scale, causal, window)
    if unbatched:
        return tuple(x[0] for x in result) if return_residual else result[0]
    return result


# ------------------------------------------------------------------------------------------------- kernel route
def _on_kernel(query, key, value, sinks, lengths, segments, scale, causal, window):
    sliding_window = None if window is None else window[0] + 1  # keys j >= i - left: the kernel's j > i - w
    q_len, kv_len = lengths["query_seq_lengths"], lengths["key_value_seq_lengths"]
    ids = segments["query_segment_ids"]
    if kv_len is None and ids is None:
        out = attention(query, key, value, causal=causal, scale=scale, sliding_window=sliding_window, sinks=sinks)
    else:
        batch, seq_q = query.shape[:2]
        low = jnp.zeros((batch, seq_q), jnp.int32)
        high = jnp.full((batch, seq_q), key.shape[1], jnp.int32)
        contiguous = None
        if ids is not None:
            low, high, contiguous = _segment_runs(ids)
        if kv_len is not None:
            high = jnp.minimum(high, kv_len.astype(jnp.int32)[:, None])
        out = attention_on_kernel(
            query,
            key,
            value,
            causal=causal,
            scale=scale,
            sliding_window=sliding_window,
            sinks=sinks,
            bound_min=low,
            bound_max=high,
        )
        if contiguous is not None:
            check_all(
                contiguous,
                f"{_WHERE}: query_segment_ids of sequence {{index}} are not contiguous runs (packing); on the kernel "
                "route its output is NaN",
            )
            out = jnp.where(contiguous[:, None, None, None], out, jnp.nan)
    if q_len is not None:
        out = _zero_padded_queries(out, q_len)
    return out


def _segment_runs(ids):
    """``(start, end, contiguous)`` of each token's run of equal ids (``[B, T]`` int32) and whether every id of a
    sequence forms one run (``[B]``): then "same run" is "same id"."""
    seq = ids.shape[1]
    positions = jnp.arange(seq, dtype=jnp.int32)
    new_run = jnp.concatenate([jnp.ones_like(ids[:, :1], bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    ends_run = jnp.concatenate([ids[:, 1:] != ids[:, :-1], jnp.ones_like(ids[:, :1], bool)], axis=1)
    start = lax.cummax(jnp.where(new_run, positions, 0), axis=1)
    end = lax.cummin(jnp.where(ends_run, positions + 1, seq), axis=1, reverse=True)
    ordered = jnp.sort(ids, axis=1)
    distinct = 1 + jnp.sum(ordered[:, 1:] != ordered[:, :-1], axis=1)
    return start, end, jnp.sum(new_run, axis=1) == distinct


def _zero_padded_queries(out, q_len):
    rows = jnp.arange(out.shape[1])[None, :] < q_len[:, None]
    return jnp.where(rows[:, :, None, None], out, jnp.zeros((), out.dtype))


# ---------------------------------------------------------------------------------------------- blockwise route
def _blockwise(query, key, value, bias, mask, sinks, lengths, segments, scale, causal, window, soft_cap, obstacles):
    """``(out [B, T, N, H], lse [B, T, N])`` from the blockwise engine, one sequence at a time (vmapped); marked
    for Neuron as running outside a kernel for ``obstacles``."""
    q_len = lengths["query_seq_lengths"]
    batch, seq_q = query.shape[:2]
    q_ids = segments["query_segment_ids"]
    kv_ids = segments["key_value_segment_ids"]
    if q_ids is not None and kv_ids is None:
        kv_ids = q_ids
    kv_len = lengths["key_value_seq_lengths"]
    if kv_len is None:
        kv_len = jnp.full((batch,), key.shape[1], jnp.int32)
    if sinks is not None:
        sinks = jnp.broadcast_to(jnp.asarray(sinks), (batch, query.shape[2]))
    statics = _Statics(scale=scale, causal=causal, window=window, soft_cap=soft_cap)
    out, lse = _engine(statics, query, key, value, bias, mask, sinks, kv_len.astype(jnp.int32), q_ids, kv_ids)
    out = reference_only(out, op=_WHERE, reasons=tuple(obstacles))
    if q_len is not None:
        out = _zero_padded_queries(out, q_len)
    return out, lse


class _Statics(NamedTuple):
    """The static configuration of the engine (hashable, for ``custom_vjp``'s ``nondiff_argnums``)."""

    scale: float
    causal: bool
    window: tuple[int, int] | None
    soft_cap: float | None


def _per_sequence_operands(query, key, value, bias, mask, sinks):
    """One sequence's operands in the engine's layouts: q ``[K, G, T, H]``, k/v ``[K, S, H]``, bias/mask
    ``[K or 1, G or 1, T or 1, S or 1]``, sink ``[K, G, 1]``."""
    heads, kv_heads = query.shape[1], key.shape[1]
    groups = heads // kv_heads
    q = jnp.transpose(query, (1, 0, 2)).reshape(kv_heads, groups, query.shape[0], query.shape[2])
    k, v = (jnp.transpose(x, (1, 0, 2)) for x in (key, value))

    def by_head(x):  # [N or 1, T', S'] -> [K or 1, G or 1, T', S']
        if x is None:
            return None
        return x[None] if x.shape[0] == 1 else x.reshape((kv_heads, groups) + x.shape[1:])

    sink = None if sinks is None else sinks.reshape(kv_heads, groups, 1)
    return q, k, v, by_head(bias), by_head(mask), sink


def _rule(statics, seq_q, seq_kv, kv_len, q_ids, kv_ids) -> MaskRule:
    left, right = (None, None) if statics.window is None else statics.window
    return MaskRule(
        n_queries=seq_q,
        n_active=seq_kv,
        causal=statics.causal,
        window=0 if left is None else left + 1,
        right_window=None if statics.causal else right,
        bound_min=jnp.zeros((seq_q,), jnp.int32),
        bound_max=jnp.full((seq_q,), kv_len, jnp.int32),
        q_segment_ids=q_ids,
        kv_segment_ids=kv_ids,
    )


def _batch_axes(query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids):
    """vmap axes over the sequences: 0, or None for an absent operand and a bias or mask shared by the batch."""
    shared = lambda x: x is None or x.shape[0] == 1  # noqa: E731
    axes = [0, 0, 0, None if shared(bias) else 0, None if shared(mask) else 0]
    return tuple(axes) + tuple(None if x is None else 0 for x in (sinks, kv_len, q_ids, kv_ids))


def _squeeze_batch(x):
    """A bias or mask shared by the batch without its batch axis (it is not mapped)."""
    return x[0] if x is not None and x.shape[0] == 1 else x


def _forward_one(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids):
    q, k, v, bias, mask, sink = _per_sequence_operands(query, key, value, bias, mask, sinks)
    rule = _rule(statics, query.shape[0], key.shape[0], kv_len, q_ids, kv_ids)
    out, row_max, row_sum = attention_forward(
        q, k, v, rule, statics.scale, sink, bias=bias, mask=mask, soft_cap=statics.soft_cap
    )
    lse = log_sum_exp(row_max, row_sum)  # [K, G, T]
    out = out.reshape(query.shape[1], query.shape[0], query.shape[2]).transpose(1, 0, 2).astype(query.dtype)
    return out, lse.reshape(query.shape[1], query.shape[0]).T


def _vmapped_forward(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids):
    axes = _batch_axes(query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids)
    one = functools.partial(_forward_one, statics)
    return jax.vmap(one, in_axes=axes)(
        query, key, value, _squeeze_batch(bias), _squeeze_batch(mask), sinks, kv_len, q_ids, kv_ids
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _engine(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids):
    return _vmapped_forward(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids)


_NAME = "dot_product_attention"
_DIFFERENTIABLE = ("query", "key", "value", "bias", "sinks")
registry.register_checkpointed(_NAME, _DIFFERENTIABLE)


def _engine_forward(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids):
    """The forward with its residuals named for remat policies (``dot_product_attention.<input>``, ``.out``,
    ``.lse``); the named output is the one returned, so the program uses the value a policy saves."""
    query, key, value, bias, sinks = name_operands(
        _NAME, dict(zip(_DIFFERENTIABLE, (query, key, value, bias, sinks)))
    ).values()
    out, lse = _vmapped_forward(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids)
    out, lse = name_outputs(_NAME, {"out": out, "lse": lse}, _DIFFERENTIABLE)
    residuals = (query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids, out, lse)
    return (out, lse), residuals


def _backward_one(statics, query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids, out, lse, dy):
    q, k, v, bias_h, mask_h, sink = _per_sequence_operands(query, key, value, bias, mask, sinks)
    rule = _rule(statics, query.shape[0], key.shape[0], kv_len, q_ids, kv_ids)
    heads_first = lambda x: jnp.transpose(x, (1, 0, 2)).reshape(q.shape)  # noqa: E731  [T, N, H] -> [K, G, T, H]
    dq, dk, dv, dsink, dbias = attention_backward(
        q,
        k,
        v,
        heads_first(out),
        heads_first(dy),
        lse.T.reshape(q.shape[:3]),
        rule,
        statics.scale,
        sink,
        bias=bias_h,
        mask=mask_h,
        soft_cap=statics.soft_cap,
        return_dbias=True,
    )
    dq = dq.reshape(query.shape[1], query.shape[0], query.shape[2]).transpose(1, 0, 2)
    dk, dv = (jnp.transpose(x, (1, 0, 2)) for x in (dk, dv))
    dsink = None if dsink is None else dsink.reshape(-1)
    if dbias is not None:
        dbias = dbias.reshape(bias.shape)
    return dq, dk, dv, dbias, dsink


def _engine_backward(statics, residuals, cotangents):
    query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids, out, lse = residuals
    dy = cotangents[0]  # the log-sum-exp is not differentiated (stop_gradient in the op)
    axes = _batch_axes(query, key, value, bias, mask, sinks, kv_len, q_ids, kv_ids) + (0, 0, 0)
    one = functools.partial(_backward_one, statics)
    dq, dk, dv, dbias, dsink = jax.vmap(one, in_axes=axes)(
        query, key, value, _squeeze_batch(bias), _squeeze_batch(mask), sinks, kv_len, q_ids, kv_ids, out, lse, dy
    )
    if bias is not None and axes[3] is None:  # a bias shared by the batch gets the sum over the sequences
        dbias = jnp.sum(dbias, axis=0, keepdims=True)
    # inside shard_map, an operand replicated over a mesh axis (a bias shared by a split batch) gets the sum of
    # its per-shard cotangents
    cast = lambda g, like: None if like is None else compat.sum_over_extra_varying(g, like).astype(like.dtype)  # noqa: E731
    return (
        cast(dq, query),
        cast(dk, key),
        cast(dv, value),
        cast(dbias, bias),
        None,
        cast(dsink, sinks),
        None,
        None,
        None,
    )


_engine.defvjp(_engine_forward, _engine_backward)
