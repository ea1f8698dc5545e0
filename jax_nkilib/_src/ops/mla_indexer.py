"""``jax_nkilib.mla_attention``'s top-k indexer on ``sparse_attention_indexer_mx_bf16score`` (BF16 projections), for
the inputs the kernel fits; :func:`fits` says which, and ``mla_attention`` keeps its XLA indexer for the others.

The op's indexer (see :mod:`.mla`) rotates the LAST ``dr`` dims of each indexer head and normalizes its keys with an
affine-free LayerNorm; the kernel rotates the FIRST ``rope_head_dim`` dims and applies ``gamma``/``beta``. Moving
the rotary columns of ``index_wq`` and ``index_wk`` first (the same permutation of both sides leaves every ``q . k``
unchanged, and the LayerNorm does not depend on column order) and passing ``gamma = 1``, ``beta = 0`` makes the two
the same score, up to the kernel's bf16 roundings. The kernel returns each query's top-k ascending; reversed here
(best first, as the XLA indexer), with positions past the sequence (the kernel's padding) clamped to its last key.
The cache the kernel fills is a fresh zero one, discarded.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..attention.sparse_attention_indexer import (
    KERNEL_HEAD_DIM,
    MAX_S_TILES,
    MIN_DIM_TILES,
    TOPK_CHUNKS,
    sparse_attention_indexer_mx_bf16score,
)
from ..framework.hardware import PARTITIONS


def fits(x, q_latent, index_wq, cos, topk: int) -> bool:
    """Whether the kernel takes this indexer call: bfloat16 operands, one rotary table for the batch, indexer heads
    of 128, hidden and q_lora_rank multiples of 128 (hidden at least 1024: the kernel's W projection), a top-k count
    that is a multiple of 16, at most 64 row tiles."""
    seq = x.shape[1]
    return (
        x.dtype == jnp.bfloat16
        and q_latent.dtype == jnp.bfloat16
        and cos.ndim == 2
        and index_wq.shape[2] == KERNEL_HEAD_DIM
        and x.shape[2] % PARTITIONS == 0
        and x.shape[2] >= MIN_DIM_TILES * PARTITIONS
        and index_wq.shape[0] % PARTITIONS == 0
        and min(topk, seq) % TOPK_CHUNKS == 0
        and -(-seq // PARTITIONS) <= MAX_S_TILES
    )


def kernel_indexer_topk(x, q_latent, indexer, topk, cos, sin, dr, interleaved):
    """``[B, S, min(topk, S)]`` int32: each query's best causal keys, best first, from the kernel (see the module
    doc); the caller checked :func:`fits`. Not differentiable."""
    index_wq, index_wk, index_weights = (jax.lax.stop_gradient(w) for w in indexer)
    x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    batch, seq, hidden = x.shape
    rank, heads, head_dim = index_wq.shape
    order = jnp.concatenate([jnp.arange(head_dim - dr, head_dim), jnp.arange(head_dim - dr)])  # rotary dims first
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    mask = jnp.tile(jnp.where(causal, 0.0, -jnp.inf).astype(jnp.float32), (batch, 1))
    count = min(topk, seq)
    _, ascending, _ = sparse_attention_indexer_mx_bf16score(
        x.reshape(batch * seq, hidden).astype(jnp.float32),
        index_wq[:, :, order].reshape(rank, heads * head_dim),
        index_wk[:, order],
        jnp.ones((head_dim,), jnp.float32),
        jnp.zeros((head_dim,), jnp.float32),
        index_weights.T,
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        jnp.zeros((batch, head_dim, seq), jnp.bfloat16),
        mask,
        qr_bf16_hbm=q_latent.reshape(batch * seq, rank),
        index_topk=count,
        precision="BF16",
        rope_layout="INTERLEAVED" if interleaved else "HALF_SPLIT",
    )
    # A query with fewer than ``count`` causal keys also selects -inf slots, which on the device may be the kernel's
    # padding past ``seq`` (its top-k ranks ``seq`` rounded up to 16); ``seq - 1`` is a future key for every such
    # query (it has at most ``count - 2 <= seq - 2`` as its position), which the sparse attention masks.
    return jnp.minimum(ascending[:, ::-1], seq - 1).reshape(batch, seq, count)
