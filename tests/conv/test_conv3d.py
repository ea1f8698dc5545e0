"""jax_nkilib.nki.conv3d and conv3d_temporal_unroll (docs-only) against a float64 NumPy oracle written from the API
reference (filters [Kd, Kh, Kw, Cin, Cout], six pads, strides, dilations, bias then activation), gradients, vmap,
their Neuron lowering (one call; the temporal-unroll asserts; an installed library without them falls back),
should_use_temporal_unroll, and errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import conv3d, conv3d_temporal_unroll, should_use_temporal_unroll
from tests.conv.test_conv1d import ACTIVATIONS
from tests.support import nki_standin
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def oracle(x, filters, bias=None, stride=(1, 1, 1), padding=(0,) * 6, dilation=(1, 1, 1), activation_fn=None):
    """``y[b, o, d, h, w] = act(bias[o] + sum filters[kd, kh, kw, c, o] xpad[b, c, d sd + kd dd, ...])``, float64."""
    x, filters = f64(x), f64(filters)
    xpad = np.pad(x, ((0, 0), (0, 0), padding[0:2], padding[2:4], padding[4:6]))
    taps = filters.shape[:3]
    outs = [(xpad.shape[2 + i] - dilation[i] * (taps[i] - 1) - 1) // stride[i] + 1 for i in range(3)]
    y = np.zeros((x.shape[0], filters.shape[4], *outs))
    for kd in range(taps[0]):
        for kh in range(taps[1]):
            for kw in range(taps[2]):
                starts = [k * dil for k, dil in zip((kd, kh, kw), dilation)]
                window = xpad[
                    :,
                    :,
                    starts[0] : starts[0] + (outs[0] - 1) * stride[0] + 1 : stride[0],
                    starts[1] : starts[1] + (outs[1] - 1) * stride[1] + 1 : stride[1],
                    starts[2] : starts[2] + (outs[2] - 1) * stride[2] + 1 : stride[2],
                ]
                y += np.einsum("bcdhw,co->bodhw", window, filters[kd, kh, kw])
    if bias is not None:
        y += f64(bias)[None, :, None, None, None]
    return ACTIVATIONS[activation_fn](y) if activation_fn else y


CASES = [  # (x shape, filter taps, Cout, stride, padding, dilation, bias, activation)
    ((2, 3, 4, 5, 6), (2, 3, 2), 4, (1, 1, 1), (0,) * 6, (1, 1, 1), False, None),
    ((1, 5, 5, 7, 9), (3, 1, 2), 3, (2, 1, 3), (1, 1, 0, 2, 1, 0), (1, 2, 1), True, "SiLU"),
    ((2, 2, 3, 3, 11), (1, 3, 3), 5, (1, 2, 2), (0, 0, 1, 1, 1, 1), (1, 1, 2), True, "GELU_Tanh_Approx"),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "case, kernel",
    [(case, conv3d) for case in CASES]
    + [pytest.param(CASES[1], conv3d_temporal_unroll)]
    + [pytest.param(case, conv3d_temporal_unroll, marks=pytest.mark.slow) for case in (CASES[0], CASES[2])],
    ids=lambda v: (
        getattr(getattr(v, "spec", None), "name", None) or (f"x{v[0]}k{v[1]}" if isinstance(v, tuple) else None)
    ),
)
def test_forward_matches_float64_oracle(case, kernel, dtype):
    shape, taps, cout, stride, padding, dilation, with_bias, act = case
    seed = sum(shape) + sum(taps)
    cin = shape[1]
    x = random(shape, dtype, seed)
    w = random((*taps, cin, cout), dtype, seed + 1, scale=1 / math.sqrt(math.prod(taps) * cin))
    bias = random((cout,), dtype, seed + 2) if with_bias else None
    kwargs = {"stride": stride, "padding": padding, "dilation": dilation, "activation_fn": act}
    y = kernel(x, w, bias, **kwargs)
    expected = oracle(x, w, bias, **kwargs)
    assert y.shape == expected.shape and y.dtype == dtype
    assert_close(y, expected, dtype, reduction=math.prod(taps) * cin, ops=8 if act else 4)


@pytest.mark.slow  # CI: the conformance check_grads of the conv3d specs
def test_gradients_float64():
    x, w, b = random((1, 2, 4, 3, 5), jnp.float64, 1), random((2, 2, 2, 2, 3), jnp.float64, 2), random((3,), seed=3)
    fn = lambda x, w, b: conv3d(x, w, b, stride=(1, 1, 2), padding=(1, 0, 0, 1, 1, 1), activation_fn="GELU")  # noqa: E731
    check_grads(fn, (x, w, b.astype(jnp.float64)), order=1, modes=["rev"])


def test_vmap_of_filters_matches_a_loop():
    x, w = random((2, 3, 3, 4, 5), seed=4), random((3, 1, 2, 2, 3, 2), seed=5)
    out = jax.vmap(lambda w: conv3d(x, w))(w)
    np.testing.assert_allclose(out, np.stack([conv3d(x, wi) for wi in w]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "shape, expected",
    [
        ((3, 4, 100, 3, 600), True),  # C_out, D_out, C_in, K_d, W_out
        ((3, 1, 100, 3, 600), False),  # one output depth
        ((3, 5, 100, 3, 600), False),  # 5 * 32 > 128
        ((33, 2, 100, 3, 600), False),  # C_out > 32
        ((3, 2, 64, 3, 600), False),  # C_in must exceed 64
        ((3, 2, 65, 3, 512), False),  # one W tile
        ((32, 2, 65, 1, 513), True),
    ],
)
def test_should_use_temporal_unroll_is_the_library_rule(shape, expected):
    assert should_use_temporal_unroll(*shape) is expected


def test_neuron_lowering_one_call_and_the_temporal_unroll_asserts_fall_back():
    x = jax.ShapeDtypeStruct((1, 100, 4, 8, 600), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((1, 3, 3, 100, 3), jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        for kernel in (conv3d, conv3d_temporal_unroll):
            text = neuron_text(lambda x, w: kernel(x, w, padding=(0, 0, 1, 1, 1, 1), lnc_shard=True), x, w)
            (cfg,) = kernel_configs(text)
            assert compute_operations(text) == [] and cfg["grid"] == 2
            assert cfg["entry_point"] == f"nkilib.experimental.conv.{kernel.spec.name}:{kernel.spec.name}"
            assert cfg["params"]["padding"] == [0, 0, 1, 1, 1, 1]
        wide = jax.ShapeDtypeStruct((1, 3, 3, 100, 33), jnp.bfloat16)
        with pytest.warns(NeuronFallbackWarning, match="Cout=33 exceeds 32"):
            assert kernel_configs(neuron_text(conv3d_temporal_unroll, x, wide)) == []
        deep = jax.ShapeDtypeStruct((1, 100, 5, 8, 600), jnp.bfloat16)
        with pytest.warns(NeuronFallbackWarning, match="Do=5 exceeds 4"):
            assert kernel_configs(neuron_text(conv3d_temporal_unroll, deep, w)) == []


def test_an_installed_library_without_conv3d_falls_back(monkeypatch):
    """Docs-only: the 2.29 library has no experimental.conv.conv3d, so lowering warns naming it and the versions."""
    entry = "nkilib.experimental.conv.conv1d:conv1d"
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {entry: nki_standin.library_function(entry)})
    x, w = random((1, 2, 3, 3, 3), jnp.bfloat16), random((1, 1, 1, 2, 2), jnp.bfloat16)
    with pytest.warns(NeuronFallbackWarning, match=r"installed NKI Library has no nkilib.experimental.conv.conv3d"):
        assert kernel_configs(neuron_text(conv3d, x, w)) == []


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({"stride": (1, 0, 1)}, ValueError, "parameter `stride` must have every entry >= 1"),
        ({"padding": (0, 0, 0, 0)}, TypeError, "parameter `padding` must be a tuple of 6 Python ints"),
        ({"padding": (0, -1, 0, 0, 0, 0)}, ValueError, "parameter `padding` must have every entry >= 0"),
        ({"dilation": (5, 1, 1)}, ValueError, "the output is empty"),
        ({"activation_fn": "ReLU"}, ValueError, "parameter `activation_fn` must be None or"),
    ],
)
def test_bad_params(kwargs, error, fragment):
    with pytest.raises(error) as info:
        conv3d(random((1, 2, 4, 4, 4)), random((2, 2, 2, 2, 3)), **kwargs)
    assert fragment in str(info.value)


def test_bad_operands():
    x, w = random((1, 2, 4, 4, 4)), random((2, 2, 2, 2, 3))
    with pytest.raises(ValueError, match=r"`filters` must have layout \[Kd, Kh, Kw, Cin, Cout\]"):
        conv3d(x, w[..., :1, :])
    with pytest.raises(TypeError, match="must share one dtype"):
        conv3d(x, w.astype(jnp.bfloat16))


def test_nki_compiler_hands_the_library_kernel_its_arguments(monkeypatch):
    """Against the stand-in SDK with the signature recorded from the 2.32 reference: six pads, the strides and the
    library's ActFnType member."""
    entry = "nkilib.experimental.conv.conv3d:conv3d"
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {entry: nki_standin.library_function(entry)})
    standin.rule("conv3d", lambda x_in, filters, **_: np.empty((1, 3, 2, 2, 2), x_in.dtype))
    x, w = random((1, 2, 3, 3, 3), jnp.bfloat16), random((2, 2, 2, 2, 3), jnp.bfloat16)
    text = neuron_text(lambda x, w: conv3d(x, w, padding=(0, 0, 0, 0, 0, 0), activation_fn="Swish"), x, w)
    assert [c["func_name"] for c in kernel_configs(text)] == ["conv3d"]
    (compilation,) = standin.compilations
    inputs = compilation["inputs"]
    assert inputs["x_in"].shape == (1, 2, 3, 3, 3) and inputs["filters"].shape == (2, 2, 2, 2, 3)
    assert tuple(inputs["padding"]) == (0,) * 6 and tuple(inputs["stride"]) == (1, 1, 1)
    assert getattr(inputs["activation_fn"], "name", None) == "Swish"
