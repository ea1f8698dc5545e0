"""jax_nkilib.nki.RoPE: forward against the float64 oracle, vmap folding, oracle gradients, explain inside shard_map,
named residuals (jit, vmap, check_grads, shard_map, lowering: tests/conformance)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.nki import RoPE
from tests.rope.oracle import rope_oracle
from tests.support.data import angles, random
from tests.support.numerics import assert_close, assert_no_worse_than_plain
from tests.support.sharding import mesh_1d, shard

SHAPES = [(64, 2, 4, 16), (128, 1, 2, 8), (6, 3, 5, 7), (2, 1, 1, 1)]  # the last two: odd sizes off Neuron


def inputs(shape, dtype=jnp.float32, table_dtype=None):
    d, b, _, s = shape
    cos, sin = angles((d // 2, b, s), table_dtype or dtype)
    return random(shape, dtype), cos, sin


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_oracle(shape, contiguous, dtype):
    x, cos, sin = inputs(shape, dtype)
    out = RoPE(x, cos, sin, contiguous_layout=contiguous)
    assert out.shape == shape and out.dtype == dtype
    assert_close(out, rope_oracle(x, cos, sin, contiguous), dtype)


def test_bf16_error_is_that_of_a_plain_bf16_computation():
    x, cos, sin = inputs((64, 2, 4, 32), jnp.bfloat16)
    half = 32
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    plain = jnp.concatenate([x[:half] * c - x[half:] * s, x[half:] * c + x[:half] * s])
    expected = rope_oracle(x, cos, sin)
    assert_no_worse_than_plain(RoPE(x, cos, sin), plain, expected)


def test_float32_tables_with_bfloat16_input():
    x, cos, sin = inputs((64, 2, 3, 8), jnp.bfloat16, table_dtype=jnp.float32)
    out = RoPE(x, cos, sin)
    assert out.dtype == jnp.bfloat16
    assert_close(out, rope_oracle(x, cos, sin), jnp.bfloat16)


def test_flags_without_numeric_effect():
    x, cos, sin = inputs((64, 2, 3, 8))
    base = RoPE(x, cos, sin, contiguous_layout=False)
    np.testing.assert_array_equal(RoPE(x, cos, sin, contiguous_layout=False, relayout_in_sbuf=True), base)
    np.testing.assert_array_equal(RoPE(x, cos, sin, contiguous_layout=False, lnc_shard=True), base)


def _kernel_calls(jaxpr) -> list:
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is RoPE.primitive:
            found.append(eqn)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if hasattr(inner, "eqns"):
                found += _kernel_calls(inner)
    return found


@pytest.mark.parametrize("in_axes", [(0, None, None), (0, 0, 0), (None, 0, 0), (3, 1, None), (2, None, 0)])
def test_vmap_matches_loop_and_folds(in_axes):
    x, cos, sin = inputs((64, 2, 3, 5))
    n = 3
    batched = [
        jnp.stack([a * (i + 1) for i in range(n)], axis=ax) if ax is not None else a
        for a, ax in zip((x, cos, sin), in_axes)
    ]
    out = jax.vmap(lambda a, c, s: RoPE(a, c, s, contiguous_layout=False), in_axes=in_axes)(*batched)
    for i in range(n):
        args = [jnp.take(a, i, axis=ax) if ax is not None else a for a, ax in zip(batched, in_axes)]
        assert_close(out[i], rope_oracle(*args, contiguous_layout=False), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.vmap(RoPE, in_axes=in_axes))(*batched).jaxpr
    calls = _kernel_calls(jaxpr)
    assert len(calls) == 1, "vmap must fold into one kernel call"
    assert not any(eqn.primitive.name in ("scan", "while") for eqn in jaxpr.eqns)


def test_vmap_folds_shared_tables_into_heads():
    x, cos, sin = inputs((64, 2, 3, 5))
    jaxpr = jax.make_jaxpr(jax.vmap(RoPE, in_axes=(0, None, None)))(jnp.stack([x] * 4), cos, sin).jaxpr
    (call,) = _kernel_calls(jaxpr)
    assert call.invars[0].aval.shape == (64, 2, 12, 5)  # heads 3 * vmapped 4
    assert call.invars[1].aval.shape == (32, 2, 5)  # tables not broadcast


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_jacrev_is_the_oracle_jacobian():
    # vmap of grad: the conformance specs RoPE and RoPE.split_halves
    x, cos, sin = inputs((4, 1, 2, 3), jnp.float64)
    jac = jax.jacrev(RoPE)(x, cos, sin)
    oracle_jac = np.stack([rope_oracle(e.reshape(x.shape), cos, sin).ravel() for e in np.eye(x.size)], axis=1).reshape(
        x.shape + x.shape
    )
    np.testing.assert_allclose(jac, oracle_jac, atol=1e-12)


def test_input_gradient_is_rotation_by_minus_sin():
    x, cos, sin = inputs((8, 2, 3, 5), jnp.float64)
    g = random(x.shape, jnp.float64, seed=7)
    _, vjp = jax.vjp(lambda a: RoPE(a, cos, sin), x)
    np.testing.assert_allclose(vjp(g)[0], rope_oracle(g, cos, -sin), atol=1e-12)


def test_explain_inside_shard_map_reports_the_per_device_shard():
    # values and gradients inside shard_map along B: the conformance spec RoPE
    mesh = mesh_1d()
    x, cos, sin = inputs((64, 8, 2, 16))
    spec_x, spec_t = P(None, "data", None, None), P(None, "data", None)
    x, cos, sin = shard(mesh, (spec_x, spec_t, spec_t), x, cos, sin)
    report = jax_nkilib.explain(
        jax.shard_map(RoPE, mesh=mesh, in_specs=(spec_x, spec_t, spec_t), out_specs=spec_x), x, cos, sin
    )
    (call,) = report
    assert call.inputs[0][1] == (64, 1, 2, 16)  # per-device shard
    assert "shard_map" in call.context and "data=8" in call.context


def test_residuals_are_named_for_remat_policies():
    x, cos, sin = inputs((8, 2, 3, 5), jnp.float64)
    loss = lambda a, c: jnp.sum(jnp.sin(RoPE(a, c, sin)))  # noqa: E731
    assert "RoPE.x_in" in str(jax.make_jaxpr(jax.grad(loss))(x, cos))
    policy = jax.checkpoint_policies.save_only_these_names("RoPE.x_in", "RoPE.cos", "RoPE.sin")
    remat = jax.checkpoint(loss, policy=policy)
    chex.assert_trees_all_close(
        jax.grad(remat, argnums=(0, 1))(x, cos), jax.grad(loss, argnums=(0, 1))(x, cos), rtol=1e-12
    )
