"""``find_nonzero_indices_with_count`` (row 37) against a NumPy oracle written from the kernel's docstring: the
nonzero positions ascending, ``-1`` padding, the count in the last slot (compared exactly)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.tools.arg_specs.benchmark import sparse_row
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import find_nonzero_indices_with_count
from tests.support.hlo import kernel_configs, neuron_text


def oracle(row):
    row = np.asarray(row, np.float64)[0]
    out = np.full(row.size + 1, -1, np.int64)
    positions = [t for t in range(row.size) if row[t] != 0]
    out[: len(positions)] = positions
    out[-1] = len(positions)
    return out[None, :]


@pytest.mark.parametrize(
    "tokens, density, dtype",
    [(37, 0.3, jnp.float32), (1, 1.0, jnp.int32), (129, 0.0, jnp.float32), (64, 1.0, jnp.bfloat16)],
)
def test_matches_the_oracle(tokens, density, dtype):
    row = sparse_row(np.random.default_rng(tokens), tokens, density, dtype)
    out = find_nonzero_indices_with_count(row)
    assert out.shape == (1, tokens + 1) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out, oracle(row))


@pytest.mark.slow  # conformance checks jit and vmap in CI
def test_jit_and_vmap():
    rows = jnp.stack([sparse_row(np.random.default_rng(i), 20, 0.5) for i in range(3)])
    mapped = jax.vmap(jax.jit(find_nonzero_indices_with_count))(rows)
    for row, out in zip(rows, mapped):
        np.testing.assert_array_equal(out, oracle(row))


def test_neuron_lowering_and_fallback():
    call = jax.jit(find_nonzero_indices_with_count)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(call, sparse_row(np.random.default_rng(0), 256)))
        assert cfg["output_names"] == ["output"]
        with pytest.warns(NeuronFallbackWarning, match="must be float32 or int32; got bfloat16"):
            text = neuron_text(call, sparse_row(np.random.default_rng(0), 256, dtype=jnp.bfloat16))
    assert "AwsNeuronCustomNativeKernel" not in text


def test_refuses_more_than_one_row():
    with pytest.raises(ValueError, match="input_tensor"):
        find_nonzero_indices_with_count(jnp.ones((2, 8)))
