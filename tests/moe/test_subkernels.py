"""jax_nkilib.nki.find_nonzero_indices / indexed_flatten against NumPy oracles (exact), their LNC=2 requirement on
Neuron (kernel call at LNC=2, fallback warning or error at LNC=1), vmap, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from jax_nkilib.nki import argsort_unstable, find_nonzero_indices, indexed_flatten
from tests.moe import oracles
from tests.support.hlo import kernel_configs, neuron_text


def sparse(t, c, dtype=jnp.int32, seed=0):
    rng = np.random.default_rng(seed)
    values = (rng.uniform(size=(t, c)) < 0.25) * rng.integers(1, 5, (t, c))
    values[:, 0] = 0  # a column with no nonzero entry
    return jnp.asarray(values, dtype)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.bfloat16])
def test_find_nonzero_indices_matches_the_oracle(dtype):
    x = sparse(384, 6, dtype)
    indices, counts = find_nonzero_indices(x)
    want_indices, want_counts = oracles.find_nonzero_indices(x)
    assert indices.dtype == jnp.int32 and counts.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)
    assert int(counts[0]) == 0 and np.all(np.asarray(indices)[0] == -1)


def test_find_nonzero_indices_of_a_column_window():
    x = sparse(256, 10, seed=1)
    start = jnp.asarray([3], jnp.int32)
    indices, counts = jax.jit(lambda x, s: find_nonzero_indices(x, s, n_cols=4))(x, start)
    want_indices, want_counts = oracles.find_nonzero_indices(x, start=3, n_cols=4)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(counts), want_counts)


def test_find_nonzero_indices_vmaps_over_columns():
    xs = jnp.stack([sparse(128, 4, seed=s) for s in range(3)])
    indices, counts = jax.vmap(find_nonzero_indices)(xs)
    for i in range(3):
        want_indices, want_counts = oracles.find_nonzero_indices(xs[i])
        np.testing.assert_array_equal(np.asarray(indices[i]), want_indices)
        np.testing.assert_array_equal(np.asarray(counts[i]), want_counts)


@pytest.mark.parametrize(
    "rows, tokens, f_len, offsets, start, padding",
    [
        (4, 64, 4, [0, 16, 40, -3], None, -1),  # an out-of-range row and a partly out-of-range one
        (5, 32, 2, [9, 0, 3, 20, 6, 1], 1, -1),  # overlapping rows within and across the two cores
        (3, 32, 2, [0, 40, 5], None, 7),  # values below padding_val lose to the other core's padding
    ],
)
def test_indexed_flatten_matches_the_two_core_oracle(rows, tokens, f_len, offsets, start, padding):
    x = jnp.asarray(np.arange(rows * tokens).reshape(rows, tokens), jnp.int32)
    extra = () if start is None else (jnp.asarray([start], jnp.int32),)
    out = indexed_flatten(x, jnp.asarray(offsets, jnp.int32), *extra, f_len=f_len, output_len=128, padding_val=padding)
    want = oracles.indexed_flatten(x, offsets, f_len, 128, start or 0, padding)
    assert out.shape == (128,) and out.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(out), want)


def test_indexed_flatten_without_overlap_is_a_plain_placement():
    """The kernel's intended use (token ids >= 0, -1 padding, disjoint rows): the torch reference's overwrite."""
    x = jnp.asarray(np.arange(3 * 32).reshape(3, 32), jnp.int32)
    out = np.asarray(indexed_flatten(x, jnp.asarray([0, 20, 40], jnp.int32), f_len=2, output_len=128))
    want = np.full(128, -1)
    for r, offset in enumerate([0, 20, 40]):
        want[offset * 2 : offset * 2 + 32] = np.arange(r * 32, r * 32 + 32)
    np.testing.assert_array_equal(out, want)


def test_bad_inputs_raise_naming_them():
    x = sparse(128, 4)
    with pytest.raises(ValueError, match="together"):
        find_nonzero_indices(x, n_cols=2)
    with pytest.raises(TypeError, match="index_dtype"):
        find_nonzero_indices(x, index_dtype=jnp.uint32)
    data = jnp.zeros((2, 32), jnp.int32)
    with pytest.raises(ValueError, match="f_len"):
        indexed_flatten(data, jnp.zeros(2, jnp.int32), f_len=3, output_len=126)
    with pytest.raises(ValueError, match="row_offsets"):
        indexed_flatten(data, jnp.zeros(3, jnp.int32), f_len=2, output_len=128)
    with pytest.raises(TypeError, match="input_tensor"):
        indexed_flatten(data.astype(jnp.float32), jnp.zeros(2, jnp.int32), f_len=2, output_len=128)


@pytest.mark.parametrize(
    "fn, args",
    [
        (lambda x: find_nonzero_indices(x), (sparse(256, 8),)),
        (
            lambda x, o: indexed_flatten(x, o, f_len=2, output_len=128),
            (jnp.zeros((2, 32), jnp.int32), jnp.asarray([0, 16], jnp.int32)),
        ),
    ],
)
def test_lnc2_kernels_run_at_lnc2_and_fall_back_at_lnc1(monkeypatch, fn, args):
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    with jax_nkilib.neuron.dry_run():
        with jax_nkilib.config(lnc=2):
            (config,) = kernel_configs(neuron_text(fn, *args))
            assert config["grid"] == 2
        with jax_nkilib.config(lnc=1):
            with pytest.warns(NeuronFallbackWarning, match="requires LNC=2"):
                assert kernel_configs(neuron_text(fn, *args)) == []
            with jax_nkilib.config(on_unsupported="error"), pytest.raises(NeuronUnsupportedError, match="LNC=2"):
                neuron_text(fn, *args)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32])
@pytest.mark.parametrize("shape", [(1, 48), (40,)])
@pytest.mark.parametrize("descending", [False, True])
def test_argsort_unstable_sorts_tie_free_data(dtype, shape, descending):
    n = shape[-1]
    data = jnp.asarray((np.random.default_rng(n).permutation(n) - n // 3).reshape(shape), dtype)
    indices = argsort_unstable(data, descending=descending)
    assert indices.shape == shape and indices.dtype == jnp.uint32
    order = np.argsort(np.asarray(data, np.float64).reshape(-1))
    np.testing.assert_array_equal(np.asarray(indices).reshape(-1), order[::-1] if descending else order)


def test_argsort_unstable_lowering_and_limits(monkeypatch):
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    with jax_nkilib.neuron.dry_run():
        (config,) = kernel_configs(
            neuron_text(lambda d: argsort_unstable(d, descending=True), jnp.zeros((1, 64), jnp.float32))
        )
        assert config["params"] == {"descending": True, "output_in_sbuf": False}
        with pytest.warns(NeuronFallbackWarning, match="multiple of 8"):
            assert kernel_configs(neuron_text(argsort_unstable, jnp.zeros((1, 12), jnp.float32))) == []
    with pytest.raises(ValueError, match="output_in_sbuf"):
        argsort_unstable(jnp.zeros((1, 16), jnp.float32), output_in_sbuf=True)
    with pytest.raises(TypeError, match="`data`"):
        argsort_unstable(jnp.zeros((1, 16), jnp.bfloat16))
