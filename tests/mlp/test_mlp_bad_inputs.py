"""Bad inputs to jax_nkilib.nki.mlp and jax_nkilib.mlp raise TypeError/ValueError at trace time, naming the argument
and the expected layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import mlp

X = jnp.zeros((2, 3, 16), jnp.bfloat16)
W = jnp.zeros((16, 8), jnp.bfloat16)
WD = jnp.zeros((8, 16), jnp.bfloat16)
F8, F8D = W.astype(jnp.float8_e4m3), WD.astype(jnp.float8_e4m3)
F32 = jnp.float32
ROW = dict(
    gate_w_scale=jnp.ones((128, 8), F32), up_w_scale=jnp.ones((128, 8), F32), down_w_scale=jnp.ones((128, 16), F32)
)
ONE = jnp.ones((128, 1), F32)


def kernel(*args, **kwargs):
    return lambda: mlp(*args, **kwargs)


def op(*args, **kwargs):
    return lambda: jax_nkilib.mlp(*args, **kwargs)


CASES = [
    (kernel(X[0], W, W, WD), ValueError, ["jax_nkilib.nki.mlp", "`hidden_tensor`", "[B, S, H]", "rank 2"]),
    (kernel(X, W, W[:, :4], WD), ValueError, ["`up_proj_weights_tensor`", "[H, I]", "I=8"]),
    (kernel(X, W, W, W), ValueError, ["`down_proj_weights_tensor`", "[I, H]"]),
    (kernel(X, W, W, WD, jnp.ones((16,))), ValueError, ["`normalization_weights_tensor`", "[1, H]"]),
    (kernel(X.astype(jnp.int32), W, W, WD), TypeError, ["`hidden_tensor`", "dtype", "int32"]),
    (kernel(X.astype(jnp.float8_e4m3), W, W, WD), TypeError, ["`hidden_tensor`", "dtype"]),
    (kernel(X, W, W, WD, normalization_type="RMS_NORM"), ValueError, ["RMS_NORM", "normalization_weights_tensor"]),
    (
        kernel(X, W, W, WD, jnp.ones((1, 16)), None, None, None, jnp.ones((1, 16)), normalization_type="RMS_NORM"),
        ValueError,
        ["normalization_bias_tensor", "LAYER_NORM"],
    ),
    (kernel(X, W, W, WD, store_fused_add_result=True), ValueError, ["store_fused_add_result", "fused_add_tensor"]),
    (kernel(X, W, W, WD, activation_fn="Tanh"), TypeError, ["`activation_fn`", "ActFnType", "SiLU"]),
    (kernel(X, W, W, WD, quantization_type="MX"), ValueError, ["`gate_proj_weights_tensor`", "[128, H/512, I]"]),
    (
        kernel(X, W, W, WD, quantization_type="STATIC_MX"),
        TypeError,
        ["STATIC_MX", "float8_e4m3", "gate_proj_weights_tensor"],
    ),
    (kernel(X, W, W, WD, quantization_type="ROW_MX"), ValueError, ["ROW_MX", "not bound"]),
    (kernel(X, W, W, WD, store_output_in_sbuf=True), ValueError, ["store_output_in_sbuf", "not applicable"]),
    (kernel(X, W, W, WD, output_dtype=jnp.int32), TypeError, ["output_dtype"]),
    (kernel(X, F8, F8, F8D), TypeError, ["FP8 weights", "ROW, STATIC or"]),
    (kernel(X, W, W, WD, quantization_type="ROW", **ROW), TypeError, ["float8_e4m3", "gate_proj_weights_tensor"]),
    (
        kernel(X, F8, F8, F8D, quantization_type="ROW"),
        ValueError,
        ["needs gate_w_scale, up_w_scale, down_w_scale", "[128, I]"],
    ),
    (
        kernel(X, F8, F8, F8D, quantization_type="ROW", **dict(ROW, down_w_scale=jnp.ones((128, 8), F32))),
        ValueError,
        ["`down_w_scale`", "[128, H]", "quantization_type=QuantizationType.ROW"],
    ),
    (
        kernel(X, F8, F8, F8D, quantization_type="STATIC", gate_w_scale=ONE, up_w_scale=ONE, down_w_scale=ONE),
        ValueError,
        ["needs gate_up_in_scale, down_in_scale"],
    ),
    (kernel(X, F8, F8, F8D, quantization_type="STATIC", **ROW), ValueError, ["`gate_w_scale`", "[128, 1]"]),
    (
        kernel(X, F8, F8, F8D, quantization_type="ROW", gate_up_in_scale=ONE, **ROW),
        ValueError,
        ["gate_up_in_scale", "STATIC input scales"],
    ),
    (kernel(X, W, W, WD, gate_w_scale=ONE), ValueError, ["gate_w_scale", "only used with"]),
    (kernel(X, W.astype(jnp.float8_e5m2), W, WD), TypeError, ["`gate_proj_weights_tensor`", "dtype"]),
    (kernel(X, W, W, WD, ROW["up_w_scale"].astype(jnp.bfloat16)), ValueError, ["`normalization_weights_tensor`"]),
    (
        kernel(X, W, W, WD, use_tkg_down_proj_optimized_layout=True),
        ValueError,
        ["use_tkg_down_proj_optimized_layout", "use_tkg_down_proj_column_tiling=False"],
    ),
    (
        kernel(X, W, W, WD, use_tkg_down_proj_optimized_layout=True, use_tkg_down_proj_column_tiling=False),
        ValueError,
        ["H % (128 * LNC)"],
    ),
    (kernel(X, W, W, WD, gate_clamp_upper_limit="1"), TypeError, ["`gate_clamp_upper_limit`", "float"]),
    (kernel(X, W, W, WD, eps=None), TypeError, ["`eps`"]),
    (kernel(X, W, W), TypeError, ["missing required tensor argument `down_proj_weights_tensor`"]),
    (kernel(X, W, W, WD, sbm=None), TypeError, ["unexpected keyword argument `sbm`"]),
    (op(X, W, W, WD, activation="tanh"), ValueError, ["jax_nkilib.mlp", "`activation`", "silu"]),
    (op(X, W, W[:8], WD), ValueError, ["`w_up`", "[hidden, inter]", "hidden=16"]),
    (op(X, W[:, :4], W, WD), ValueError, ["`w_gate`", "[hidden, inter]"]),
    (op(X, W, W, W), ValueError, ["`w_down`", "[inter, hidden]"]),
    (op(X, W, W, WD, norm="batch"), ValueError, ["`norm`"]),
    (op(X, W, W, WD, norm_weight=jnp.ones(16)), ValueError, ["norm_weight", "norm='rms'"]),
    (op(X, W, W, WD, norm="rms", norm_bias=jnp.ones(16)), ValueError, ["norm_bias", "norm='layer'"]),
    (op(X, W, W, WD, norm="rms", norm_weight=jnp.ones(8)), ValueError, ["`norm_weight`", "[hidden]"]),
    (op(X, W, W, WD, residual=X[0]), ValueError, ["`residual`", "x's shape"]),
    (op(X, W, W, WD, return_residual=True), ValueError, ["return_residual", "`residual`"]),
    (op(X, None, W, WD, gate_clamp=(None, 1.0)), ValueError, ["gate_clamp", "w_gate"]),
    (op(X, W, W, WD, up_clamp=1.0), TypeError, ["`up_clamp`", "(lower, upper)"]),
    (op(X, W, W, WD, up_bias=jnp.ones(16)), ValueError, ["`up_bias`", "[inter]"]),
    (op(X.astype(jnp.int32), W, W, WD), TypeError, ["`x`", "floating"]),
    (op([1.0], W, W, WD), TypeError, ["`x`", "array"]),
    # issue 11: static values checked at trace time, in the op's terms (no kernel operand or parameter names)
    (op(X, W, W, WD, gate_clamp=(3.0, -3.0)), ValueError, ["jax_nkilib.mlp", "`gate_clamp`", "lower > upper"]),
    (op(X, W, W, WD, up_clamp=(float("nan"), 1.0)), ValueError, ["`up_clamp`", "lower bound is NaN"]),
    (op(X, W, W, WD, up_clamp=(None, "1")), TypeError, ["`up_clamp`", "upper bound is '1'"]),
    (op(X, W, W, WD, gate_clamp=[-3.0, 3.0]), TypeError, ["`gate_clamp`", "(lower, upper) tuple"]),
    (op(X, W, W, WD, norm="rms", eps=-1e-5), ValueError, ["jax_nkilib.mlp", "`eps`", ">= 0"]),
    (op(X, W, W, WD, norm="rms", eps=float("nan")), ValueError, ["`eps`", "nan"]),
    (op(X, W, W, WD, norm="rms", eps="x"), TypeError, ["jax_nkilib.mlp", "`eps`"]),
    (op(X, W, W, WD, residual=X, return_residual=1), TypeError, ["jax_nkilib.mlp", "`return_residual`", "bool"]),
    (op(X, W, W, WD, output_dtype=jnp.int32), TypeError, ["jax_nkilib.mlp", "`output_dtype`", "int32"]),
    (op(X, W, W, WD, output_dtype="foo"), TypeError, ["jax_nkilib.mlp", "`output_dtype`", "'foo'"]),
    (op(X.astype(jnp.float8_e4m3), W, W, WD), TypeError, ["jax_nkilib.mlp", "`x`", "float8_e4m3"]),
    (op(X, W, W, WD, residual=X.astype(jnp.float8_e4m3)), TypeError, ["jax_nkilib.mlp", "`residual`"]),
    (op(X, W, W, WD, norm="rms", norm_weight=jnp.ones(16, jnp.float8_e5m2)), TypeError, ["`norm_weight`"]),
    (op(X.reshape((1,) * 10 + X.shape), W, W, WD), ValueError, ["jax_nkilib.mlp", "`x` has 12 leading axes"]),
    (op(X[..., :0], W[:0], W[:0], WD[:, :0]), ValueError, ["jax_nkilib.mlp", "`x`", "hidden >= 1"]),
    (op(X, W[:, :0], W[:, :0], WD[:0]), ValueError, ["`w_up`", "inter >= 1"]),
    (
        lambda: jax.jit(lambda x, e: jax_nkilib.mlp(x, W, W, WD, norm="rms", eps=e))(X, 1e-6),
        TypeError,
        ["jax_nkilib.mlp", "`eps`", "static", "not a traced value"],
    ),
    (
        lambda: jax.jit(lambda x, c: jax_nkilib.mlp(x, W, W, WD, gate_clamp=(None, c)))(X, 1.0),
        TypeError,
        ["jax_nkilib.mlp", "`gate_clamp[upper]`", "static"],
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_bad_input(case):
    call, error, fragments = CASES[case]
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"


def test_clamps_and_eps_accept_numpy_values_and_open_sides():
    x, w, wd = X.astype(jnp.float32), W.astype(jnp.float32) + 0.1, WD.astype(jnp.float32) + 0.1
    out = jax_nkilib.mlp(
        x, w, w, wd, norm="rms", eps=np.float32(1e-5), gate_clamp=(-np.inf, np.float64(7.0)), up_clamp=(None, None)
    )
    assert out.shape == x.shape and bool(jnp.all(jnp.isfinite(out)))


def test_mlp_of_no_tokens_is_empty():
    # was a kernel error naming its internal dimension ("dimension S is 0")
    x = jnp.zeros((2, 0, 16), jnp.float32)
    out = jax_nkilib.mlp(x, W, W, WD, output_dtype=jnp.bfloat16)
    assert out.shape == (2, 0, 16) and out.dtype == jnp.bfloat16
    out, summed = jax_nkilib.mlp(x, W, W, WD, residual=x, return_residual=True)
    assert out.shape == summed.shape == (2, 0, 16)
