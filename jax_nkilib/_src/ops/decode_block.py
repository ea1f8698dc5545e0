"""``jax_nkilib.decode_block``: one decoder layer's attention half for token generation, fused where the kernel
allows it.

Math (per sequence ``b``, new token ``i`` at position ``p = cache_len[b] + i``)::

    h = rms_norm(x, norm_weight, eps)                       # skipped without norm_weight
    q, k, v = split_heads(h @ qkv_weight + qkv_bias)        # [Q heads | K heads | V heads], or grouped by kv head
    q, k = rms_norm(q, q_norm), rms_norm(k, k_norm)         # per head, before RoPE (Qwen3 / OLMo-2 style), optional
    q, k = rope(q, cos, sin), rope(k, cos, sin)             # halves [x1 | x2]
    cache[b, :, p] = k, v                                   # the caches' functional update
    o = softmax(q k^T * scale + causal mask over positions <= p) v
    out = o @ out_weight + out_bias                         # [batch, seq, hidden]; no residual add

Two equivalent routes compute it, chosen from the shapes alone (the same on every platform, so CPU results are the
Neuron ones up to the kernels' fidelity):

* **fused**, one ``attention_block_tkg`` kernel per call (:func:`_fused_operands`, :func:`_run_fused`), when the
  call has one kv head (a tensor-parallel shard's usual count: the kernel's GQA has one KV head) and meets the
  kernel's limits;
* **composed** otherwise: ``qkv_projection`` -> (``rms_norm`` + ``rope`` on the heads) -> ``decode_attention`` ->
  ``output_projection``, each its own kernel on Neuron.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..framework.validation import check_operand_layouts, static_float
from ..sharding import auto
from ..transformer.attention_block_tkg import attention_block_tkg
from .attention import decode_attention
from .layouts import KV_CACHE_LAYOUT
from .norm import rms_norm
from .projection import head_counts, output_projection, qkv_projection
from .rope import rope as apply_rope

WHERE = "jax_nkilib.decode_block"

DECODE_BLOCK_SHARDING = auto.register_rule(
    auto.ShardingRule(
        WHERE,
        free={"b": "batch"},
        collective={
            "n": (
                "heads (qkv_weight grouped or as (w_q, w_k, w_v), the caches' kv heads, out_weight's rows)",
                "local blocks over the local heads + one all-reduce (psum) of the output projection, then out_bias",
            )
        },
        note="heads shard when qkv_weight is grouped [hidden, kv_heads, q_per_kv + 2, head_dim] or given as (w_q, "
        "w_k, w_v); num_q_heads and num_kv_heads divisible by the mesh axis size",
    )
)


def _pair(name: str, value, what: str):
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise TypeError(f"{WHERE}: `{name}` must be a pair {what}; got {type(value).__name__}")
    return tuple(jnp.asarray(v) for v in value)


def _check(x, kv_cache, cache_len, qkv_weight, out_weight, num_q_heads, num_kv_heads, rope) -> None:
    """Trace-time checks of what this op itself reads (the ops it composes check the rest)."""
    check_operand_layouts(WHERE, {"x": "batch, seq, hidden"}, positive=("batch", "seq", "hidden"), x=x)
    k_cache, v_cache = _pair("kv_cache", kv_cache, f"(k_cache, v_cache), each [{KV_CACHE_LAYOUT}]")
    dims = check_operand_layouts(
        WHERE,
        {"k_cache": KV_CACHE_LAYOUT, "v_cache": KV_CACHE_LAYOUT, "cache_len": "batch"},
        dtypes={"k_cache": "floating", "v_cache": "floating", "cache_len": None},
        known={"batch": x.shape[0], "kv_heads": num_kv_heads},
        k_cache=k_cache,
        v_cache=v_cache,
        cache_len=cache_len,
    )
    if not jnp.issubdtype(cache_len.dtype, jnp.integer):
        raise TypeError(f"{WHERE}: `cache_len` must be an integer array [batch]; got {cache_len.dtype}")
    if rope is not None:
        _pair("rope", rope, "(cos, sin) of [seq, head_dim/2] or [batch, seq, head_dim/2] tables")
    w_out = jnp.asarray(out_weight)
    if w_out.shape != (num_q_heads * dims["head_dim"], x.shape[2]):
        raise ValueError(
            f"{WHERE}: `out_weight` must be [num_q_heads * head_dim, hidden] = "
            f"[{num_q_heads * dims['head_dim']}, {x.shape[2]}]; got {tuple(w_out.shape)}"
        )
    if _grouped(qkv_weight):
        expected = (x.shape[2], num_kv_heads, num_q_heads // num_kv_heads + 2, dims["head_dim"])
        if tuple(jnp.shape(qkv_weight)) != expected:
            raise ValueError(
                f"{WHERE}: a grouped `qkv_weight` must be [hidden, num_kv_heads, num_q_heads / num_kv_heads + 2, "
                f"head_dim] = {list(expected)}; got {tuple(jnp.shape(qkv_weight))}"
            )
    # qkv_projection checks the other weight forms against x, the heads and head_dim


def _grouped(qkv_weight) -> bool:
    """Whether ``qkv_weight`` is the grouped ``[hidden, kv_heads, q_per_kv + 2, head_dim]`` form."""
    return not isinstance(qkv_weight, (tuple, list)) and jnp.ndim(qkv_weight) == 4


def _ungrouped(grouped):
    """A grouped weight ``[hidden, kv_heads, q_per_kv + 2, d]`` or bias ``[kv_heads, q_per_kv + 2, d]`` as
    ``(w_q, w_k, w_v)`` (``(b_q, b_k, b_v)``): the form qkv_projection takes (``None`` stays ``None``)."""
    if grouped is None:
        return None
    t = jnp.asarray(grouped)
    group = t.shape[-2] - 2
    parts = (t[..., :group, :], t[..., group, :], t[..., group + 1, :])
    return tuple(part.reshape(*t.shape[:-3], -1) for part in parts)


def _table_dims(rope):
    """The RoPE tables' letters: a per-sequence table ``[batch, seq, head_dim/2]`` splits with the batch."""
    if rope is None:
        return None
    table = jnp.asarray(rope[0])
    dims = "b__" if table.ndim == 3 and table.shape[0] != 1 else "_" * table.ndim
    return (dims, dims)


def _static_heads(num_q_heads, num_kv_heads) -> tuple[int, int]:
    num_q_heads, num_kv_heads = head_counts(WHERE, num_q_heads, num_kv_heads)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{WHERE}: num_q_heads={num_q_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    return num_q_heads, num_kv_heads


def decode_block(
    x,
    kv_cache,
    cache_len,
    *,
    qkv_weight,
    out_weight,
    num_q_heads: int,
    num_kv_heads: int,
    rope=None,
    norm_weight=None,
    eps: float = 1e-6,
    qkv_bias=None,
    out_bias=None,
    qk_norm=None,
    qk_norm_eps: float = 1e-6,
    scale: float | None = None,
):
    """One decoder layer's attention for ``seq`` new tokens per sequence against a KV cache (the math is in
    :mod:`jax_nkilib._src.ops.decode_block`): RMSNorm -> QKV -> optional per-head Q/K RMSNorm -> RoPE -> cache
    update -> attention -> output projection.

    Args:
      x: ``[batch, seq, hidden]``, the layer's input (the residual stream; the residual add is the caller's).
      kv_cache: ``(k_cache, v_cache)``, each ``[batch, kv_heads, max_len, head_dim]`` (the library's one KV-cache
        layout); as :func:`jax_nkilib.decode_attention`'s, the last ``seq`` slots of ``max_len`` are the kernel's
        scratch: keep ``cache_len + 2 * seq <= max_len``.
      cache_len: int ``[batch]``: the tokens already cached; new token ``i`` of sequence ``b`` has position
        ``cache_len[b] + i`` (a runtime value).
      qkv_weight: ``[hidden, (num_q_heads + 2 * num_kv_heads) * head_dim]`` (columns ``[Q | K | V]``) or
        ``(w_q, w_k, w_v)``, as :func:`jax_nkilib.qkv_projection` takes it, or **grouped by kv head**
        ``[hidden, num_kv_heads, num_q_heads / num_kv_heads + 2, head_dim]`` (kv head ``g``'s query heads
        ``g * q_per_kv ...``, then its key, then its value): the fused kernel's own layout per kv head, so a shard
        with one kv head reaches the kernel by a reshape (the other forms are concatenated per call, a copy of the
        layer's QKV weights). ``qkv_bias`` in the same form (grouped: ``[num_kv_heads, q_per_kv + 2, head_dim]``).
      out_weight: ``[num_q_heads * head_dim, hidden]``; ``out_bias`` ``[hidden]``.
      rope: ``(cos, sin)``, each ``[seq, head_dim/2]`` or ``[batch, seq, head_dim/2]`` (the tables at each new
        token's position); ``None`` skips RoPE.
      norm_weight: ``[hidden]`` RMSNorm gain over ``x`` (``None``: no norm); ``eps`` its epsilon.
      qk_norm: ``(q_weight, k_weight)``, each ``[head_dim]``: RMSNorm of every query and key head before RoPE, with
        ``qk_norm_eps``.
      scale: the softmax scale, default ``1/sqrt(head_dim)``.

    An invalid ``cache_len[b]``, outside ``[0, max_len - 2 * seq]``, gives NaN rows for sequence ``b`` and stores
    nothing in its valid slots (the fused kernel writes its tokens into the scratch tail).

    Returns ``(out [batch, seq, hidden], (k_cache, v_cache))`` in ``x``'s dtype, the caches holding the new keys
    (after RoPE) and values at their positions (a functional update: under ``jax.jit(..., donate_argnums=...)`` of
    the caches, XLA writes them in place). Differentiable in ``x`` and every weight.

    On Neuron, a call with one kv head (``num_kv_heads == 1``, e.g. a tensor-parallel shard of a GQA model) that
    fits the kernel is one ``attention_block_tkg`` kernel with the caches updated in place (aliased); other calls
    are ``qkv`` + ``decode_attention``'s ``attention_tkg`` + ``output_projection_tkg``. Sharding: batch freely;
    heads with ``qkv_weight`` grouped or as ``(w_q, w_k, w_v)`` (column-parallel QKV, the caches' kv heads,
    row-parallel output projection with one all-reduce).
    """
    num_q_heads, num_kv_heads = _static_heads(num_q_heads, num_kv_heads)
    x = jnp.asarray(x)
    cache_len = jnp.asarray(cache_len)
    _check(x, kv_cache, cache_len, qkv_weight, out_weight, num_q_heads, num_kv_heads, rope)
    eps = static_float(WHERE, "eps", eps, minimum=0.0)
    qk_norm_eps = static_float(WHERE, "qk_norm_eps", qk_norm_eps, minimum=0.0)
    if qk_norm is not None:
        qk_norm = _pair("qk_norm", qk_norm, "(q_weight, k_weight), each [head_dim]")
    flags = dict(eps=eps, qk_norm_eps=qk_norm_eps, scale=scale)
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads)
    block = _Block(
        x, tuple(kv_cache), cache_len, qkv_weight, out_weight, rope, norm_weight, qkv_bias, out_bias, qk_norm
    )
    sharded = auto.plan(
        DECODE_BLOCK_SHARDING,
        [auto.ShardedArgument(name, value, dims) for name, value, dims in zip(block._fields, block, _letters(block))],
    )
    if sharded:
        return _run_sharded(sharded, heads, flags)
    fused = _fused_operands(block, num_kv_heads, **flags)
    if fused is not None:
        return _run_fused(*fused)
    return _composed(block, heads, **flags)


class _Block(NamedTuple):
    """A call's tensors (and pairs of tensors), in :func:`decode_block`'s order."""

    x: Any
    kv_cache: Any
    cache_len: Any
    qkv_weight: Any
    out_weight: Any
    rope: Any
    norm_weight: Any
    qkv_bias: Any
    out_bias: Any
    qk_norm: Any = None


def _letters(block: _Block) -> tuple:
    """The sharding letters of each of ``block``'s fields (``b`` batch, ``n`` heads, ``_`` never split)."""
    split, grouped = isinstance(block.qkv_weight, (tuple, list)), _grouped(block.qkv_weight)
    return (
        "b__",
        ("bn__", "bn__"),
        "b",
        ("_n",) * 3 if split else "_n__" if grouped else "__",
        "n_",
        _table_dims(block.rope),
        "_",
        ("n",) * 3 if split else "n__" if grouped else "_",
        "_",
        ("_", "_"),
    )


def _call(block: _Block, heads, flags, out_bias=None):
    """:func:`decode_block` of ``block`` (with ``out_bias`` in place of its own)."""
    weights = dict(qkv_weight=block.qkv_weight, out_weight=block.out_weight, rope=block.rope)
    weights.update(norm_weight=block.norm_weight, qkv_bias=block.qkv_bias, out_bias=out_bias, qk_norm=block.qk_norm)
    return decode_block(block.x, block.kv_cache, block.cache_len, **weights, **heads, **flags)


def _run_sharded(sharded, heads, flags):
    """Local blocks on the shards: batch split freely; heads split with the weights and caches, each shard
    projecting its own heads and the partial output projections summed (one psum), then ``out_bias``."""
    parts = sharded.axis_size("n")
    if heads["num_q_heads"] % parts or heads["num_kv_heads"] % parts:
        raise ValueError(
            f"{WHERE}: {heads['num_q_heads']} query and {heads['num_kv_heads']} kv heads cannot be split evenly "
            f"over mesh axis {sharded.axes['n']} of size {parts}"
        )
    local_heads = {name: count // parts for name, count in heads.items()}

    def local(*tensors, axes):
        block = _Block(*tensors)
        if "n" not in axes:
            return _call(block, local_heads, flags, out_bias=block.out_bias)
        out, cache = _call(block, local_heads, flags)
        out = jax.lax.psum(out, axes["n"])
        return (out if block.out_bias is None else out + jnp.asarray(block.out_bias).astype(out.dtype)), cache

    return sharded.run(local, ("b__", ("bn__", "bn__")))


def _composed(block: _Block, heads, *, eps, qk_norm_eps, scale):
    """The block as the separate ops compute it."""
    qkv_weight, qkv_bias, rope, qk_norm = block.qkv_weight, block.qkv_bias, block.rope, block.qk_norm
    if _grouped(qkv_weight):
        qkv_weight, qkv_bias = _ungrouped(qkv_weight), _ungrouped(qkv_bias)
    q, k, v = qkv_projection(
        block.x,
        qkv_weight,
        **heads,
        bias=qkv_bias,
        norm=None if block.norm_weight is None else "rms",
        norm_weight=block.norm_weight,
        eps=eps,
        rope=None if qk_norm is not None else rope,
    )
    if qk_norm is not None:
        q, k = rms_norm(q, qk_norm[0], eps=qk_norm_eps), rms_norm(k, qk_norm[1], eps=qk_norm_eps)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    attn, k_cache, v_cache = decode_attention(q, k, v, *block.kv_cache, block.cache_len, scale=scale)
    return output_projection(attn, block.out_weight, block.out_bias), (k_cache, v_cache)


def _row(value, dtype):
    return None if value is None else jnp.asarray(value).astype(dtype).reshape(1, -1)


def _causal_cache_mask(cache_len, capacity: int, seq: int, q_heads: int):
    """``attention_block_tkg``'s mask ``[capacity, batch, q_heads, seq]``: slot ``j < capacity - seq`` of the cache
    is seen by every new token when ``j < cache_len[b]``; the last ``seq`` slots stand for the new tokens, token
    ``i`` seeing new tokens ``t <= i``."""
    slot = jnp.arange(capacity, dtype=jnp.int32)[:, None, None]  # [capacity, 1, 1]
    token = jnp.arange(seq, dtype=jnp.int32)[None, None, :]  # [1, 1, seq]
    prior = slot < cache_len.astype(jnp.int32)[None, :, None]  # [capacity, batch, 1]
    active = (slot >= capacity - seq) & (slot - (capacity - seq) <= token)
    visible = jnp.where(slot < capacity - seq, prior, active)  # [capacity, batch, seq]
    return jnp.broadcast_to(visible[:, :, None, :], (capacity, cache_len.shape[0], q_heads, seq)).astype(jnp.uint8)


def _fused_operands(block: _Block, num_kv_heads: int, *, eps, qk_norm_eps, scale):
    """The ``attention_block_tkg`` call of this block, ``(operands, params, valid)``, or ``None`` when the block
    does not fit the kernel: several kv heads, caches not in ``x``'s dtype, or a kernel limit unmet."""
    x, (k_cache, v_cache), cache_len = block.x, block.kv_cache, block.cache_len
    qkv_weight, qkv_bias, rope, qk_norm = block.qkv_weight, block.qkv_bias, block.rope, block.qk_norm
    io = x.dtype
    if num_kv_heads != 1 or {k_cache.dtype, v_cache.dtype} != {io}:
        return None
    batch, seq, hidden = x.shape
    capacity, d = k_cache.shape[2], k_cache.shape[3]
    if _grouped(qkv_weight):  # one kv head: [hidden, 1, q + 2, d] is the kernel's [hidden, (q + 2) d]
        qkv_weight = jnp.reshape(qkv_weight, (hidden, -1))
        qkv_bias = None if qkv_bias is None else jnp.reshape(qkv_bias, (-1,))
    elif isinstance(qkv_weight, (tuple, list)):
        qkv_weight = jnp.concatenate([jnp.asarray(w) for w in qkv_weight], axis=1)
        qkv_bias = None if qkv_bias is None else jnp.concatenate([jnp.asarray(b) for b in qkv_bias])
    q_heads = qkv_weight.shape[1] // d - 2
    # A cache_len outside [0, capacity - 2 seq] gives NaN rows, as decode_attention's. Its tokens go to the scratch
    # tail (the last seq slots, which hold no valid position): the kernel's skip index is honoured only by block
    # caches (a flat cache's out-of-range write is undefined on the device).
    valid = (cache_len >= 0) & (cache_len <= capacity - 2 * seq)
    lengths = jnp.where(valid, cache_len, 0).astype(jnp.int32)
    operands = dict(
        X=x,
        W_qkv=jnp.asarray(qkv_weight).astype(io),
        K_cache=k_cache.reshape(batch, capacity, d),
        V_cache=v_cache.reshape(batch, capacity, d),
        attention_mask=_causal_cache_mask(lengths, capacity, seq, q_heads),
        rmsnorm_X_gamma=_row(block.norm_weight, io),
        bias_qkv=_row(qkv_bias, io),
        rmsnorm_QK_pre_rope_W_Q=None if qk_norm is None else _row(qk_norm[0], io),
        rmsnorm_QK_pre_rope_W_K=None if qk_norm is None else _row(qk_norm[1], io),
        cos=None if rope is None else _rope_table(rope[0], batch, seq, io),
        sin=None if rope is None else _rope_table(rope[1], batch, seq, io),
        kv_cache_update_idx=jnp.where(valid, lengths, capacity - seq).astype(jnp.uint32)[:, None],
        W_out=jnp.asarray(block.out_weight).astype(io),
        bias_out=_row(block.out_bias, io),
    )
    params = attention_block_tkg.params(
        rmsnorm_X_enabled=block.norm_weight is not None,
        rmsnorm_X_eps=eps,
        rmsnorm_QK_pre_rope_enabled=qk_norm is not None,
        rmsnorm_QK_pre_rope_eps=qk_norm_eps,
        update_cache=True,
        softmax_scale=scale,
    )
    if attention_block_tkg.unmet_neuron_limits(operands, params):
        return None
    return operands, params, valid


def _rope_table(table, batch: int, seq: int, dtype):
    """A ``[seq, d/2]`` or ``[batch | 1, seq, d/2]`` table as the kernel's ``[d/2, batch, seq]``."""
    table = jnp.asarray(table).astype(dtype)
    table = jnp.broadcast_to(table if table.ndim == 3 else table[None], (batch, seq, table.shape[-1]))
    return jnp.transpose(table, (2, 0, 1))


def _run_fused(operands, params, valid):
    """One ``attention_block_tkg`` call: ``(out [batch, seq, hidden], (k_cache, v_cache))`` in the library's
    layouts (the caches only reshaped)."""
    x, k_cache = operands["X"], operands["K_cache"]
    out, k_cache, v_cache = attention_block_tkg.call(operands, params)
    batch, seq, hidden = x.shape
    out = jnp.where(valid[:, None, None], out.reshape(batch, seq, hidden), jnp.nan)
    shape = (batch, 1) + k_cache.shape[1:]
    return out, (k_cache.reshape(shape), v_cache.reshape(shape))
