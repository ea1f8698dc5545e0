"""Attention in JAX layouts: ``jax_nkilib.attention`` (prefill, on ``attention_cte``) and
``jax_nkilib.decode_attention`` (a few new tokens against a KV cache, on ``attention_tkg``)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..parallel import auto
from .checks import check_qkv_layout
from .cte import attention_cte
from .tkg import attention_tkg

_WHERE = "jax_nkilib.attention"


def _heads_into_batch(x):
    """[batch, S, H, d] -> [batch * H, S, d] (row b * H + h)."""
    batch, seq, heads, d = x.shape
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(batch * heads, seq, d)


def _check(q, k, v, sinks, prefix, causal, sliding_window) -> None:
    check_qkv_layout(_WHERE, q, k, v)
    if sinks is not None and jnp.shape(sinks) not in ((q.shape[2],), (q.shape[0], q.shape[2])):
        raise ValueError(f"{_WHERE}: `sinks` must be [heads] or [batch, heads] = ({q.shape[2]},) or "
                         f"{q.shape[:1] + q.shape[2:3]}; got {jnp.shape(sinks)}")
    if sliding_window is not None and (not causal or sliding_window <= 0):
        raise ValueError(f"{_WHERE}: sliding_window must be a positive int and needs causal=True; got "
                         f"sliding_window={sliding_window}, causal={causal}")
    if prefix is not None:
        if not (isinstance(prefix, (tuple, list)) and len(prefix) == 3):
            raise TypeError(f"{_WHERE}: `prefix` must be (k_prior, v_prior, prior_len)")
        k_prior, v_prior, _ = prefix
        if jnp.shape(k_prior) != jnp.shape(v_prior) or jnp.ndim(k_prior) != 4 or \
                (jnp.shape(k_prior)[0],) + tuple(jnp.shape(k_prior)[2:]) != (k.shape[0],) + k.shape[2:]:
            raise ValueError(f"{_WHERE}: prefix k_prior/v_prior must be [batch, prior_len_max, kv_heads, head_dim] "
                             f"matching k {k.shape}; got {jnp.shape(k_prior)} and {jnp.shape(v_prior)}")


ATTENTION_SHARDING = auto.register_rule(auto.ShardingRule(
    "jax_nkilib.attention", free={"b": "batch", "n": "heads"},
    collective={"s": ("sequence", "ring attention over the mesh axis (K/V blocks travel by ppermute; q, k and v "
                      "split alike, contiguous layout; no sliding window, sinks or prefix)")},
    note="query and kv heads split over the same mesh axis (kv_heads divisible by its size)"))
DECODE_ATTENTION_SHARDING = auto.register_rule(auto.ShardingRule(
    "jax_nkilib.decode_attention", free={"b": "batch", "n": "heads"},
    note="with a block_table (paged caches shared by the batch) only heads shard"))


def _plan_attention(q, k, v, sinks, prefix, sliding_window):
    """The shard_map plan of :func:`attention`: batch and heads free; a sharded sequence selects ring attention."""
    operands = [auto.Operand("q", q, "bsnd"), auto.Operand("k", k, "bsnd"), auto.Operand("v", v, "bsnd"),
                auto.Operand("sinks", sinks, None if sinks is None else "bn"[2 - jnp.ndim(sinks):])]
    operands.append(auto.Operand("prefix", None if prefix is None else tuple(prefix), ("b_nd", "b_nd", None)))
    sharded = auto.plan(ATTENTION_SHARDING, operands)
    if sharded and "s" in sharded.axes:
        if sliding_window or sinks is not None or prefix is not None:
            axis = auto.spec_entry(sharded.axes["s"])
            raise ValueError(f"jax_nkilib.attention: a sequence sharded over mesh axis {axis!r} runs ring attention, "
                             "which supports no sliding_window, sinks or prefix; replicate the sequence axis")
    return sharded


def attention(q, k, v, *, causal: bool = True, scale: float | None = None, sliding_window: int | None = None,
              sinks=None, prefix=None):
    """Multi-head attention ``softmax(scale * q k^T + mask [‖ sinks]) v`` for prefill.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``.
      k, v: ``[batch, seq_kv, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA/MQA: query head ``h`` uses kv
        head ``h // (heads / kv_heads)``).
      causal: query ``i`` sees keys at positions ``<= i``.
      scale: defaults to ``1/sqrt(head_dim)``.
      sliding_window: with ``causal``, query ``i`` sees only keys at positions ``> i - sliding_window``.
      sinks: ``[heads]`` or ``[batch, heads]`` extra softmax logits (attention sinks), differentiable.
      prefix: ``(k_prior, v_prior, prior_len)``: cached keys/values ``[batch, max_prior, kv_heads, head_dim]`` of
        which the first ``prior_len`` (an int, possibly traced) precede ``k``/``v``; they sit at positions
        ``-prior_len .. -1``, so every query sees them (within the sliding window).

    Returns ``[batch, seq_q, heads, head_dim]`` in ``q``'s dtype; differentiable in ``q``, ``k``, ``v``, ``sinks``
    and the prefix keys/values. Rows that see no key give 0. On Neuron this is the ``attention_cte`` kernel (and
    ``attention_bwd`` in reverse mode); elsewhere a blockwise reference that never forms the score matrix.
    """
    _check(q, k, v, sinks, prefix, causal, sliding_window)
    sharded = _plan_attention(q, k, v, sinks, prefix, sliding_window)
    if sharded:
        def local(q, k, v, sinks, prefix, axes):
            if "s" in axes:
                from ..parallel.ring_attention import ring_attention
                return ring_attention(q, k, v, axis_name=auto.spec_entry(axes["s"]), causal=causal, layout="contiguous",
                                      scale=scale)
            return attention(q, k, v, causal=causal, scale=scale, sliding_window=sliding_window, sinks=sinks,
                             prefix=prefix)
        return sharded.run(local, "bsnd")
    batch, seq_q, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q_rows = _heads_into_batch(q)
    kernel_scale = scale
    if sliding_window or prefix is not None:  # the kernel's contract: pre-scale q, pass scale=1.0
        q_rows, kernel_scale = (q_rows * scale).astype(q.dtype), 1.0
    sink = None
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks), (batch, heads)).reshape(batch * heads, 1).astype(q.dtype)
    k_prior = v_prior = prior_used_len = None
    if prefix is not None:
        k_prior, v_prior = _heads_into_batch(jnp.asarray(prefix[0])), _heads_into_batch(jnp.asarray(prefix[1]))
        prior_used_len = jnp.asarray(prefix[2], jnp.int32).reshape(1)
    out = attention_cte(q_rows, _heads_into_batch(k), _heads_into_batch(v), k_prior, v_prior, prior_used_len, sink,
                        scale=kernel_scale, causal_mask=causal, sliding_window=sliding_window, tp_q=True, tp_k=True,
                        tp_out=False)
    return jnp.transpose(out.reshape(batch, heads, seq_q, head_dim), (0, 2, 1, 3))


_DECODE = "jax_nkilib.decode_attention"


def _check_decode(q, k_new, v_new, k_cache, v_cache, cache_len, block_table) -> None:
    paged = block_table is not None
    cache_layout = "[num_blocks, kv_heads, block_len, d]" if paged else "[batch, kv_heads, max_len, d]"
    for name, x, rank in (("q", q, 4), ("k_new", k_new, 4), ("v_new", v_new, 4), ("k_cache", k_cache, 4),
                          ("v_cache", v_cache, 4), ("cache_len", cache_len, 1)):
        if not hasattr(x, "shape") or x.ndim != rank:
            raise ValueError(f"{_DECODE}: `{name}` must have rank {rank}; got {getattr(x, 'shape', type(x).__name__)}"
                             f" (q [batch, s_new, heads, d], k_new/v_new [batch, s_new, kv_heads, d], caches "
                             f"{cache_layout}, cache_len [batch])")
    batch, s_new, heads, d = q.shape
    if k_new.shape != v_new.shape or k_new.shape[:2] != (batch, s_new) or k_new.shape[3] != d:
        raise ValueError(f"{_DECODE}: k_new/v_new must be [batch, s_new, kv_heads, d] matching q {q.shape}; got "
                         f"{k_new.shape} and {v_new.shape}")
    kv_heads = k_new.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{_DECODE}: query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    lead = (k_cache.shape[0], kv_heads) if paged else (batch, kv_heads)
    if k_cache.shape != v_cache.shape or k_cache.shape[:2] != lead or k_cache.shape[3] != d:
        raise ValueError(f"{_DECODE}: k_cache/v_cache must be {cache_layout} with kv_heads={kv_heads}, d={d}; got "
                         f"{k_cache.shape} and {v_cache.shape}")
    if paged and (block_table.ndim != 2 or block_table.shape[0] != batch
                  or not jnp.issubdtype(block_table.dtype, jnp.integer)):
        raise ValueError(f"{_DECODE}: `block_table` must be an integer array [batch, max_blocks] with batch={batch}; "
                         f"got {block_table.shape} {block_table.dtype}")
    max_len = block_table.shape[1] * k_cache.shape[2] if paged else k_cache.shape[2]
    if max_len < 2 * s_new:
        raise ValueError(f"{_DECODE}: the cache capacity {max_len} must leave room for the s_new={s_new} new tokens "
                         "and the kernel's scratch tail")
    if cache_len.shape != (batch,) or not jnp.issubdtype(cache_len.dtype, jnp.integer):
        raise TypeError(f"{_DECODE}: `cache_len` must be an integer array [batch]; got {cache_len.shape} "
                        f"{cache_len.dtype}")


def decode_attention(q, k_new, v_new, k_cache, v_cache, cache_len, *, scale: float | None = None,
                     block_table=None):
    """Attention of ``s_new`` new tokens per sequence against a KV cache with per-sequence lengths.

    Args:
      q: ``[batch, s_new, heads, head_dim]``; new token ``i`` of sequence ``b`` has position ``cache_len[b] + i``.
      k_new, v_new: ``[batch, s_new, kv_heads, head_dim]`` (``heads % kv_heads == 0``).
      k_cache, v_cache: a flat cache ``[batch, kv_heads, max_len, head_dim]``, or with ``block_table`` a paged
        cache ``[num_blocks, kv_heads, block_len, head_dim]``. The first ``cache_len[b]`` positions of sequence ``b``
        are valid. The last ``s_new`` positions of the capacity are the kernel's scratch: keep
        ``cache_len + s_new <= capacity - s_new``.
      cache_len: int ``[batch]``, the tokens already cached per sequence (a runtime value).
      scale: defaults to ``1/sqrt(head_dim)``.
      block_table: int ``[batch, max_blocks]``: sequence ``b``'s positions ``j * block_len ...`` live in block
        ``block_table[b, j]`` (capacity ``max_blocks * block_len``).

    Returns ``(out [batch, s_new, heads, head_dim], k_cache, v_cache)``: each new token attends to its sequence's
    cached tokens and to the new tokens up to itself; the returned caches hold the new keys and values at positions
    ``cache_len[b] + i`` (a functional update). On Neuron the attention is the NKI ``attention_tkg`` kernel with its
    in-kernel position mask (``use_pos_id``) and, for a paged cache, its block KV cache.
    """
    q, k_new, v_new = jnp.asarray(q), jnp.asarray(k_new), jnp.asarray(v_new)
    k_cache, v_cache, cache_len = jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(cache_len)
    block_table = None if block_table is None else jnp.asarray(block_table)
    _check_decode(q, k_new, v_new, k_cache, v_cache, cache_len, block_table)
    cache_dims = "bn_d" if block_table is None else "_n_d"
    sharded = auto.plan(DECODE_ATTENTION_SHARDING, [
        auto.Operand("q", q, "bsnd"), auto.Operand("k_new", k_new, "bsnd"), auto.Operand("v_new", v_new, "bsnd"),
        auto.Operand("k_cache", k_cache, cache_dims), auto.Operand("v_cache", v_cache, cache_dims),
        auto.Operand("cache_len", cache_len, "b"), auto.Operand("block_table", block_table, "b_")])
    if sharded:
        if block_table is not None and "b" in sharded.axes:
            axis = auto.spec_entry(sharded.axes["b"])
            raise ValueError("jax_nkilib.decode_attention: with a block_table the paged caches are shared by the "
                             f"whole batch, so the batch cannot be split over mesh axis {axis!r}; shard the heads, or "
                             "replicate the batch")
        def local(q, k_new, v_new, k_cache, v_cache, cache_len, block_table, axes):
            return decode_attention(q, k_new, v_new, k_cache, v_cache, cache_len, scale=scale,
                                    block_table=block_table)
        return sharded.run(local, ("bsnd", cache_dims, cache_dims))
    batch, s_new, heads, d = q.shape
    kv_heads = k_new.shape[2]
    groups = heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    rows = batch * kv_heads  # one kernel row per (sequence, kv head)
    queries = (q * scale).astype(q.dtype).reshape(batch, s_new, kv_heads, groups, d)
    queries = jnp.transpose(queries, (0, 2, 3, 1, 4)).reshape(rows, groups, s_new, d)
    new_rows = lambda x: jnp.transpose(x, (0, 2, 1, 3)).reshape(rows, 1, s_new, d)  # noqa: E731
    positions = jnp.repeat(cache_len.astype(jnp.int32), kv_heads)[:, None] + jnp.arange(s_new, dtype=jnp.int32)
    active_mask = jnp.ones((s_new, rows, groups, s_new), jnp.uint8)  # unused with use_pos_id, as in the kernel
    if block_table is None:
        capacity = k_cache.shape[2]
        caches, paging = (c.reshape(rows, 1, capacity, d) for c in (k_cache, v_cache)), {}
    else:  # pools [num_blocks * kv_heads, block_len, d]; row (b, h) uses blocks table[b, j] * kv_heads + h
        block_len = k_cache.shape[2]
        capacity = block_table.shape[1] * block_len
        caches = (c.reshape(-1, block_len, d) for c in (k_cache, v_cache))
        table = block_table[:, None, :] * kv_heads + jnp.arange(kv_heads)[None, :, None]
        paging = dict(active_blocks_table=table.reshape(rows, -1).astype(jnp.uint32), block_len=block_len)
    out = attention_tkg(queries, new_rows(k_new), new_rows(v_new), *caches, active_mask, rope_pos_ids=positions,
                           use_pos_id=True, tp_k_prior=True, curr_sprior=capacity, **paging)
    out = jnp.transpose(out.reshape(batch, kv_heads, groups, d, s_new), (0, 4, 1, 2, 3)).reshape(q.shape)
    return (out,) + tuple(_write_new_tokens(cache, new, cache_len, block_table)
                          for cache, new in ((k_cache, k_new), (v_cache, v_new)))


def _write_new_tokens(cache, new, cache_len, block_table):
    """The cache with ``new [batch, s_new, kv_heads, d]`` stored at positions ``cache_len[b] + i``."""
    positions = cache_len.astype(jnp.int32)[:, None] + jnp.arange(new.shape[1], dtype=jnp.int32)  # [batch, s_new]
    new = new.astype(cache.dtype)
    if block_table is None:
        rows = jnp.arange(new.shape[0])[:, None]
        return cache.at[rows, :, positions].set(new)
    block_len = cache.shape[2]
    blocks = jnp.take_along_axis(block_table, positions // block_len, axis=1)
    return cache.at[blocks, :, positions % block_len].set(new)
