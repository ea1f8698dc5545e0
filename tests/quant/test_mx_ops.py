"""jax_nkilib.quantize_mx / dequantize_mx / mxfp8_matmul against float64 NumPy oracles: plain MX layout,
round trip and saturation at the format limits, the straight-through training matmul; transformations; Neuron
lowering; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.quant import mx
from tests.quant.test_matmul_mxfp8 import check, f64, oracle_backward
from tests.quant.test_mx import codes, oracle_biased_exponent, oracle_dequantize
from tests.quant.test_quantize_mxfp8 import FORMATS, oracle_mx_matmul, spread
from tests.support.hlo import compute_operations, kernel_configs, neuron_text

DTYPES = {"float8_e4m3fn": jnp.float8_e4m3fn, "float8_e5m2": jnp.float8_e5m2}


def oracle_quantize_along(x, axis, fmt="float8_e4m3fn", block=32):
    """float64 loops over blocks of ``block`` consecutive elements along ``axis``: byte ``clip(E - emax, 0, 255)``
    and elements ``clip(x 2**(127 + emax - E), +-largest)`` with the alternative emax (7 / 14)."""
    kind, largest, emax = FORMATS[fmt]
    x = np.moveaxis(np.asarray(x, np.float32), axis, -1)
    data = np.zeros(x.shape, kind)
    scales = np.zeros(x.shape[:-1] + (x.shape[-1] // block,), np.uint8)
    for index in np.ndindex(*x.shape[:-1]):
        for b in range(x.shape[-1] // block):
            values = x[index][b * block : (b + 1) * block].astype(np.float64)
            top = oracle_biased_exponent(values).max()
            with np.errstate(invalid="ignore"):
                data[index][b * block : (b + 1) * block] = np.clip(
                    values * 2.0 ** (127 + emax - top), -largest, largest
                ).astype(kind)
            scales[index + (b,)] = np.clip(top - emax, 0, 255)
    return np.moveaxis(data, -1, axis), np.moveaxis(scales, -1, axis)


def oracle_dequantize_along(data, scales, axis, block=32):
    return oracle_dequantize(data, np.repeat(np.asarray(scales), block, axis=axis))


# --------------------------------------------------------------------------------------------- quantize_mx
@pytest.mark.parametrize("shape, axis", [((3, 1024, 2), 1), ((2, 5, 96), -1), ((64, 3), 0), ((4, 512), -1)])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_quantize_matches_oracle(shape, axis, fmt):
    x = spread(shape, sum(shape), jnp.float32)  # axis % 512 == 0 runs the kernel's reference, else JAX
    data, scales = jax_nkilib.quantize_mx(x, axis=axis, dtype=DTYPES[fmt])
    want_data, want_scales = oracle_quantize_along(x, axis, fmt)
    assert data.dtype == DTYPES[fmt] and scales.dtype == jnp.uint8 and scales.shape == want_scales.shape
    np.testing.assert_array_equal(codes(data), codes(want_data))
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    back = jax_nkilib.dequantize_mx(data, scales, axis=axis)
    np.testing.assert_array_equal(np.asarray(back), oracle_dequantize_along(want_data, want_scales, axis))


def test_kernel_path_equals_jax_path_and_other_blocks():
    x = spread((6, 1536), 3, jnp.bfloat16)
    via_kernel = jax_nkilib.quantize_mx(x)  # 3 tiles of 512: quantize_block_mxfp8_kernel
    via_jax = mx.quantize_mx_along(x, -1, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(codes(via_kernel[0]), codes(via_jax[0]))
    np.testing.assert_array_equal(np.asarray(via_kernel[1]), np.asarray(via_jax[1]))
    data, scales = jax_nkilib.quantize_mx(x, block=16, dtype=jnp.float8_e5m2)  # not MX-32: JAX only
    want = oracle_quantize_along(x, -1, "float8_e5m2", 16)
    assert scales.shape == (6, 96)
    np.testing.assert_array_equal(codes(data), codes(want[0]))
    np.testing.assert_array_equal(np.asarray(scales), want[1])


@pytest.mark.parametrize(
    "fmt, half_step_offset, top_range", [("float8_e4m3fn", 124, (128, 256)), ("float8_e5m2", 116, (2**14, 2**15))]
)
def test_round_trip_error_is_half_a_step(fmt, half_step_offset, top_range):
    x = spread((8, 512), 4, jnp.float32)
    data, scales = jax_nkilib.quantize_mx(x, dtype=DTYPES[fmt])
    error = np.abs(np.asarray(jax_nkilib.dequantize_mx(data, scales)) - np.asarray(x))
    # the top element of a block sits in [128, 256] (e4m3: 3 mantissa bits, step 16): half a step is 2**(s - 124)
    bound = 2.0 ** (np.repeat(np.asarray(scales).astype(np.float64), 32, axis=-1) - half_step_offset)
    assert np.all(error <= bound)
    top = np.abs(np.asarray(data.astype(jnp.float32))).reshape(8, 16, 32).max(axis=-1)
    assert np.all(top >= top_range[0]) and np.all(top <= top_range[1])  # never saturates


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_saturation_and_special_values(fmt):
    _, largest, emax = FORMATS[fmt]
    x = np.ones((4, 32), np.float32)
    x[0, :3] = [np.inf, -np.inf, 2.0]  # +-inf saturate to the format's largest, left out of the block's scale
    x[1, 0] = np.nan
    x[2, :] = np.float32(3.0e38)  # near the float32 maximum: no saturation, scale byte 254 - emax
    x[3, :] = 0.0
    data, scales = jax_nkilib.quantize_mx(jnp.asarray(x), dtype=DTYPES[fmt])
    values, bytes_ = np.asarray(data.astype(jnp.float32)), np.asarray(scales)[:, 0]
    assert values[0, 0] == largest and values[0, 1] == -largest and bytes_[0] == 128 - emax  # E of 2.0
    assert np.isnan(values[1, 0]) and bytes_[1] == 127 - emax and not np.isnan(values[1, 1:]).any()
    assert bytes_[2] == 254 - emax and np.all(values[2] <= 256 if fmt == "float8_e4m3fn" else values[2] <= 2**15)
    back = np.asarray(jax_nkilib.dequantize_mx(data, scales))
    np.testing.assert_allclose(back[2], x[2], rtol=2.0**-4)
    assert bytes_[3] == 0 and not np.any(back[3]) and back[0, 0] == largest * 2.0 ** (128 - emax - 127)
    # 3.4e38 = 1.998 * 2**127 rounds up to the top of the block range, 2**128: it dequantizes to inf (as in the
    # kernels' goldens)
    top = jax_nkilib.quantize_mx(jnp.full((1, 32), 3.4e38, jnp.float32), dtype=DTYPES[fmt])
    assert np.all(np.isinf(np.asarray(jax_nkilib.dequantize_mx(*top))))
    want = oracle_quantize_along(np.where(np.isfinite(x), x, 0), -1, fmt)
    finite = np.isfinite(x)
    np.testing.assert_array_equal(codes(data)[finite], codes(want[0])[finite])


@pytest.mark.parametrize("length", [64, 1024])  # the JAX path and the kernel path (axis % 512 == 0)
def test_non_finite_elements_leave_their_block_mates_alone(length):
    # issue 11: a NaN flushed its 31 block-mates to 0 (its exponent 255 set the block's scale). Now a NaN or +-inf is
    # left out of its block's scale: the block quantizes as if it were 0, and it becomes NaN or +-largest itself.
    x = np.array(spread((3, length), 6, jnp.float32))
    x[0, 3], x[1, 40], x[2, length - 1], x[2, 0] = np.nan, np.inf, -np.inf, np.nan
    x[1, 32:64] = np.where(np.arange(32) % 2, np.nan, np.inf)  # a block with no finite element: scale 0
    data, scales = jax_nkilib.quantize_mx(jnp.asarray(x))
    finite = np.isfinite(x)
    want_data, want_scales = oracle_quantize_along(np.where(finite, x, 0), -1)
    np.testing.assert_array_equal(np.asarray(scales), want_scales)
    np.testing.assert_array_equal(codes(data)[finite], codes(want_data)[finite])
    values = np.asarray(data.astype(jnp.float32))
    assert np.all(np.isnan(values[np.isnan(x)])) and np.all(values[np.isinf(x)] == np.sign(x[np.isinf(x)]) * 448)
    back = np.asarray(jax_nkilib.dequantize_mx(data, scales))
    bound = 2.0 ** (np.repeat(want_scales.astype(np.float64), 32, axis=-1) - 124)  # half a step, as without them
    assert np.all(np.abs(back - x)[finite] <= bound[finite])


def test_dequantize_dtype_and_e8m0_scales():
    x = spread((2, 64), 5, jnp.float32)
    data, scales = jax_nkilib.quantize_mx(x)
    e8m0 = jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu)
    out = jax_nkilib.dequantize_mx(data, e8m0, dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(out, np.float32), np.asarray(jax_nkilib.dequantize_mx(data, scales).astype(jnp.bfloat16), np.float32)
    )


def test_scales_in_jax_mx_format_feed_jax_scaled_matmul():
    """``scale_dtype=jnp.float8_e8m0fnu`` gives JAX's MX scale type: jax.lax.scaled_dot (JAX >= 0.8, any platform)
    computes the dequantized product from ``(data, scales)`` as they are, and jax.nn.scaled_matmul (cuDNN, GPU only)
    lowers for ``cuda`` with them; JAX-format scales come back through dequantize_mx unchanged."""
    x, w = spread((8, 128), 5, jnp.float32), spread((16, 128), 6, jnp.float32)
    (xd, xs), (wd, ws) = (jax_nkilib.quantize_mx(a, scale_dtype=jnp.float8_e8m0fnu) for a in (x, w))
    assert xs.dtype == jnp.float8_e8m0fnu and xs.shape == (8, 4)
    uint8_scales = jax_nkilib.quantize_mx(x)[1]
    np.testing.assert_array_equal(jax.lax.bitcast_convert_type(xs, jnp.uint8), uint8_scales)
    expected = f64(jax_nkilib.dequantize_mx(xd, xs)) @ f64(jax_nkilib.dequantize_mx(wd, ws)).T
    if hasattr(jax.lax, "scaled_dot"):
        out = jax.lax.scaled_dot(
            xd,
            wd,
            lhs_scale=xs,
            rhs_scale=ws,
            dimension_numbers=(((1,), (1,)), ((), ())),
            preferred_element_type=jnp.float32,
        )
        np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max())
    text = (
        jax.jit(jax.nn.scaled_matmul)
        .trace(xd[None], wd[None], xs[None], ws[None])
        .lower(lowering_platforms=("cuda",))
        .as_text()
    )
    assert "block_scaled_dot" in text


def test_quantized_outputs_carry_no_gradient():
    """(jit, vmap and shard_map of quantize_mx are the conformance suite's: arg spec quantize_mx.)"""
    x = spread((4, 3, 512), 6, jnp.bfloat16)
    call = lambda a: jax_nkilib.quantize_mx(a, axis=-1)  # noqa: E731
    grad = jax.grad(lambda a: jnp.sum(jax_nkilib.dequantize_mx(*call(a))))(x.astype(jnp.float32))
    assert not np.any(np.asarray(grad))


# -------------------------------------------------------------------------------------------- mxfp8_matmul
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "float8_e5m2"])
def test_mxfp8_matmul_forward(dtype, fmt):
    x, w = spread((2, 3, 160), 7, dtype), spread((160, 24), 8, dtype)
    out = jax_nkilib.mxfp8_matmul(x, w, float8_dtype=DTYPES[fmt])
    assert out.shape == (2, 3, 24) and out.dtype == dtype
    want = oracle_mx_matmul(f64(x).reshape(6, 160), f64(w).T, fmt).reshape(2, 3, 24)
    check(out, want, dtype, 160)


def test_mxfp8_matmul_gradients_are_straight_through():
    x, w = spread((3, 5, 64), 9, jnp.bfloat16), spread((64, 40), 10, jnp.bfloat16)
    g = spread((3, 5, 40), 11, jnp.bfloat16)
    out, vjp = jax.vjp(lambda a, b: jax_nkilib.mxfp8_matmul(a, b, float8_dtype=jnp.float8_e5m2), x, w)
    dx, dw = vjp(g)
    assert dx.dtype == dw.dtype == jnp.bfloat16 and dx.shape == x.shape and dw.shape == w.shape
    want_dx, want_dw = oracle_backward(g.reshape(15, 40), f64(w).T, x.reshape(15, 64), "float8_e5m2")
    check(dx.reshape(15, 64), want_dx, jnp.bfloat16, 1)
    check(dw, want_dw.T, jnp.bfloat16, 1)
    # close to the exact gradients of the unquantized product (MX error, not a different function)
    exact_dx = f64(g).reshape(15, 40) @ f64(w).T
    assert np.max(np.abs(f64(dx).reshape(15, 64) - exact_dx)) <= 0.3 * np.max(np.abs(exact_dx))


def test_neuron_lowering():
    x, w = jnp.zeros((2, 64, 512), jnp.bfloat16), jnp.zeros((512, 1024), jnp.bfloat16)

    def train_step(a, b):
        y, vjp = jax.vjp(jax_nkilib.mxfp8_matmul, a, b)
        return y, vjp(y)

    with jax_nkilib.neuron.dry_run():
        text = neuron_text(train_step, x, w)
        assert [cfg["func_name"] for cfg in kernel_configs(text)] == ["matmul_mxfp8", "matmul_mxfp8_backward"]
        assert set(compute_operations(text)) <= {"stablehlo.reshape", "stablehlo.transpose"}
        (cfg,) = kernel_configs(neuron_text(jax_nkilib.quantize_mx, jnp.zeros((8, 1024), jnp.bfloat16)))
        assert cfg["func_name"] == "quantize_block_mxfp8_kernel" and cfg["params"]["enable_scale_packing"] is False
        assert not kernel_configs(neuron_text(jax_nkilib.quantize_mx, jnp.zeros((8, 96), jnp.bfloat16)))


BAD = [
    (lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 48))), ValueError, "must be a multiple of block=32"),
    (
        lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 64)), dtype=jnp.float8_e4m3),
        ValueError,
        "`dtype` must be jnp.float8_e4m3fn or jnp.float8_e5m2",
    ),
    (lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 64), jnp.int32)), TypeError, "`x` must have a floating dtype"),
    (lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 64)), axis=2), ValueError, "`axis`=2 is out of range"),
    (lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 64)), block=0), TypeError, "`block` must be a positive int"),
    (lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 64)), scale_dtype=jnp.int8), TypeError, "`scale_dtype` must be"),
    (lambda: jax_nkilib.quantize_mx([1.0] * 32), TypeError, "`x` must be an array"),
    (
        lambda: jax_nkilib.dequantize_mx(jnp.zeros((4, 64), jnp.float8_e4m3fn), jnp.zeros((4, 3), jnp.uint8)),
        ValueError,
        "`scales` must have the shape of `data`",
    ),
    (
        lambda: jax_nkilib.dequantize_mx(jnp.zeros((4, 64)), jnp.zeros((4, 2), jnp.uint8)),
        ValueError,
        "`data.dtype` must be jnp.float8_e4m3fn or jnp.float8_e5m2",
    ),
    (
        lambda: jax_nkilib.dequantize_mx(jnp.zeros((4, 64), jnp.float8_e5m2), jnp.zeros((4, 2), jnp.int8)),
        TypeError,
        "`scales` must be uint8",
    ),
    (
        lambda: jax_nkilib.mxfp8_matmul(jnp.zeros((4, 64)), jnp.zeros((32, 8))),
        ValueError,
        r"`w` must have layout \[K, N\]",
    ),
    (
        lambda: jax_nkilib.mxfp8_matmul(jnp.zeros((4, 64)), jnp.zeros((64, 8)), float8_dtype="e4m3"),
        ValueError,
        "`float8_dtype` must be",
    ),
    (
        lambda: jax_nkilib.mxfp8_matmul(jnp.zeros((4, 64)), jnp.zeros((64, 8), jnp.int32)),
        TypeError,
        r"`w` \[K, N\] must have a floating dtype",
    ),
    (
        lambda: jax_nkilib.quantize_mx(jnp.zeros((4, 64), jnp.float8_e4m3fn)),
        TypeError,
        r"quantize_mx: `x` must have a floating dtype \(float32, bfloat16, float16 or float64\); got float8_e4m3fn",
    ),
    (
        lambda: jax_nkilib.quantize_mx(jnp.zeros((1,) * 11 + (64,))),
        ValueError,
        "quantize_mx: `x` has 12 leading axes; at most 10",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    call, error, fragment = case
    with pytest.raises(error, match=fragment):
        call()


def test_mx_helper_shapes_are_named():
    with pytest.raises(ValueError, match="quantize_mx_along: the quantized axis"):
        mx.quantize_mx_along(np.zeros((2, 33), np.float32))
    with pytest.raises(ValueError, match="dequantize_mx_along: scales"):
        mx.dequantize_mx_along(jnp.zeros((2, 64), jnp.float8_e4m3fn), jnp.zeros((3, 2), jnp.uint8))
    ocp = mx.quantize_mx_along(np.full((1, 32), 15.2, np.float32), emax_offset=0)  # the OCP rule of mx.quantize_mx
    assert int(ocp[1][0, 0]) == 130 - 8 and float(ocp[0][0, 0].astype(jnp.float32)) == 448.0


def test_quantize_mx_of_an_empty_axis():
    # an empty quantized axis of 0 % 512 == 0 reached the kernel, which named its internal dimension K
    data, scales = jax_nkilib.quantize_mx(jnp.zeros((2, 0)))
    assert data.shape == (2, 0) and scales.shape == (2, 0) and scales.dtype == jnp.uint8
