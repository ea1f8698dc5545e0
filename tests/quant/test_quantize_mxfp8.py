"""jax_nkilib.nki.quantize_block_mxfp8_kernel against a float64 NumPy oracle of its golden; transformations;
Neuron lowering; errors.

The ``oracle_*`` functions (the matmul_mxfp8 family's wrapX / 1x32 swizzles, alternative-emax quantization, scale
layouts, MX matmul) are also the matmul_mxfp8 and idiomatic-op tests' oracle.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import quantize_block_mxfp8_kernel
from tests.quant.test_mx import codes, oracle_biased_exponent, oracle_dequantize
from tests.support.hlo import kernel_configs, neuron_text

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
FORMATS = {"float8_e4m3fn": (E4M3, 448.0, 7), "float8_e5m2": (E5M2, 57344.0, 14)}  # (type, largest, alt emax)


# ------------------------------------------------------------------------------------------------------- the oracle
def oracle_tiles(k):
    """(start, size) of the golden's swizzle tiles: 512s, then a remainder that is a multiple of 128 as 256 and
    128, any other remainder as one tile."""
    tiles = [(start, 512) for start in range(0, k - k % 512, 512)]
    start, rest = k - k % 512, k % 512
    for size in (256, 128) if rest % 128 == 0 else (rest,):
        if rest >= size and size:
            tiles.append((start, size))
            start, rest = start + size, rest - size
    return tiles


def oracle_swizzle(x, scheme="wrapX"):
    """``[F, K]`` -> ``[K/4, 4F]`` element by element: wrapX ``dst[k0/4 + p, 4f + j] = x[f, k0 + j*T/4 + p]`` per
    tile; 1x32 ``dst[p, 4f + c] = x[f, 4p + c]``."""
    x = np.asarray(x, np.float64)
    f, k = x.shape
    out = np.zeros((k // 4, 4 * f))
    if scheme == "1x32":
        for p in range(k // 4):
            for c in range(4):
                out[p, c::4] = x[:, 4 * p + c]
        return out
    for start, size in oracle_tiles(k):
        for j in range(4):
            for p in range(size // 4):
                out[start // 4 + p, j::4] = x[:, start + j * (size // 4) + p]
    return out


def oracle_quantize(swizzled, fmt="float8_e4m3fn"):
    """Alternative-emax MX quantization of ``[P, F4]`` in blocks of 8 rows x 4 columns: ``(elements, bytes [P/8,
    F4/4])`` with byte ``clip(E - emax, 0, 255)`` and elements ``clip(x 2**(127 + emax - E), +-largest)``."""
    kind, largest, emax = FORMATS[fmt]
    x = np.asarray(swizzled, np.float32).astype(np.float64)
    rows, cols = x.shape
    top = oracle_biased_exponent(x).reshape(rows // 8, 8, cols // 4, 4).max(axis=(1, 3))
    factor = np.repeat(np.repeat(2.0 ** (127 + emax - top), 8, 0), 4, 1)
    with np.errstate(invalid="ignore"):
        elements = np.clip(x * factor, -largest, largest).astype(kind)
    return elements, np.clip(top - emax, 0, 255).astype(np.uint8)


def oracle_dequantize_tiles(elements, scale_bytes):
    return oracle_dequantize(elements, np.repeat(np.repeat(scale_bytes, 8, 0), 4, 1))


def oracle_scale_layout(dense, k, packed):
    """Dense scales ``[K/32, F]`` -> ``[K/4, F]`` (row ``c`` at ``(c // 4) * 32 + c % 4``) or packed
    ``[ceil(K/2048)*128, F]`` (the golden's ``_pack_scales``: tile t, row i at ``128 (t // 4) + 4 (t % 4) +
    32 (i // 4) + i % 4``, a 128 remainder after a 256 one continuing tile t at row 64)."""
    out = np.zeros(((-(-k // 2048)) * 128 if packed else k // 4, dense.shape[1]), np.uint8)
    for c in range(k // 32):
        if packed:
            tile, i = c // 16, c % 16
            out[128 * (tile // 4) + 4 * (tile % 4) + 32 * (i // 4) + i % 4] = dense[c]
        else:
            out[(c // 4) * 32 + c % 4] = dense[c]
    return out


def oracle_dense_scales(scales, k):
    """Inverse of :func:`oracle_scale_layout` (packed or not by the row count)."""
    packed = scales.shape[0] != k // 4 or k == 512
    probe = oracle_scale_layout(np.arange(1, k // 32 + 1)[:, None].astype(np.uint8), k, packed)[:, 0]
    rows = [int(np.flatnonzero(probe == c + 1)[0]) for c in range(k // 32)]
    return np.asarray(scales)[rows]


def oracle_operand(x, fmt="float8_e4m3fn", scheme="wrapX"):
    """float64 dequantized swizzled ``[K'/4, 4F]`` of a raw ``[F, K]`` (K zero-padded to a multiple of 32)."""
    x = np.asarray(x, np.float32)
    x = np.concatenate([x, np.zeros((x.shape[0], -x.shape[1] % 32), np.float32)], axis=1)
    return oracle_dequantize_tiles(*oracle_quantize(oracle_swizzle(x, scheme), fmt))


def oracle_contract(a, b):
    """``nc_matmul_mx_golden``: ``out[m, n] = sum_{r, j} a[r, 4m + j] b[r, 4n + j]`` of dequantized swizzled
    operands, in float64."""
    rows = a.shape[0]
    return np.einsum("rmj,rnj->mn", a.reshape(rows, -1, 4), b.reshape(rows, -1, 4))


def oracle_mx_matmul(a, b, fmt="float8_e4m3fn", scheme="wrapX"):
    """``a [F1, K] . b [F2, K]^T`` with both MX-quantized along K (raw operands), float64."""
    return oracle_contract(oracle_operand(a, fmt, scheme), oracle_operand(b, fmt, scheme))


def oracle_quantize_block(src, fmt, packed):
    """The kernel's outputs ``(scale bytes, data)`` for ``src [F, K]``."""
    elements, dense = oracle_quantize(oracle_swizzle(np.asarray(src, np.float32)), fmt)
    return oracle_scale_layout(dense, src.shape[1], packed), elements


# ------------------------------------------------------------------------------------------------------- helpers
def spread(shape, seed, dtype=jnp.bfloat16):
    """Normal values times powers of two over a wide range, rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.integers(-20, 20, shape), dtype)


def assert_outputs(scales, data, src, fmt, packed):
    want_scales, want_data = oracle_quantize_block(np.asarray(src, np.float32), fmt, packed)
    assert scales.dtype == jnp.float8_e8m0fnu and data.dtype == FORMATS[fmt][0]
    np.testing.assert_array_equal(np.asarray(scales).view(np.uint8), want_scales)
    np.testing.assert_array_equal(codes(data), codes(want_data))


# --------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matches_oracle(fmt, packed, dtype):
    src = spread((8, 2944), 0, dtype)  # 5 tiles of 512 (two packed groups) + 256 + 128
    scales, data = quantize_block_mxfp8_kernel(src, return_fp8_dtype=fmt, enable_scale_packing=packed)
    rows = 256 if packed else 736
    assert scales.shape == (rows, 8) and data.shape == (736, 32)
    assert_outputs(scales, data, src, fmt, packed)


@pytest.mark.parametrize("shape", [(3, 96), (5, 160), (1, 32), (16, 384)])
def test_odd_sizes(shape):
    src = spread(shape, 1)  # K not a multiple of 128: one tile (CPU); F odd
    for packed in (True, False):
        assert_outputs(
            *quantize_block_mxfp8_kernel(src, return_fp8_dtype=jnp.float8_e4m3fn, enable_scale_packing=packed),
            src,
            "float8_e4m3fn",
            packed,
        )


def test_saturation_nan_and_zero_blocks():
    src = np.zeros((8, 128), np.float32)
    src[0, :3] = [np.inf, -np.inf, 1.0]  # an inf block: +-448, the finite values scaled by 2**-121 (to 0)
    src[1, 0] = np.nan
    src[2, :] = 255.9  # largest magnitude of the block maps into [128, 256): 255.9 * 2**0 rounds to 256
    src[3, 5] = 3.0e38  # finite values near the float32 maximum do not saturate
    scales, data = quantize_block_mxfp8_kernel(
        jnp.asarray(src), return_fp8_dtype="float8_e4m3fn", enable_scale_packing=False
    )
    assert_outputs(scales, data, src, "float8_e4m3fn", False)
    values = np.asarray(data.astype(jnp.float32))  # data[r, 4f + j]: f = 0 is columns 0..3
    bytes_ = np.asarray(scales).view(np.uint8)
    assert values[0, 0] == 448 and values[1, 0] == -448 and values[2, 0] == 0 and bytes_[0, 0] == 255 - 7
    assert np.isnan(values[0, 4])
    assert np.all(values[:, 8:12] == 256.0) and bytes_[0, 2] == 134 - 7  # 255.9 has E = 134
    assert values[5, 12] == 224.0 and bytes_[0, 3] == 254 - 7  # 3e38 = 1.76 * 2**127 -> 225.7 -> 224
    assert np.all(bytes_[0, 4:] == 0) and not np.any(codes(data)[:, 16:])  # all-zero blocks: byte 0, elements 0


def test_vmap_folds_and_zero_gradients():
    src = spread((8, 256), 2)
    call = lambda s: quantize_block_mxfp8_kernel(s, return_fp8_dtype="float8_e5m2")  # noqa: E731
    stacked = jnp.stack([src, -src, 2 * src])
    assert "while" not in str(jax.make_jaxpr(jax.vmap(call))(stacked))  # folded into F, no loop
    grad = jax.grad(lambda s: jnp.sum(call(s)[1].astype(jnp.float32)))(src.astype(jnp.float32))
    assert not np.any(np.asarray(grad))


def test_neuron_lowering():
    src = jnp.zeros((16, 1024), jnp.bfloat16)
    call = lambda s: quantize_block_mxfp8_kernel(s, return_fp8_dtype="float8_e4m3fn")  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(call, src))
        assert cfg["entry_point"] == "nkilib.experimental.quantize_mxfp8.quantize_mxfp8:quantize_block_mxfp8_kernel"
        assert cfg["output_names"] == ["quantized_scales_hbm", "quantized_data_hbm"]
        assert cfg["params"] == {
            "return_fp8_dtype": "float8_e4m3fn",
            "run_with_lnc2": False,
            "enable_scale_packing": True,
        }
        with pytest.warns(NeuronFallbackWarning, match="src_tensor must be bfloat16; got float32"):
            assert not kernel_configs(neuron_text(call, src.astype(jnp.float32)))
        with pytest.warns(NeuronFallbackWarning, match="K=96 must be a multiple of 128; F=3 must be a multiple of 8"):
            neuron_text(call, jnp.zeros((3, 96), jnp.bfloat16))
        with jax_nkilib.config(lnc=2):
            with pytest.warns(NeuronFallbackWarning, match="run_with_lnc2 needs F >= 512"):
                neuron_text(call, src)
            (cfg,) = kernel_configs(neuron_text(call, jnp.zeros((512, 128), jnp.bfloat16)))
            assert cfg["params"]["run_with_lnc2"] is True and cfg["grid"] == 2


BAD = [
    (dict(src_tensor=jnp.zeros((8, 128))), TypeError, "missing required parameter `return_fp8_dtype`"),
    (
        dict(src_tensor=jnp.zeros((8, 128)), return_fp8_dtype="float8_e4m3"),
        ValueError,
        r"`return_fp8_dtype` must be one of \('float8_e4m3fn', 'float8_e5m2'\)",
    ),
    (
        dict(src_tensor=jnp.zeros((8, 100)), return_fp8_dtype="float8_e5m2"),
        ValueError,
        r"\[F, K\] with K a multiple of 32",
    ),
    (
        dict(src_tensor=jnp.zeros((2, 8, 128)), return_fp8_dtype="float8_e5m2"),
        ValueError,
        r"argument `src_tensor` must have layout \[F, K\]",
    ),
    (
        dict(src_tensor=jnp.zeros((8, 128), jnp.int32), return_fp8_dtype="float8_e5m2"),
        TypeError,
        "argument `src_tensor` must have dtype",
    ),
    (
        dict(src_tensor=jnp.zeros((8, 128)), return_fp8_dtype="float8_e5m2", enable_scale_packing=1),
        TypeError,
        "`enable_scale_packing` must be a Python bool",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    kwargs, error, fragment = case
    with pytest.raises(error, match=fragment):
        quantize_block_mxfp8_kernel(**kwargs)
