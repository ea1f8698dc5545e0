"""jax_nkilib.nki.pad (docs-only) and jax_nkilib.pad against float64 NumPy oracles written from the kernel's index
maps (``pad_modes.py``: constant, replicate, reflect, circular) and ``np.pad``: PyTorch's innermost-first padding
order, batch axes, the VJP (a slice for constant, sums onto the copied elements otherwise), jnp.pad's modes and
pad widths, Neuron lowering (one call per group of up to three padded axes; the fallback where the installed
library predates the kernel) and errors."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import pad
from tests.support import nki_standin
from tests.support.data import random
from tests.support.hlo import compiled_collectives, compute_operations, kernel_configs, neuron_text
from tests.support.numerics import f64
from tests.support.sharding import use_mesh

MODES = ("constant", "replicate", "reflect", "circular")
NUMPY_NAMES = {"constant": "constant", "replicate": "edge", "reflect": "reflect", "circular": "wrap"}


def source_index(mode, size, before, after):
    """The kernel's map from each output position of one axis to its input index (``None`` where constant fills)."""
    index = np.arange(-before, size + after)
    if mode == "constant":
        return np.where((index >= 0) & (index < size), index, -1)
    if mode == "replicate":
        return np.clip(index, 0, size - 1)
    if mode == "reflect":
        return np.where(index < 0, -index, np.where(index >= size, 2 * (size - 1) - index, index))
    return index % size  # circular


def oracle(x, widths, mode, value=0.0):
    """Float64 pad of ``x`` by per-axis ``widths`` and its adjoint ``dy -> dx``, from the index maps."""
    x = f64(x)
    maps = [source_index(mode, n, *w) for n, w in zip(x.shape, widths)]
    grid = np.ix_(*[np.maximum(m, 0) for m in maps])
    inside = np.ones([len(m) for m in maps], bool)
    for axis, m in enumerate(maps):
        inside &= (m >= 0).reshape([-1 if a == axis else 1 for a in range(x.ndim)])
    out = np.where(inside, x[grid], value)

    def adjoint(dy):
        dx = np.zeros_like(x)
        np.add.at(dx, grid, np.where(inside, f64(dy), 0.0))
        return dx

    return out, adjoint


def torch_order(widths, spatial):
    """PyTorch's padding tuple for the last ``spatial`` axes' widths (innermost first)."""
    return tuple(size for width in reversed(widths[-spatial:]) for size in width)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "shape, widths",
    [
        ((9,), ((3, 4),)),  # no batch axis
        ((2, 3, 7), ((0, 0), (2, 0), (1, 6))),  # 2 spatial axes, one batch axis
        ((2, 2, 3, 5, 4), ((0, 0), (0, 0), (1, 2), (0, 4), (3, 3))),  # 3 spatial axes, two batch axes
    ],
)
def test_forward_matches_the_index_map_oracle_and_np_pad(shape, widths, mode, dtype):
    x = random(shape, dtype, seed=len(shape))
    spatial = len(shape) - next(axis for axis, w in enumerate(widths) if w != (0, 0))  # first padded axis on
    kwargs = {"value": 0.1} if mode == "constant" else {}
    out = pad(x, padding=torch_order(widths, spatial), mode=mode, **kwargs)
    fill = float(jnp.asarray(0.1, dtype)) if mode == "constant" else 0.0  # the value rounded to the dtype
    expected, _ = oracle(x, widths, mode, fill)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(f64(out), expected)  # a copy: exact
    np.testing.assert_array_equal(
        expected, np.pad(f64(x), widths, NUMPY_NAMES[mode], **({"constant_values": fill} if mode == "constant" else {}))
    )


def test_padding_is_innermost_first_and_the_default_mode_is_replicate():
    x = random((3, 4), seed=1)
    out = pad(x, padding=(1, 2, 0, 3))  # last axis (1, 2), then the first axis (0, 3)
    np.testing.assert_array_equal(f64(out), np.pad(f64(x), ((0, 3), (1, 2)), "edge"))


@pytest.mark.parametrize("mode", MODES)
def test_vjp_matches_the_adjoint_of_the_index_maps(mode):
    x = random((2, 5, 6), seed=2)
    widths = ((0, 0), (4, 1), (2, 5))
    out, pullback = jax.vjp(lambda x: pad(x, padding=(2, 5, 4, 1), mode=mode), x)
    dy = random(out.shape, seed=3)
    _, adjoint = oracle(x, widths, mode)
    np.testing.assert_allclose(f64(pullback(dy)[0]), adjoint(dy), rtol=1e-6, atol=1e-6)
    if mode == "constant":  # the VJP of a constant pad is a slice
        np.testing.assert_array_equal(pullback(dy)[0], dy[:, 4:-1, 2:-5])


def test_neuron_lowering_is_one_call_with_the_kernels_arguments():
    x = jax.ShapeDtypeStruct((4, 3, 16, 16), jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x: pad(x, padding=(1, 1, 2, 2), mode="reflect"), x)
    (cfg,) = kernel_configs(text)
    assert cfg["entry_point"] == "nkilib.experimental.pad.pad:pad"
    assert cfg["params"] == {"padding": [1, 1, 2, 2], "mode": "reflect", "value": 0.0}
    assert compute_operations(text) == []
    assert "tensor<4x3x20x18xbf16>" in text


def test_the_installed_library_without_pad_falls_back_naming_it(monkeypatch):
    """nki-library 2.29 (and the snapshot's main) has no experimental/pad: the reference runs, with a warning."""
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {})
    assert "nkilib.experimental.pad.pad" not in sys.modules
    with pytest.warns(NeuronFallbackWarning, match=r"nkilib.experimental.pad.pad:pad.*installed: nki 0.4.0"):
        text = neuron_text(lambda x: pad(x, padding=(1, 1)), random((2, 8)))
    assert kernel_configs(text) == [] and standin.compilations == []


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: pad(x, padding=(1, 2, 3)), ValueError, "parameter `padding` must be a tuple of 2, 4 or 6"),
        (lambda x: pad(x, padding=(1, -1)), ValueError, "non-negative"),
        (lambda x: pad(x, padding=(1.0, 1)), TypeError, "parameter `padding`"),
        (lambda x: pad(x), TypeError, "missing required parameter `padding`"),
        (lambda x: pad(x, padding=(1, 1, 1, 1, 1, 1, 1, 1)), ValueError, "padding"),
        (lambda x: pad(x[0, 0], padding=(1, 1, 1, 1)), ValueError, "at least 2 axes"),
        (lambda x: pad(x, padding=(5, 0), mode="reflect"), ValueError, "mode 'reflect' needs axis 2"),
        (lambda x: pad(x, padding=(0, 6), mode="circular"), ValueError, "mode 'circular' needs pads <="),
        (lambda x: pad(x, padding=(1, 1), mode="symmetric"), ValueError, "parameter `mode` must be one of"),
        (lambda x: pad(x.astype(jnp.int32), padding=(1, 1)), TypeError, "argument `x_ref` must have dtype"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 5)))
    assert fragment in str(info.value)


# -------------------------------------------------------------------------------------------------- jax_nkilib.pad
# bfloat16 copies like float32 (the kernel-native test above covers it in CI)
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize("mode", ["constant", "edge", "reflect", "wrap"])
@pytest.mark.parametrize(
    "pad_width",
    [2, (1, 3), ((0, 0), (2, 1), (0, 0), (3, 0)), ((1, 1), (0, 0), (0, 0), (0, 2))],
    ids=["int", "pair", "middle-and-last", "first-and-last"],
)
def test_op_matches_np_pad(pad_width, mode, dtype):
    x = random((4, 5, 4, 6), dtype, seed=4)
    fill = {"constant_values": -1.5} if mode == "constant" else {}
    out = jax_nkilib.pad(x, pad_width, mode, **fill)
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(f64(out), np.pad(f64(x), pad_width, mode, **fill))


def test_op_one_kernel_call_per_group_of_three_padded_axes():
    x = jax.ShapeDtypeStruct((2, 3, 4, 5, 6), jnp.float32)
    with jax_nkilib.neuron.dry_run():
        trailing = neuron_text(lambda x: jax_nkilib.pad(x, ((0, 0), (0, 0), (1, 1), (0, 0), (2, 0))), x)
        every = neuron_text(lambda x: jax_nkilib.pad(x, 1, "wrap"), x)
    (cfg,) = kernel_configs(trailing)  # padded axes among the last three: no transpose, zero pads between
    assert cfg["params"]["padding"] == [2, 0, 0, 0, 1, 1] and compute_operations(trailing) == []
    first, second = kernel_configs(every)
    assert first["params"]["padding"] == [1, 1] * 3 and second["params"]["padding"] == [1, 1] * 2
    assert first["params"]["mode"] == second["params"]["mode"] == "circular"


def test_op_gradient_is_a_slice_for_constant_and_matches_the_adjoint_otherwise():
    x = random((3, 4, 5), seed=5)
    widths = ((1, 0), (0, 0), (2, 3))
    for mode, kernel_mode in (("constant", "constant"), ("edge", "replicate"), ("reflect", "reflect")):
        out, pullback = jax.vjp(lambda x: jax_nkilib.pad(x, widths, mode), x)
        dy = random(out.shape, seed=6)
        _, adjoint = oracle(x, widths, kernel_mode)
        np.testing.assert_allclose(f64(pullback(dy)[0]), adjoint(dy), rtol=1e-6, atol=1e-6)


def test_op_sharded_unpadded_axes_need_no_communication():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x = random((4, 8, 8), seed=7)
    fn = lambda x: jax_nkilib.pad(x, ((0, 0), (0, 0), (2, 1)), "reflect")
    with use_mesh(mesh):
        placed = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
        jitted = jax.jit(fn)
        out = jitted(placed)
        assert compiled_collectives(jitted.lower(placed).compile().as_text()) == {}
        with pytest.raises(ValueError, match=r"`x` is sharded along axis 2 \(this dimension\)"):
            jitted(jax.device_put(x, NamedSharding(mesh, P("data", None, "model"))))
    np.testing.assert_array_equal(f64(out), np.pad(f64(x), ((0, 0), (0, 0), (2, 1)), "reflect"))


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: jax_nkilib.pad(x, 1, "symmetric"), ValueError, "`mode` must be one of 'constant', 'edge'"),
        (lambda x: jax_nkilib.pad(x, 1, "median"), ValueError, "Use jnp.pad for the others"),
        (lambda x: jax_nkilib.pad(x, -1), ValueError, "`pad_width` must be non-negative"),
        (lambda x: jax_nkilib.pad(x, ((1, 1), (2, 2))), ValueError, "one (before, after) pair per axis"),
        (lambda x: jax_nkilib.pad(x, 1.5), TypeError, "`pad_width` must be"),
        (lambda x: jax_nkilib.pad(x, 3, "reflect"), ValueError, "mode 'reflect' pads axis 0 (size 2)"),
        (lambda x: jax_nkilib.pad(x, 4, "wrap"), ValueError, "mode 'wrap' pads axis 0 (size 2)"),
        (lambda x: jax_nkilib.pad(x, 1, constant_values=(1.0, 2.0)), ValueError, "`constant_values` must be one"),
        (lambda x: jax.jit(lambda x, v: jax_nkilib.pad(x, 1, constant_values=v))(x, 1.0), TypeError, "static"),
        (lambda x: jax_nkilib.pad(x.astype(jnp.int32), 1), TypeError, "`x` must have a floating dtype"),
    ],
)
def test_op_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 5)))
    assert fragment in str(info.value)


def test_vmap_folds_into_the_first_batch_axis():
    x = random((5, 2, 3, 7), seed=8)
    per_row = lambda r: pad(r, padding=(1, 2), mode="reflect")
    np.testing.assert_array_equal(jax.vmap(per_row)(x), jnp.stack([per_row(r) for r in x]))
    np.testing.assert_array_equal(jax.vmap(per_row, 2)(x), jnp.stack([per_row(x[:, :, i]) for i in range(3)]))
    no_batch_axis = lambda r: pad(r, padding=(1, 2, 1, 1, 0, 1), mode="circular")  # every axis padded: lax.map
    np.testing.assert_array_equal(jax.vmap(no_batch_axis)(x), jnp.stack([no_batch_axis(r) for r in x]))
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(jax.vmap(per_row), x))
    assert cfg["input_specs"][0][0] == [10, 3, 7]
