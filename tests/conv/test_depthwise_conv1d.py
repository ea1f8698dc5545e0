"""jax_nkilib.nki.depthwise_conv1d_implicit_gemm against a float64 NumPy oracle (one filter per channel, zero W
padding, stride_w), its gradients, vmap, its Neuron lowering (LNC=2 only, even C) and errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import depthwise_conv1d_implicit_gemm as depthwise
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def oracle(img, filt, pad=(0, 0), stride_w=1):
    """``out[n, c, 0, q] = sum_s filt[c, 0, 0, s] xpad[n, c, 0, q stride_w + s]`` in float64."""
    x, w = f64(img)[:, :, 0, :], f64(filt)[:, 0, 0, :]
    xpad = np.pad(x, ((0, 0), (0, 0), pad))
    taps = w.shape[1]
    q = (xpad.shape[2] - taps) // stride_w + 1
    out = np.zeros(x.shape[:2] + (q,))
    for s in range(taps):
        out += w[None, :, s, None] * xpad[:, :, s : s + (q - 1) * stride_w + 1 : stride_w]
    return out[:, :, None, :]


CASES = [  # (N, C, W, S, (pad_l, pad_r), stride_w)
    (1, 4, 31, 3, (0, 0), 1),
    (2, 5, 40, 7, (3, 3), 1),
    (3, 2, 33, 5, (0, 4), 2),
    (1, 3, 129, 130, (1, 0), 1),  # S past one 128-partition tile
    (2, 6, 17, 4, (2, 1), 3),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}C{c[1]}W{c[2]}S{c[3]}")
def test_forward_matches_float64_oracle(case, dtype):
    n, c, w, s, pad, stride_w = case
    img = random((n, c, 1, w), dtype, seed=w + s)
    filt = random((c, 1, 1, s), dtype, seed=w + s + 1, scale=1 / math.sqrt(s))
    out = depthwise(img, filt, padding=((0, 0), pad), stride=(1, stride_w), feature_group_count=c)
    expected = oracle(img, filt, pad, stride_w)
    assert out.shape == expected.shape and out.dtype == dtype
    assert_close(out, expected, dtype, reduction=s)


@pytest.mark.slow  # order 2; CI: the conformance check_grads of the spec
def test_gradients_float64():
    img, filt = random((2, 3, 1, 14), jnp.float64, 1), random((3, 1, 1, 4), jnp.float64, 2)
    fn = lambda x, f: depthwise(x, f, padding=((0, 0), (1, 2)), stride=(1, 2), feature_group_count=3)  # noqa: E731
    check_grads(fn, (img, filt), order=2, modes=["rev"])


def test_vmap_of_filters_matches_a_loop():
    img, filt = random((2, 4, 1, 12), seed=3), random((3, 4, 1, 1, 5), seed=4)
    out = jax.vmap(lambda f: depthwise(img, f, feature_group_count=4))(filt)
    loop = np.stack([depthwise(img, f, feature_group_count=4) for f in filt])
    np.testing.assert_allclose(out, loop, rtol=1e-6, atol=1e-6)


def test_neuron_lowering_needs_lnc2_and_even_channels():
    img = jax.ShapeDtypeStruct((2, 256, 1, 512), jnp.bfloat16)
    filt = jax.ShapeDtypeStruct((256, 1, 1, 64), jnp.bfloat16)
    call = lambda x, f: depthwise(x, f, padding=((0, 0), (5, 5)), feature_group_count=x.shape[1])  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        with jax_nkilib.config(lnc=2):
            text = neuron_text(call, img, filt)
            (cfg,) = kernel_configs(text)
            assert compute_operations(text) == [] and cfg["grid"] == 2
            assert cfg["params"]["padding"] == [[0, 0], [5, 5]] and cfg["params"]["feature_group_count"] == 256
            odd = jax.ShapeDtypeStruct((2, 3, 1, 512), jnp.bfloat16), jax.ShapeDtypeStruct((3, 1, 1, 64), jnp.bfloat16)
            with pytest.warns(NeuronFallbackWarning, match="C=3 must be even"):
                assert kernel_configs(neuron_text(call, *odd)) == []
        with jax_nkilib.config(lnc=1), pytest.warns(NeuronFallbackWarning, match="requires LNC=2"):
            assert kernel_configs(neuron_text(call, img, filt)) == []


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        ({}, ValueError, "parameter `feature_group_count` must be C=4"),
        ({"stride": (2, 1)}, ValueError, "parameter `stride` must be (1, stride_w)"),
        ({"padding": ((1, 0), (0, 0))}, ValueError, "parameter `padding` must be ((0, 0), (pad_l, pad_r))"),
        ({"padding": ((0, 0), (-1, 0))}, ValueError, "parameter `padding` must be non-negative"),
        ({"rhs_dilation": (1, 2)}, ValueError, "parameter `rhs_dilation` must be (1, 1)"),
        ({"lhs_dilation": (1, 2)}, ValueError, "parameter `lhs_dilation` must be (1, 1)"),
        ({"batch_group_count": 2}, ValueError, "parameter `batch_group_count` must be 1"),
        ({"in_perm": (0, 1, 2, 3)}, ValueError, "parameter `in_perm` must be None"),
        ({"stride": 1}, TypeError, "parameter `stride` must be a tuple of 2 Python ints"),
    ],
)
def test_bad_params(kwargs, error, fragment):
    if kwargs:  # every other case is depthwise; the empty case keeps the kernel's default 1
        kwargs = {"feature_group_count": 4, **kwargs}
    with pytest.raises(error) as info:
        depthwise(random((2, 4, 1, 9)), random((4, 1, 1, 3)), **kwargs)
    assert fragment in str(info.value)


def test_bad_operands():
    img, filt = random((2, 4, 1, 9)), random((4, 1, 1, 3))
    with pytest.raises(ValueError, match=r"`filter_ref` must have layout \[C, 1, 1, S\]"):
        depthwise(img, filt.reshape(4, 1, 3, 1), feature_group_count=4)
    with pytest.raises(TypeError, match="must share one dtype"):
        depthwise(img, filt.astype(jnp.bfloat16), feature_group_count=4)
    with pytest.raises(ValueError, match="the output is empty"):
        depthwise(img[..., :2], filt, feature_group_count=4)
