"""jax_nkilib.nki.cumsum and jax_nkilib.cumsum against float64 NumPy oracles: the kernel's tiled numerics (float32
sums, the carry between 2048-column tiles rounded to the dtype), any axis, the reversed-cumsum VJP, sharding of the
summed axis, Neuron lowering (splits, fallbacks) and errors."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import cumsum
from tests.support import nki_standin
from tests.support.data import random
from tests.support.hlo import compiled_collectives, kernel_configs, neuron_text
from tests.support.numerics import assert_close, assert_no_worse_than_plain, f64
from tests.support.sharding import use_mesh

TILE = 2048  # the kernel's column tile (core/cumsum/cumsum.py F_TILE_SIZE)


def kernel_model(x, dtype):
    """NumPy model of the kernel on ``x [R, H]``: per 2048-column tile a sequential float32 scan from the carry, each
    output rounded to ``dtype``; the carry is the tile's last rounded output."""
    rows = np.asarray(x, np.float32)
    out = np.empty(rows.shape, dtype)
    carry = np.zeros((rows.shape[0], 1), np.float32)
    for start in range(0, rows.shape[1], TILE):
        tile = np.cumsum(np.concatenate([carry, rows[:, start : start + TILE]], axis=1), axis=1, dtype=np.float32)
        out[:, start : start + TILE] = tile[:, 1:].astype(dtype)
        carry = out[:, start + TILE - 1 : start + TILE].astype(np.float32) if start + TILE < rows.shape[1] else carry
    return out


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(5, 37), (3, 2, 129), (2, 5000), (1, 1)])
def test_forward_matches_float64_oracle(shape, dtype):
    x = random(shape, dtype, seed=sum(shape))
    out = cumsum(x)
    assert out.shape == x.shape and out.dtype == x.dtype
    expected = np.cumsum(f64(x), axis=-1)
    assert_close(out, expected, dtype, reduction=shape[-1])
    if dtype == jnp.bfloat16:  # no worse than XLA's own bfloat16 cumsum
        assert_no_worse_than_plain(out, jnp.cumsum(x, axis=-1), expected)


def test_the_carry_between_tiles_is_rounded_to_the_dtype():
    """Quarter-integers sum exactly in float32, so only the bfloat16 roundings differ: the output equals the
    kernel's model bit for bit, and differs from rounding the exact prefix sums (the carry is rounded)."""
    rng = np.random.default_rng(0)
    x = (rng.integers(0, 8, (4, 3 * TILE + 100)) / 4).astype(ml_dtypes.bfloat16)
    out = np.asarray(cumsum(jnp.asarray(x)))
    model = kernel_model(x, ml_dtypes.bfloat16)
    np.testing.assert_array_equal(out.view(np.uint16), model.view(np.uint16))
    exact_then_rounded = np.cumsum(x.astype(np.float64), axis=1).astype(ml_dtypes.bfloat16)
    assert (out[:, TILE:] != exact_then_rounded[:, TILE:]).any()
    np.testing.assert_array_equal(out[:, :TILE].view(np.uint16), exact_then_rounded[:, :TILE].view(np.uint16))


def test_vjp_is_the_reversed_cumsum_and_runs_the_kernel():
    x, dy = random((3, 4, 50), seed=1), random((3, 4, 50), seed=2)
    _, pullback = jax.vjp(cumsum, x)
    (dx,) = pullback(dy)
    assert_close(dx, np.flip(np.cumsum(np.flip(f64(dy), -1), -1), -1), jnp.float32, reduction=50)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, dy: jax.vjp(cumsum, x)[1](dy), x, dy)
    assert [c["func_name"] for c in kernel_configs(text)] == ["cumsum"]  # the backward's call (forward unused)


def test_vmap_folds_into_rows():
    x = random((4, 6, 33), seed=3)
    np.testing.assert_allclose(jax.vmap(cumsum)(x), np.stack([cumsum(row) for row in x]), rtol=0, atol=0)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(jax.vmap(cumsum), x))
    assert cfg["input_specs"][0][0] == [24, 33]


def test_neuron_lowering_one_call_split_and_fallbacks():
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(cumsum, jax.ShapeDtypeStruct((64, 4, 1024), jnp.bfloat16)))
        assert cfg["entry_point"] == "nkilib.core.cumsum.cumsum:cumsum" and cfg["params"] == {"axis": -1}
        assert cfg["grid"] == 1
        configs = kernel_configs(neuron_text(cumsum, jax.ShapeDtypeStruct((4096, 512), jnp.float32)))
        assert [c["input_specs"][0][0] for c in configs] == [[2048, 512]] * 2  # B <= 2048 per call
        with pytest.warns(NeuronFallbackWarning, match="H=9000 exceeds"):
            assert kernel_configs(neuron_text(cumsum, jax.ShapeDtypeStruct((8, 9000), jnp.float32))) == []
        with pytest.warns(NeuronFallbackWarning, match="S=11 exceeds"):
            neuron_text(cumsum, jax.ShapeDtypeStruct((8, 11, 64), jnp.float32))


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: cumsum(x, axis=0), ValueError, "parameter `axis` must be -1 or 2"),
        (lambda x: cumsum(x[0, 0]), ValueError, "`x` must have layout [B, H] or [B, S, H]"),
        (lambda x: cumsum(x.astype(jnp.int32)), TypeError, "`x` must have dtype"),
        (lambda x: cumsum(x, axis=1.0), TypeError, "parameter `axis`"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 8)))
    assert fragment in str(info.value)


# ----------------------------------------------------------------------------------------------- jax_nkilib.cumsum
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("axis", [0, 1, -1, None])
def test_op_matches_numpy_on_any_axis(axis, dtype):
    x = random((7, 3, 45), dtype, seed=5)
    out = jax_nkilib.cumsum(x, axis)
    expected = np.cumsum(f64(x), axis)
    assert out.shape == expected.shape and out.dtype == x.dtype
    assert_close(out, expected, dtype, reduction=expected.shape[0 if axis is None else axis])


def test_op_dtype_casts_first_as_jnp_does():
    ints = jnp.arange(-5, 20, dtype=jnp.int32).reshape(5, 5)
    out = jax_nkilib.cumsum(ints, 0, dtype=jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(out, np.cumsum(np.asarray(ints), 0))
    x = random((4, 300), jnp.bfloat16, seed=6)
    wide = jax_nkilib.cumsum(x, dtype=jnp.float32)
    assert wide.dtype == jnp.float32
    assert_close(wide, np.cumsum(f64(x), -1), jnp.float32, reduction=300)


def test_op_gradient_matches_the_reversed_cumsum_and_lowers_to_kernels_only():
    x, dy = random((6, 9, 4), seed=7), random((6, 9, 4), seed=8)
    out, pullback = jax.vjp(lambda x: jax_nkilib.cumsum(x, axis=1), x)
    (dx,) = pullback(dy)
    assert_close(dx, np.flip(np.cumsum(np.flip(f64(dy), 1), 1), 1), jnp.float32, reduction=9)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax.grad(lambda x: jnp.sum(jax_nkilib.cumsum(x, axis=1) * dy)), x)
    configs = kernel_configs(text)
    assert [c["func_name"] for c in configs] == ["cumsum"] and configs[0]["input_specs"][0][0] == [24, 9]


def test_op_empty_and_flattened():
    assert jax_nkilib.cumsum(jnp.zeros((0, 3)), 0).shape == (0, 3)
    np.testing.assert_allclose(jax_nkilib.cumsum(jnp.ones((2, 3)), None), np.arange(1, 7))


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: jax_nkilib.cumsum(x, 3), ValueError, "`axis` must be an int in [-3, 2]"),
        (lambda x: jax_nkilib.cumsum(x.astype(jnp.int32)), TypeError, "result dtype must be float32"),
        (lambda x: jax_nkilib.cumsum(x, dtype=jnp.int32), TypeError, "from `dtype`"),
        (lambda x: jax_nkilib.cumsum(x[0, 0, 0]), ValueError, "at least one axis"),
        (lambda x: jax.jit(jax_nkilib.cumsum)(x, 1), TypeError, "`axis` must be static"),
        (lambda x: jax_nkilib.cumsum("x"), TypeError, "`x` must be an array"),
    ],
)
def test_op_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 8)))
    assert fragment in str(info.value)


def test_a_split_summed_axis_adds_the_earlier_shards_totals():
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    x, dy = random((4, 64, 5), seed=9), random((4, 64, 5), seed=10)
    fn = lambda x: jax_nkilib.cumsum(x, axis=1)
    single, single_grad = fn(x), jax.grad(lambda x: jnp.sum(fn(x) * dy))(x)
    with use_mesh(mesh):
        placed = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
        jitted = jax.jit(fn)
        out = jitted(placed)
        grad = jax.jit(jax.grad(lambda x: jnp.sum(fn(x) * dy)))(placed)
        collectives = compiled_collectives(jitted.lower(placed).compile().as_text())
    assert out.sharding.spec == P("data", "model", None)
    assert collectives == {"all-gather": 1}
    assert_close(out, np.asarray(single, np.float64), jnp.float32, reduction=64)
    assert_close(grad, np.asarray(single_grad, np.float64), jnp.float32, reduction=64)
    assert_close(out, np.cumsum(f64(x), 1), jnp.float32, reduction=64)


def test_nki_compiler_hands_the_library_kernel_x_and_axis(monkeypatch):
    """Against the stand-in SDK (the library function with its recorded signature): one compile of
    nkilib.core.cumsum.cumsum:cumsum with the rows as a NumPy array and axis=-1, also for the VJP's call."""
    entry = "nkilib.core.cumsum.cumsum:cumsum"
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {entry: nki_standin.library_function(entry)})
    standin.rule("cumsum", lambda x, **_: np.empty(x.shape, x.dtype))
    x = random((6, 5, 40), jnp.bfloat16)
    text = neuron_text(lambda x: jax_nkilib.cumsum(x, axis=1), x)
    assert [c["func_name"] for c in kernel_configs(text)] == ["cumsum"]
    (compilation,) = standin.compilations
    assert list(compilation["inputs"]) == ["x", "axis"] and compilation["inputs"]["axis"] == -1
    assert compilation["inputs"]["x"].shape == (240, 5) and compilation["inputs"]["x"].dtype == jnp.bfloat16


def test_op_scans_an_axis_past_the_kernels_limit_in_blocks():
    """n > 8192: one call on 8192-column blocks and one on the block totals, no fallback, the same sums."""
    x = random((3, 20000), seed=11)
    assert_close(jax_nkilib.cumsum(x), np.cumsum(f64(x), -1), jnp.float32, reduction=20000)
    xb = x.astype(jnp.bfloat16)
    assert_close(jax_nkilib.cumsum(xb), np.cumsum(f64(xb), -1), jnp.bfloat16, reduction=20000)
    with jax_nkilib.neuron.dry_run(), warnings.catch_warnings():
        warnings.simplefilter("error", NeuronFallbackWarning)
        configs = kernel_configs(neuron_text(jax_nkilib.cumsum, x))
    assert [c["input_specs"][0][0] for c in configs] == [[9, 8192], [3, 2]]
    _, pullback = jax.vjp(jax_nkilib.cumsum, x)
    dy = random((3, 20000), seed=12)
    assert_close(pullback(dy)[0], np.flip(np.cumsum(np.flip(f64(dy), -1), -1), -1), jnp.float32, reduction=20000)
