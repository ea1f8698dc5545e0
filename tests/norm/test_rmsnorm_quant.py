"""jax_nkilib.nki.rmsnorm_quant_kernel: against a float64 NumPy oracle of the kernel's steps; the packed ROW scale;
transformations; Neuron lowering; errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.nki import rmsnorm_quant_kernel
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

E4M3 = ml_dtypes.float8_e4m3
MODES = {"NON_OCP": (ml_dtypes.float8_e4m3, 240.0), "OCP": (ml_dtypes.float8_e4m3fn, 448.0)}


def bf16(v):
    return np.asarray(v, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def oracle(
    hidden,
    ln_w=None,
    in_scale=None,
    pre_gamma=None,
    residual=None,
    *,
    lower_bound=0.0,
    norm=True,
    row=True,
    eps=1e-6,
    mode="NON_OCP",
):
    """The kernel's steps with bfloat16 tiles, in float64 except the ROW scale steps (float32, as the kernel):
    (fp8 values [.., H], float32 scale [..] or None, residual_out or None). ``mode`` is the resolved dtype_mode."""
    fp8, top = MODES[mode]
    exact = np.dtype(hidden.dtype) == np.float64
    tile = (lambda v: np.asarray(v, np.float64)) if exact else bf16
    eps_t = eps if exact else float(bf16(eps))

    def rms(t, g):
        return tile(t / np.sqrt(np.mean(t * t, axis=-1, keepdims=True) + eps_t) * np.asarray(g, np.float64).ravel())

    t = tile(hidden)
    res_out = None
    if pre_gamma is not None:
        t = rms(t, pre_gamma)
    if residual is not None:
        t = tile(t + tile(residual))
        res_out = t
    if norm:
        t = rms(t, ln_w)
    if row:
        a = np.max(np.abs(t), axis=-1, keepdims=True)
        if lower_bound > 1e-6:
            a, t = np.minimum(a, lower_bound), np.clip(t, -lower_bound, lower_bound)
        # the kernel's float32 steps: s = max(a * f32(1/top), f32(1e-6)), q = t * (1/s)
        f32 = np.float32
        s = np.maximum(a.astype(f32) * f32(1 / top), f32(1e-6))
        v = t * (f32(1) / s) if exact else t.astype(f32) * (f32(1) / s)
        q = np.clip(v, -top, top).astype(fp8).astype(np.float64)
        return q, s[..., 0], res_out
    q = np.clip(tile(t / np.float64(np.asarray(in_scale)[0, 0])), -top, top).astype(fp8).astype(np.float64)
    return q, None, res_out


def fp8_ulp(values):
    """The spacing of an E4M3 format at |values| (at least the subnormal spacing 2**-9; the same for both)."""
    mag = np.maximum(np.abs(values), 2.0**-6)
    return 2.0 ** (np.floor(np.log2(mag)) - 3)


def assert_fp8_close(got, want):
    """Equal up to one E4M3 step (the oracle rounds float64 values, the reference float32 ones)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_array_less(np.abs(got - want), fp8_ulp(want) * 1.001 + 1e-30)
    assert np.mean(got != want) < 0.02  # a tie between neighbours is rare


def unpack(out, hidden):
    """ROW output -> (values, float32 scale) by reading the trailing bytes little-endian with NumPy."""
    out = np.asarray(out)
    raw = np.ascontiguousarray(out[..., hidden:]).view(np.uint8)
    scale = raw.view("<f4")[..., 0]
    return out[..., :hidden].astype(np.float64), scale


def problem(shape=(2, 5, 40), dtype=jnp.float32, seed=0):
    hidden = random(shape, dtype, seed, scale=3.0)
    ln_w = random(shape[-1:], dtype, seed + 1)
    return hidden, ln_w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(norm=False),
        dict(lower_bound=0.5),
        dict(lower_bound=1e-7),
        dict(eps=1e-2),
        dict(shape=(1, 3, 37)),
        dict(gamma_2d=True),
    ],
)
def test_row_quantization_matches_oracle(dtype, config):
    hidden, ln_w = problem(config.get("shape", (2, 5, 40)), dtype)
    h = hidden.shape[-1]
    w = ln_w.reshape(1, h) if config.get("gamma_2d") else ln_w
    norm = config.get("norm", True)
    kw = dict(lower_bound=config.get("lower_bound", 0.0), eps=config.get("eps", 1e-6))
    out = rmsnorm_quant_kernel(hidden, w if norm else None, norm_type="RMS_NORM" if norm else "NO_NORM", **kw)
    assert out.shape == hidden.shape[:-1] + (h + 4,) and out.dtype == jnp.float8_e4m3
    values, scale = unpack(out, h)
    want_q, want_s, _ = oracle(np.asarray(hidden), ln_w, norm=norm, **kw)
    assert_fp8_close(values, want_q)
    assert_close(scale, want_s, jnp.float32)
    if not norm:  # no rsqrt: every step is exactly the kernel's float32 arithmetic
        np.testing.assert_array_equal(values, want_q)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_static_quantization_matches_oracle(dtype, norm):
    hidden, ln_w = problem(dtype=dtype)
    in_scale = jnp.full((128, 1), 0.011, jnp.float32)
    out = rmsnorm_quant_kernel(
        hidden, ln_w, in_scale, quantization_type="STATIC", norm_type="RMS_NORM" if norm else "NO_NORM"
    )
    assert out.shape == hidden.shape and out.dtype == jnp.float8_e4m3
    want, _, _ = oracle(np.asarray(hidden), ln_w, in_scale, norm=norm, row=False)
    assert_fp8_close(out.astype(jnp.float32), want)
    assert np.max(np.abs(np.asarray(out.astype(jnp.float32)))) == 240.0  # 3-sigma inputs / 0.011 saturate


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["NON_OCP", "OCP"])
@pytest.mark.parametrize("config", [dict(), dict(norm=False, lower_bound=0.5), dict(shape=(1, 3, 37))])
def test_dtype_mode_row_matches_oracle(dtype, mode, config):
    hidden, ln_w = problem(config.get("shape", (2, 5, 40)), dtype, seed=3)
    h, norm = hidden.shape[-1], config.get("norm", True)
    kw = dict(lower_bound=config.get("lower_bound", 0.0))
    out = rmsnorm_quant_kernel(
        hidden, ln_w if norm else None, norm_type="RMS_NORM" if norm else "NO_NORM", dtype_mode=mode, **kw
    )
    assert out.shape == hidden.shape[:-1] + (h + 4,) and out.dtype == MODES[mode][0]
    values, scale = unpack(out, h)
    want_q, want_s, _ = oracle(np.asarray(hidden), ln_w, norm=norm, mode=mode, **kw)
    assert_fp8_close(values, want_q)
    assert_close(scale, want_s, jnp.float32)
    assert np.max(np.abs(values)) == MODES[mode][1]  # each row's largest magnitude maps to the format's maximum


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["NON_OCP", "OCP"])
def test_dtype_mode_static_saturates_at_the_mode_maximum(dtype, mode):
    hidden, ln_w = problem(dtype=dtype, seed=4)
    in_scale = jnp.full((128, 1), 0.002, jnp.float32)  # normalized values past 1 saturate both formats
    out, res = rmsnorm_quant_kernel(hidden, ln_w, in_scale, ln_w, hidden, quantization_type="STATIC", dtype_mode=mode)
    assert out.shape == hidden.shape and out.dtype == MODES[mode][0] and res.dtype == dtype
    want, _, _ = oracle(np.asarray(hidden), ln_w, in_scale, ln_w, hidden, row=False, mode=mode)
    assert_fp8_close(out.astype(jnp.float32), want)
    assert np.max(np.abs(np.asarray(out.astype(jnp.float32)))) == MODES[mode][1]


def test_ocp_scale_bytes_and_saturation():
    hidden = jnp.array([[[1.0, -2.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0], [3.0e-3, 1.0, -7.0, 2.0]]], jnp.float32)
    out = rmsnorm_quant_kernel(hidden, None, norm_type="NO_NORM", dtype_mode="OCP")
    assert out.dtype == jnp.float8_e4m3fn
    raw = np.asarray(jax.lax.bitcast_convert_type(out[..., 4:], jnp.uint8))
    f32 = np.float32
    expected = np.array([f32(2) * f32(1 / 448), 1e-6, f32(7) * f32(1 / 448)], "<f4")
    np.testing.assert_array_equal(raw[0], np.asarray(expected.reshape(3, 1).view(np.uint8)))
    values = np.asarray(out[0, :, :4].astype(jnp.float32))
    assert values[0, 1] == -448.0 and values[2, 2] == -448.0 and np.all(values[1] == 0)
    static = rmsnorm_quant_kernel(
        jnp.array([[[1e6, -1e6, np.inf, 3.0]]], jnp.float32),
        None,
        jnp.full((128, 1), 0.5, jnp.float32),
        norm_type="NO_NORM",
        quantization_type="STATIC",
        dtype_mode="OCP",
    )
    np.testing.assert_array_equal(np.asarray(static.astype(jnp.float32)), [[[448.0, -448.0, 448.0, 6.0]]])


@pytest.mark.parametrize(
    "target, mode", [(None, "NON_OCP"), ("trn2", "NON_OCP"), ("trn3", "OCP"), ("trn3pre", "OCP"), ("trn1", "NON_OCP")]
)
def test_auto_follows_the_platform_target_at_trace_time(target, mode):
    hidden, ln_w = problem(seed=5)
    with jax_nkilib.config(target=target):  # None: the suite's default target, trn2
        out = jax.jit(lambda x: rmsnorm_quant_kernel(x, ln_w, dtype_mode="AUTO"))(hidden)
    want = rmsnorm_quant_kernel(hidden, ln_w, dtype_mode=mode)
    assert out.dtype == want.dtype == MODES[mode][0]
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), np.asarray(want).view(np.uint8))


def test_scale_bytes_are_the_float32_bytes_little_endian():
    hidden = jnp.array([[[1.0, -2.0, 0.5, 0.25], [0.0, 0.0, 0.0, 0.0], [3.0e-3, 1.0, -7.0, 2.0]]], jnp.float32)
    out = rmsnorm_quant_kernel(hidden, None, norm_type="NO_NORM")
    raw = np.asarray(jax.lax.bitcast_convert_type(out[..., 4:], jnp.uint8))
    f32 = np.float32  # the kernel multiplies by float32(1/240): 7 * f32(1/240) is one ulp above f32(7/240)
    expected = np.array([f32(2) * f32(1 / 240), 1e-6, f32(7) * f32(1 / 240)], "<f4")
    np.testing.assert_array_equal(raw[0], np.asarray(expected.reshape(3, 1).view(np.uint8)))
    values = np.asarray(out[0, :, :4].astype(jnp.float32))
    np.testing.assert_array_equal(values[1], 0.0)  # a zero row: scale floor 1e-6, no division by zero
    assert values[0, 1] == -240.0 and values[2, 2] == -240.0


def test_nan_and_inf_rows():
    hidden = jnp.array([[[1.0, np.nan, 2.0], [1.0, np.inf, -2.0], [1.0, 2.0, 4.0]]], jnp.float32)
    out = rmsnorm_quant_kernel(hidden, None, norm_type="NO_NORM")
    values, scale = unpack(out, 3)
    assert np.isnan(scale[0, 0]) and np.all(np.isnan(values[0, 0]))
    assert np.isinf(scale[0, 1]) and np.isnan(values[0, 1, 1]) and np.all(values[0, 1, [0, 2]] == 0)
    assert scale[0, 2] == np.float32(4.0) * np.float32(1 / 240) and values[0, 2, 2] == 240
    static = rmsnorm_quant_kernel(
        hidden, None, jnp.full((128, 1), 0.5, jnp.float32), norm_type="NO_NORM", quantization_type="STATIC"
    )
    static = np.asarray(static.astype(jnp.float32))
    assert np.isnan(static[0, 0, 1]) and static[0, 1, 1] == 240 and static[0, 2, 2] == 8


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pre_norm_and_residual(dtype):
    hidden, ln_w = problem(dtype=dtype)
    residual, pre = random(hidden.shape, dtype, 7), random(ln_w.shape, dtype, 8)
    out, res_out = rmsnorm_quant_kernel(hidden, ln_w, None, pre, residual)
    want_q, want_s, want_res = oracle(np.asarray(hidden), ln_w, None, pre, residual)
    assert res_out.dtype == dtype and res_out.shape == hidden.shape
    assert_close(res_out, want_res, jnp.bfloat16)
    values, scale = unpack(out, hidden.shape[-1])
    assert_fp8_close(values, want_q)
    assert_close(scale, want_s, jnp.bfloat16)
    out2, res2 = rmsnorm_quant_kernel(hidden, None, None, None, residual, norm_type="NO_NORM")
    assert_close(res2, oracle(np.asarray(hidden), residual=residual, norm=False)[2], jnp.bfloat16)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_batched_gamma_and_gradients():
    """What the conformance suite (arg specs rmsnorm_quant_kernel, rmsnorm_quant_kernel.residual) does not check:
    a batched gamma, zero cotangents of the quantized output, vmap of grad against the oracle gradient."""
    hidden, ln_w = problem(dtype=jnp.float32)
    xs = jnp.stack([hidden, -2 * hidden, hidden[:, ::-1]])
    ws = jnp.stack([ln_w, 2 * ln_w])  # batched gamma: no fold plan, lax.map, which stacks the FP8 outputs:
    per_w = jax.vmap(lambda w: rmsnorm_quant_kernel(hidden, w), in_axes=0)(ws)  # XLA:CPU may rewrite NaN-like
    got, want = (unpack(o, 40) for o in (per_w[1], rmsnorm_quant_kernel(hidden, 2 * ln_w)))  # scale bytes there
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5)
    # only residual_out is differentiable; the quantized output has zero cotangents
    grad = jax.grad(lambda x: jnp.sum(rmsnorm_quant_kernel(x, ln_w).astype(jnp.float32)))(hidden)
    np.testing.assert_array_equal(grad, 0.0)
    vgrad = jax.vmap(
        jax.grad(lambda x, r: jnp.sum(rmsnorm_quant_kernel(x, None, None, None, r, norm_type="NO_NORM")[1] ** 2)),
        in_axes=(0, None),
    )(xs, hidden)
    np.testing.assert_allclose(vgrad[1], 2 * (np.asarray(bf16(xs[1]) + bf16(hidden))), rtol=1e-2)


def test_ocp_jit_vmap_and_shard_map():
    hidden, ln_w = problem(dtype=jnp.bfloat16, seed=6)
    ocp = lambda x, w=ln_w: rmsnorm_quant_kernel(x, w, dtype_mode="OCP")  # noqa: E731
    want = np.asarray(ocp(hidden)).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(jax.jit(ocp)(hidden)).view(np.uint8), want)
    xs = jnp.stack([hidden, -hidden])
    batched = jax.vmap(ocp)(xs)
    assert batched.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(batched[0]).view(np.uint8), want)
    nested = jax.vmap(jax.vmap(ocp, in_axes=(0, None)), in_axes=(0, None))(xs[:, :, None], ln_w)
    np.testing.assert_array_equal(np.asarray(nested[0, :, 0]).view(np.uint8), want)
    in_scale = jnp.full((128, 1), 0.02, jnp.float32)
    static = lambda x: rmsnorm_quant_kernel(
        x,
        None,
        in_scale,
        None,
        x,
        norm_type="NO_NORM",  # noqa: E731
        quantization_type="STATIC",
        dtype_mode="OCP",
    )
    vgrad = jax.vmap(jax.grad(lambda x: jnp.sum(static(x)[1].astype(jnp.float32))))(xs.astype(jnp.float32))
    np.testing.assert_array_equal(vgrad, 2.0)
    mesh = mesh_1d()
    h8 = random((2, 16, 40), jnp.float32, 9)
    sharded = jax.jit(jax.shard_map(ocp, mesh=mesh, in_specs=P(None, "data"), out_specs=P(None, "data")))
    np.testing.assert_array_equal(
        np.asarray(sharded(shard(mesh, (P(None, "data"),), h8))).view(np.uint8), np.asarray(ocp(h8)).view(np.uint8)
    )


def test_neuron_lowering_one_call_and_split_past_the_batch_limit():
    hidden, ln_w = problem()
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, w: rmsnorm_quant_kernel(x, w, lower_bound=0.5), hidden, ln_w)
        (cfg,) = kernel_configs(text)
        assert cfg["entry_point"] == "jax_nkilib_kernels.norm:rmsnorm_quant_kernel"
        assert cfg["params"]["norm_type"] == "RMS_NORM" and cfg["params"]["lower_bound"] == 0.5
        assert "tensor<2x5x44xf8E4M3>" in text
        four = random((4, 5, 40), jnp.float32)
        assert len(kernel_configs(neuron_text(lambda x: rmsnorm_quant_kernel(x, ln_w), four))) == 2  # B <= 2
        with_residual = kernel_configs(neuron_text(lambda x, w: rmsnorm_quant_kernel(x, w, None, w, x), hidden, ln_w))
        assert with_residual[0]["output_names"] == ["out", "residual_out"]
        assert cfg["params"]["dtype_mode"] == "NON_OCP" and "quant_dtype" not in cfg["params"]


@pytest.mark.parametrize(
    "mode, target, element", [("OCP", "trn2", "f8E4M3FN"), ("AUTO", "trn3", "f8E4M3FN"), ("AUTO", "trn2", "f8E4M3")]
)
def test_neuron_lowering_dtype_mode(mode, target, element):
    hidden, ln_w = problem()
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target=target):
        text = neuron_text(lambda x, w: rmsnorm_quant_kernel(x, w, dtype_mode=mode), hidden, ln_w)
        (cfg,) = kernel_configs(text)
        assert operations(text) == ["stablehlo.custom_call"]
        assert cfg["params"]["dtype_mode"] == {"f8E4M3FN": "OCP", "f8E4M3": "NON_OCP"}[element]  # AUTO resolved
        assert f"tensor<2x5x44x{element}>" in text


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda h, w: rmsnorm_quant_kernel(h, None), ValueError, "needs `ln_w`"),
        (
            lambda h, w: rmsnorm_quant_kernel(h, w, quantization_type="STATIC"),
            ValueError,
            "needs `input_dequant_scale`",
        ),
        (lambda h, w: rmsnorm_quant_kernel(h, w, None, w), ValueError, "`pre_norm_gamma` needs `residual`"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, dtype_mode="E5M2"), TypeError, "DtypeMode"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, dtype_mode=jnp.float8_e4m3fn), TypeError, "`dtype_mode`"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, norm_type="LAYER_NORM"), ValueError, "RMS_NORM or NO_NORM"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, quantization_type="MX"), ValueError, "ROW or STATIC"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, lower_bound=-1.0), ValueError, "must be >= 0"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, norm_type="RMS"), TypeError, "NormType"),
        (lambda h, w: rmsnorm_quant_kernel(h, w[:7]), ValueError, "`ln_w`"),
        (
            lambda h, w: rmsnorm_quant_kernel(h, w, jnp.ones((128, 1)), quantization_type="STATIC"),
            TypeError,
            "`input_dequant_scale`",
        ),
        (lambda h, w: rmsnorm_quant_kernel(h.astype(jnp.int32), None, norm_type="NO_NORM"), TypeError, "`hidden`"),
        (lambda h, w: rmsnorm_quant_kernel(h[0], None, norm_type="NO_NORM"), ValueError, "[B, S, H]"),
        (lambda h, w: rmsnorm_quant_kernel(h, w, None, None, h[:1]), ValueError, "`residual`"),
    ],
)
def test_bad_inputs(call, error, fragment):
    hidden, ln_w = problem()
    with pytest.raises(error) as info:
        call(hidden, ln_w)
    assert fragment in str(info.value)
