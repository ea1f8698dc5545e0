"""jax_nkilib.embedding_lookup: rows for ids of any shape and integer dtype against a float64 NumPy oracle,
repeated ids in the gradient, out-of-range ids, the Neuron lowering (gather forward, scatter_add backward, LNC
padding), vmap, sharding and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib import embedding_lookup
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64
from tests.support.sharding import use_mesh


def lookup_oracle(table, ids):
    return np.asarray(f64(table))[np.asarray(ids)]


def table_gradient_oracle(vocab, ids, d_out):
    grad = np.zeros((vocab, d_out.shape[-1]))
    np.add.at(grad, np.asarray(ids).reshape(-1), np.asarray(f64(d_out)).reshape(-1, d_out.shape[-1]))
    return grad


def ids_of(shape, vocab, seed=0, dtype=jnp.int32):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, size=shape), dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4)])
def test_rows_match_the_oracle_exactly(dtype, shape):
    table, ids = random((37, 9), dtype), ids_of(shape, 37)
    out = embedding_lookup(table, ids)
    assert out.shape == (*shape, 9) and out.dtype == dtype
    np.testing.assert_array_equal(f64(out), lookup_oracle(table, ids))


@pytest.mark.parametrize("dtype", [jnp.uint8, jnp.int16, jnp.uint32, jnp.int64])
def test_any_integer_dtype(dtype):
    table, ids = random((200, 4)), ids_of((3, 4), 200, dtype=dtype)
    np.testing.assert_array_equal(embedding_lookup(table, ids), lookup_oracle(table, ids))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradient_accumulates_repeated_ids(dtype):
    table, ids = random((11, 6), dtype), ids_of((4, 40), 11, seed=1)  # each id repeats about 15 times
    d_out = random((4, 40, 6), dtype, seed=2)
    _, pull = jax.vjp(lambda t: embedding_lookup(t, ids), table)
    (grad,) = pull(d_out)
    assert grad.dtype == dtype
    repeats = int(np.bincount(np.asarray(ids).ravel()).max())
    assert_close(grad, table_gradient_oracle(11, ids, d_out), dtype, reduction=repeats)


def test_check_grads_in_float64():
    table, ids = random((13, 5), jnp.float64), ids_of((3, 7), 13, seed=3)
    check_grads(lambda t: embedding_lookup(t, ids), (table,), order=2, modes=["rev"])


def test_out_of_range_ids_raise_when_concrete_and_clamp_when_traced():
    table = random((5, 3), jnp.float64)
    for bad in ([0, 5], [[1], [-1]]):
        with pytest.raises(ValueError, match=r"jax_nkilib.embedding_lookup: ids\[.*outside \[0, vocab=5\)"):
            embedding_lookup(table, jnp.asarray(bad, jnp.int32))
    ids = jnp.array([-4, 2, 9], jnp.int32)
    out = jax.jit(embedding_lookup)(table, ids)
    np.testing.assert_array_equal(out, np.asarray(table)[[0, 2, 4]])
    (grad,) = jax.grad(lambda t, i: jnp.sum(jax.jit(embedding_lookup)(t, i)), argnums=(0,))(table, ids)
    np.testing.assert_array_equal(grad[:, 0], [1, 0, 1, 0, 1])  # the clamped rows receive the gradient
    with jax_nkilib.config(runtime_checks=True):
        checked = jax.jit(checkify.checkify(embedding_lookup, errors=checkify.user_checks))
        err, _ = checked(table, ids)
    assert "ids[0] = -4 is outside [0, vocab=5)" in err.get()


def test_empty_ids_and_vmap():
    table = random((6, 4))
    assert embedding_lookup(table, jnp.zeros((0, 3), jnp.int32)).shape == (0, 3, 4)
    ids = ids_of((5, 2, 3), 6, seed=4)
    out = jax.vmap(embedding_lookup, (None, 0))(table, ids)
    np.testing.assert_array_equal(out, lookup_oracle(table, ids))
    tables = random((5, 6, 4), seed=5)
    out = jax.vmap(embedding_lookup)(tables, ids)
    np.testing.assert_array_equal(out, np.stack([lookup_oracle(tables[b], ids[b]) for b in range(5)]))


@pytest.mark.parametrize("lnc, count, padded", [(1, 15, 15), (2, 15, 16), (2, 12, 12)])
def test_neuron_forward_and_backward_are_gather_and_scatter_add(lnc, count, padded):
    table, ids = jnp.zeros((64, 32), jnp.float32), jnp.zeros((count,), jnp.int32)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = neuron_text(jax.value_and_grad(lambda t: embedding_lookup(t, ids).sum()), table)
    gather_cfg, scatter_cfg = kernel_configs(text)
    assert gather_cfg["func_name"] == "gather" and scatter_cfg["func_name"] == "scatter_add"
    assert scatter_cfg["params"] == {"dim": 0, "unique_indices": False} and scatter_cfg["aliases"] == [[0, 0]]
    assert f"tensor<{padded}x32xf32>" in text and gather_cfg["grid"] == lnc


def test_a_table_sharded_over_the_vocabulary_is_refused():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    with use_mesh(mesh):
        table = jax.device_put(random((16, 4)), NamedSharding(mesh, P("data")))
        with pytest.raises(ValueError, match="jax_nkilib.embedding_lookup.*table"):
            jax.jit(embedding_lookup)(table, jnp.zeros((3,), jnp.int32))


@pytest.mark.parametrize(
    "table, ids, error, match",
    [
        (jnp.zeros((4, 3), jnp.float32), jnp.zeros((2,), jnp.float32), TypeError, "`ids` must have an integer"),
        (jnp.zeros((4, 3), jnp.int32), jnp.zeros((2,), jnp.int32), TypeError, "`table`"),
        (jnp.zeros((4,), jnp.float32), jnp.zeros((2,), jnp.int32), ValueError, "`table`"),
        (jnp.zeros((0, 3), jnp.float32), jnp.zeros((2,), jnp.int32), ValueError, "at least one row"),
        ([[1.0]], jnp.zeros((2,), jnp.int32), TypeError, "`table`"),
    ],
)
def test_bad_inputs_name_the_argument(table, ids, error, match):
    with pytest.raises(error, match=match):
        embedding_lookup(table, ids)
