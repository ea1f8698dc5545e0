"""jax_nkilib.nki.conv1d against a float64 NumPy oracle written from the kernel's contract (filters [K, Cin, Cout],
zero padding (left, right), stride, dilation, bias then activation, each rounded to the dtype), its gradients, vmap,
its Neuron lowering (one call, LNC grid, limits) and errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import conv1d
from tests.support import nki_standin
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

_erf = np.vectorize(math.erf)


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


ACTIVATIONS = {  # the kernels' nl.silu, nl.gelu, nl.gelu_apprx_tanh, nl.gelu_apprx_sigmoid, in float64
    "SiLU": lambda x: x * sigmoid(x),
    "GELU": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "GELU_Tanh_Approx": lambda x: 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "Swish": lambda x: x * sigmoid(1.702 * x),
}


def oracle(x, filters, bias=None, stride=1, padding=(0, 0), dilation=1, activation_fn=None):
    """``y[b, o, l] = act(bias[o] + sum_{k, c} filters[k, c, o] xpad[b, c, l stride + k dilation])`` in float64."""
    x, filters = f64(x), f64(filters)
    batch, _, length = x.shape
    taps, _, _ = filters.shape
    xpad = np.pad(x, ((0, 0), (0, 0), padding))
    out_len = (length + sum(padding) - dilation * (taps - 1) - 1) // stride + 1
    y = np.zeros((batch, filters.shape[2], out_len))
    for k in range(taps):
        window = xpad[:, :, k * dilation : k * dilation + (out_len - 1) * stride + 1 : stride]  # [B, Cin, Lout]
        y += np.einsum("bcl,co->bol", window, filters[k])
    if bias is not None:
        y += f64(bias)[None, :, None]
    return ACTIVATIONS[activation_fn](y) if activation_fn else y


CASES = [  # (B, Cin, L, K, Cout, stride, padding, dilation, bias, activation)
    (2, 3, 17, 3, 5, 1, (0, 0), 1, False, None),
    (1, 7, 33, 5, 4, 2, (2, 1), 1, True, None),
    (3, 5, 29, 4, 3, 3, (0, 3), 2, True, "SiLU"),
    (2, 130, 20, 1, 129, 1, (0, 0), 1, False, "GELU"),  # channels past one 128-partition tile
    (1, 4, 9, 9, 2, 1, (4, 4), 1, True, "GELU_Tanh_Approx"),  # "same" padding, K = L
    (2, 2, 40, 3, 6, 1, (1, 0), 7, False, "Swish"),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}Cin{c[1]}L{c[2]}K{c[3]}Cout{c[4]}")
def test_forward_matches_float64_oracle(case, dtype):
    b, cin, length, k, cout, stride, padding, dilation, with_bias, act = case
    seed = b * 1000 + cin * 10 + k
    x, w = random((b, cin, length), dtype, seed), random((k, cin, cout), dtype, seed + 1, scale=1 / math.sqrt(k * cin))
    bias = random((cout,), dtype, seed + 2) if with_bias else None
    kwargs = {"stride": stride, "padding": padding, "dilation": dilation, "activation_fn": act}
    y = conv1d(x, w, bias, **kwargs)
    expected = oracle(x, w, bias, **kwargs)
    assert y.shape == expected.shape and y.dtype == dtype
    assert_close(y, expected, dtype, reduction=k * cin, ops=8 if act else 4)


def test_bias_and_activation_round_between_steps_in_bfloat16():
    """With both, the kernel rounds ``acc + bias`` to the dtype before the activation; with the activation alone it
    applies it to the float32 sum."""
    x, w = random((1, 16, 64), jnp.bfloat16, 5), random((3, 16, 8), jnp.bfloat16, 6, scale=0.3)
    bias = random((8,), jnp.bfloat16, 7)
    acc = oracle(x, w).astype(np.float32)
    rounded = jnp.asarray(acc + f64(bias).astype(np.float32)[None, :, None]).astype(jnp.bfloat16).astype(jnp.float32)
    silu = lambda v: v * jax.nn.sigmoid(v)  # noqa: E731
    np.testing.assert_array_equal(conv1d(x, w, bias, activation_fn="SiLU"), silu(rounded).astype(jnp.bfloat16))
    np.testing.assert_array_equal(conv1d(x, w, activation_fn="SiLU"), silu(jnp.asarray(acc)).astype(jnp.bfloat16))


def test_swish_is_the_sigmoid_gelu_approximation_not_silu():
    x, w = random((1, 2, 12), seed=8), random((1, 2, 3), seed=9)
    swish = conv1d(x, w, activation_fn=jax_nkilib.nki.ActFnType.Swish)
    assert_close(swish, oracle(x, w, activation_fn="Swish"), jnp.float32, reduction=2, ops=8)
    assert float(jnp.max(jnp.abs(swish - conv1d(x, w, activation_fn="SiLU")))) > 1e-3


@pytest.mark.slow  # order 2; CI: the conformance check_grads of the conv1d spec
def test_gradients_with_stride_dilation_and_padding_float64():
    x, w, b = random((2, 3, 13), jnp.float64, 1), random((3, 3, 2), jnp.float64, 2), random((2,), jnp.float64, 3)
    fn = lambda x, w, b: conv1d(x, w, b, stride=2, padding=(1, 2), dilation=2, activation_fn="GELU")  # noqa: E731
    check_grads(fn, (x, w, b), order=2, modes=["rev"])


def test_vmap_of_filters_matches_a_loop():
    x, w = random((2, 3, 11), seed=1), random((4, 2, 3, 5), seed=2)
    out = jax.vmap(lambda w: conv1d(x, w, padding=(1, 1)))(w)
    np.testing.assert_allclose(out, np.stack([conv1d(x, wi, padding=(1, 1)) for wi in w]), rtol=1e-6, atol=1e-6)


def test_neuron_lowering_is_one_call_with_the_lnc_grid_and_limits_fall_back():
    x = jax.ShapeDtypeStruct((4, 256, 1000), jnp.bfloat16)
    w, b = jax.ShapeDtypeStruct((5, 256, 384), jnp.bfloat16), jax.ShapeDtypeStruct((384,), jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(lambda x, w, b: conv1d(x, w, b, padding=(2, 2), lnc_shard=True), x, w, b)
        (cfg,) = kernel_configs(text)
        assert compute_operations(text) == []
        assert cfg["entry_point"] == "nkilib.experimental.conv.conv1d:conv1d" and cfg["grid"] == 2
        assert cfg["params"]["padding"] == [2, 2] and cfg["params"]["lnc_shard"] is True
        with pytest.warns(NeuronFallbackWarning, match="K=129 exceeds"):
            big = jax.ShapeDtypeStruct((129, 256, 8), jnp.bfloat16)
            assert kernel_configs(neuron_text(lambda x, w: conv1d(x, w), x, big)) == []


def test_nki_compiler_hands_the_library_kernel_its_arguments(monkeypatch):
    """Against the stand-in SDK with the recorded signature: the library enum member and the padding pair."""
    entry = "nkilib.experimental.conv.conv1d:conv1d"
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {entry: nki_standin.library_function(entry)})
    standin.rule("conv1d", lambda x_in, filters, **_: np.empty((2, filters.shape[2], 6), x_in.dtype))
    x, w = random((2, 4, 8), jnp.bfloat16), random((3, 4, 5), jnp.bfloat16)
    text = neuron_text(lambda x, w: conv1d(x, w, activation_fn="SiLU"), x, w)
    assert [c["func_name"] for c in kernel_configs(text)] == ["conv1d"]
    (compilation,) = standin.compilations
    inputs = compilation["inputs"]
    assert inputs["x_in"].shape == (2, 4, 8) and inputs["filters"].shape == (3, 4, 5)
    assert tuple(inputs["padding"]) == (0, 0) and getattr(inputs["activation_fn"], "name", None) == "SiLU"


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x, w: conv1d(x, w[:, :3]), ValueError, "`filters` must have layout [K, Cin, Cout]"),
        (lambda x, w: conv1d(x, w.astype(jnp.bfloat16)), TypeError, "must share one dtype"),
        (lambda x, w: conv1d(x, w, padding=1), TypeError, "parameter `padding` must be a pair"),
        (lambda x, w: conv1d(x, w, padding=(-1, 0)), ValueError, "parameter `padding` must be non-negative"),
        (lambda x, w: conv1d(x, w, stride=0), ValueError, "parameter `stride` must be >= 1"),
        (lambda x, w: conv1d(x, w, activation_fn="ReLU"), ValueError, "parameter `activation_fn` must be None or"),
        (lambda x, w: conv1d(x, w, dilation=5), ValueError, "the output is empty"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 4, 8)), random((3, 4, 5)))
    assert fragment in str(info.value)
