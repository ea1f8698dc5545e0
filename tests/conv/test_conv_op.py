"""jax_nkilib.conv against lax.conv_general_dilated (same arguments) and a float64 NumPy oracle: the routes to the
conv1d and depthwise kernels (layouts, padding strings, strides, dilation), the lax route with its Neuron fallback
warning, gradients, vmap, shard_map and errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from tests.conv.test_conv3d import oracle as oracle_3d
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64
from tests.support.sharding import make_mesh


def oracle_1d(x_ncl, w_oik, stride, pads, dilation, groups=1):
    """Grouped 1-D cross-correlation in float64: ``x [N, C, L]``, ``w [O, C/groups, K]`` -> ``[N, O, Lout]``."""
    x, w = f64(x_ncl), f64(w_oik)
    xpad = np.pad(x, ((0, 0), (0, 0), pads))
    out_ch, per_group, taps = w.shape
    out_len = (xpad.shape[2] - dilation * (taps - 1) - 1) // stride + 1
    y = np.zeros((x.shape[0], out_ch, out_len))
    outs_per_group = out_ch // groups
    for o in range(out_ch):
        g = o // outs_per_group
        for k in range(taps):
            window = xpad[:, g * per_group : (g + 1) * per_group, k * dilation :: stride][:, :, :out_len]
            y[:, o, :] += np.einsum("ncl,c->nl", window, w[o, :, k])
    return y


def kernel_names(fn, *args, lnc=2):
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        return [cfg["func_name"] for cfg in kernel_configs(neuron_text(fn, *args))]


# bfloat16 and float64 of every route run with -m slow (CI: float32 here; bfloat16 in the kernels' own tests)
SLOW_DTYPES = [pytest.param(jnp.bfloat16, marks=pytest.mark.slow), pytest.param(jnp.float64, marks=pytest.mark.slow)]

ROUTED = [  # (lhs shape, rhs shape, kwargs, kernel); odd sizes, each layout and padding form
    ((2, 5, 17), (4, 5, 3), dict(window_strides=(1,), padding="VALID"), "conv1d"),
    (
        (3, 19, 7),
        (3, 7, 6),
        dict(window_strides=(2,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")),
        "conv1d",
    ),
    (
        (2, 13, 3),
        (5, 3, 4),
        dict(window_strides=(3,), padding=[(2, 0)], rhs_dilation=(2,), dimension_numbers=("NWC", "OIW", "NCW")),
        "conv1d",
    ),  # fmt: skip
    ((1, 6, 23), (6, 1, 5), dict(window_strides=(2,), padding=[(1, 3)], feature_group_count=6), "depthwise"),
    (
        (2, 21, 4),
        (4, 1, 4),
        dict(window_strides=(1,), padding="SAME", feature_group_count=4, dimension_numbers=("NWC", "WIO", "NWC")),
        "depthwise",
    ),  # fmt: skip
]


def _to_ncl_oik(lhs, rhs, kwargs):
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, kwargs.get("dimension_numbers"))
    return lhs.transpose(dn.lhs_spec), rhs.transpose(dn.rhs_spec), dn


@pytest.mark.parametrize("dtype", [jnp.float32, *SLOW_DTYPES])
@pytest.mark.parametrize("case", ROUTED, ids=lambda c: f"{c[3]}-{c[0]}-{c[1]}")
def test_routed_cases_match_lax_and_the_oracle(case, dtype):
    lhs_shape, rhs_shape, kwargs, kernel = case
    lhs, rhs = random(lhs_shape, dtype, seed=sum(lhs_shape)), random(rhs_shape, dtype, seed=sum(rhs_shape), scale=0.5)
    out = jax_nkilib.conv(lhs, rhs, **kwargs)
    plain = lax.conv_general_dilated(lhs, rhs, **kwargs, precision=lax.Precision.HIGHEST)
    assert out.shape == plain.shape and out.dtype == plain.dtype == dtype
    x, w, dn = _to_ncl_oik(lhs, rhs, kwargs)
    pads = lax.padtype_to_pads(x.shape[2:], [(w.shape[2] - 1) * kwargs.get("rhs_dilation", (1,))[0] + 1],
                               kwargs["window_strides"], kwargs["padding"]) if isinstance(kwargs["padding"], str) \
        else kwargs["padding"]  # fmt: skip
    expected = oracle_1d(x, w, kwargs["window_strides"][0], tuple(pads[0]), kwargs.get("rhs_dilation", (1,))[0],
                         kwargs.get("feature_group_count", 1)).transpose(np.argsort(dn.out_spec))  # fmt: skip
    reduction = w.shape[1] * w.shape[2]
    assert_close(out, expected, dtype, reduction=reduction)
    assert_close(plain, expected, dtype, reduction=reduction, ops=8)
    if dtype != jnp.float64:  # Neuron kernels take no float64 (the kernel call falls back to its reference)
        lnc = 2 if kernel == "depthwise" else 1
        name = "depthwise_conv1d_implicit_gemm" if kernel == "depthwise" else "conv1d"
        assert kernel_names(lambda a, b: jax_nkilib.conv(a, b, **kwargs), lhs, rhs, lnc=lnc) == [name]


@pytest.mark.slow  # CI: the conformance check_grads of the jax_nkilib.conv specs (each route)
@pytest.mark.parametrize("case", ROUTED[1:4], ids=lambda c: c[3])
def test_gradients_float64_match_lax(case):
    lhs_shape, rhs_shape, kwargs, _ = case
    lhs, rhs = random(lhs_shape, jnp.float64, seed=1), random(rhs_shape, jnp.float64, seed=2)
    fn = lambda a, b: jax_nkilib.conv(a, b, **kwargs)  # noqa: E731
    check_grads(fn, (lhs, rhs), order=1, modes=["rev"])
    dy = random(fn(lhs, rhs).shape, jnp.float64, seed=3)
    ours = jax.vjp(fn, lhs, rhs)[1](dy)
    theirs = jax.vjp(lambda a, b: lax.conv_general_dilated(a, b, **kwargs), lhs, rhs)[1](dy)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


FALLBACKS = [  # (lhs, rhs, kwargs, what the warning names)
    ((2, 3, 5, 6), (4, 3, 2, 2), dict(window_strides=(1, 1), padding="SAME"), "2-D convolution"),
    (
        (1, 2, 3, 4, 5),
        (4, 1, 2, 2, 2),
        dict(window_strides=(1, 1, 1), padding="VALID", feature_group_count=2),
        "feature_group_count=2 in a 3-D convolution",
    ),  # fmt: skip
    (
        (1, 2, 3, 4, 5),
        (3, 2, 2, 2, 2),
        dict(window_strides=(1, 1, 1), padding=[(1, 1)] * 3, lhs_dilation=(2, 1, 2)),
        "lhs_dilation=(2, 1, 2)",
    ),  # fmt: skip
    ((2, 3, 9), (4, 3, 3), dict(window_strides=(1,), padding=[(2, 2)], lhs_dilation=(2,)), "lhs_dilation=(2,)"),
    ((2, 3, 9), (4, 3, 3), dict(window_strides=(1,), padding=[(-1, 0)]), "negative padding"),
    ((2, 4, 9), (4, 2, 3), dict(window_strides=(1,), padding="VALID", feature_group_count=2), "feature_group_count=2"),
    (
        (2, 4, 9),
        (4, 1, 3),
        dict(window_strides=(1,), padding="VALID", feature_group_count=4, rhs_dilation=(2,)),
        "rhs_dilation=(2,) in a depthwise",
    ),  # fmt: skip
    ((4, 3, 9), (4, 3, 3), dict(window_strides=(1,), padding="VALID", batch_group_count=2), "batch_group_count=2"),
]


@pytest.mark.parametrize("case", FALLBACKS, ids=lambda c: c[3])
def test_other_cases_run_lax_and_warn_on_neuron(case):
    lhs_shape, rhs_shape, kwargs, reason = case
    lhs, rhs = random(lhs_shape, seed=4), random(rhs_shape, seed=5)
    out = jax_nkilib.conv(lhs, rhs, **kwargs)
    np.testing.assert_array_equal(out, lax.conv_general_dilated(lhs, rhs, **kwargs))
    with pytest.warns(NeuronFallbackWarning, match=reason.replace("(", r"\(").replace(")", r"\)")):
        assert kernel_names(lambda a, b: jax_nkilib.conv(a, b, **kwargs), lhs, rhs) == []


def test_mixed_dtypes_and_preferred_element_type_take_the_lax_route():
    lhs, rhs = random((2, 3, 9), jnp.bfloat16), random((4, 3, 3), jnp.bfloat16)
    kwargs = dict(window_strides=(1,), padding="VALID", preferred_element_type=jnp.float32)
    out = jax_nkilib.conv(lhs, rhs, **kwargs)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, lax.conv_general_dilated(lhs, rhs, **kwargs))
    with pytest.warns(NeuronFallbackWarning, match="preferred_element_type=float32"):
        kernel_names(lambda a, b: jax_nkilib.conv(a, b, **kwargs), lhs, rhs)


def test_vmap_and_shard_map_match_loops():
    lhs, rhs = random((3, 4, 5, 11), seed=6), random((2, 5, 3), seed=7)
    fn = lambda a: jax_nkilib.conv(a, rhs, (1,), "SAME")  # noqa: E731
    np.testing.assert_allclose(jax.vmap(fn)(lhs), np.stack([fn(a) for a in lhs]), rtol=1e-6, atol=1e-6)
    mesh = make_mesh((8,), ("data",))
    x = random((8, 6, 13), seed=8)
    w = random((6, 1, 4), seed=9)
    dw = lambda a, b: jax_nkilib.conv(a, b, (2,), "VALID", feature_group_count=6)  # noqa: E731
    sharded = jax.jit(jax.shard_map(dw, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
    sharded = sharded(jax.device_put(x, NamedSharding(mesh, P("data"))), jax.device_put(w, NamedSharding(mesh, P())))
    np.testing.assert_allclose(sharded, dw(x, w), rtol=1e-6, atol=1e-6)


def test_bad_inputs():
    x, w = random((2, 3, 9)), random((4, 3, 3))
    with pytest.raises(ValueError, match="`lhs` and `rhs` must have the same rank"):
        jax_nkilib.conv(x, w[0], (1,), "VALID")
    with pytest.raises(TypeError, match="`window_strides` must be a sequence of 1 ints"):
        jax_nkilib.conv(x, w, (1, 1), "VALID")
    with pytest.raises(TypeError, match="`padding` must be a string or one"):
        jax_nkilib.conv(x, w, (1,), [(1, 1), (1, 1)])
    with pytest.raises(TypeError, match="`lhs` must be an array"):
        jax_nkilib.conv([[1.0]], w, (1,), "VALID")


def test_one_output_position_per_tap():
    """Edge: the filter as long as the input gives one output position (a dot product per channel pair)."""
    x, w = random((1, 3, 7), seed=10), random((2, 3, 7), seed=11)
    out = jax_nkilib.conv(x, w, (1,), "VALID")
    assert out.shape == (1, 2, 1)
    np.testing.assert_allclose(out[0, :, 0], np.einsum("cl,ocl->o", f64(x[0]), f64(w)), rtol=1e-5)
    assert math.isfinite(float(out.sum()))


ROUTED_3D = [  # (lhs, rhs, kwargs): channels first and channels last, strides, dilation, padding strings
    ((2, 3, 4, 5, 6), (4, 3, 2, 3, 2), dict(window_strides=(1, 2, 1), padding="SAME", rhs_dilation=(1, 1, 2))),
    (
        (1, 5, 4, 3, 2),
        (2, 3, 1, 2, 3),
        dict(window_strides=(2, 1, 1), padding=[(1, 0), (0, 2), (1, 1)], dimension_numbers=("NDHWC", "DHWIO", "NCDHW")),
    ),  # fmt: skip
]


@pytest.mark.parametrize("dtype", [jnp.float32, *SLOW_DTYPES])
@pytest.mark.parametrize("case", ROUTED_3D, ids=lambda c: f"{c[0]}-{c[1]}")
def test_3d_convolutions_match_lax_and_the_oracle(case, dtype):
    lhs_shape, rhs_shape, kwargs = case
    lhs, rhs = random(lhs_shape, dtype, seed=sum(lhs_shape)), random(rhs_shape, dtype, seed=sum(rhs_shape), scale=0.3)
    out = jax_nkilib.conv(lhs, rhs, **kwargs)
    plain = lax.conv_general_dilated(lhs, rhs, **kwargs, precision=lax.Precision.HIGHEST)
    assert out.shape == plain.shape and out.dtype == dtype
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, kwargs.get("dimension_numbers"))
    x, w = lhs.transpose(dn.lhs_spec), rhs.transpose(*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])
    dilation = kwargs.get("rhs_dilation", (1, 1, 1))
    pads = kwargs["padding"]
    if isinstance(pads, str):
        dilated = [(k - 1) * d + 1 for k, d in zip(w.shape[:3], dilation)]
        pads = lax.padtype_to_pads(x.shape[2:], dilated, kwargs["window_strides"], pads)
    flat = tuple(p for pair in pads for p in pair)
    expected = oracle_3d(x, w, None, kwargs["window_strides"], flat, dilation).transpose(np.argsort(dn.out_spec))
    assert_close(out, expected, dtype, reduction=math.prod(w.shape[:4]))
    if dtype != jnp.float64:
        assert kernel_names(lambda a, b: jax_nkilib.conv(a, b, **kwargs), lhs, rhs) == ["conv3d"]
    if dtype == jnp.float64:
        check_grads(lambda a, b: jax_nkilib.conv(a, b, **kwargs), (lhs, rhs), order=1, modes=["rev"])


def test_3d_shapes_the_library_rule_picks_run_the_temporal_unroll_kernel():
    """Cout=3, Do=2, Cin=65, Wo=513: should_use_temporal_unroll holds, so conv3d_temporal_unroll runs."""
    lhs = jax.ShapeDtypeStruct((1, 65, 3, 4, 515), jnp.bfloat16)
    rhs = jax.ShapeDtypeStruct((3, 65, 2, 3, 3), jnp.bfloat16)
    call = lambda a, b: jax_nkilib.conv(a, b, (1, 1, 1), "VALID")  # noqa: E731
    assert kernel_names(call, lhs, rhs) == ["conv3d_temporal_unroll"]
    narrow = jax.ShapeDtypeStruct((1, 65, 3, 4, 514), jnp.bfloat16)  # Wo = 512: one W tile
    assert kernel_names(call, narrow, rhs) == ["conv3d"]


def test_the_lax_route_raises_on_neuron_under_on_unsupported_error():
    lhs, rhs = random((2, 3, 5, 6)), random((4, 3, 2, 2))
    with jax_nkilib.config(on_unsupported="error"), pytest.raises(NeuronUnsupportedError, match="2-D convolution"):
        kernel_names(lambda a, b: jax_nkilib.conv(a, b, (1, 1), "SAME"), lhs, rhs)
