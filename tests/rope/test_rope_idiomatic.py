"""jax_nkilib.rope: JAX layout [..., seq, heads, head_dim], broadcasting tables, autodiff, vmap, shard_map."""

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from tests.rope.oracle import idiomatic_rope_oracle
from tests.support.data import angles, random
from tests.support.numerics import assert_close, assert_no_worse_than_plain
from tests.support.sharding import mesh_1d, shard


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "x_shape, table_shape",
    [
        ((2, 7, 3, 8), (7, 4)),  # shared table
        ((2, 7, 3, 8), (2, 7, 4)),  # per-batch table
        ((7, 3, 8), (7, 4)),  # no batch axis
        ((3, 2, 5, 1, 64), (2, 5, 32)),  # two leading axes, table broadcast over the first
        ((2, 5, 2, 6), (1, 5, 3)),  # batch-1 table
    ],
)
def test_forward_matches_oracle(dtype, interleaved, x_shape, table_shape):
    x = random(x_shape, dtype)
    cos, sin = angles(table_shape, dtype)
    out = jax_nkilib.rope(x, cos, sin, interleaved=interleaved)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, idiomatic_rope_oracle(x, cos, sin, interleaved), dtype)


def test_bf16_error_is_that_of_a_plain_bf16_computation():
    x = random((2, 64, 4, 128), jnp.bfloat16)
    cos, sin = angles((64, 64), jnp.bfloat16)
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = x[..., :64], x[..., 64:]
    plain = jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)
    assert_no_worse_than_plain(jax_nkilib.rope(x, cos, sin), plain, idiomatic_rope_oracle(x, cos, sin))


def test_gradients_float64():
    # per-batch tables not interleaved and shared tables interleaved: the conformance specs rope and
    # rope.interleaved_shared_tables
    x = random((2, 3, 2, 4), jnp.float64)
    for table_shape, interleaved in (((3, 2), False), ((2, 3, 2), True)):
        cos, sin = angles(table_shape, jnp.float64)
        check_grads(lambda *a: jax_nkilib.rope(*a, interleaved=interleaved), (x, cos, sin), order=2, modes=["rev"])


def test_gradient_matches_oracle_gradient():
    """Gradients against finite differences of the float64 oracle itself."""
    x = random((1, 3, 2, 4), jnp.float64)
    cos, sin = angles((3, 2), jnp.float64)
    g = random(x.shape, jnp.float64, seed=11)
    _, vjp = jax.vjp(jax_nkilib.rope, x, cos, sin)
    dx, dcos, dsin = vjp(g)
    eps = 1e-6

    def numeric(arg_index, shape):
        grad = np.zeros(shape)
        base = [np.asarray(x), np.asarray(cos), np.asarray(sin)]
        for idx in np.ndindex(shape):
            plus, minus = [b.copy() for b in base], [b.copy() for b in base]
            plus[arg_index][idx] += eps
            minus[arg_index][idx] -= eps
            diff = idiomatic_rope_oracle(*plus) - idiomatic_rope_oracle(*minus)
            grad[idx] = np.sum(np.asarray(g) * diff) / (2 * eps)
        return grad

    np.testing.assert_allclose(dx, numeric(0, x.shape), atol=1e-8)
    np.testing.assert_allclose(dcos, numeric(1, cos.shape), atol=1e-8)
    np.testing.assert_allclose(dsin, numeric(2, sin.shape), atol=1e-8)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_vmap_against_the_oracle_and_jacrev():
    x = random((2, 5, 3, 8))
    cos, sin = angles((5, 4))
    xs = jnp.stack([x, -x, 2 * x])
    out = jax.jit(jax.vmap(jax_nkilib.rope, in_axes=(0, None, None)))(xs, cos, sin)
    assert_close(out[2], idiomatic_rope_oracle(xs[2], cos, sin), jnp.float32)
    cos_b = jnp.stack([cos, cos * 0.5])
    partial = jax.vmap(jax_nkilib.rope, in_axes=(None, 0, None))(x, cos_b, sin)
    assert_close(partial[1], idiomatic_rope_oracle(x, cos_b[1], sin), jnp.float32)
    jac = jax.jacrev(jax_nkilib.rope, argnums=1)(x[:1, :2, :1, :4], cos[:2, :2], sin[:2, :2])
    assert jac.shape == (1, 2, 1, 4, 2, 2)


def test_head_sharded_inside_shard_map_with_replicated_tables():
    mesh = mesh_1d("model")
    x = random((2, 6, 8, 64))
    cos, sin = angles((6, 32))
    x_spec, t_spec = P(None, None, "model"), P()
    args = shard(mesh, (x_spec, t_spec, t_spec), x, cos, sin)
    fn = jax.shard_map(jax_nkilib.rope, mesh=mesh, in_specs=(x_spec, t_spec, t_spec), out_specs=x_spec)
    assert_close(jax.jit(fn)(*args), idiomatic_rope_oracle(x, cos, sin), jnp.float32)
    lowered = jax.jit(fn).lower(*args).compile().as_text()
    assert "all-gather" not in lowered and "all-reduce" not in lowered


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    seq=st.integers(1, 9),
    heads=st.integers(1, 4),
    half=st.integers(1, 5),
    batched_table=st.booleans(),
    interleaved=st.booleans(),
)
@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_property_any_shape_matches_oracle(lead, seq, heads, half, batched_table, interleaved):
    x = random((*lead, seq, heads, 2 * half))
    table_shape = ((lead[-1] if lead else 1), seq, half) if batched_table else (seq, half)
    cos, sin = angles(table_shape)
    out = jax_nkilib.rope(x, cos, sin, interleaved=interleaved)
    assert_close(out, idiomatic_rope_oracle(x, cos, sin, interleaved), jnp.float32)
