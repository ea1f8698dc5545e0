"""Memory-efficient attention in JAX: online-softmax forward and the matching backward, block by block.

No ``[Sq, Sk]`` score matrix is ever formed: queries and keys are processed in blocks (``lax.map`` over query
blocks, ``lax.scan`` over key blocks), so memory is ``O(block_q * block_k)`` per (kv-head, group) plus the inputs.

Layouts (the engine's own): ``q [H_kv, G, Sq, d]`` (``G`` query heads share each KV head: grouped-query
attention), ``k, v [H_kv, Sk, d]``; ``sink`` ``[H_kv, G, n_sinks]`` holds extra softmax logits per row (unscaled).

Precision (the NKI kernels'): scores, softmax statistics and accumulations are float32 (float64 for float64
inputs); probabilities and score gradients are rounded to the input dtype before their matmuls.

Rows with no allowed key (and no sink) have output 0, row max ``-inf`` and row sum 0, so ``lse = +inf`` and their
gradients are 0: never NaN.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from ..framework.compat import varying_like
from .masks import MaskRule

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


def _accumulation_dtype(dtype):
    return jnp.promote_types(dtype, jnp.float32)


def _blocks(x, axis: int, block: int):
    """Pad ``axis`` to a multiple of ``block`` and move the block index to the front: [n_blocks, ..., block, ...]."""
    size = x.shape[axis]
    n_blocks = -(-size // block)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, n_blocks * block - size)
    x = jnp.pad(x, pad)
    x = x.reshape(x.shape[:axis] + (n_blocks, block) + x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)


def _unblock(x, axis: int, size: int):
    """Inverse of :func:`_blocks` for an array whose block index is in front and block axis at ``axis + 1``."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2:])
    return lax.slice_in_dim(x, 0, size, axis=axis)


def _block_sizes(rule: MaskRule, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    return min(block_q or DEFAULT_BLOCK_Q, rule.n_queries), min(block_k or DEFAULT_BLOCK_K, rule.n_keys)


def _scores(q_block, k_block, scale, acc):
    """``scale * q k^T`` in the accumulation dtype: [H_kv, G, bq, bk]."""
    return jnp.einsum("hgqd,hkd->hgqk", q_block, k_block, preferred_element_type=acc) * scale


def attention_forward(q, k, v, rule: MaskRule, scale: float, sink=None, *, block_q=None, block_k=None):
    """Returns ``(o, row_max, row_sum)``: ``o [H_kv, G, Sq, d]`` in the accumulation dtype, statistics
    ``[H_kv, G, Sq]`` over the allowed keys and the sinks (``row_max`` is ``-inf`` for empty rows)."""
    acc = _accumulation_dtype(q.dtype)
    bq, bk = _block_sizes(rule, block_q, block_k)
    n_kv, groups, seq_q, d = q.shape
    q_blocks = _blocks(q, 2, bq)
    k_blocks, v_blocks = _blocks(k, 1, bk), _blocks(v, 1, bk)
    k_index = jnp.arange(k_blocks.shape[0] * bk).reshape(-1, bk)

    def one_q_block(args):
        q_block, q_index = args

        def one_k_block(carry, xs):
            row_max, row_sum, out = carry
            k_block, v_block, k_idx = xs
            allowed = rule.allowed(q_index, k_idx)
            s = jnp.where(allowed, _scores(q_block, k_block, scale, acc), -jnp.inf)
            new_max = jnp.maximum(row_max, s.max(-1))
            safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
            p = jnp.exp(s - safe_max[..., None])
            correction = jnp.exp(row_max - safe_max)
            row_sum = row_sum * correction + p.sum(-1)
            pv = jnp.einsum("hgqk,hkd->hgqd", p.astype(v.dtype), v_block, preferred_element_type=acc)
            return (new_max, row_sum, out * correction[..., None] + pv), None

        init = (jnp.full((n_kv, groups, bq), -jnp.inf, acc), jnp.zeros((n_kv, groups, bq), acc),
                jnp.zeros((n_kv, groups, bq, d), acc))
        init = tuple(varying_like(x, q_block, k_blocks, v_blocks, *rule.runtime_values()) for x in init)
        (row_max, row_sum, out), _ = lax.scan(one_k_block, init, (k_blocks, v_blocks, k_index))
        return row_max, row_sum, out

    q_index = jnp.arange(q_blocks.shape[0] * bq).reshape(-1, bq)
    row_max, row_sum, out = lax.map(one_q_block, (q_blocks, q_index))
    row_max, row_sum = _unblock(row_max, 2, seq_q), _unblock(row_sum, 2, seq_q)
    out = _unblock(out, 2, seq_q)
    if sink is not None:
        sink = sink.astype(acc)[:, :, None, :]  # the same logits for every row
        new_max = jnp.maximum(row_max, sink.max(-1))
        correction = jnp.exp(row_max - new_max)
        row_sum = row_sum * correction + jnp.exp(sink - new_max[..., None]).sum(-1)
        out, row_max = out * correction[..., None], new_max
    out = jnp.where(row_sum[..., None] > 0, out / jnp.where(row_sum > 0, row_sum, 1.0)[..., None], 0.0)
    return out, row_max, row_sum


def log_sum_exp(row_max, row_sum):
    """``log(sum(exp(scores)))`` per row from the forward statistics (``+inf`` for empty rows)."""
    return jnp.where(row_sum > 0, row_max + jnp.log(jnp.where(row_sum > 0, row_sum, 1.0)), jnp.inf)


def attention_backward(q, k, v, o, dy, lse, rule: MaskRule, scale: float, sink=None, *, block_q=None,
                       block_k=None):
    """Gradients ``(dq, dk, dv, dsink)`` in the accumulation dtype from the forward output ``o`` and its row
    log-sum-exp ``lse [H_kv, G, Sq]`` (FlashAttention-2: ``D = rowsum(dy * o)``, ``dS = P * (dP - D)``)."""
    acc = _accumulation_dtype(q.dtype)
    bq, bk = _block_sizes(rule, block_q, block_k)
    seq_q, seq_k = q.shape[2], k.shape[1]
    delta = jnp.sum(dy.astype(acc) * o.astype(acc), axis=-1)
    q_blocks, dy_blocks = _blocks(q, 2, bq), _blocks(dy, 2, bq)
    lse_blocks, delta_blocks = _blocks(lse.astype(acc), 2, bq), _blocks(delta, 2, bq)
    q_index = jnp.arange(q_blocks.shape[0] * bq).reshape(-1, bq)
    k_blocks, v_blocks = _blocks(k, 1, bk), _blocks(v, 1, bk)
    k_index = jnp.arange(k_blocks.shape[0] * bk).reshape(-1, bk)
    inputs = (q, k, v, o, dy, lse, *rule.runtime_values())

    def one_k_block(dq, xs):
        k_block, v_block, k_idx = xs

        def one_q_block(carry, ys):
            dk, dv = carry
            q_block, dy_block, lse_block, delta_block, q_idx = ys
            allowed = rule.allowed(q_idx, k_idx)
            s = _scores(q_block, k_block, scale, acc)
            p = jnp.where(allowed, jnp.exp(s - lse_block[..., None]), 0.0)
            dv = dv + jnp.einsum("hgqk,hgqd->hkd", p.astype(dy.dtype), dy_block, preferred_element_type=acc)
            dp = jnp.einsum("hgqd,hkd->hgqk", dy_block, v_block, preferred_element_type=acc)
            ds = (p * (dp - delta_block[..., None])).astype(q.dtype)
            dq_block = jnp.einsum("hgqk,hkd->hgqd", ds, k_block, preferred_element_type=acc) * scale
            dk = dk + jnp.einsum("hgqk,hgqd->hkd", ds, q_block, preferred_element_type=acc) * scale
            return (dk, dv), dq_block

        zeros = varying_like(jnp.zeros((k.shape[0], bk, k.shape[2]), acc), *inputs)
        (dk, dv), dq_blocks = lax.scan(one_q_block, (zeros, zeros),
                                       (q_blocks, dy_blocks, lse_blocks, delta_blocks, q_index))
        return dq + dq_blocks, (dk, dv)

    dq0 = varying_like(jnp.zeros(q_blocks.shape, acc), *inputs)
    dq, (dk, dv) = lax.scan(one_k_block, dq0, (k_blocks, v_blocks, k_index))
    dq = _unblock(dq, 2, seq_q)
    dk, dv = _unblock(dk, 1, seq_k), _unblock(dv, 1, seq_k)
    dsink = None
    if sink is not None:
        p_sink = jnp.exp(sink.astype(acc)[:, :, None, :] - lse.astype(acc)[..., None])  # [H_kv, G, Sq, n_sinks]
        dsink = -jnp.sum(p_sink * delta[..., None], axis=2)
    return dq, dk, dv, dsink


def group_queries(x, n_kv: int):
    """``[B, S, d]`` with ``B = n_kv * G`` (kv index ``b // G``) to the engine's ``[n_kv, G, S, d]``."""
    return x.reshape((n_kv, x.shape[0] // n_kv) + x.shape[1:])


def ungroup_queries(x):
    return x.reshape((math.prod(x.shape[:2]),) + x.shape[2:])
