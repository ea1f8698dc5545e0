"""jax_nkilib.nki.rope_hf: forward and backward flag against the float64 oracle, gradients of the variants no arg spec
covers, vmap axes and its fallback (jit, the rest of vmap, shard_map: tests/conformance)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_nkilib.nki import rope_hf
from tests.rope.oracle import rope_hf_oracle
from tests.support.data import angles, random
from tests.support.numerics import assert_close


def qk(b=2, hq=4, hk=2, s=9, d=8, dtype=jnp.float32):
    return random((b, hq, s, d), dtype, seed=3), random((b, hk, s, d), dtype, seed=4)


def tables(shape, dtype=jnp.float32):
    return angles(shape, dtype, seed=5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("table_batch", [False, True])
def test_forward_matches_oracle(dtype, backward, table_batch):
    q, k = qk(dtype=dtype)
    cos, sin = tables((2, 12, 8) if table_batch else (12, 8), dtype)  # S_rope 12 >= S 9: first 9 rows used
    q_out, k_out = rope_hf(q, k, cos=cos, sin=sin, backward=backward)
    want_q, want_k = rope_hf_oracle(q, k, cos, sin, backward=backward)
    assert q_out.dtype == dtype and k_out.shape == k.shape
    assert_close(q_out, want_q, dtype)
    assert_close(k_out, want_k, dtype)


@pytest.mark.parametrize("table_batch", [False, True])
def test_packed_rope_cache_equals_separate_tables(table_batch):
    q, k = qk()
    cos, sin = tables((2, 9, 8) if table_batch else (9, 8))
    cache = jnp.concatenate([cos, sin], axis=-1)
    packed = rope_hf(q, k, rope_cache=cache)
    separate = rope_hf(q, k, cos, sin)
    np.testing.assert_array_equal(packed[0], separate[0])
    np.testing.assert_array_equal(packed[1], separate[1])
    assert_close(packed[0], rope_hf_oracle(q, k, rope_cache=cache)[0], jnp.float32)


def test_backward_flag_is_the_transpose_of_forward():
    q, k = qk(dtype=jnp.float64)
    cos, sin = tables((9, 8), jnp.float64)
    g_q, g_k = random(q.shape, jnp.float64, seed=8), random(k.shape, jnp.float64, seed=9)
    _, vjp = jax.vjp(lambda a, b: rope_hf(a, b, cos, sin), q, k)
    dq, dk = vjp((g_q, g_k))
    bq, bk = rope_hf(g_q, g_k, cos, sin, backward=True)
    np.testing.assert_allclose(dq, bq, atol=1e-12)
    np.testing.assert_allclose(dk, bk, atol=1e-12)


@pytest.mark.parametrize("table_batch", [False, True])
def test_gradients_float64(table_batch):
    q, k = qk(b=2, hq=2, hk=1, s=3, d=4, dtype=jnp.float64)
    cos, sin = tables((2, 5, 4) if table_batch else (5, 4), jnp.float64)
    # backward=False at order 2 is the conformance specs rope_hf (batched tables) and rope_hf.shared_tables
    check_grads(lambda *a: rope_hf(*a, backward=True), (q, k, cos, sin), order=2, modes=["rev"])
    check_grads(
        lambda a, b, c: rope_hf(a, b, rope_cache=c), (q, k, jnp.concatenate([cos, sin], -1)), order=1, modes=["rev"]
    )


# every operand along axis 0 is the conformance spec rope_hf's vmap check
@pytest.mark.parametrize("in_axes", [(0, 0, None, None), (1, None, None, None), (None, 0, 1, 1)])
def test_vmap(in_axes):
    q, k = qk(s=5)
    cos, sin = tables((2, 5, 8))
    n = 3
    args = [
        jnp.stack([a + i for i in range(n)], axis=ax) if ax is not None else a
        for a, ax in zip((q, k, cos, sin), in_axes)
    ]
    out_q, out_k = jax.vmap(lambda *a: rope_hf(*a), in_axes=in_axes)(*args)
    for i in range(n):
        one = [jnp.take(a, i, axis=ax) if ax is not None else a for a, ax in zip(args, in_axes)]
        want_q, want_k = rope_hf_oracle(*one)
        assert_close(out_q[i], want_q, jnp.float32)
        assert_close(out_k[i], want_k, jnp.float32)


def test_vmap_of_batched_two_dimensional_tables_falls_back_to_map():
    q, k = qk(s=5)
    cos, sin = tables((3, 5, 8))  # vmapped over a [S, D] table: no kernel axis to fold into
    out_q, _ = jax.vmap(lambda c, s: rope_hf(q, k, c, s))(cos, sin)
    for i in range(3):
        assert_close(out_q[i], rope_hf_oracle(q, k, cos[i], sin[i])[0], jnp.float32)
    jaxpr = jax.make_jaxpr(jax.vmap(lambda c, s: rope_hf(q, k, c, s)))(cos, sin)
    assert "scan" in str(jaxpr)
