"""NumPy float64 oracle and independent MX packers for ``mla_qkv_cte_kernel`` (written from its torch reference
``mla_qkv_cte_torch_ref``: the packed-row decode (multiplied as it is, as the kernel does; the torch reference
re-quantizes it), MX quantization of ``qr`` in blocks of 32 along the contraction with the kernel's scale
(``nisa.quantize_mx``'s default, the alternative emax 7; the torch reference's OCP rule has 8), compact block-128
weight scales, the MLA column swizzle, RMS norms, interleaved RoPE,
the bf16 absorption), with the fp8/bf16 roundings emulated by ml_dtypes."""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
BLOCK = 32


# ------------------------------------------------------------------------------------------------ MX in NumPy
def _block_exponent(blocks32):
    """Largest float32 biased exponent of each block (last axis), as int64."""
    bits = np.abs(blocks32).astype(np.float32).view(np.uint32)
    return ((bits >> 23) & 0xFF).astype(np.int64).max(axis=-1, keepdims=True)


def mx_quantize(values, emax):
    """``(fp8 elements, uint8 scales)`` of ``values [..., n]`` in blocks of 32 along the last axis: scale byte
    ``clip(E - emax, 0, 255)``, element ``fp8(clip(v * 2**(127 + emax - E), +-448))``."""
    blocks = np.asarray(values, np.float32).reshape(*np.shape(values)[:-1], -1, BLOCK)
    exponent = _block_exponent(blocks)
    scaled = blocks.astype(np.float64) * 2.0 ** (127 + emax - exponent)  # exact power-of-two scaling
    elements = np.clip(scaled, -448, 448).astype(E4M3).reshape(np.shape(values))
    return elements, np.clip(exponent[..., 0] - emax, 0, 255).astype(np.uint8)


def mx_dequantize(elements, scales):
    """float64 ``element * 2**(scale - 127)``, one scale per 32 consecutive elements of the last axis."""
    blocks = elements.astype(np.float64).reshape(*scales.shape, BLOCK)
    return (blocks * 2.0 ** (scales.astype(np.float64)[..., None] - 127)).reshape(elements.shape)


def mx_round_trip(values):
    """What the kernel's ``quantize_mx`` does to a matmul input (its default scale, emax 7), in float64."""
    return mx_dequantize(*mx_quantize(values, emax=7))


# ------------------------------------------------------------------------------------------------ packers
def packed_scale_byte(hidden, block):
    """Column of MX block ``block`` (hidden ``32 block ..``) in a pack_scales=True row: after the ``H`` elements,
    4 H512 tiles per 128-byte group, tile ``k`` at lane ``k % 4`` of each 32-byte quadrant ``g // 4``."""
    tile, g = divmod(block, 16)
    return hidden + (tile // 4) * 128 + (g // 4) * 32 + (tile % 4) * 4 + g % 4


def pack_x(values, emax=7):
    """``rmsnorm_mx_prefill`` packed rows (float8_e4m3fn bytes) ``[..., H + ceil(H/2048)*128]`` of ``values [..., H]``
    (scales with the producer's alternative emax 7 by default)."""
    hidden = values.shape[-1]
    elements, scales = mx_quantize(values, emax)
    region = -(-hidden // 2048) * 128
    rows = np.zeros((*values.shape[:-1], hidden + region), np.uint8)
    rows[..., :hidden] = elements.view(np.uint8)
    for block in range(hidden // BLOCK):
        rows[..., packed_scale_byte(hidden, block)] = scales[..., block]
    return rows.view(E4M3)


def decode_x(rows, hidden):
    """float64 ``[..., H]`` of packed rows: the elements times their blocks' scales read back from the row bytes."""
    raw = rows.view(np.uint8)
    scales = np.stack([raw[..., packed_scale_byte(hidden, b)] for b in range(hidden // BLOCK)], axis=-1)
    return mx_dequantize(raw[..., :hidden].view(E4M3), scales)


def random_mx_weight(rng, rows, cols):
    """``(words [rows/4, cols] uint32, compact scales [rows/128, ceil(cols/128)] uint8, float64 value [rows, cols])``:
    fp8 elements of normal draws at a random block-128 scale (about ``rows**-0.5`` in magnitude)."""
    scales = rng.integers(118, 123, (rows // 128, -(-cols // 128))).astype(np.uint8)
    full = np.repeat(np.repeat(scales, 128, axis=0), 128, axis=1)[:, :cols].astype(np.float64)
    target = rng.standard_normal((rows, cols)) * rows**-0.5
    elements = np.clip(target * 2.0 ** (127 - full), -448, 448).astype(E4M3)
    codes = elements.view(np.uint8).reshape(rows // 4, 4, cols).astype(np.uint32)
    words = codes[:, 0] | (codes[:, 1] << 8) | (codes[:, 2] << 16) | (codes[:, 3] << 24)
    return words, scales, elements.astype(np.float64) * 2.0 ** (full - 127)


def swizzled_column(width, natural):
    """Stored column of natural column ``512 t + 4 p + q`` in an MLA-swizzled block of ``width`` columns."""
    tile, rest = divmod(natural, 512)
    p, q = divmod(rest, 4)
    return q * (width // 4) + 128 * tile + p


# ------------------------------------------------------------------------------------------------ the oracle
def _rms_norm(x, gamma, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma.reshape(-1)


def _rope(x, cos, sin):
    out = np.empty_like(x)
    for j in range(x.shape[-1] // 2):
        x0, x1 = x[..., 2 * j], x[..., 2 * j + 1]
        out[..., 2 * j] = x0 * cos[..., j] - x1 * sin[..., j]
        out[..., 2 * j + 1] = x0 * sin[..., j] + x1 * cos[..., j]
    return out


def projections(x_rows, w_a, w_b, q_gamma, heads, latent, q_rank, eps):
    """float64 ``(q [B, S, N, D + R], kv [T, L], k_pe [B, S, R])`` before RoPE and the KV norm; ``w_a [H, Na]`` /
    ``w_b [Q, Nb]`` the dequantized weights (stored column order)."""
    batch, seq, _ = x_rows.shape
    hidden = w_a.shape[0]
    x = decode_x(x_rows, hidden).reshape(batch * seq, hidden)
    fused = x @ w_a  # the packed MX values as they are
    qr = np.stack([fused[:, swizzled_column(q_rank, c)] for c in range(q_rank)], axis=-1)
    kv = np.stack([fused[:, q_rank + swizzled_column(latent, c)] for c in range(latent)], axis=-1)
    k_pe = fused[:, q_rank + latent :].reshape(batch, seq, -1)
    q = mx_round_trip(_rms_norm(qr, q_gamma, eps)) @ w_b
    return q.reshape(batch, seq, heads, -1), kv, k_pe


def mla_qkv(x_rows, w_a, w_b, q_gamma, kv_gamma, wuk, cos, sin, heads, nope, rope, latent, q_rank, eps, round_to):
    """float64 ``(q_lift, q_pe, c_kv, k_pe)`` (weights as in :func:`projections`); ``round_to``: the dtype q_nope
    is rounded to before the absorption."""
    batch, seq, _ = x_rows.shape
    q, kv, k_pe = projections(x_rows, w_a, w_b, q_gamma, heads, latent, q_rank, eps)
    q_nope = q[..., :nope].astype(round_to).astype(np.float64)
    q_lift = np.stack([q_nope[:, :, h] @ wuk[:, h * latent : (h + 1) * latent] for h in range(heads)], axis=2)
    half = rope // 2
    cos, sin = cos[..., :half], sin[..., :half]
    q_pe = _rope(q[..., nope:], cos[:, :, None], sin[:, :, None])
    c_kv = _rms_norm(kv, kv_gamma, eps).reshape(batch, seq, latent)
    return q_lift, q_pe, c_kv, _rope(k_pe, cos, sin)
