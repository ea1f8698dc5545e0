"""jax_nkilib.quantize_fp8 / dequantize_fp8: round-trip error bounds, saturation at the format limits, NaN/inf and zero
rows, odd H, transformations, Neuron lowering, errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.sharding import mesh_1d, shard

FORMATS = [(jnp.float8_e4m3, 240.0), (jnp.float8_e4m3fn, 448.0), (jnp.float8_e5m2, 57344.0)]


def row_oracle(x, fp8_max):
    """Per-row scale ``max(max|bf16(x)| / fp8_max, 1e-6)`` in float64 (x read as bfloat16, as the kernel)."""
    xb = np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)
    return xb, np.maximum(np.max(np.abs(xb), axis=-1, keepdims=True) / fp8_max, 1e-6)


def round_trip_bound(x, scale, dtype):
    """|x - q * scale| <= half an FP8 step at |x| (relative eps/2, or half the subnormal step times scale) plus the
    bfloat16 rounding of the input and the float32 scale arithmetic."""
    info = ml_dtypes.finfo(dtype)
    rel = float(info.eps) / 2 + 2.0**-8
    return rel * np.abs(x) + float(info.smallest_subnormal) / 2 * scale * 1.01 + 1e-30


@pytest.mark.parametrize("dtype, fp8_max", FORMATS)
@pytest.mark.parametrize("x_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 64), (7, 37), (33,)])
def test_row_round_trip_and_scale(dtype, fp8_max, x_dtype, shape):
    x = random(shape, x_dtype, 0, scale=5.0)
    q, scale = jax_nkilib.quantize_fp8(x, dtype=dtype)
    assert q.shape == x.shape and q.dtype == dtype and scale.shape == shape[:-1] + (1,) and scale.dtype == jnp.float32
    xb, want_scale = row_oracle(x, fp8_max)
    np.testing.assert_allclose(scale, want_scale, rtol=2e-7)
    back = np.asarray(jax_nkilib.dequantize_fp8(q, scale), np.float64)
    np.testing.assert_array_less(np.abs(back - xb), round_trip_bound(xb, np.asarray(scale), dtype))
    # the largest magnitude of every row is the format's largest value
    np.testing.assert_array_equal(np.max(np.abs(np.asarray(q.astype(jnp.float32))), axis=-1), fp8_max)
    assert jax_nkilib.dequantize_fp8(q, scale, jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype, fp8_max", FORMATS)
def test_static_saturates_at_the_format_limit(dtype, fp8_max):
    x = jnp.array([[1.0, -1.0, 1e9, -1e9, 0.3, np.inf, -np.inf, 0.0]], jnp.float32)
    q, scale = jax_nkilib.quantize_fp8(x, mode="static", scale=0.5, dtype=dtype)
    assert scale.shape == () and scale == 0.5
    values = np.asarray(q.astype(jnp.float32))[0]
    np.testing.assert_array_equal(values[[0, 1, 2, 3, 5, 6, 7]], [2, -2, fp8_max, -fp8_max, fp8_max, -fp8_max, 0])
    want = np.float64(ml_dtypes.bfloat16(0.3)) * 2
    assert abs(values[4] - want) <= float(ml_dtypes.finfo(dtype).eps) * want
    x = random((4, 40), jnp.float32, 1)
    q, scale = jax_nkilib.quantize_fp8(x, mode="static", scale=jnp.float32(0.01), dtype=dtype)
    back = np.asarray(jax_nkilib.dequantize_fp8(q, scale), np.float64)
    inside = np.abs(np.asarray(x)) < fp8_max * 0.01
    xb = np.asarray(x, np.float64)
    np.testing.assert_array_less(np.abs(back - xb)[inside], round_trip_bound(xb, 0.01, dtype)[inside])


@pytest.mark.parametrize("dtype, fp8_max", FORMATS)
def test_zero_nan_and_inf_rows(dtype, fp8_max):
    x = jnp.array([[0.0, 0.0, 0.0], [1.0, np.nan, 2.0], [1.0, np.inf, -2.0], [1.0, 2.0, -4.0]], jnp.float32)
    q, scale = jax_nkilib.quantize_fp8(x, dtype=dtype)
    q, scale = np.asarray(q.astype(jnp.float32)), np.asarray(scale)[:, 0]
    assert scale[0] == np.float32(1e-6) and np.all(q[0] == 0)  # no division by zero
    # a non-finite element is left out of its row's max (its neighbours quantize as if it were 0): NaN stays NaN,
    # +-inf saturates (the kernel-native rmsnorm_quant_kernel keeps the kernel's NaN rows and inf scales instead)
    np.testing.assert_array_equal(scale[1:3], np.float32(2.0) * np.float32(1 / fp8_max))
    assert np.isnan(q[1, 1]) and q[1, 0] == fp8_max / 2 and q[1, 2] == fp8_max
    np.testing.assert_array_equal(q[2], [fp8_max / 2, fp8_max, -fp8_max])
    assert q[3, 2] == -fp8_max and np.all(np.isfinite(q[3]))
    static, _ = jax_nkilib.quantize_fp8(x, mode="static", scale=1.0, dtype=dtype)
    static = np.asarray(static.astype(jnp.float32))
    assert np.isnan(static[1, 1]) and static[2, 1] == fp8_max


def test_float64_input_is_not_rounded_to_bfloat16():
    x = jnp.array([[1.0 + 2.0**-12, 3.0]], jnp.float64)
    q, scale = jax_nkilib.quantize_fp8(x)
    assert scale[0, 0] == np.float32(3.0) * np.float32(1 / 240)
    assert q.dtype == jnp.float8_e4m3


def test_not_differentiable_and_dequantize_is():
    x = random((3, 16))
    grad = jax.grad(lambda a: jnp.sum(jax_nkilib.dequantize_fp8(*jax_nkilib.quantize_fp8(a))))(x)
    np.testing.assert_array_equal(grad, 0.0)  # zero cotangents: no straight-through estimator
    q, scale = jax_nkilib.quantize_fp8(x)
    dscale = jax.grad(lambda s: jnp.sum(jax_nkilib.dequantize_fp8(q, s)))(scale)
    np.testing.assert_allclose(dscale[:, 0], np.sum(np.asarray(q.astype(jnp.float32)), axis=-1))
    grad_fn = jax.grad(lambda a: jnp.sum(jax_nkilib.quantize_fp8(a, dtype=jnp.float8_e4m3fn)[1]))
    np.testing.assert_array_equal(grad_fn(x), 0.0)


def test_vmap_over_the_static_scale():
    x = random((4, 6, 48), jnp.float32, 2)
    per_scale = jax.vmap(lambda s: jax_nkilib.quantize_fp8(x, mode="static", scale=s)[0])(jnp.array([0.02, 0.04]))
    np.testing.assert_array_equal(
        np.asarray(per_scale[1]).view(np.uint8),
        np.asarray(jax_nkilib.quantize_fp8(x, mode="static", scale=0.04)[0]).view(np.uint8),
    )


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3, jnp.float8_e4m3fn])
@pytest.mark.parametrize("mode", ["row", "static"])
def test_kernel_path_equals_the_jax_path(dtype, mode):
    from jax_nkilib._src.ops.norm import _quantize_in_jax

    x = random((3, 5, 48), jnp.bfloat16, 4, scale=4.0)
    scale = None if mode == "row" else jnp.float32(0.01)
    q, s = jax_nkilib.quantize_fp8(x, mode=mode, scale=scale, dtype=dtype)
    want_q, want_s = _quantize_in_jax(x, mode, scale, np.dtype(dtype))
    assert q.dtype == want_q.dtype == dtype
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), np.asarray(want_q).view(np.uint8))
    np.testing.assert_array_equal(s, want_s)


def test_ocp_jit_vmap_and_shard_map():
    x = random((4, 6, 48), jnp.float32, 5)
    quantize = lambda a: jax_nkilib.quantize_fp8(a, dtype=jnp.float8_e4m3fn)  # noqa: E731
    want_q, want_s = quantize(x)
    for got_q, got_s in (jax.jit(quantize)(x), jax.vmap(quantize)(x), jax.vmap(jax.vmap(quantize))(x)):
        assert got_q.dtype == jnp.float8_e4m3fn
        np.testing.assert_array_equal(np.asarray(got_q).view(np.uint8), np.asarray(want_q).view(np.uint8))
        np.testing.assert_array_equal(got_s, want_s)
    mesh = mesh_1d()
    x8 = random((8, 5, 48), jnp.float32, 6)
    q8, s8 = jax.jit(jax.shard_map(quantize, mesh=mesh, in_specs=P("data"), out_specs=P("data")))(
        shard(mesh, (P("data"),), x8)
    )
    want_q, want_s = quantize(x8)
    np.testing.assert_array_equal(np.asarray(q8).view(np.uint8), np.asarray(want_q).view(np.uint8))
    np.testing.assert_array_equal(s8, want_s)


def test_neuron_lowering():
    x = random((2, 3, 64))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax_nkilib.quantize_fp8, x)
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "rmsnorm_quant_kernel" and cfg["input_specs"] == [[[1, 6, 64], "float32"]]
        assert cfg["params"]["norm_type"] == "NO_NORM" and cfg["params"]["quantization_type"] == "ROW"
        # glue: the slices of the packed output, and the non-finite patch (elementwise: is_finite, select, a clip and
        # an FP8 convert for the saturated values)
        patch = {
            "stablehlo.is_finite",
            "stablehlo.select",
            "stablehlo.minimum",
            "stablehlo.maximum",
            "stablehlo.convert",
            "stablehlo.broadcast_in_dim",
        }
        packed = {"stablehlo.reshape", "stablehlo.slice", "stablehlo.bitcast_convert"}
        assert set(compute_operations(text)) <= packed | patch
        assert "stablehlo.reduce" not in compute_operations(text)
        (cfg,) = kernel_configs(neuron_text(lambda a: jax_nkilib.quantize_fp8(a, mode="static", scale=0.1), x))
        assert cfg["params"]["quantization_type"] == "STATIC" and cfg["input_names"] == [
            "hidden",
            "input_dequant_scale",
        ]
        assert cfg["params"]["dtype_mode"] == "NON_OCP"
        for mode in ("row", "static"):  # the OCP format is the kernel with dtype_mode=OCP
            text = neuron_text(
                lambda a: jax_nkilib.quantize_fp8(
                    a, mode=mode, scale=None if mode == "row" else 0.1, dtype=jnp.float8_e4m3fn
                ),
                x,
            )
            (cfg,) = kernel_configs(text)
            assert cfg["params"]["dtype_mode"] == "OCP" and "quant_dtype" not in cfg["params"]
            assert ("tensor<1x6x68xf8E4M3FN>" if mode == "row" else "tensor<1x6x64xf8E4M3FN>") in text
        assert kernel_configs(neuron_text(lambda a: jax_nkilib.quantize_fp8(a, dtype=jnp.float8_e5m2), x)) == []
        long = jax.ShapeDtypeStruct((40000, 64), jnp.bfloat16)  # S <= 32768 per kernel call
        assert len(kernel_configs(neuron_text(jax_nkilib.quantize_fp8, long))) == 2


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: jax_nkilib.quantize_fp8(x, mode="tensor"), ValueError, "mode"),
        (lambda x: jax_nkilib.quantize_fp8(x, mode="static"), ValueError, "needs `scale`"),
        (lambda x: jax_nkilib.quantize_fp8(x, scale=1.0), ValueError, "mode='static'"),
        (lambda x: jax_nkilib.quantize_fp8(x, mode="static", scale=jnp.ones(3)), ValueError, "one value"),
        (lambda x: jax_nkilib.quantize_fp8(x, dtype=jnp.int8), TypeError, "dtype"),
        (lambda x: jax_nkilib.quantize_fp8(x.astype(jnp.int32)), TypeError, "floating"),
        (lambda x: jax_nkilib.quantize_fp8(x[0, 0, 0]), ValueError, "[..., H]"),
        (lambda x: jax_nkilib.dequantize_fp8(x, 1.0), TypeError, "FP8"),
        (lambda x: jax_nkilib.dequantize_fp8(x.astype(jnp.float8_e4m3), jnp.ones((3, 3))), ValueError, "broadcast"),
        # issue 11: values checked at trace time, in the op's own terms
        (
            lambda x: jax_nkilib.quantize_fp8(x, mode="static", scale=0.0),
            ValueError,
            ("quantize_fp8", "`scale`", "> 0"),
        ),
        (
            lambda x: jax_nkilib.quantize_fp8(x, mode="static", scale=jnp.float32(np.inf)),
            ValueError,
            ("`scale`", "finite"),
        ),
        (lambda x: jax_nkilib.quantize_fp8(x, mode="static", scale=np.nan), ValueError, ("`scale`", "nan")),
        (lambda x: jax_nkilib.quantize_fp8(x, mode="static", scale=-0.5), ValueError, ("`scale`", "-0.5")),
        (lambda x: jax_nkilib.quantize_fp8(x, mode="static", scale="1"), TypeError, ("quantize_fp8", "`scale`", "str")),
        (
            lambda x: jax_nkilib.quantize_fp8(x.astype(jnp.float8_e4m3)),
            TypeError,
            ("quantize_fp8", "`x`", "float8_e4m3"),
        ),
        (lambda x: jax_nkilib.quantize_fp8(x.reshape((1,) * 10 + x.shape)), ValueError, ("quantize_fp8", "12 leading")),
        (
            lambda x: jax_nkilib.dequantize_fp8(x.astype(jnp.float8_e4m3), None),
            TypeError,
            ("dequantize_fp8", "`scale`", "NoneType"),
        ),
        (lambda x: jax_nkilib.dequantize_fp8(x.astype(jnp.float8_e4m3), "x"), TypeError, ("dequantize_fp8", "`scale`")),
        (
            lambda x: jax_nkilib.dequantize_fp8(x.astype(jnp.float8_e4m3), 1.0, dtype=jnp.int32),
            TypeError,
            ("dequantize_fp8", "`dtype`", "float"),
        ),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 8)))
    for part in [fragment] if isinstance(fragment, str) else fragment:
        assert part in str(info.value)


def test_traced_static_scale_is_not_checked():
    # a traced scale cannot be checked at trace time; it runs (documented: 0 saturates, as the kernel's reciprocal)
    q, _ = jax.jit(lambda a, s: jax_nkilib.quantize_fp8(a, mode="static", scale=s))(random((2, 8)), 0.5)
    assert q.dtype == jnp.float8_e4m3
