"""``ms_deformable_attention`` / ``ms_deformable_attention_bwd`` (rows 54, 55) and ``jax_nkilib.deformable_attention``
against a float64 NumPy oracle written from Deformable DETR's ``ms_deform_attn_core_pytorch`` (``grid_sample``,
bilinear, zero padding) and the kernel docs (``align_corners``, ``"border"``, the two layouts of each operand)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.tools.arg_specs.deformable import kink_free_locations
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import ms_deformable_attention, ms_deformable_attention_bwd
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64
from tests.support.sharding import mesh_1d, run_sharded

SHAPES = ((4, 5), (3, 2), (1, 3))  # odd sizes, a 1-pixel-high level
STARTS = (0, 20, 26)
PIXELS = 29


# ------------------------------------------------------------------------------------------------------- oracle
def _corners(x, y, height, width, align_corners, padding_mode):
    """The four (row, col, weight, d weight/dx, d weight/dy) of one point's bilinear sample (pixel units)."""
    px = x * (width - 1) if align_corners else x * width - 0.5
    py = y * (height - 1) if align_corners else y * height - 0.5
    x0, y0 = int(np.floor(px)), int(np.floor(py))
    fx, fy = px - x0, py - y0
    out = []
    for cx, wx, dwx in ((x0, 1 - fx, -1.0), (x0 + 1, fx, 1.0)):
        for cy, wy, dwy in ((y0, 1 - fy, -1.0), (y0 + 1, fy, 1.0)):
            if padding_mode == "zeros" and not (0 <= cx < width and 0 <= cy < height):
                continue
            row, col = min(max(cy, 0), height - 1), min(max(cx, 0), width - 1)
            out.append((row, col, wx * wy, dwx * wy, wx * dwy))
    scale_x, scale_y = (width - 1, height - 1) if align_corners else (width, height)
    return out, scale_x, scale_y


def oracle(value, locations, weights, grad_output=None, *, align_corners=False, padding_mode="zeros"):
    """Forward ``[B, N_q, N_h * C]`` and, with ``grad_output``, the exact gradients (value, locations, weights), in
    float64, canonical layouts (BLNC, BQHLP2)."""
    value, locations, weights = f64(value), f64(locations), f64(weights)
    batch, queries, heads, levels, points = weights.shape
    channels = value.shape[-1]
    out = np.zeros((batch, queries, heads, channels))
    g = None if grad_output is None else f64(grad_output).reshape(batch, queries, heads, channels)
    d_value, d_loc, d_w = np.zeros_like(value), np.zeros_like(locations), np.zeros_like(weights)
    for b, q, h, lvl, p in np.ndindex(batch, queries, heads, levels, points):
        height, width = SHAPES[lvl]
        x, y = locations[b, q, h, lvl, p]
        corners, scale_x, scale_y = _corners(x, y, height, width, align_corners, padding_mode)
        a = weights[b, q, h, lvl, p]
        sample = np.zeros(channels)
        for row, col, w, dwx, dwy in corners:
            v = value[b, STARTS[lvl] + row * width + col, h]
            sample += w * v
            if g is not None:
                d_value[b, STARTS[lvl] + row * width + col, h] += a * w * g[b, q, h]
                d_loc[b, q, h, lvl, p, 0] += a * dwx * scale_x * g[b, q, h] @ v
                d_loc[b, q, h, lvl, p, 1] += a * dwy * scale_y * g[b, q, h] @ v
        out[b, q, h] += a * sample
        if g is not None:
            d_w[b, q, h, lvl, p] = g[b, q, h] @ sample
    out = out.reshape(batch, queries, heads * channels)
    return out if g is None else (out, d_value, d_loc, d_w)


def problem(seed=0, batch=2, queries=5, heads=3, channels=7, points=3, dtype=jnp.float32, spread=None):
    rng = np.random.default_rng(seed)
    value = jnp.asarray(rng.standard_normal((batch, PIXELS, heads, channels)), dtype)
    shape = (batch, queries, heads, len(SHAPES), points, 2)
    if spread is None:
        locations = kink_free_locations(rng, shape, SHAPES)
    else:  # anywhere, also well outside the maps
        locations = rng.uniform(-spread, 1 + spread, shape).astype(np.float32)
    weights = jnp.asarray(rng.uniform(0, 1, shape[:-1]), dtype)
    return value, jnp.asarray(locations), weights


STATIC = {"spatial_shapes": SHAPES, "level_start_index": STARTS}


# ------------------------------------------------------------------------------------------------------- forward
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "dtype, align_corners, padding_mode",
    [
        (jnp.float32, False, "zeros"),
        (jnp.bfloat16, True, "border"),
        pytest.param(jnp.bfloat16, False, "zeros", marks=_SLOW),
        pytest.param(jnp.float32, True, "zeros", marks=_SLOW),
        pytest.param(jnp.float32, False, "border", marks=_SLOW),
    ],
)
def test_forward_matches_the_oracle(dtype, align_corners, padding_mode):
    value, loc, w = problem(dtype=dtype, spread=0.3)
    flags = {"align_corners": align_corners, "padding_mode": padding_mode}
    out = ms_deformable_attention(value, loc, w, **STATIC, **flags)
    assert out.shape == (2, 5, 3 * 7) and out.dtype == dtype
    assert_close(out, oracle(value, loc, w, **flags), dtype, reduction=4 * 3 * 3, ops=8)


def test_the_other_layouts_are_transposes():
    value, loc, w = problem(seed=1, spread=0.2)
    out = ms_deformable_attention(
        jnp.swapaxes(value, 1, 2),
        jnp.moveaxis(loc, -1, 1),
        w,
        value_layout="BNLC",
        sampling_locations_layout="B2QHLP",
        **STATIC,
    )
    assert_close(out, oracle(value, loc, w), jnp.float32, reduction=36)


# ------------------------------------------------------------------------------------------------------- backward
@pytest.mark.parametrize("align_corners, padding_mode", [(False, "zeros"), pytest.param(True, "border", marks=_SLOW)])
def test_backward_kernel_matches_the_oracle_gradients(align_corners, padding_mode):
    value, loc, w = problem(seed=2)
    g = jnp.asarray(np.random.default_rng(3).standard_normal((2, 5, 21)), jnp.float32)
    flags = {"align_corners": align_corners, "padding_mode": padding_mode}
    grads = ms_deformable_attention_bwd(g, value, loc, w, **STATIC, **flags)
    _, *expected = oracle(value, loc, w, g, **flags)
    for actual, want, name in zip(grads, expected, ("value", "locations", "weights")):
        assert actual.shape == want.shape, name
        assert_close(actual, want, jnp.float32, reduction=36, ops=16)


@pytest.mark.slow
def test_backward_kernel_keeps_the_other_layouts():
    value, loc, w = problem(seed=4)
    g = jnp.ones((2, 5, 21), jnp.float32)
    dv, dl, dw = ms_deformable_attention_bwd(
        g,
        jnp.swapaxes(value, 1, 2),
        jnp.moveaxis(loc, -1, 1),
        w,
        value_layout="BNLC",
        sampling_locations_layout="B2QHLP",
        **STATIC,
    )
    _, ev, el, ew = oracle(value, loc, w, g)
    assert_close(dv, np.swapaxes(ev, 1, 2), jnp.float32, reduction=36, ops=16)
    assert_close(dl, np.moveaxis(el, -1, 1), jnp.float32, reduction=36, ops=16)
    assert_close(dw, ew, jnp.float32, reduction=36, ops=16)


def test_the_forward_vjp_is_the_backward_kernel():
    """jax.grad of the forward lowers to the two kernels (conformance checks vmap of grad, which folds the batch
    into the backward kernel)."""
    value, loc, w = problem(seed=5, dtype=jnp.bfloat16)

    def loss(value, loc, w):
        return jnp.sum(ms_deformable_attention(value, loc, w, **STATIC).astype(jnp.float32) ** 2)

    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax.grad(loss, argnums=(0, 1, 2)), value, loc, w)
    names = [cfg["func_name"] for cfg in kernel_configs(text)]
    assert names == ["ms_deformable_attention", "ms_deformable_attention_bwd"]


def _backward_problem():
    value, loc, w = problem(seed=6, batch=8, queries=2, heads=2, channels=3, points=2)
    return jnp.ones((8, 2, 6), jnp.float32), value, loc, w


def _backward(*args):
    return ms_deformable_attention_bwd(*args, **STATIC)


def test_backward_kernel_inside_shard_map_on_8_devices():
    args = _backward_problem()
    sharded = run_sharded(_backward, mesh_1d(), (P("data"),) * 4, (P("data"),) * 3, *args)
    for s, e in zip(sharded, _backward(*args)):
        np.testing.assert_allclose(s, e, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_jit_and_vmap_of_the_backward_kernel():
    g, value, loc, w = _backward_problem()
    eager = _backward(g, value, loc, w)
    mapped = jax.vmap(jax.jit(_backward), in_axes=(None, 0, 0, 0))(g[:2], value[None, :2], loc[None, :2], w[None, :2])
    for e, j, m in zip(eager, jax.jit(_backward)(g, value, loc, w), mapped):
        np.testing.assert_allclose(j, e, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(m[0], e[:2], rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------- neuron
def test_neuron_lowering_passes_the_static_shapes_and_falls_back_outside_the_limits():
    value, loc, w = problem(seed=7, dtype=jnp.bfloat16)
    call = jax.jit(lambda v, s, a: ms_deformable_attention(v, s, a, **STATIC, padding_mode="border"))
    with jax_nkilib.neuron.dry_run():
        _check_lowering(call, value, loc, w)


def _check_lowering(call, value, loc, w):
    (cfg,) = kernel_configs(neuron_text(call, value, loc, w))
    assert cfg["entry_point"] == (
        "nkilib.experimental.deformable_attention.ms_deformable_attention:ms_deformable_attention"
    )
    assert cfg["input_names"] == ["value", "sampling_locations", "attention_weights"]
    with pytest.warns(NeuronFallbackWarning, match="attention_weights must have value's dtype"):
        text = neuron_text(call, value, loc, w.astype(jnp.float32))
    assert "AwsNeuronCustomNativeKernel" not in text
    wide = ((300, 1),)
    big = jnp.zeros((1, 300, 1, 2), jnp.bfloat16), jnp.full((1, 1, 1, 1, 1, 2), 0.5), jnp.ones((1, 1, 1, 1, 1))
    wide_call = jax.jit(lambda v, s, a: ms_deformable_attention(v, s, a, spatial_shapes=wide, level_start_index=(0,)))
    with pytest.warns(NeuronFallbackWarning, match="at most 256 pixels per side"):
        neuron_text(wide_call, big[0], big[1], big[2].astype(jnp.bfloat16))


# ------------------------------------------------------------------------------------------------------- idiomatic
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_deformable_attention_matches_the_pytorch_semantics(dtype):
    value, loc, w = problem(seed=8, dtype=dtype, spread=0.2)
    out = jax_nkilib.deformable_attention(value, SHAPES, loc, w)
    assert out.dtype == dtype
    assert_close(out, oracle(value, loc, w), dtype, reduction=36, ops=8)


@pytest.mark.slow
def test_deformable_attention_gradients_match_the_oracle():
    value, loc, w = problem(seed=9)
    g = jnp.asarray(np.random.default_rng(10).standard_normal((2, 5, 21)), jnp.float32)
    _, pull_back = jax.vjp(lambda *args: jax_nkilib.deformable_attention(args[0], SHAPES, *args[1:]), value, loc, w)
    _, *expected = oracle(value, loc, w, g)
    for actual, want in zip(pull_back(g), expected):
        assert_close(actual, want, jnp.float32, reduction=36, ops=16)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"spatial_shapes": ((4, 5), (3, 2))}, ValueError, "N_l=3"),
        ({"spatial_shapes": ((4, 5), (3, 2), (1, 4))}, ValueError, r"sum\(H_l \* W_l\)=30"),
        ({"spatial_shapes": [[4, 5], [3, 2], [1, 2.0]]}, TypeError, "spatial_shapes"),
        ({"attention_weights": jnp.ones((2, 5, 3, 3, 2))}, ValueError, "attention_weights"),
        ({"value": jnp.ones((2, PIXELS, 3, 7), jnp.int32)}, TypeError, "value"),
    ],
)
def test_deformable_attention_refuses_bad_inputs(change, error, match):
    value, loc, w = problem(seed=11)
    args = {"value": value, "spatial_shapes": SHAPES, "sampling_locations": loc, "attention_weights": w, **change}
    with pytest.raises(error, match=match):
        jax_nkilib.deformable_attention(**args)


def test_kernel_refuses_levels_past_the_value():
    value, loc, w = problem(seed=12)
    with pytest.raises(ValueError, match="level 2 .* runs past L=29"):
        ms_deformable_attention(value, loc, w, spatial_shapes=SHAPES, level_start_index=(0, 20, 27))
    with pytest.raises(ValueError, match="grad_output must be"):
        ms_deformable_attention_bwd(jnp.ones((2, 5, 20)), value, loc, w, **STATIC)
