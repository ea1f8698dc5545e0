"""The model's QKV weight layout: grouped by kv head, ``w_qkv [hidden, kv_heads, heads / kv_heads + 2, head_dim]``
(kv head ``g``'s query heads ``g * heads / kv_heads ...``, then its key, then its value).

It is the fused decode kernel's own layout per kv head (``attention_block_tkg``'s ``W_qkv [hidden, (q + 2) d]``),
and it shards over kv heads as one array: a tensor-parallel shard holding one kv head hands its slice to
:func:`jax_nkilib.decode_block` by a reshape, where separate ``w_q``, ``w_k``, ``w_v`` would be concatenated on
every decode step. The prefill's ``qkv_projection`` takes it as :func:`projection_weight` gives it.
"""

from __future__ import annotations

import jax.numpy as jnp


def group_qkv(w_q, w_k, w_v, kv_heads: int):
    """``w_q [hidden, heads * d]``, ``w_k``, ``w_v [hidden, kv_heads * d]`` as the grouped ``w_qkv``."""
    hidden, kv_width = w_k.shape
    d = kv_width // kv_heads
    q = jnp.reshape(w_q, (hidden, kv_heads, -1, d))
    k, v = (jnp.reshape(w, (hidden, kv_heads, 1, d)) for w in (w_k, w_v))
    return jnp.concatenate([q, k, v], axis=2)


def split_qkv(w_qkv):
    """The grouped ``w_qkv`` as ``(w_q [hidden, heads * d], w_k, w_v [hidden, kv_heads * d])``."""
    hidden, _, width, _ = w_qkv.shape
    group = width - 2
    parts = (w_qkv[:, :, :group], w_qkv[:, :, group], w_qkv[:, :, group + 1])
    return tuple(jnp.reshape(part, (hidden, -1)) for part in parts)


def projection_weight(w_qkv):
    """The grouped ``w_qkv`` as ``jax_nkilib.qkv_projection``'s ``w``: with one kv head it is already the fused
    ``[hidden, (heads + 2) * d]`` ``[Q | K | V]`` matrix (a reshape); otherwise the split form (three slices, which
    shard over kv heads)."""
    hidden, kv_heads, width, d = w_qkv.shape
    return jnp.reshape(w_qkv, (hidden, width * d)) if kv_heads == 1 else split_qkv(w_qkv)
