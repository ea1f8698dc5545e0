"""Float64 NumPy oracle of ``qkv_mla_mx`` / ``qkv_mla_mx_deepseek_v4``, written from nki-library's torch references
(``experimental/qkv/qkv_cte_mla_torch.py``, ``core/utils/mx_torch_common.py``), and an independent packer of their
MX operands (``build_qkv_mla_input``'s layouts).

Roundings emulated as the torch reference makes them, with the kernels' MX scale (``nisa.quantize_mx``'s default,
the alternative emax 7; the torch reference's OCP rule has 8): activations cast to float32 and MX-quantized along K
in blocks of 32 (scale byte ``clip(E - 7, 0, 255)`` from the block's largest float32 exponent ``E``, elements
``fp8_e4m3fn(float32(clip(x / 2**(E - 134), +-448)))``, dequantized with the byte); matmul outputs cast to float32
before each RMSNorm; everything else float64; outputs compared after the caller's bfloat16 rounding.
"""

import ml_dtypes
import numpy as np

FP8 = ml_dtypes.float8_e4m3fn
EMAX = 7  # nisa.quantize_mx's default scale (the alternative emax), the kernels' rule as compiled by the library
TILE, PMAX, Q = 512, 128, 4


# ------------------------------------------------------------------------------------------------ packing
def random_fp8_codes(rng, k, n):
    """uint8 float8_e4m3fn codes ``[k, n]`` of normal values (never NaN: |x| << 448)."""
    return (rng.standard_normal((k, n)) * 0.5).astype(np.float32).astype(FP8).view(np.uint8)


def pack_words(codes):
    """uint32 words ``[K/4, N]`` from codes ``[K, N]``: byte ``j`` (bits 8j..8j+7) of word ``[r, n]`` is
    ``codes[4r + j, n]``."""
    k, n = codes.shape
    lanes = codes.reshape(k // Q, Q, n).astype(np.uint32)
    return lanes[:, 0] | (lanes[:, 1] << 8) | (lanes[:, 2] << 16) | (lanes[:, 3] << 24)


def random_compact_scales(rng, k, n):
    """uint8 compact block-128 scales ``[K/128, ceil(N/128)]`` around 2**-4."""
    return rng.integers(119, 126, (k // 128, -(-n // 128))).astype(np.uint8)


def decode(codes, compact):
    """float64 ``[K, N]``: ``fp8(codes[k, n]) * 2**(compact[k // 128, n // 128] - 127)``."""
    k, n = codes.shape
    rows, cols = np.arange(k) // 128, np.arange(n) // 128
    return codes.view(FP8).astype(np.float64) * 2.0 ** (compact[rows][:, cols].astype(np.float64) - 127)


def swizzle_columns(natural):
    """The kernels' stored order of ``natural [..., D]``: natural ``t*512 + 4p + q`` at ``q*(D/4) + t*128 + p``."""
    d = natural.shape[-1]
    idx = np.arange(d).reshape(d // TILE, PMAX, Q).transpose(2, 0, 1).reshape(d)
    return natural[..., idx]


def unswizzle_columns(stored):
    d = stored.shape[-1]
    idx = np.arange(d).reshape(Q, d // TILE, PMAX).transpose(1, 2, 0).reshape(d)
    return stored[..., idx]


# ------------------------------------------------------------------------------------------------ math
def mx_quantize(a):
    """float64 of ``a [..., K]`` after the torch reference's MX round trip (blocks of 32 consecutive K)."""
    a32 = np.asarray(a, np.float32)
    blocks = a32.reshape(*a32.shape[:-1], -1, 32)
    exponent = ((blocks.view(np.uint32) >> 23) & 0xFF).max(axis=-1, keepdims=True).astype(np.int64)
    scaled = np.clip(blocks.astype(np.float64) / 2.0 ** (exponent - EMAX - 127), -448, 448)
    elements = scaled.astype(np.float32).astype(FP8).astype(np.float64)
    return (elements * 2.0 ** (np.clip(exponent - EMAX, 0, 255) - 127)).reshape(a32.shape)


def mx_matmul(a, codes, compact):
    return mx_quantize(a) @ decode(codes, compact)


def rms_norm(x, gamma, eps):
    x = np.asarray(x, np.float32).astype(np.float64)  # the reference's .to(float32)
    out = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return out if gamma is None else out * gamma.reshape(-1)


def rope(x, cos, sin):
    half = x.shape[-1] // 2
    a, b, c, s = x[..., :half], x[..., half:], cos[..., :half], sin[..., :half]
    return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)


def qkv_mla_mx(x_hbm, w_a, w_qb, gq, w_kvb, gkv, cos, sin, heads, nope, rope_dim, v_dim, kv_rank, q_rank, eps):
    """``(q, k, v)`` float64; each ``w_*`` is ``(codes [K, N], compact scales)``."""
    b, s, h = x_hbm.shape
    x = x_hbm.reshape(b * s, Q, h // TILE, PMAX).transpose(0, 2, 3, 1).reshape(b, s, h)
    fused = mx_matmul(x, *w_a)
    qr = unswizzle_columns(fused[..., :q_rank])
    kv = unswizzle_columns(fused[..., q_rank : q_rank + kv_rank])
    k_pe = rope(fused[..., q_rank + kv_rank :], cos, sin)
    q = mx_matmul(rms_norm(qr, gq, eps), *w_qb).reshape(b, s, heads, nope + rope_dim)
    q[..., nope:] = rope(q[..., nope:], cos[:, :, None], sin[:, :, None])
    kvo = mx_matmul(rms_norm(kv, gkv, eps), *w_kvb).reshape(b, s, heads, nope + v_dim)
    k = np.concatenate([kvo[..., :nope], np.broadcast_to(k_pe[:, :, None], (b, s, heads, rope_dim))], axis=-1)
    return q, k, kvo[..., nope:]


def qkv_mla_mx_deepseek_v4(x_hbm, w, w_qb, gq, gkv, cos, sin, heads, head_dim, rope_dim, q_rank, eps):
    """``(q, kv)`` float64."""
    b, s, h = x_hbm.shape
    x = x_hbm.reshape(b * s, Q, h // TILE, PMAX).transpose(0, 2, 3, 1).reshape(b, s, h)
    fused = mx_matmul(x, *w)
    q = mx_matmul(rms_norm(unswizzle_columns(fused[..., :q_rank]), gq, eps), *w_qb).reshape(b, s, heads, head_dim)
    q = q / np.sqrt(np.mean(q * q, axis=-1, keepdims=True) + eps)
    q[..., -rope_dim:] = rope(q[..., -rope_dim:], cos[:, :, None], sin[:, :, None])
    kv = rms_norm(fused[..., q_rank:], gkv, eps)
    kv[..., -rope_dim:] = rope(kv[..., -rope_dim:], cos, sin)
    return q, kv
