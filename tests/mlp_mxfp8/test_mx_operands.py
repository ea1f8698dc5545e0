"""The matmul_mxfp8-family operand helpers of jax_nkilib._src.quant.mx (wrapX swizzle, alternative-emax
quantization, x4 words and scale layouts) against a NumPy oracle written from the kernels' goldens
(``matmul_mxfp8_torch._swizzle``, ``mx_util.quantize_mx_golden`` with ``_get_mx_max_exp``, the packed-scale
unpacker ``_unpack_packed_scales``).

The ``oracle_*`` functions are the MXFP8 MLP tests' building blocks.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_nkilib._src.quant import mx
from tests.quant.test_mx import assert_same_float32, oracle_biased_exponent, spread

E4M3 = ml_dtypes.float8_e4m3fn
ALT_EMAX = 7  # e4m3fn's emax 8, minus one (the compilers' alternative emax)


# ------------------------------------------------------------------------------------------------------- the oracle
def oracle_swizzle(kf, tile=512):
    """The golden's interleave: ``[K, F]`` -> ``[K/4, 4F]``, a K remainder that is a multiple of 128 cut into 256
    and 128 sub-tiles; in a tile of size T, source row ``j*(T/4) + p`` goes to row ``p``, column ``4f + j``."""
    k, f = kf.shape
    rest = k % tile
    if rest and rest % 128 == 0:
        parts, start = [], k - rest
        if start:
            parts.append(oracle_swizzle(kf[:start], tile))
        for size in (256, 128):
            if rest >= size:
                parts.append(oracle_swizzle(kf[start : start + size], size))
                start, rest = start + size, rest - size
        return np.concatenate(parts, axis=0)
    out = np.zeros((k // 4, 4 * f), kf.dtype)
    for t in range(-(-k // tile)):
        sub = min(tile, k - t * tile) // 4
        for j in range(4):  # rows p = 0..sub-1 of lane j
            out[t * (tile // 4) : t * (tile // 4) + sub, j::4] = kf[t * tile + j * sub : t * tile + (j + 1) * sub]
    return out


def oracle_quantize_swizzled(sw):
    """``[R, 4F]`` float32 -> (e4m3fn elements, dense scales ``[R/8, F]``): 8 x 4 blocks, byte clip(E - 7, 0, 255),
    elements clip(x 2**(134 - E), +-448) rounded to nearest even."""
    r, f4 = sw.shape
    blocks = np.asarray(sw, np.float32).astype(np.float64).reshape(r // 8, 8, f4 // 4, 4)
    top = oracle_biased_exponent(blocks).max(axis=(1, 3), keepdims=True)
    with np.errstate(invalid="ignore"):
        elements = np.clip(blocks * 2.0 ** (127 + ALT_EMAX - top), -448, 448).astype(E4M3).reshape(r, f4)
    return elements, np.clip(top[:, 0, :, 0] - ALT_EMAX, 0, 255).astype(np.uint8)


def _k_order(k):
    return oracle_swizzle(np.arange(k)[:, None])  # [K/4, 4]: the K index at swizzled row r, lane j


def oracle_round_trip(x):
    """float64 dequantize(quantize(x)) of an ``[F, K]`` operand (contraction K, zero-padded to a multiple of 32)."""
    x = np.asarray(x, np.float32)
    f, n = x.shape
    x = np.concatenate([x, np.zeros((f, -n % 32), np.float32)], axis=1)
    k = x.shape[1]
    elements, scales = oracle_quantize_swizzled(oracle_swizzle(x.T))
    values = elements.astype(np.float64) * 2.0 ** (np.repeat(np.repeat(scales, 8, 0), 4, 1).astype(np.float64) - 127)
    out, order = np.zeros((f, k)), _k_order(k)
    for j in range(4):
        out[:, order[:, j]] = values[:, j::4].T
    return out[:, :n]


def oracle_scale_rows(k, packed):
    """The scale row of each dense scale row (one per 32 K of the swizzled order), as the golden's unpackers read
    them: unpacked ``(c // 4) * 32 + c % 4``; packed per K tile of 512 (then the 256, 128 and smaller remainders,
    which share the next tile index), offset by the tile's group of 4 (128 rows) and slot (4 rows each)."""
    if not packed:
        return np.array([(c // 4) * 32 + c % 4 for c in range(k // 32)])
    rows = []

    def tile(size, index, k_within):
        base = (index // 4) * 128 + 4 * (index % 4) + (k_within // 128) * 32
        rows.extend(base + (r // 4) * 32 + r % 4 for r in range(size // 32))

    full, rest = divmod(k, 512)
    for t in range(full):
        tile(512, t, 0)
    has_256, has_128 = rest >= 256, rest % 256 >= 128
    if has_256:
        tile(256, full, 0)
    if has_128:
        tile(128, full, 256 if has_256 else 0)
    remaining = rest - 256 * has_256 - 128 * has_128
    if remaining:
        tile(remaining, full, rest - remaining)
    return np.array(rows)


def oracle_quantize_operand(x, packed=False):
    """``[F, K]`` -> (uint32 words ``[K/4, F]``, uint8 scales ``[K/4, F]`` or packed ``[ceil(K/2048)*128, F]``)."""
    x = np.asarray(x, np.float32)
    f, k = x.shape
    elements, dense = oracle_quantize_swizzled(oracle_swizzle(x.T))
    codes = elements.view(np.uint8).astype(np.uint32)
    words = sum(codes[:, j::4] << np.uint32(8 * j) for j in range(4))
    scales = np.zeros((-(-k // 2048) * 128 if packed else k // 4, f), np.uint8)
    scales[oracle_scale_rows(k, packed)] = dense
    return words.astype(np.uint32), scales


# --------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("k", [32, 96, 128, 384, 512, 640, 1408, 2560])
def test_wrapx_swizzle_and_round_trip_match_the_golden(k):
    x = spread((12, k), k)
    x[0, :8] *= 2.0**-100  # a tiny block
    x[1, 3] = 448.0 * 2.0**5  # a block whose top would saturate under the OCP emax
    np.testing.assert_array_equal(np.asarray(mx.swizzle_wrapx(x)), oracle_swizzle(x.T))
    np.testing.assert_array_equal(np.asarray(mx.unswizzle_wrapx(oracle_swizzle(x.T))), x)
    np.testing.assert_array_equal(mx.wrapx_index(k), _k_order(k))
    assert_same_float32(jax.jit(mx.mx_round_trip_wrapx, static_argnums=1)(x, -1), oracle_round_trip(x))
    assert_same_float32(mx.mx_round_trip_wrapx(x.T, 0), oracle_round_trip(x).T)


def test_alternative_emax_never_saturates():
    x = np.zeros((1, 32), np.float32)
    x[0, 0], x[0, 1] = 15.2, 1.0  # OCP emax: 15.2 saturates to 14; alternative: 15.2 -> 243.2 -> 240 (e4m3 step 16)
    out = np.asarray(mx.mx_round_trip_wrapx(x))
    assert out[0, 0] == 15.0 and out[0, 1] == 1.0
    assert np.asarray(mx.mx_round_trip(x))[0, 0] == 14.0


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("k", [128, 640, 2560, 4608])
def test_pre_quantized_operand_layouts(k, packed):
    x = spread((8, k), 7) * np.float32(2.0**-20)
    words, scales = mx.quantize_matmul_operand(x, packed=packed)
    want_words, want_scales = oracle_quantize_operand(x, packed)
    assert words.dtype == jnp.uint32 and scales.dtype == jnp.uint8
    assert scales.shape == (mx.matmul_scale_rows(k, packed), 8)
    np.testing.assert_array_equal(np.asarray(words), want_words)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    assert_same_float32(mx.dequantize_matmul_operand(want_words, want_scales), oracle_round_trip(x))


def test_padding_tile_plan_and_errors():
    x = spread((5, 530), 9)  # padded to 544 = 512 + 32
    assert_same_float32(mx.mx_round_trip_wrapx(x), oracle_round_trip(x))
    assert mx.wrapx_tiles(1408) == ((0, 512), (512, 512), (1024, 256), (1280, 128))
    assert mx.wrapx_tiles(160) == ((0, 160),) and mx.wrapx_tiles(544) == ((0, 512), (512, 32))
    with pytest.raises(ValueError, match="wrapx_tiles: the contraction must be a positive multiple of 32"):
        mx.swizzle_wrapx(np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match=r"dequantize_matmul_operand: scales must be \[K/4, F\]"):
        mx.dequantize_matmul_operand(np.zeros((32, 4), np.uint32), np.zeros((64, 4), np.uint8))
