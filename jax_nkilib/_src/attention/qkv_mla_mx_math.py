"""The MX datapath shared by ``qkv_mla_mx`` and ``qkv_mla_mx_deepseek_v4`` (see :mod:`.qkv_mla_mx`), in ``jnp``.

* **512-swizzle** (:func:`unswizzle_512`): a width ``D`` (``D % 512 == 0``) stored in the kernels' pre-swizzled order
  holds the natural index ``t * 512 + 4 p + q`` at position ``q * (D / 4) + t * 128 + p`` (``t < D / 512``,
  ``p < 128``, ``q < 4``). The hidden states ``x_hbm`` arrive in this order along H, and the first projection's
  ``qr`` (and, in v32, ``kv``) columns come out of the matmul in it.
* **Block-128 weights** (:func:`decode_block128_weight`): ``float8_e4m3fn_x4`` words ``[K / 4, N]`` (uint32; byte
  ``j`` of word ``[r, n]`` is the weight at ``k = 4 r + j``) with DeepSeek's compact uint8 scales ``[K / 128,
  ceil(N / 128)]``: ``w[k, n] = fp8(byte) * 2**(scales[k // 128, n // 128] - 127)``.
* **MX matmul** (:func:`mx_matmul`): the activation ``[..., K]`` is MX-quantized along K in blocks of 32 consecutive
  elements (OCP rule, emax 8: :func:`..quant.mx.mx_round_trip`), then contracted with the decoded weight exactly
  (float32 at HIGHEST precision, float64 for float64 inputs).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..quant import mx

H_PACK = 4  # fp8 elements per x4 word
SWIZZLE_TILE = 512  # 128 partitions x 4
SCALE_BLOCK = 128  # DeepSeek compact scales: one per 128 x 128 weight block
MX_SCALE_ROWS_PER_BLOCK = SCALE_BLOCK // mx.BLOCK_SIZE  # dense MX scale rows (of 32 K) per compact row


def scale_blocks(n: int) -> int:
    """Compact scale columns for ``n`` weight columns: ``ceil(n / 128)``."""
    return -(-n // SCALE_BLOCK)


def unswizzle_512(stored):
    """Natural order of ``stored [..., D]`` (D % 512 == 0) from the kernels' 512-swizzled order (module doc)."""
    *lead, d = stored.shape
    tiles = stored.reshape(*lead, H_PACK, d // SWIZZLE_TILE, SWIZZLE_TILE // H_PACK)  # [q, t, p]
    return jnp.moveaxis(tiles, -3, -1).reshape(*lead, d)  # [t, p, q]


def swizzle_512(natural):
    """Inverse of :func:`unswizzle_512`: the kernels' stored order of ``natural [..., D]``."""
    *lead, d = natural.shape
    tiles = natural.reshape(*lead, d // SWIZZLE_TILE, SWIZZLE_TILE // H_PACK, H_PACK)  # [t, p, q]
    return jnp.moveaxis(tiles, -1, -3).reshape(*lead, d)  # [q, t, p]


def decode_block128_weight(words, compact_scales):
    """float32 ``[K, N]`` weight from x4 words ``[K / 4, N]`` and compact scales ``[K / 128, ceil(N / 128)]``."""
    rows, n = words.shape
    dense = jnp.repeat(jnp.repeat(compact_scales, MX_SCALE_ROWS_PER_BLOCK, axis=0), SCALE_BLOCK, axis=1)[:, :n]
    lanes = mx.decode_x4_weight(words, dense)  # [K / 4, N, 4]: lane j of row r is k = 4 r + j
    return jnp.swapaxes(lanes, -1, -2).reshape(rows * H_PACK, n)


def mx_matmul(activation, weight):
    """``mx_round_trip(activation) @ weight`` over K (the last axis of ``activation [..., K]``, ``weight [K, N]``),
    in ``activation``'s dtype (float32 or float64)."""
    wide = activation.dtype
    quantized = mx.mx_round_trip(activation, axis=-1).astype(wide)
    return jnp.matmul(quantized, weight.astype(wide), precision=lax.Precision.HIGHEST)


def rms_norm(x, gamma, eps: float):
    """``x / sqrt(mean(x^2) + eps) * gamma`` over the last axis (``gamma`` broadcast; ``None``: no gain)."""
    normed = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return normed if gamma is None else normed * gamma


def rope_halves(x, cos, sin):
    """RoPE on ``x [..., R]`` with halves ``(a, b)``: ``(a cos - b sin, a sin + b cos)``; ``cos``/``sin``
    ``[..., R]`` broadcast against ``x``, of which only the first ``R / 2`` entries are read."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    c, s = cos[..., :half], sin[..., :half]
    return jnp.concatenate([a * c - b * s, a * s + b * c], axis=-1)
