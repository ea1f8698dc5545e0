"""MX helpers (jax_nkilib._src.quant.mx) against an independent NumPy float64 oracle of the nkilib MXFP8 rules.

The ``oracle_*`` functions are also the attention_mxfp8_tkg test's oracle building blocks.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_nkilib._src.quant import mx

E4M3 = ml_dtypes.float8_e4m3fn
FORMATS = {E4M3: (448.0, 8), ml_dtypes.float8_e5m2: (57344.0, 15)}  # (largest, emax)


# ------------------------------------------------------------------------------------------------------- the oracle
def oracle_biased_exponent(x):
    """The biased float32 exponent from frexp: 0 for zeros and subnormals, 255 for inf/NaN."""
    x = np.asarray(x, np.float32).astype(np.float64)
    _, exponent = np.frexp(np.abs(np.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)))  # |x| = m 2**e, m in [.5, 1)
    biased = np.where(np.abs(x) < 2.0**-126, 0, exponent + 126)
    return np.where(np.isfinite(x), biased, 255).astype(np.int64)


def oracle_quantize_groups(x, fmt=E4M3):
    """``x [..., 32]`` -> (elements [..., 32], uint8 scales [...]): byte clip(E - emax, 0, 255), elements
    clip(x 2**(127 + emax - E), +-largest) rounded to nearest even (e4m3: 2**(135 - E), +-448)."""
    largest, emax = FORMATS[fmt]
    x = np.asarray(x, np.float32).astype(np.float64)
    top = oracle_biased_exponent(x).max(axis=-1)
    with np.errstate(invalid="ignore"):
        elements = np.clip(x * 2.0 ** (127 + emax - top[..., None]), -largest, largest).astype(fmt)
    return elements, np.clip(top - emax, 0, 255).astype(np.uint8)


def oracle_quantize_tile(x, fmt=E4M3):
    """``nisa.quantize_mx`` on ``[P, F]``: one scale per 8 partitions x 4 free elements (explicit block loop)."""
    x = np.asarray(x, np.float32)
    p, f = x.shape
    elements, scales = np.zeros((p, f), fmt), np.zeros((p // 8, f // 4), np.uint8)
    for i in range(p // 8):
        for j in range(f // 4):
            block, scale = oracle_quantize_groups(x[8 * i : 8 * i + 8, 4 * j : 4 * j + 4].reshape(32), fmt)
            elements[8 * i : 8 * i + 8, 4 * j : 4 * j + 4], scales[i, j] = block.reshape(8, 4), scale
    return elements, scales


def oracle_dequantize(elements, scales):
    """float64 ``element * 2**(scale - 127)`` (``scales`` broadcast against ``elements``)."""
    return np.asarray(elements).astype(np.float64) * 2.0 ** (np.asarray(scales).astype(np.float64) - 127)


def oracle_round_trip(x, axis=-1, fmt=E4M3):
    """float64 dequantize(quantize(x)) in blocks of 32 consecutive elements along ``axis`` (zero-padded)."""
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    n = x.shape[-1]
    padded = np.concatenate([x, np.zeros(x.shape[:-1] + (-n % 32,), np.float32)], axis=-1)
    elements, scales = oracle_quantize_groups(padded.reshape(*x.shape[:-1], -1, 32), fmt)
    out = oracle_dequantize(elements, scales[..., None]).reshape(padded.shape)[..., :n]
    return np.moveaxis(out, -1, axis)


def oracle_encode_block(x, contraction):
    """attention_mxfp8_tkg's cache block ``[32, 160]`` float32 words of a ``[128, 128]`` tokens x d block, written
    element by element: operand ``[N, C]`` (C the contraction), element ``(n, c)`` in word ``[c // 4, n]`` byte
    ``c % 4``; the scale of ``(n, c // 32)`` in row ``c // 32`` (of quadrant 0), word ``128 + n // 4``, byte ``n % 4``.
    """
    operand = np.asarray(x, np.float32) if contraction == "d_head" else np.asarray(x, np.float32).T
    n, c = operand.shape
    elements, scales = oracle_quantize_groups(operand.reshape(n, c // 32, 32))
    codes = elements.view(np.uint8).reshape(n, c).astype(np.uint32)
    words = np.zeros((c // 4, n + n // 4), np.uint32)
    for col in range(c):
        words[col // 4, :n] |= codes[:, col] << np.uint32(8 * (col % 4))
    for group in range(c // 32):
        for byte in range(4):
            words[group, n:] |= scales[byte::4, group].astype(np.uint32) << np.uint32(8 * byte)
    return words.view(np.float32)


def oracle_decode_block(words, contraction):
    """float64 ``[128, 128]`` tokens x d block from its ``[32, 160]`` words (NaN element bytes decode to NaN)."""
    words = np.asarray(words, np.float32).view(np.uint32)
    n, c = words.shape[1] * 4 // 5, words.shape[0] * 4
    operand = np.zeros((n, c))
    for col in range(c):
        codes = ((words[col // 4, :n] >> np.uint32(8 * (col % 4))) & 0xFF).astype(np.uint8)
        scale_words = words[col // 32, n + np.arange(n) // 4]
        scales = (scale_words >> (8 * (np.arange(n) % 4)).astype(np.uint32)) & 0xFF
        operand[:, col] = oracle_dequantize(codes.view(E4M3), scales)
    return operand if contraction == "d_head" else operand.T


def oracle_encode_cache(x, contraction):
    """Blocks ``[n, 128, 128]`` -> cache ``[n, 32, 160]`` float32."""
    return np.stack([oracle_encode_block(block, contraction) for block in np.asarray(x)])


def oracle_decode_cache(words, contraction):
    return np.stack([oracle_decode_block(block, contraction) for block in np.asarray(words)])


# ------------------------------------------------------------------------------------------------------- helpers
def codes(x):
    return np.asarray(x).view(np.uint8)


def assert_same_float32(actual, expected):
    """Bitwise-equal float32 values (NaN equal to NaN), ``expected`` rounded from float64."""
    with np.errstate(over="ignore"):
        expected = np.asarray(expected).astype(np.float32)
    actual = np.asarray(actual)
    assert actual.dtype == np.float32 and actual.shape == expected.shape
    same = (actual.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(actual) & np.isnan(expected))
    assert same.all(), f"{(~same).sum()} values differ, e.g. {actual[~same][:4]} vs {expected[~same][:4]}"


def spread(shape, seed):
    """Normal values times per-element powers of two over a wide range (so blocks mix magnitudes)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(-24, 24, shape)).astype(np.float32)


# --------------------------------------------------------------------------------------------------------- tests
def test_quantize_tile_matches_oracle_and_round_trips():
    x = spread((2, 32, 16), 0)
    x[0, :8, :4] *= 2.0**-100  # a block in the tiny range too
    elements, scales = jax.jit(mx.quantize_mx)(x)
    assert elements.dtype == jnp.float8_e4m3fn and scales.dtype == jnp.uint8 and scales.shape == (2, 4, 4)
    for i in range(2):
        want_elements, want_scales = oracle_quantize_tile(x[i])
        np.testing.assert_array_equal(codes(elements[i]), codes(want_elements))
        np.testing.assert_array_equal(np.asarray(scales[i]), want_scales)
        assert_same_float32(
            mx.dequantize_mx(elements[i], scales[i]),
            oracle_dequantize(want_elements, np.repeat(np.repeat(want_scales, 8, 0), 4, 1)),
        )
    # ordinary blocks round-trip within 64 units of the block scale (half a step of 32 at the top, or saturation)
    normal = np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32)
    elements, scales = mx.quantize_mx(normal)
    unit = 2.0 ** (np.repeat(np.repeat(np.asarray(scales), 8, 0), 4, 1).astype(float) - 127)
    assert np.all(np.abs(np.asarray(mx.dequantize_mx(elements, scales)) - normal) <= 64 * unit)


def test_e5m2_elements():
    x = spread((16, 8), 6)
    x[0, 0] = np.inf
    elements, scales = mx.quantize_mx(x, jnp.float8_e5m2)
    want_elements, want_scales = oracle_quantize_tile(x, ml_dtypes.float8_e5m2)
    assert elements.dtype == jnp.float8_e5m2 and scales[0, 0] == 255 - 15
    np.testing.assert_array_equal(codes(elements), codes(want_elements))
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    assert_same_float32(
        mx.dequantize_mx(elements, scales),
        oracle_dequantize(want_elements, np.repeat(np.repeat(want_scales, 8, 0), 4, 1)),
    )
    assert_same_float32(mx.mx_round_trip(x, 0, jnp.float8_e5m2), oracle_round_trip(x, 0, ml_dtypes.float8_e5m2))


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_round_trip_along_an_axis_matches_oracle(axis):
    x = spread((40, 72, 3), 2)
    assert_same_float32(mx.mx_round_trip(x, axis), oracle_round_trip(x, axis))
    # the swizzle + 8x4 tile quantization is the same geometry: 32 consecutive contraction elements of one row
    rows = x[:8, :64, 0]
    via_tile = mx.unswizzle_mx(mx.dequantize_mx(*mx.quantize_mx(mx.swizzle_mx(rows))))
    assert_same_float32(via_tile, oracle_round_trip(rows, -1))


def test_saturation_at_448():
    x = np.zeros((8, 12), np.float32)
    x[0, 0], x[0, 4], x[0, 8] = 15.2, -1.74 * 2**5, 448.0  # one per block
    elements, scales = mx.quantize_mx(x)
    # the block max maps into [256, 512): 15.2 * 2**5 = 486.4 saturates to 448 -> 14.0 = 1.75 * 2**3
    np.testing.assert_array_equal(np.asarray(scales)[0], [122, 124, 127])
    np.testing.assert_array_equal(np.asarray(elements.astype(jnp.float32))[0, [0, 4, 8]], [448, -448, 448])
    back = np.asarray(mx.dequantize_mx(elements, scales))[0, [0, 4, 8]]
    np.testing.assert_array_equal(back, [14.0, -56.0, 448.0])  # -55.68 -> -445.44 rounds up to the top, -448
    assert_same_float32(mx.mx_round_trip(x), oracle_round_trip(x))


def test_zeros_and_signed_zeros():
    x = np.zeros((8, 8), np.float32)
    x[1, 5] = -0.0
    elements, scales = mx.quantize_mx(x)
    assert np.all(np.asarray(scales) == 0)
    assert codes(elements)[1, 5] == 0x80 and np.count_nonzero(codes(elements)) == 1
    back = np.asarray(mx.dequantize_mx(elements, scales))
    assert np.all(back == 0) and np.signbit(back[1, 5]) and not np.signbit(back[0, 0])


def test_tiny_values_follow_the_reference_rule():
    x = np.zeros((8, 12), np.float32)
    x[0, 0], x[1, 1] = 2.0**-125, -(2.0**-127)  # block 0: E = 2 < 8, normal and subnormal inputs
    x[0, 4:8] = [1e-40, -3e-39, 2.0**-140, 5e-45]  # block 1: subnormals only (E = 0)
    x[0, 8], x[0, 9] = 1.0, 2.0**-140  # block 2: a subnormal next to a normal value underflows to 0
    elements, scales = mx.quantize_mx(x)
    want_elements, want_scales = oracle_quantize_tile(x)
    np.testing.assert_array_equal(codes(elements), codes(want_elements))
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    assert np.asarray(scales)[0, 0] == 0 and float(elements[0, 0]) == 256.0  # 2**-125 * 2**(135 - 2)
    back = np.asarray(mx.dequantize_mx(elements, scales))
    assert back[0, 0] == 2.0**-119  # byte 0 means 2**-127: blocks with E < 8 do not round-trip (as the reference)
    assert_same_float32(back, oracle_dequantize(want_elements, np.repeat(np.repeat(want_scales, 8, 0), 4, 1)))
    # dequantized values below 2**-126 are float32 subnormals, exact despite XLA:CPU's flush-to-zero
    small = np.array([[2.0**-9, -(2.0**-9), 0.875, 448.0]] * 8, np.float32).astype(E4M3)
    for byte in (0, 1, 3, 9):
        scale = np.full((1, 1), byte, np.uint8)
        out = np.asarray(jax.jit(mx.dequantize_mx)(jnp.asarray(small), jnp.asarray(scale)))
        assert_same_float32(out, oracle_dequantize(small, byte))
    assert np.asarray(mx.dequantize_mx(jnp.asarray(small), jnp.zeros((1, 1), jnp.uint8)))[0, 0] == 2.0**-136


def test_nan_and_inf():
    x = np.ones((8, 8), np.float32)
    x[0, :4] = [np.inf, 1.0, np.nan, -np.inf]
    elements, scales = mx.quantize_mx(x)
    assert np.asarray(scales)[0, 0] == 247 and np.asarray(scales)[0, 1] == 119  # E = 255 for inf/NaN
    values = np.asarray(elements.astype(jnp.float32))[0]
    assert values[0] == 448 and values[3] == -448 and np.isnan(values[2]) and values[1] == 0
    back = np.asarray(mx.dequantize_mx(elements, scales))
    assert back[0, 0] == np.inf and back[0, 3] == -np.inf and np.isnan(back[0, 2])  # 448 * 2**120 overflows
    want_elements, _ = oracle_quantize_tile(x)
    np.testing.assert_array_equal(
        codes(elements)[~np.isnan(values)[None].repeat(8, 0)],
        codes(want_elements)[~np.isnan(values)[None].repeat(8, 0)],
    )
    # scale byte 255 decodes as 2**128 (no NaN code); NaN element bytes stay NaN
    odd = np.array([[1.0, 2.0**-9, np.nan, 0.0]] * 8, np.float32).astype(E4M3)
    out = np.asarray(mx.dequantize_mx(jnp.asarray(odd), jnp.full((1, 1), 255, jnp.uint8)))[0]
    assert out[0] == np.inf and out[1] == 2.0**119 and np.isnan(out[2]) and out[3] == 0


def test_x4_packing_bytes():
    raw = jnp.asarray([1, 2, 3, 4, 0xFF, 0, 0, 0x80], jnp.uint8)
    words = mx.pack_x4(raw)
    assert words.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(words), [0x04030201, 0x800000FF])
    np.testing.assert_array_equal(np.asarray(mx.unpack_x4(words, jnp.uint8)), np.asarray(raw))
    fp8 = np.array([1.0, -2.0, 0.5, 448.0], np.float32).astype(E4M3)
    (word,) = np.asarray(mx.pack_x4(jnp.asarray(fp8)))
    assert word == sum(int(b) << (8 * j) for j, b in enumerate(fp8.view(np.uint8)))
    # every 32-bit pattern, passed as float32 words (NaN patterns included), survives unpack -> pack bit for bit
    patterns = np.random.default_rng(3).integers(0, 2**32, (64, 40), dtype=np.uint64).astype(np.uint32)
    patterns[0, :4] = [0x7F800001, 0xFFC00000, 0x00000001, 0x7F7F7F7F]
    as_float = jnp.asarray(patterns.view(np.float32))
    round_trip = jax.jit(lambda w: mx.pack_x4(mx.unpack_x4(w)))(as_float)
    np.testing.assert_array_equal(np.asarray(round_trip), patterns)
    unpacked = codes(mx.unpack_x4(as_float)).reshape(64, 40, 4)
    np.testing.assert_array_equal(unpacked[..., 2], (patterns >> 16) & 0xFF)


def test_swizzle_layout_and_quadrant_scales():
    x = np.arange(2 * 3 * 8).reshape(2, 3, 8)
    y = np.asarray(mx.swizzle_mx(x))
    assert y.shape == (2, 2, 12)
    for m in range(3):
        for k in range(8):
            assert y[1, k // 4, 4 * m + k % 4] == x[1, m, k]
    np.testing.assert_array_equal(np.asarray(mx.unswizzle_mx(y)), x)
    dense = np.arange(1, 8 * 5 + 1, dtype=np.uint8).reshape(8, 5)
    spread_out = np.asarray(mx.scales_to_quadrants(dense))
    assert spread_out.shape == (64, 5)
    np.testing.assert_array_equal(spread_out[[0, 1, 2, 3, 32, 33, 34, 35]], dense)
    assert np.count_nonzero(spread_out) == dense.size
    np.testing.assert_array_equal(np.asarray(mx.scales_from_quadrants(spread_out)), dense)


@pytest.mark.parametrize("contraction", ["d_head", "block_len"])
def test_kv_cache_block_encode_decode(contraction):
    blocks = spread((2, 128, 128), 4) * np.float32(2.0**-10)
    words = mx.encode_mx_block(blocks, contraction)
    assert words.shape == (2, 32, 160) and words.dtype == jnp.float32
    want = oracle_encode_cache(blocks, contraction)
    np.testing.assert_array_equal(np.asarray(words).view(np.uint32), want.view(np.uint32))
    assert np.all(np.asarray(words).view(np.uint32)[:, 4:, 128:] == 0)  # scales only in partitions 0..3
    decoded = mx.decode_mx_block(words, contraction)
    assert_same_float32(decoded, oracle_decode_cache(want, contraction))
    axis = -1 if contraction == "d_head" else -2
    assert_same_float32(decoded, oracle_round_trip(blocks, axis))
    # any words decode like the oracle, NaN bytes and scale byte 255 included
    noise = np.random.default_rng(5).integers(0, 2**32, (32, 160), dtype=np.uint64).astype(np.uint32)
    noise[:4, 128:] &= 0x7F7F7F7F  # keep scales below 2**1 so that most values stay finite
    noise[0, 128] |= 0xFF
    assert_same_float32(
        mx.decode_mx_block(jnp.asarray(noise), contraction), oracle_decode_block(noise.view(np.float32), contraction)
    )


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match=r"quantize_mx: .*P % 8 == 0 and F % 4 == 0"):
        mx.quantize_mx(np.zeros((7, 4), np.float32))
    with pytest.raises(ValueError, match=r"dequantize_mx: scales must be \[..., P // 8, F // 4\]"):
        mx.dequantize_mx(jnp.zeros((8, 8), jnp.float8_e4m3fn), jnp.zeros((1, 1), jnp.uint8))
    with pytest.raises(ValueError, match="encode_mx_block: contraction size 100 must be a multiple of 128"):
        mx.encode_mx_block(np.zeros((128, 100), np.float32))
    with pytest.raises(ValueError, match="contraction must be one of"):
        mx.decode_mx_block(np.zeros((32, 160), np.float32), "tokens")
    with pytest.raises(ValueError, match="quantize_mx: the element format must be one of"):
        mx.quantize_mx(np.zeros((8, 4), np.float32), jnp.float16)
    with pytest.raises(ValueError, match="unpack_x4: expected 32-bit words"):
        mx.unpack_x4(np.zeros((4,), np.float64))
