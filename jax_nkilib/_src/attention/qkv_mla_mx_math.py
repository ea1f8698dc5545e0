"""The float math of ``qkv_mla_mx`` and ``qkv_mla_mx_deepseek_v4`` (see :mod:`.qkv_mla_mx`) around their MX
matmuls (the MX weights, the 512-swizzle and the MX matmul are :mod:`..quant.mx_weights`), in ``jnp``."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..rope.pairs import rotate_pairs


def rms_norm(x, gamma, eps: float):
    """``x / sqrt(mean(x^2) + eps) * gamma`` over the last axis (``gamma`` broadcast; ``None``: no gain)."""
    normed = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed if gamma is None else normed * gamma


def rope_halves(x, cos, sin):
    """RoPE on ``x [..., R]`` with halves ``(a, b)``: ``(a cos - b sin, a sin + b cos)``; ``cos``/``sin``
    ``[..., R]`` broadcast against ``x``, of which only the first ``R / 2`` entries are read."""
    half = x.shape[-1] // 2
    return rotate_pairs(x, cos[..., :half], sin[..., :half], interleaved=False)
