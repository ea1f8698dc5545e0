"""jax_nkilib.mlp with FP8 weights (jax_nkilib.quantize_weight_fp8 / QuantizedWeight): the helper against NumPy, the
op against a float64 oracle on the independently dequantized weights (with the CTE path's activation quantization),
jit, vmap, gradients in x, shard_map, Neuron lowering and bad inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib import QuantizedWeight, quantize_weight_fp8
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

HID, INTER = 32, 24
E4M3 = ml_dtypes.float8_e4m3  # Trainium2 E4M3, max 240


def np_quantize(w, mode, fp8=E4M3):
    """NumPy oracle of the helper: ``(data, scale)`` with ``w ~= data * scale``."""
    w = np.asarray(w, np.float64)
    top = float(ml_dtypes.finfo(fp8).max)
    amax = np.abs(w).max(axis=0) if mode == "row" else np.abs(w).max()
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    return np.clip(w / scale.astype(np.float64), -top, top).astype(fp8), scale


def dequantized(q):
    """float64 ``W`` of a QuantizedWeight, from its leaves."""
    data, scale = np.asarray(q.data).astype(np.float64), np.asarray(q.scale, np.float64)
    return data * (scale[None, :] if q.mode == "row" else scale)


def fp8_round_trip(v, scale, bound=240.0):
    return np.clip(v / scale, -bound, bound).astype(E4M3).astype(np.float64) * scale


def quantize_activation(a, mode, in_scale):
    """The CTE path's activation quantization (ROW: per token, max(absmax/240, 1e-6); STATIC: by in_scale)."""
    if mode == "row":
        return fp8_round_trip(a, np.maximum(np.abs(a).max(-1, keepdims=True) / 240.0, 1e-6))
    return fp8_round_trip(a, in_scale)


def oracle(x, qs, cte=False):
    """float64 SwiGLU MLP on the dequantized weights; ``cte`` adds the CTE activation quantization."""
    wg, wu, wd = (dequantized(q) for q in qs)
    a = np.asarray(x, np.float64)
    mode = qs[1].mode
    if cte:
        a = quantize_activation(a, mode, None if mode == "row" else float(qs[1].input_scale))
    g, u = a @ wg, a @ wu
    h = g / (1 + np.exp(-g)) * u
    if cte:
        h = quantize_activation(h, mode, None if mode == "row" else float(qs[2].input_scale))
    return h @ wd


def jnp_oracle(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def quantized(mode, dtype=jnp.float8_e4m3, in_scales=(0.02, 0.02, 0.01), seed=1, hid=HID, inter=INTER):
    ws = (
        random((hid, inter), jnp.float32, seed, 0.25),
        random((hid, inter), jnp.float32, seed + 1, 0.25),
        random((inter, hid), jnp.float32, seed + 2, 0.25),
    )
    if mode == "row":
        return ws, tuple(quantize_weight_fp8(w, "row", dtype) for w in ws)
    return ws, tuple(quantize_weight_fp8(w, "static", dtype, input_scale=s) for w, s in zip(ws, in_scales))


@pytest.mark.parametrize("mode", ["row", "static"])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3, jnp.float8_e4m3fn])
def test_quantize_weight_fp8_matches_numpy(mode, dtype):
    w = random((33, 7), jnp.float32, 4).at[:, 3].set(0.0)  # a zero column: scale 1
    kw = {} if mode == "row" else dict(input_scale=jnp.float32(0.5))
    q = quantize_weight_fp8(w, mode, dtype, **kw)
    data, scale = np_quantize(w, mode, np.dtype(dtype))
    assert q.mode == mode and q.data.dtype == dtype and q.scale.dtype == jnp.float32
    assert q.scale.shape == ((7,) if mode == "row" else ())
    np.testing.assert_array_equal(np.asarray(q.data).astype(np.float64), data.astype(np.float64))
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
    assert (q.input_scale is None) == (mode == "row")
    # 3 mantissa bits: half an ulp is 2^-4 relative; subnormal steps (2^-9) absolute, times the scale
    bound = 2.0**-4 * np.abs(np.asarray(w, np.float64)) + scale.astype(np.float64) * 2.0**-9
    assert np.all(np.abs(dequantized(q) - np.asarray(w, np.float64)) <= bound)
    np.testing.assert_allclose(q.dequantize(jnp.float64), dequantized(q), rtol=1e-15)


@pytest.mark.parametrize("mode", ["row", "static"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tkg_path_matches_the_dequantized_oracle(mode, dtype):
    x = random((2, 5, HID), dtype, 0)  # 10 tokens: TKG, activations not quantized
    _, qs = quantized(mode)
    out = jax_nkilib.mlp(x, *qs)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, oracle(x, qs), dtype, reduction=HID, ops=4 if dtype == jnp.float32 else 6)


@pytest.mark.parametrize("mode", ["row", "static"])
def test_cte_path_quantizes_activations(mode):
    x = random((2, 50, HID), jnp.bfloat16, 0)  # 100 tokens: CTE
    _, qs = quantized(mode, in_scales=(4.5 / 240, 4.5 / 240, 1.5 / 240))
    out = jax_nkilib.mlp(x, *qs)
    assert_close(out, oracle(x, qs, cte=True), jnp.bfloat16, reduction=HID, ops=8)
    odd = jax_nkilib.mlp(x[:, :49], *qs)  # 98 tokens, odd sequence length
    assert_close(odd, oracle(x[:, :49], qs, cte=True), jnp.bfloat16, reduction=HID, ops=8)


def test_skip_gate_and_biases():
    x = random((3, 4, HID), jnp.float32, 0)
    _, (_, qu, qd) = quantized("row")
    bu, bd = random((INTER,), jnp.float32, 7, 0.2), random((HID,), jnp.float32, 8, 0.2)
    out = jax_nkilib.mlp(x, None, qu, qd, activation="relu", up_bias=bu, down_bias=bd)
    want = np.maximum(np.asarray(x, np.float64) @ dequantized(qu) + np.asarray(bu, np.float64), 0) @ dequantized(
        qd
    ) + np.asarray(bd, np.float64)
    assert_close(out, want, jnp.float32, reduction=HID)


@pytest.mark.parametrize("mode, tokens", [("row", (2, 3)), ("static", (2, 3)), ("row", (2, 50)), ("static", (2, 50))])
def test_gradient_in_x_is_the_dequantized_mlp_gradient(mode, tokens):
    """float64: the weights get no cotangent; x gets the gradient of the MLP on the dequantized weights (CTE: the
    activation quantization passes straight through)."""
    x = random(tokens + (HID,), jnp.float64, 0)
    _, qs = quantized(mode, in_scales=(4.5 / 240, 4.5 / 240, 1.5 / 240))
    ct = random(tokens + (HID,), jnp.float64, 5)
    got = jax.grad(lambda a: jnp.sum(jax_nkilib.mlp(a, *qs) * ct))(x)
    ws = tuple(jnp.asarray(dequantized(q)) for q in qs)
    want = jax.grad(lambda a: jnp.sum(jnp_oracle(a, *ws) * ct))(x)
    assert_close(got, want, jnp.float64, reduction=HID)
    if tokens == (2, 3):  # TKG is smooth in x: finite differences agree
        check_grads(lambda a: jax_nkilib.mlp(a, *qs), (x,), order=1, modes=["rev"])
    wgrad = jax.grad(lambda q: jnp.sum(jax_nkilib.mlp(x, *q)))(qs)
    assert all(not np.any(np.asarray(leaf, np.float64)) for leaf in jax.tree_util.tree_leaves(wgrad))


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_jit_vmap_and_vmap_of_grad():
    x = random((2, 3, HID), jnp.float32, 0)
    _, qs = quantized("static")
    stack = jnp.stack([x, -x, 2 * x])
    got = jax.jit(jax.vmap(lambda a, q: jax_nkilib.mlp(a, *q), in_axes=(0, None)))(stack, qs)
    assert_close(got[1], oracle(-x, qs), jnp.float32, reduction=HID)
    nested = jax.vmap(jax.vmap(lambda a: jax_nkilib.mlp(a, *qs)))(stack[:, :, None])
    assert_close(nested[2, :, 0], oracle(2 * x, qs), jnp.float32, reduction=HID)
    grad = jax.grad(lambda a: jnp.sum(jnp.tanh(jax_nkilib.mlp(a, *qs))))
    np.testing.assert_allclose(jax.vmap(grad)(stack)[1], grad(-x), rtol=1e-5, atol=1e-6)
    jitted = jax.jit(jax_nkilib.mlp)(x, *qs)  # containers as jit arguments
    np.testing.assert_array_equal(jitted, jax_nkilib.mlp(x, *qs))


def test_shard_map_over_the_batch():
    mesh = mesh_1d()
    x = random((8, 4, HID), jnp.bfloat16, 0)
    _, qs = quantized("row")
    specs = (P("data"), P(), P(), P())
    fn = jax.jit(jax.shard_map(lambda *a: jax_nkilib.mlp(*a), mesh=mesh, in_specs=specs, out_specs=P("data")))
    assert_close(fn(shard(mesh, (P("data"),), x), *qs), oracle(x, qs), jnp.bfloat16, reduction=HID, ops=6)


@pytest.mark.parametrize(
    "mode, seq, kind", [("row", 3, "ROW"), ("static", 3, "STATIC"), ("row", 128, "ROW"), ("static", 128, "STATIC")]
)
def test_neuron_lowering_is_one_kernel_with_the_quantization_type(mode, seq, kind):
    x = random((1, seq, 256), jnp.bfloat16, 0)
    _, qs = quantized(mode, hid=256, inter=128)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda a, *q: jax_nkilib.mlp(a, *q, norm="rms"), x, *qs)
    (cfg,) = kernel_configs(text)
    assert operations(text).count("stablehlo.custom_call") == 1
    assert set(compute_operations(text)) <= {"stablehlo.reshape", "stablehlo.broadcast_in_dim"}
    assert cfg["params"]["quantization_type"] == kind
    specs = [spec for spec in cfg["input_specs"] if spec is not None]
    assert [256, 128] in [spec[0] for spec in specs]
    scales = [spec[0] for spec in specs if spec[1] == "float32"]  # [128, n] tiles: ROW n = I, I, H; STATIC 1
    assert scales == ([[128, 128], [128, 128], [128, 256]] if mode == "row" else [[128, 1]] * 5)


def _bad_scale():
    _, (qg, qu, qd) = quantized("row")
    return qg, qu, QuantizedWeight(qd.data, qd.scale[:-1], None, "row")


def _raw_fp8():
    _, (qg, qu, qd) = quantized("row")
    return qg, qu, qd.data


def _mixed_modes():
    _, (qg, qu, _) = quantized("row")
    _, (_, _, qd) = quantized("static")
    return qg, qu, qd


def _float_and_quantized():
    ws, (qg, qu, _) = quantized("row")
    return qg, qu, ws[2]


def _different_gate_up_input_scales():
    _, qs = quantized("static", in_scales=(0.1, 0.2, 0.1))
    return qs


@pytest.mark.parametrize(
    "weights, kwargs, error, fragment",
    [
        (_bad_scale, {}, ValueError, "`w_down`.scale must be float32 [32] for mode='row'"),
        (_raw_fp8, {}, TypeError, "`w_down` is a raw FP8 array; pass FP8 weights with their scales"),
        (_mixed_modes, {}, ValueError, "w_down: static"),
        (_float_and_quantized, {}, ValueError, "quantized weights must be all of w_up, w_down, w_gate"),
        (_different_gate_up_input_scales, {}, ValueError, "must share one input_scale"),
    ],
)
def test_bad_weights(weights, kwargs, error, fragment):
    x = random((2, 3, HID), jnp.float32, 0)
    with pytest.raises(error) as info:
        jax_nkilib.mlp(x, *weights(), **kwargs)
    assert fragment in str(info.value)


def test_cte_down_bias_and_helper_arguments_are_rejected():
    _, qs = quantized("row")
    with pytest.raises(ValueError, match="`down_bias` with quantized weights needs the TKG path"):
        jax_nkilib.mlp(random((2, 50, HID), jnp.float32), *qs, down_bias=jnp.zeros(HID))
    w = random((8, 4), jnp.float32)
    with pytest.raises(ValueError, match="mode='static' needs `input_scale`"):
        quantize_weight_fp8(w, "static")
    with pytest.raises(ValueError, match="`input_scale` is for mode='static'"):
        quantize_weight_fp8(w, "row", input_scale=1.0)
    with pytest.raises(ValueError, match="`mode` must be 'row' or 'static'"):
        quantize_weight_fp8(w, "column")
    with pytest.raises(TypeError, match="`dtype` must be float8_e4m3 or float8_e4m3fn"):
        quantize_weight_fp8(w, "row", jnp.float8_e5m2)
    with pytest.raises(TypeError, match="`w` must be a float"):
        quantize_weight_fp8(w[0], "row")


@pytest.mark.parametrize("mode", ["row", "static"])
def test_quantize_weight_fp8_non_finite_values_leave_their_neighbours_alone(mode):
    # issue 11: one NaN reset its column's scale to 1 (every other value saturated at +-240) and an inf made the
    # column 0. Now a NaN or inf takes no part in its scale's max; it becomes NaN or +-240 itself.
    w = np.array(random((16, 4), jnp.float32, 7))
    w[0, 0], w[3, 1], w[5, 2], w[6, 2] = np.nan, np.inf, -np.inf, np.nan
    kw = {} if mode == "row" else dict(input_scale=0.5)
    q = quantize_weight_fp8(jnp.asarray(w), mode, **kw)
    finite = np.isfinite(w)
    data, scale = np_quantize(jnp.asarray(np.where(finite, w, 0.0)), mode, np.dtype(jnp.float8_e4m3))
    np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
    values = np.asarray(q.data).astype(np.float64)
    np.testing.assert_array_equal(values[finite], data.astype(np.float64)[finite])
    assert np.all(np.isnan(values[np.isnan(w)])) and np.all(values[np.isinf(w)] == np.sign(w[np.isinf(w)]) * 240)


def test_quantize_weight_fp8_empty_and_checked_scales():
    empty = quantize_weight_fp8(jnp.zeros((0, 3)), "row")  # was a zero-size reduction error
    assert empty.data.shape == (0, 3) and np.all(np.asarray(empty.scale) == 1.0)
    assert quantize_weight_fp8(jnp.zeros((4, 0)), "static", input_scale=1.0).data.shape == (4, 0)
    w = random((8, 4), jnp.float32)
    for bad in (0.0, -1.0, np.nan, np.inf, jnp.float32(-2.0)):
        with pytest.raises(ValueError, match=r"quantize_weight_fp8: `input_scale` .* must be finite and > 0"):
            quantize_weight_fp8(w, "static", input_scale=bad)
    with pytest.raises(TypeError, match="quantize_weight_fp8: `input_scale` must be a positive float scalar"):
        quantize_weight_fp8(w, "static", input_scale="0.5")
    traced = jax.jit(lambda s: quantize_weight_fp8(w, "static", input_scale=s).input_scale)(0.25)  # not checkable
    assert float(traced) == 0.25
    _, qs = quantized("static")
    bad_scale = QuantizedWeight(qs[2].data, qs[2].scale, jnp.float32(0.0), "static")  # built by hand
    with pytest.raises(ValueError, match=r"mlp: `w_down.input_scale` .* must be finite and > 0; got 0.0"):
        jax_nkilib.mlp(random((2, 3, HID), jnp.float32), qs[0], qs[1], bad_scale)
