"""jax_nkilib.rms_norm / layer_norm: JAX layout [..., H], odd H, autodiff, vmap, shard_map, Neuron lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, assert_no_worse_than_plain
from tests.support.xla_flags import DEFAULT_EMITTERS


def rms_oracle(x, weight=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if weight is None else y * np.asarray(weight, np.float64)


def layer_oracle(x, weight=None, bias=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    y = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    y = y if weight is None else y * np.asarray(weight, np.float64)
    return y if bias is None else y + np.asarray(bias, np.float64)


# (shape, LNC); odd H: padded (rms_norm) or plain JAX (layer_norm)
CASES = [((2, 3, 256), 1), ((2, 3, 256), 2), ((5, 128), 1), ((256,), 1), ((2, 2, 3, 100), 2), ((3, 37), 1)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, lnc", CASES)
def test_rms_norm_matches_oracle(dtype, shape, lnc):
    x, w = random(shape, dtype, 0), random(shape[-1:], dtype, 1)
    with jax_nkilib.config(lnc=lnc):
        out = jax_nkilib.rms_norm(x, w, eps=1e-5)
        plain = jax_nkilib.rms_norm(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_oracle(x, w, 1e-5), dtype, reduction=shape[-1])
    assert_close(plain, rms_oracle(x), dtype, reduction=shape[-1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, lnc", CASES)
def test_layer_norm_matches_oracle(dtype, shape, lnc):
    x = random(shape, dtype, 2, scale=2.0) + 1.0
    w, b = random(shape[-1:], dtype, 3), random(shape[-1:], dtype, 4)
    with jax_nkilib.config(lnc=lnc):
        out = jax_nkilib.layer_norm(x, w, b)
        plain = jax_nkilib.layer_norm(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, layer_oracle(x, w, b), dtype, reduction=shape[-1], ops=8)
    assert_close(plain, layer_oracle(x), dtype, reduction=shape[-1], ops=8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("hidden", [256, 200])  # the kernel path and the plain-JAX path (H % 128 != 0)
def test_layer_norm_is_accurate_on_rows_with_a_large_mean(dtype, hidden):
    # The kernel's one-pass variance mean(x^2) - mean^2 cancels when |mean| >> std (float32: 9e-2 error at mean 1e3,
    # NaN from 3e3); layer_norm subtracts each row's mean first, which LayerNorm is invariant to.
    means = np.array([0.0, 1e3, -3e3, 1e4, 1e5])[:, None]
    x = jnp.asarray(means + np.asarray(random((5, hidden), jnp.float64, 8)), dtype)
    w, b = random((hidden,), dtype, 9), random((hidden,), dtype, 10)
    rows = slice(None) if dtype == jnp.float32 else slice(0, 3)  # bfloat16 rows past 1e3 are nearly constant
    out = jax_nkilib.layer_norm(x, w, b)
    assert_close(out[rows], layer_oracle(x, w, b)[rows], dtype, reduction=hidden, ops=8)
    if dtype == jnp.float32:  # reverse mode at the offset, against float64 autodiff of the two-pass formula
        cot = random((5, hidden), jnp.float64, 11)

        def two_pass(a):
            c = a - a.mean(-1, keepdims=True)
            return c * jax.lax.rsqrt((c * c).mean(-1, keepdims=True) + 1e-6)

        # compiled as users' programs are: the suite's cheap compile flags (conftest.py) sum the backward's row
        # reductions in an order that loses 4e-5 at the mean 1e5 here, against 1e-7 with XLA's default emitters
        backward = jax.jit(jax.grad(lambda a: jnp.sum(jax_nkilib.layer_norm(a) * cot)))
        grad = backward.lower(x).compile(compiler_options=DEFAULT_EMITTERS)(x)
        want = jax.jit(jax.grad(lambda a: jnp.sum(two_pass(a) * cot)))(x.astype(jnp.float64))
        assert_close(grad, want, dtype, reduction=hidden, ops=16)


def test_bf16_error_is_that_of_a_plain_bf16_computation():
    x, w = random((4, 8, 512), jnp.bfloat16), random((512,), jnp.bfloat16, 1)
    xf = x.astype(jnp.float32)
    plain = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16) * w
    assert_no_worse_than_plain(jax_nkilib.rms_norm(x, w), plain, rms_oracle(x, w))
    mu = xf.mean(-1, keepdims=True)
    plain = ((xf - mu) * jax.lax.rsqrt(xf.var(-1, keepdims=True) + 1e-6)).astype(jnp.bfloat16) * w
    assert_no_worse_than_plain(jax_nkilib.layer_norm(x, w), plain, layer_oracle(x, w), factor=3.0)


# LNC 2 and odd H (padded rms_norm, plain-JAX layer_norm) with and without a weight; the conformance suite (arg specs
# rms_norm, layer_norm) checks LNC 1 with H % 128 == 0 at second order
@pytest.mark.parametrize("shape, lnc, order", [((2, 256), 2, 1), ((3, 40), 1, 1)])
def test_gradients_float64(shape, lnc, order):
    x, w, b = random(shape, jnp.float64, 5), random(shape[-1:], jnp.float64, 6), random(shape[-1:], jnp.float64, 7)
    with jax_nkilib.config(lnc=lnc):
        check_grads(jax.jit(jax_nkilib.rms_norm), (x, w), order=order, modes=["rev"])
        check_grads(jax.jit(jax_nkilib.rms_norm), (x,), order=1, modes=["rev"])
        check_grads(
            jax.jit(lambda a, c, d: jax_nkilib.layer_norm(a, c, d, eps=1e-5)), (x, w, b), order=order, modes=["rev"]
        )


def test_gradient_matches_oracle_gradient():
    x, w = random((2, 128), jnp.float64, 8), random((128,), jnp.float64, 9)
    g = random(x.shape, jnp.float64, 10)
    for op, oracle in ((jax_nkilib.rms_norm, rms_oracle), (jax_nkilib.layer_norm, layer_oracle)):
        _, vjp = jax.vjp(op, x, w)
        dx, dw = vjp(g)
        eps, idx = 1e-6, (1, 17)
        plus, minus = np.array(x), np.array(x)
        plus[idx] += eps
        minus[idx] -= eps
        numeric = np.sum(np.asarray(g) * (oracle(plus, w) - oracle(minus, w))) / (2 * eps)
        np.testing.assert_allclose(dx[idx], numeric, rtol=1e-6, atol=1e-8)
        np.testing.assert_allclose(dw, np.sum(np.asarray(g) * (oracle(x, w) / np.asarray(w)), axis=0), rtol=1e-8)


def test_neuron_lowering_is_one_kernel_and_layout_glue():
    x, w = random((2, 3, 256)), random((256,), seed=1)
    with jax_nkilib.neuron.dry_run():
        # layer_norm adds its per-row shift: one row mean (a reduce and a divide) and a subtraction
        shift = {"stablehlo.reduce", "stablehlo.divide", "stablehlo.broadcast_in_dim", "stablehlo.subtract"}
        for op, name, glue in (
            (jax_nkilib.rms_norm, "rmsnorm_tkg", set()),
            (jax_nkilib.layer_norm, "layernorm_tkg", shift),
        ):
            text = neuron_text(op, x, w)
            (cfg,) = kernel_configs(text)
            assert cfg["func_name"] == name and cfg["input_specs"][0] == [[6, 1, 256], "float32"]
            assert set(compute_operations(text)) == {"stablehlo.reshape", "stablehlo.transpose"} | glue
            assert compute_operations(text).count("stablehlo.transpose") == 1
            assert compute_operations(text).count("stablehlo.reduce") == len(glue and [1])
        text = neuron_text(jax_nkilib.rms_norm, x[..., :100], w[:100])  # odd H: padded to 128, hidden_actual=100
        (cfg,) = kernel_configs(text)
        assert cfg["params"]["hidden_actual"] == 100 and cfg["input_specs"][0][0] == [6, 1, 128]
        assert "stablehlo.pad" in compute_operations(text) and "stablehlo.slice" in compute_operations(text)
        assert kernel_configs(neuron_text(jax_nkilib.layer_norm, x[..., :100])) == []  # no kernel for odd H
        grad_text = neuron_text(jax.value_and_grad(lambda a: jnp.sum(jax_nkilib.rms_norm(a, w))), x)
        assert len(kernel_configs(grad_text)) == 1  # the forward kernel; the backward is JAX
        with jax_nkilib.config(lnc=2):
            (cfg,) = kernel_configs(neuron_text(jax_nkilib.rms_norm, x, w))
            assert cfg["grid"] == 2


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: jax_nkilib.rms_norm(x, jnp.ones(7)), ValueError, "[H]"),
        (lambda x: jax_nkilib.layer_norm(x, None, jnp.ones((1, 256))), ValueError, "`bias`"),
        (lambda x: jax_nkilib.rms_norm(x.astype(jnp.int32)), TypeError, "floating"),
        (lambda x: jax_nkilib.rms_norm([1.0, 2.0]), TypeError, "array"),
        (lambda x: jax_nkilib.layer_norm(x[0, 0, 0]), ValueError, "[..., H]"),
        (lambda x: jax_nkilib.rms_norm(x, jnp.ones(256, jnp.int32)), TypeError, "`weight`"),
        # issue 11: eps is a static finite float >= 0; FP8 inputs and too many leading axes in the op's own terms
        (lambda x: jax_nkilib.rms_norm(x, eps=-1e-6), ValueError, ("rms_norm", "`eps`", ">= 0", "-1e-06")),
        (lambda x: jax_nkilib.layer_norm(x, eps=float("nan")), ValueError, ("layer_norm", "`eps`", "finite", "nan")),
        (lambda x: jax_nkilib.layer_norm(x, eps=np.inf), ValueError, ("layer_norm", "`eps`", "inf")),
        (lambda x: jax_nkilib.rms_norm(x, eps="1e-6"), TypeError, ("rms_norm", "`eps`", "Python float")),
        (
            lambda x: jax.jit(lambda a, e: jax_nkilib.rms_norm(a, eps=e))(x, 1e-6),
            TypeError,
            ("rms_norm", "`eps`", "static", "not a traced value", "static_argnames"),
        ),
        (
            lambda x: jax.jit(lambda a, e: jax_nkilib.layer_norm(a, eps=e))(x, 1e-6),
            TypeError,
            ("layer_norm", "`eps`", "static"),
        ),
        (lambda x: jax_nkilib.layer_norm(x.astype(jnp.float8_e4m3)), TypeError, ("layer_norm", "`x`", "float8_e4m3")),
        (lambda x: jax_nkilib.rms_norm(x, jnp.ones(256, jnp.float8_e5m2)), TypeError, ("rms_norm", "`weight`")),
        (lambda x: jax_nkilib.rms_norm(x.reshape((1,) * 9 + x.shape)), ValueError, ("rms_norm", "`x`", "11 leading")),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 256)))
    for part in [fragment] if isinstance(fragment, str) else fragment:
        assert part in str(info.value)


def test_eps_accepts_numpy_and_zero():
    x = random((2, 256), seed=12)
    assert_close(jax_nkilib.rms_norm(x, eps=np.float32(0.0)), rms_oracle(x, eps=0.0), jnp.float32, reduction=256)
    assert_close(
        jax_nkilib.layer_norm(x, eps=jnp.float32(1e-3)), layer_oracle(x, eps=1e-3), jnp.float32, reduction=256, ops=8
    )
