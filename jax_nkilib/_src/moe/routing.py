"""The RMSNorm and router of the fused token-generation MoE kernels (``moe_block_tkg``,
``rmsnorm_router_topk_a2av``, ``rmsnorm_router_topk_tkg``), as the NKI Library's ``rmsnorm_tkg`` and
``router_topk`` compute them.

RMSNorm of ``x [B, S, H]`` as rows ``[T, H]``: ``x * gamma / sqrt(sum(x^2) / hidden_actual + eps)`` (float32, or
float64 for float64 inputs). Router: ``logits = n @ W + b`` with ``n`` and ``W`` in ``router_mm_dtype`` and float32
accumulation; the top-k experts are the ``top_k`` largest logits, descending. Affinities ``[T, E]``: with
``router_pre_norm`` the activation (sigmoid per logit, or softmax over all ``E``) of every logit, optionally
(``norm_topk_prob``) kept on the top-k and divided by their sum; without it (the "ACT2" pipeline) the activation of
the top-k logits alone (softmax over the ``k``) scattered to their experts, 0 elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.common_types import RouterActFnType
from ..framework.spec import accumulation_dtype
from ..norm.rmsnorm_tkg import rms_statistics


def rms_normalized_rows(x, gamma, eps: float, hidden_actual: int | None):
    """RMSNorm of ``x [B, S, H]`` as rows ``[B*S, H]`` in the accumulation dtype (not rounded)."""
    acc = accumulation_dtype(x.dtype)
    rows = x.reshape(-1, x.shape[-1]).astype(acc)
    return rows * gamma.reshape(1, -1).astype(acc) * rms_statistics(rows, hidden_actual or x.shape[-1], eps)


def route(normed, router_weights, router_bias, *, top_k, act_fn, pre_norm, norm_topk, mm_dtype):
    """``(logits [T, E], index [T, K] int32, affinities [T, E])`` for normalized rows ``normed [T, H]``, in the
    accumulation dtype."""
    acc = jnp.promote_types(jnp.promote_types(normed.dtype, mm_dtype), jnp.float32)
    x = normed.astype(mm_dtype).astype(acc)
    w = router_weights.astype(mm_dtype).astype(acc)
    logits = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    if router_bias is not None:
        logits = logits + router_bias.reshape(1, -1).astype(acc)
    top_logits, index = jax.lax.top_k(logits, top_k)
    act = (lambda v: jax.nn.softmax(v, axis=-1)) if act_fn == RouterActFnType.SOFTMAX else jax.nn.sigmoid
    chosen = jax.nn.one_hot(index, logits.shape[-1], dtype=acc)  # [T, K, E]
    if not pre_norm:  # ACT2: the activation of the top-k logits alone
        return logits, index, jnp.einsum("tk,tke->te", act(top_logits), chosen)
    affinities = act(logits)
    if norm_topk:
        kept = affinities * jnp.sum(chosen, axis=1)
        affinities = kept / jnp.sum(kept, axis=-1, keepdims=True)
    return logits, index, affinities
