"""jax_nkilib.nki.gather / scatter_add: against float64 NumPy oracles (float32, bfloat16, odd sizes, repeated
indices), each the other's VJP, vmap, the in-place alias and LNC limits on the Neuron lowering, run-time checks and
bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import gather, scatter_add
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, assert_no_worse_than_plain, f64


def gather_oracle(table, index):
    return np.asarray(f64(table))[np.asarray(index)]


def scatter_add_oracle(table, index, src):
    out = np.array(f64(table))
    np.add.at(out, np.asarray(index), np.asarray(f64(src)))
    return out


def indices(n, k, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, n, size=k), jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n, d, k", [(7, 5, 11), (130, 33, 257), (1, 3, 4)])
def test_gather_matches_oracle_exactly(dtype, n, d, k):
    table, index = random((n, d), dtype), indices(n, k)
    out = gather(table, index)
    assert out.shape == (k, d) and out.dtype == dtype
    np.testing.assert_array_equal(f64(out), gather_oracle(table, index))  # a copy: bit exact


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n, d, k", [(7, 5, 11), (130, 33, 300)])
def test_scatter_add_accumulates_repeated_indices(dtype, n, d, k):
    table, src, index = random((n, d), dtype, 1), random((k, d), dtype, 2), indices(n, k, seed=3)
    assert len(np.unique(np.asarray(index))) < k  # repeats, also within one 128-row tile
    out = scatter_add(table, index, src, unique_indices=False)
    assert out.shape == (n, d) and out.dtype == dtype
    expected = scatter_add_oracle(table, index, src)
    repeats = int(np.bincount(np.asarray(index)).max())
    assert_close(out, expected, dtype, reduction=repeats + 1)
    if dtype == jnp.bfloat16:  # no worse than the plain bfloat16 scatter-add
        plain = table.at[index].add(src)
        assert_no_worse_than_plain(out, plain, expected)


def test_scatter_add_with_unique_indices_is_exact():
    table, src = random((300, 8), jnp.float32, 1), random((256, 8), jnp.float32, 2)
    index = jnp.asarray(np.random.default_rng(4).permutation(300)[:256], jnp.int32)
    out = scatter_add(table, index, src)  # unique_indices=True, its precondition met
    # one float32 add per element: the exact sum rounded once
    np.testing.assert_array_equal(out, scatter_add_oracle(table, index, src).astype(np.float32))


def test_out_of_range_indices_are_clamped_in_both_directions():
    table = random((4, 3), jnp.float64)
    index = jnp.array([-3, 9, 2], jnp.int32)
    np.testing.assert_array_equal(gather(table, index), np.asarray(table)[[0, 3, 2]])
    src = random((3, 3), jnp.float64, 1)
    np.testing.assert_allclose(scatter_add(table, index, src), scatter_add_oracle(table, [0, 3, 2], src))
    check_grads(lambda t: gather(t, index), (table,), order=1, modes=["rev"])


def test_vjps_are_each_other():
    table, index = random((9, 4), jnp.float64), indices(9, 14)
    dy = random((14, 4), jnp.float64, 5)
    _, pull = jax.vjp(lambda t: gather(t, index), table)
    np.testing.assert_allclose(pull(dy)[0], scatter_add_oracle(np.zeros((9, 4)), index, dy))
    src = random((14, 4), jnp.float64, 6)
    dz = random((9, 4), jnp.float64, 7)
    _, pull = jax.vjp(lambda t, s: scatter_add(t, index, s, unique_indices=False), table, src)
    d_table, d_src = pull(dz)
    np.testing.assert_array_equal(d_table, dz)
    np.testing.assert_array_equal(d_src, np.asarray(dz)[np.asarray(index)])
    check_grads(lambda t, s: scatter_add(t, index, s, unique_indices=False), (table, src), order=2, modes=["rev"])


def test_vmap_folds_a_batch_of_index_vectors_and_maps_batched_tables():
    table, index = random((10, 6)), indices(10, 12).reshape(3, 4)
    out = jax.vmap(gather, (None, 0))(table, index)
    np.testing.assert_array_equal(out, np.asarray(table)[np.asarray(index)])
    jaxpr = str(jax.make_jaxpr(jax.vmap(gather, (None, 0)))(table, index))
    assert jaxpr.count("gather[") == 1 and "while" not in jaxpr  # folded into K, not a loop
    tables, src = random((3, 10, 6), seed=1), random((3, 4, 6), seed=2)
    out = jax.vmap(lambda t, i, s: scatter_add(t, i, s, unique_indices=False))(tables, index, src)
    for b in range(3):
        assert_close(out[b], scatter_add_oracle(tables[b], index[b], src[b]), jnp.float32, reduction=4)


@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_lowering_is_one_kernel_call_scatter_add_aliasing_its_input(lnc):
    table, src, index = jnp.zeros((64, 32), jnp.float32), jnp.zeros((16, 32), jnp.float32), jnp.zeros((16,), jnp.int32)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = neuron_text(lambda t, i, s: scatter_add(t, i, s, unique_indices=False), table, index, src)
        gathered = neuron_text(gather, table, index)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "scatter_add" and cfg["grid"] == lnc and cfg["aliases"] == [[0, 0]]
    assert cfg["entry_point"] == "jax_nkilib_kernels.misc:scatter_add"
    assert cfg["params"] == {"dim": 0, "unique_indices": False} and "output_operand_aliases" in text
    (cfg,) = kernel_configs(gathered)
    assert cfg["func_name"] == "gather" and cfg["params"] == {"dim": 0} and cfg["aliases"] == []
    assert compute_operations(text) == compute_operations(gathered) == []


def test_neuron_gradient_of_gather_is_the_scatter_add_kernel():
    table, index = jnp.zeros((64, 32), jnp.float32), jnp.zeros((16,), jnp.int32)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=1):
        text = neuron_text(jax.value_and_grad(lambda t: gather(t, index).sum()), table)
    configs = kernel_configs(text)
    assert [c["func_name"] for c in configs] == ["gather", "scatter_add"]
    assert configs[1]["params"]["unique_indices"] is False


@pytest.mark.parametrize(
    "fn, args, limit",
    [
        (
            gather,
            (jnp.zeros((8, 4), jnp.float32), jnp.zeros((5,), jnp.int32)),
            "K=5 must be a multiple of the LNC degree 2",
        ),
        (
            scatter_add,
            (jnp.zeros((8, 5), jnp.float32), jnp.zeros((4,), jnp.int32), jnp.zeros((4, 5), jnp.float32)),
            "D=5 must be a multiple of the LNC degree 2",
        ),
    ],
)
def test_lnc2_limits_fall_back_with_a_warning(fn, args, limit):
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2), pytest.warns(NeuronFallbackWarning, match=limit):
        text = neuron_text(fn, *args)
    assert kernel_configs(text) == []
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2, on_unsupported="error"):
        with pytest.raises(Exception, match=limit):
            neuron_text(fn, *args)


def _checked(fn):
    with jax_nkilib.config(runtime_checks=True):
        checked = jax.jit(checkify.checkify(fn, errors=checkify.user_checks))

    def run(*args):
        with jax_nkilib.config(runtime_checks=True):
            err, _ = checked(*args)
        return err.get()

    return run


def test_runtime_checks_report_out_of_range_and_repeats_within_a_tile():
    table, src = jnp.zeros((200, 2)), jnp.ones((130, 2))
    report = _checked(lambda i: scatter_add(table, i, src))
    unique = jnp.asarray(np.random.default_rng(0).permutation(200)[:130], jnp.int32)
    assert report(unique) is None
    assert "repeats within one tile of 128" in report(unique.at[5].set(unique[77]))
    assert report(unique.at[129].set(unique[3])) is None  # different tiles: the kernel accumulates them
    assert "outside [0, N=200)" in report(unique.at[7].set(200))
    assert "outside [0, N=200)" in _checked(lambda i: gather(table, i))(jnp.array([-1, 0], jnp.int32))


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: gather(jnp.zeros((4, 3)), jnp.zeros((2,), jnp.float32)), TypeError, "index"),
        (lambda: gather(jnp.zeros((4, 3)), jnp.zeros((2, 1), jnp.int32)), ValueError, "index"),
        (lambda: gather(jnp.zeros((4, 3)), jnp.zeros((2,), jnp.int32), dim=1), ValueError, "dim"),
        (lambda: scatter_add(jnp.zeros((4, 3)), jnp.zeros((2,), jnp.int32), jnp.zeros((3, 3))), ValueError, "src"),
        (
            lambda: scatter_add(jnp.zeros((4, 3)), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3), jnp.bfloat16)),
            TypeError,
            "src",
        ),
        (
            lambda: scatter_add(jnp.zeros((4, 3)), jnp.zeros((2,), jnp.int32), jnp.zeros((2, 3)), unique_indices=1),
            TypeError,
            "unique_indices",
        ),
    ],
)
def test_bad_inputs_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()
