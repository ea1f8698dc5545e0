"""jax_nkilib.nki.topk / rotational_topk / cascaded_max against float64 oracles (exact values, exact uint32 indices;
float32, bfloat16, odd sizes), their gradients, errors and Neuron lowerings (dry run) with their fallbacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import (
    GpsimdTopkConfig,
    RotationalTopkConfig,
    SupportedTopkMethods,
    cascaded_max,
    gpsimd_topk,
    rotational_topk,
    topk,
)
from tests.moe import oracles
from tests.support.hlo import kernel_configs, neuron_text


def distinct(shape, dtype, seed=0, check=True):
    """Rows of distinct integers (a permutation of ``[-V/2, V/2)`` each), exact in bfloat16 for ``V <= 512``."""
    rng = np.random.default_rng(seed)
    rows = int(np.prod(shape[:-1]))
    values = np.stack([rng.permutation(shape[-1]) - shape[-1] // 2 for _ in range(rows)]).reshape(shape)
    x = jnp.asarray(values, dtype)
    if check:
        flat = np.asarray(x, np.float64).reshape(rows, -1)
        assert all(len(set(row)) == len(row) for row in flat), "the test data must be tie-free"
    return x


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, k", [((3, 5, 200), 7), ((11, 251), 1), ((2, 1, 97), 97)])
def test_topk_matches_the_oracle_exactly(dtype, shape, k):
    x = distinct(shape, dtype)
    values, indices = topk(x, k=k)
    want_values, want_indices = oracles.topk(x, k)
    assert values.shape == shape[:-1] + (k,) and values.dtype == dtype and indices.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rotational_topk_matches_the_oracle_exactly(dtype):
    x = distinct((9, 250), dtype, seed=3)
    values, indices = rotational_topk(x, config=RotationalTopkConfig(orig_k=13))
    want_values, want_indices = oracles.topk(x, 13)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)


def test_topk_gradient_goes_to_the_selected_positions():
    x = distinct((4, 60), jnp.float64)
    g = jax.grad(lambda x: jnp.sum(topk(x, k=3)[0] * jnp.arange(1.0, 4.0)))(x)
    _, index = oracles.topk(x, 3)
    want = np.zeros(x.shape)
    np.put_along_axis(want, index, np.arange(1.0, 4.0)[None, :], axis=-1)
    np.testing.assert_array_equal(np.asarray(g), want)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 300), (7, 129)])
def test_cascaded_max_matches_the_oracle_exactly(dtype, shape):
    x = distinct(shape, dtype, seed=5)
    values, indices = cascaded_max(x)
    want_values, want_indices = oracles.topk(x, 1)
    assert values.shape == shape[:-1] + (1,) and indices.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)


def test_cascaded_max_gradient_is_one_at_the_maximum():
    x = distinct((3, 140), jnp.float64, seed=2)
    g = jax.grad(lambda x: jnp.sum(cascaded_max(x)[0]))(x)
    _, index = oracles.topk(x, 1)
    want = np.zeros(x.shape)
    np.put_along_axis(want, index, 1.0, axis=-1)
    np.testing.assert_array_equal(np.asarray(g), want)


def test_bad_inputs_raise_naming_them():
    x = distinct((4, 50), jnp.float32)
    with pytest.raises(ValueError, match="k must be in"):
        topk(x, k=51)
    with pytest.raises(TypeError, match="`k`"):
        topk(x)
    with pytest.raises(TypeError, match="method"):
        topk(x, k=2, method="HEAP")
    with pytest.raises(TypeError, match="RotationalTopkConfig"):
        rotational_topk(x, config=(2, True))
    with pytest.raises(ValueError, match="orig_k"):
        rotational_topk(x, config=RotationalTopkConfig(orig_k=0))
    with pytest.raises(ValueError, match="`inp`"):
        rotational_topk(x.reshape(2, 2, 50), config=RotationalTopkConfig(2))
    with pytest.raises(TypeError, match="input_tensor"):
        cascaded_max(x.astype(jnp.int32))


def test_neuron_lowerings_are_the_kernels():
    x = distinct((4, 8, 1000), jnp.bfloat16, check=False)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        (top,) = kernel_configs(neuron_text(lambda x: topk(x, k=50, sorted_flag=False), x))
        (rot,) = kernel_configs(neuron_text(lambda x: rotational_topk(x, config=RotationalTopkConfig(9)), x[0]))
        (cmax,) = kernel_configs(neuron_text(cascaded_max, x))
    assert top["func_name"] == "topk" and top["grid"] == 2
    assert top["params"] == {"k": 50, "sorted_flag": False, "method": "ROTATIONAL"}
    assert rot["params"] == {"config": {"orig_k": 9, "sorted": True}}
    assert cmax["func_name"] == "cascaded_max" and cmax["output_names"] == ["max_values", "max_indices"]


@pytest.mark.parametrize(
    "fn, shape, reason",
    [
        (lambda x: topk(x, k=x.shape[-1]), (4, 64), "k == V"),
        (lambda x: topk(x, k=3, method=SupportedTopkMethods.SCANNING), (4, 64), "method=SCANNING"),
        (cascaded_max, (300, 256), "rows per core"),
        (cascaded_max, (4, 100), r"V=100 must be in \[128, 16384\]"),
        (cascaded_max, (4, 20000), "V=20000 must be in"),
    ],
)
def test_neuron_limits_fall_back(monkeypatch, fn, shape, reason):
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match=reason):
        assert kernel_configs(neuron_text(fn, distinct(shape, jnp.float32))) == []


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gpsimd_topk_matches_the_oracle_and_ranks_nan_last(dtype):
    x = distinct((6, 120), dtype, seed=7).at[2, 5].set(jnp.nan)
    values, indices = gpsimd_topk(x, config=GpsimdTopkConfig(k=120))
    folded = np.where(
        np.isnan(np.asarray(x, np.float64)), float(jnp.finfo(jnp.bfloat16).min), np.asarray(x, np.float64)
    )
    want_values, want_indices = oracles.topk(folded, 120)
    np.testing.assert_array_equal(np.asarray(indices), want_indices)
    np.testing.assert_array_equal(np.asarray(values, np.float64), want_values)
    assert int(indices[2, -1]) == 5 and float(values[2, -1]) == float(jnp.finfo(jnp.bfloat16).min)


def test_gpsimd_topk_lowering_and_its_bfloat16_limit(monkeypatch):
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    fn = lambda x: gpsimd_topk(x, config=GpsimdTopkConfig(k=16, sorted=False))
    with jax_nkilib.neuron.dry_run():
        (config,) = kernel_configs(neuron_text(fn, distinct((8, 500), jnp.bfloat16)))
        assert config["params"] == {"config": {"k": 16, "sorted": False}}
        with pytest.warns(NeuronFallbackWarning, match="bfloat16 only"):
            assert kernel_configs(neuron_text(fn, distinct((8, 500), jnp.float32))) == []
    with pytest.raises(TypeError, match="GpsimdTopkConfig"):
        gpsimd_topk(distinct((8, 50), jnp.float32), config=RotationalTopkConfig(3))
