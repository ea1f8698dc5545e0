"""jax_nkilib.nki.output_projection_cte / output_projection_tkg: float64 oracle (NONE, FP8 STATIC, ROW,
TRANSPOSE_OUT), output dtype, jit, vmap, gradients, shard_map, Neuron lowering and bad inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import QuantizationType, output_projection_cte, output_projection_tkg
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close

E4M3, E4M3FN = jnp.float8_e4m3, jnp.float8_e4m3fn


# ----------------------------------------------------------------------------------------------- float64 oracle
def projection_oracle(
    attn_bsnd, weight, bias=None, *, quant=None, w_scale=None, in_scale=None, fp8=None, bound=None, round_to=None
):
    """``[B, S, H]`` float64 from attention ``[B, S, N, D]`` (token-major, any dtype).

    ``quant``: None, ``"static"`` (``fp8(clip(a / in_scale, ±bound)) @ W * w_scale * in_scale``; ``round_to`` rounds
    ``a / in_scale`` to that dtype first) or ``"row"`` (``a @ W * w_scale[h]``); quantized results are rounded to
    the attention's dtype after the scale and again after the bias (the kernels' result buffers)."""
    io = np.dtype(attn_bsnd.dtype)
    keep = (lambda v: v.astype(io).astype(np.float64)) if quant else (lambda v: v)  # noqa: E731
    a = np.asarray(attn_bsnd, np.float64)
    b, s, n, d = a.shape
    a = a.reshape(b * s, n * d)
    w = np.asarray(weight.astype(jnp.float32), np.float64)
    if quant == "static":
        scaled = a / in_scale
        if round_to is not None:
            scaled = scaled.astype(round_to).astype(np.float64)
        a = np.clip(scaled, -bound, bound).astype(fp8).astype(np.float64)
        out = keep(a @ w * (w_scale * in_scale))
    elif quant == "row":
        out = keep(a @ w * np.asarray(w_scale, np.float64))
    else:
        out = a @ w
    if bias is not None:
        out = keep(out + np.asarray(bias, np.float64).reshape(1, -1))
    return out.reshape(b, s, -1)


def problem(b=2, s=5, n=3, d=4, h=7, dtype=jnp.float32, seed=0):
    """Attention in the token-major [B, S, N, D] order, weight [N*D, H], bias [1, H]."""
    return (
        random((b, s, n, d), dtype, seed),
        random((n * d, h), dtype, seed + 1, 0.4),
        random((1, h), dtype, seed + 2, 0.3),
    )


def cte_layout(a):  # [B, S, N, D] -> [B, N, D, S]
    return jnp.transpose(a, (0, 2, 3, 1))


def tkg_layout(a):  # [B, S, N, D] -> [D, B, N, S]
    return jnp.transpose(a, (3, 0, 2, 1))


# ---------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 3, 4, 7), (1, 1, 1, 1, 1), (3, 9, 2, 5, 11)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_both_kernels_match_the_oracle(dtype, shape, with_bias):
    b, s, n, d, h = shape
    a, w, bias = problem(b, s, n, d, h, dtype)
    bias = bias if with_bias else None
    want = projection_oracle(a, w, bias)
    cte = output_projection_cte(cte_layout(a), w, bias)
    tkg = output_projection_tkg(tkg_layout(a), w, bias)
    assert cte.shape == (b, s, h) and cte.dtype == dtype and tkg.shape == (b * s, h) and tkg.dtype == dtype
    assert_close(cte, want, dtype, reduction=n * d)
    assert_close(tkg.reshape(b, s, h), want, dtype, reduction=n * d)


def test_cte_output_dtype_rounds_to_the_attention_dtype_first():
    a, w, bias = problem(dtype=jnp.bfloat16)
    out = output_projection_cte(cte_layout(a), w, bias, output_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, output_projection_cte(cte_layout(a), w, bias).astype(jnp.float32))


def _exact_fp8_problem(dtype, fp8, scale_power=-3):
    """Small integers times 2^k: the scaled attention, the FP8 values and every product are exact."""
    rng = np.random.default_rng(4)
    a = jnp.asarray(rng.integers(-6, 7, (2, 3, 2, 4)) * 2.0**scale_power, dtype)
    w = jnp.asarray(rng.integers(-8, 9, (8, 6)), jnp.float32).astype(fp8)
    return a, w


@pytest.mark.parametrize("fp8", [E4M3, E4M3FN])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_static_fp8_cte_and_tkg(fp8, dtype):
    a, w = _exact_fp8_problem(dtype, fp8)
    a = a.at[0, 0, 0, 0].set(200.0)  # 200 / 2^-3 = 1600: clamped (240 on CTE; the weights' format on TKG)
    in_s, w_s = 2.0**-3, 0.5
    scales = jnp.full((128, 1), in_s, jnp.float32), jnp.full((128, 1), w_s, jnp.float32)
    bias = jnp.asarray(np.arange(6)[None] * 0.25, dtype)
    cte = output_projection_cte(cte_layout(a), w, bias, scales[0], scales[1], quantization_type="STATIC")
    want = projection_oracle(
        a, w, bias, quant="static", w_scale=w_s, in_scale=in_s, fp8=ml_dtypes.float8_e4m3, bound=240.0
    )
    np.testing.assert_array_equal(np.asarray(cte, np.float64), want)
    tkg = output_projection_tkg(tkg_layout(a), w, bias, scales[1], scales[0], quantization_type=QuantizationType.STATIC)
    bound = float(ml_dtypes.finfo(fp8).max)
    want = projection_oracle(a, w, bias, quant="static", w_scale=w_s, in_scale=in_s, fp8=np.dtype(fp8), bound=bound)
    np.testing.assert_array_equal(np.asarray(tkg, np.float64).reshape(want.shape), want)
    assert bound != 240.0 or fp8 == E4M3


def test_static_fp8_rounds_non_exact_inputs_like_the_kernel():
    a, w, bias = problem(2, 4, 2, 8, 16, jnp.bfloat16)
    w8 = (w * 8).astype(jnp.float32).astype(E4M3)
    in_s, w_s = 0.02, 0.125
    scales = (jnp.full((128, 1), w_s, jnp.float32), jnp.full((128, 1), in_s, jnp.float32))
    out = output_projection_tkg(tkg_layout(a), w8, bias, *scales, quantization_type="STATIC")
    want = projection_oracle(
        a,
        w8,
        bias,
        quant="static",
        w_scale=w_s,
        in_scale=in_s,
        fp8=ml_dtypes.float8_e4m3,
        bound=240.0,
        round_to=ml_dtypes.bfloat16,
    )
    assert_close(out.reshape(want.shape), want, jnp.bfloat16, reduction=16, ops=4)


def test_row_quantization_tkg():
    a, w = _exact_fp8_problem(jnp.bfloat16, E4M3FN, 0)
    w_row = jnp.asarray(2.0 ** np.arange(-3, 3), jnp.float32)
    out = output_projection_tkg(tkg_layout(a), w, None, jnp.broadcast_to(w_row, (128, 6)), quantization_type="ROW")
    want = projection_oracle(a, w, quant="row", w_scale=w_row)
    np.testing.assert_array_equal(np.asarray(out, np.float64).reshape(want.shape), want)


@pytest.mark.parametrize("lnc", [1, 2])
def test_transpose_out_layout_follows_the_lnc_degree(lnc):
    a, w, bias = problem(2, 3, 2, 4, 512)
    flat = output_projection_tkg(tkg_layout(a), w, bias)
    with jax_nkilib.config(lnc=lnc):
        out = output_projection_tkg(tkg_layout(a), w, bias, TRANSPOSE_OUT=True)
    h2 = 512 // lnc // 128
    assert out.shape == (128, lnc, h2, 6)
    h0, h1, h2i, t = 1 % lnc, 77, h2 - 1, 4  # out[h1, h0, h2, t] = flat[t, h0 * 128 * H2 + h1 * H2 + h2]
    assert out[h1, h0, h2i, t] == flat[t, h0 * 128 * h2 + h1 * h2 + h2i]
    np.testing.assert_array_equal(jnp.transpose(out, (3, 1, 0, 2)).reshape(6, 512), flat)


# -------------------------------------------------------------------------------------------------- gradients
# (jit, vmap and nested vmap of both kernels are the conformance suite's: arg specs output_projection_cte,
# output_projection_tkg)
def test_fp8_weights_get_no_cotangent_and_the_attention_does():
    a, w = _exact_fp8_problem(jnp.float32, E4M3FN)
    scales = jnp.full((128, 1), 0.5, jnp.float32), jnp.full((128, 1), 0.125, jnp.float32)
    g = jax.grad(lambda x: jnp.sum(output_projection_cte(cte_layout(x), w, None, *scales, quantization_type="STATIC")))(
        a + 0.01
    )
    assert g.shape == a.shape and np.isfinite(np.asarray(g)).all()


# ----------------------------------------------------------------------------------------------------- Neuron
@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_lowering_is_one_kernel_call_each(lnc):
    a, w, bias = problem(2, 4, 2, 64, 256, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = neuron_text(lambda x, y, z: output_projection_cte(x, y, z), cte_layout(a), w, bias)
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "output_projection_cte" and cfg["grid"] == lnc and cfg["aliases"] == []
        assert cfg["output_names"] == ["out"] and compute_operations(text) == []
        text = neuron_text(lambda x, y, z: output_projection_tkg(x, y, z, TRANSPOSE_OUT=True), tkg_layout(a), w, bias)
        (cfg,) = kernel_configs(text)
        assert cfg["entry_point"].endswith("output_projection_tkg:output_projection_tkg")
        assert cfg["params"] == {"quantization_type": "NONE", "TRANSPOSE_OUT": True, "OUT_IN_SB": False}
        assert f"tensor<128x{lnc}x{256 // lnc // 128}x8xbf16>" in text and compute_operations(text) == []


def test_neuron_limits_fall_back():
    a, w, bias = problem(1, 2, 2, 130, 8, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match="head dim D=130 exceeds 128"):
        text = neuron_text(lambda x, y: output_projection_tkg(x, y), tkg_layout(a), w)
    assert "AwsNeuronCustomNativeKernel" not in text


# ------------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "case, error, fragment",
    [
        ("rows", ValueError, "`weight` must be [N * D, H] = [12, H]"),
        ("rank", ValueError, "argument `attention` must have layout [B, N, D, S]"),
        ("weight_dtype", TypeError, "`weight` must have the dtype of `attention`"),
        ("mx", ValueError, "quantization_type=MX needs N * D % 32 == 0"),
        ("static_mx", ValueError, "quantization_type=STATIC_MX: STATIC_MX"),
        ("row_on_cte", ValueError, "quantization_type=ROW is not supported by this kernel"),
        ("static_no_scale", ValueError, "quantization_type=STATIC requires `weight_scales`"),
        ("static_float_weight", TypeError, "needs FP8 weights"),
        ("scale_without_quant", ValueError, "`input_scales` is only used with quantized weights"),
        ("bias_shape", ValueError, "argument `bias` must have layout [1, H]"),
        ("output_dtype", TypeError, "`output_dtype` must be a floating dtype"),
    ],
)
def test_cte_bad_inputs(case, error, fragment):
    a, w, bias = problem()
    x, args, flags = cte_layout(a), [w, bias], {}
    one = jnp.ones((128, 1), jnp.float32)
    if case == "rows":
        args[0] = w[:10]
    if case == "rank":
        x = a[0]
    if case == "weight_dtype":
        args[0] = w.astype(jnp.bfloat16)
    if case == "mx":
        flags["quantization_type"] = "MX"
    if case == "static_mx":
        flags["quantization_type"] = "STATIC_MX"
    if case == "row_on_cte":
        flags["quantization_type"] = "ROW"
    if case == "static_no_scale":
        args = [w.astype(E4M3), None, one]
        flags["quantization_type"] = "STATIC"
    if case == "static_float_weight":
        args = [w, None, one, one]
        flags["quantization_type"] = "STATIC"
    if case == "scale_without_quant":
        args = [w, None, one]
    if case == "bias_shape":
        args[1] = bias[0]
    if case == "output_dtype":
        flags["output_dtype"] = jnp.int32
    with pytest.raises(error) as info:
        output_projection_cte(x, *args, **flags)
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "case, fragment",
    [
        ("row_scale", "`weight_scale` must be [128, H] = [128, 7]"),
        ("mx", "quantization_type=MX is not supported by this kernel"),
        ("row_in_scale", "`input_scale` is only used with quantized weights; got it with quantization_type=ROW"),
        ("out_in_sb", "OUT_IN_SB=True leaves the output in SBUF"),
        ("transpose", "H=7 must be a multiple of 128 * LNC = 128"),
        ("flag", "parameter `TRANSPOSE_OUT` must be a Python bool"),
    ],
)
def test_tkg_bad_inputs(case, fragment):
    a, w, bias = problem()
    w8, one = w.astype(E4M3), jnp.ones((128, 1), jnp.float32)
    calls = {
        "row_scale": lambda: output_projection_tkg(tkg_layout(a), w8, None, one, quantization_type="ROW"),
        "row_in_scale": lambda: output_projection_tkg(
            tkg_layout(a), w8, None, jnp.ones((128, 7), jnp.float32), one, quantization_type="ROW"
        ),
        "mx": lambda: output_projection_tkg(tkg_layout(a), w, quantization_type="MX"),
        "out_in_sb": lambda: output_projection_tkg(tkg_layout(a), w, OUT_IN_SB=True),
        "transpose": lambda: output_projection_tkg(tkg_layout(a), w, TRANSPOSE_OUT=True),
        "flag": lambda: output_projection_tkg(tkg_layout(a), w, TRANSPOSE_OUT=1),
    }
    with pytest.raises((TypeError, ValueError)) as info:
        calls[case]()
    assert fragment in str(info.value)
