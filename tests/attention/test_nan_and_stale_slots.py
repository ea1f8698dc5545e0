"""Issue 11: NaN propagates through attention as in jax.nn.dot_product_attention (never turned into zeros), and cache
slots past a valid length (prefix prior_len, decode cache_len) never influence a result, whatever they hold."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.attention.attention_kv_parallel import merge_partials
from jax_nkilib.nki import attention_cte, attention_tkg
from tests.attention.oracle import attention_tkg_oracle, decode_attention_oracle, idiomatic_attention
from tests.support.data import random
from tests.support.numerics import assert_close

NAN = float("nan")


def qkv(batch=1, sq=8, sk=8, heads=2, kv_heads=1, d=4, dtype=jnp.float32):
    return (
        random((batch, sq, heads, d), dtype, 0),
        random((batch, sk, kv_heads, d), dtype, 1),
        random((batch, sk, kv_heads, d), dtype, 2),
    )


def nan_rows(x):
    """[batch, seq, heads] booleans: which output rows are entirely NaN (rows are all-NaN or all-finite)."""
    x = np.asarray(x, np.float64)
    assert np.all(np.isnan(x).all(-1) | np.isfinite(x).all(-1)), "a row is partly NaN"
    return np.isnan(x).all(-1)


# ------------------------------------------------------------------------------------------------ NaN contract
@pytest.mark.parametrize("seq", [8, 96])  # rows of 64+ keys take XLA's vectorised max reductions
def test_a_nan_query_row_gives_a_nan_output_row_like_jax_nn(seq):
    q, k, v = qkv(sq=seq, sk=seq)
    q = q.at[0, 3, 1].set(NAN)
    out = jax_nkilib.attention(q, k, v, causal=False)
    expected = np.zeros((1, seq, 2), bool)
    expected[0, 3, 1] = True
    np.testing.assert_array_equal(nan_rows(out), expected)
    np.testing.assert_array_equal(nan_rows(jax.nn.dot_product_attention(q, k, v)), expected)
    finite = ~expected[..., None].repeat(4, -1)
    q_clean = q.at[0, 3, 1].set(0.0)
    np.testing.assert_allclose(
        np.asarray(out)[finite], idiomatic_attention(q_clean, k, v, causal=False)[finite], rtol=1e-5, atol=1e-6
    )


def test_a_nan_key_poisons_exactly_the_rows_that_see_it():
    q, k, v = qkv()
    k = k.at[0, 5].set(NAN)  # causal: rows 5.. see key 5
    out = jax_nkilib.attention(q, k, v, causal=True)
    expected = np.broadcast_to((np.arange(8) >= 5)[None, :, None], (1, 8, 2))
    np.testing.assert_array_equal(nan_rows(out), expected)
    assert_close(out[:, :5], idiomatic_attention(q, k.at[0, 5].set(0.0), v)[:, :5], jnp.float32)


def test_nan_inputs_give_a_nan_loss_and_nan_gradients():
    q, k, v = qkv()
    loss = lambda a: jnp.sum(jax_nkilib.attention(a, k, v, causal=True) ** 2)  # noqa: E731
    assert np.isnan(loss(q * NAN))
    grads = jax.grad(loss)(q.at[0, 2, 0].set(NAN))
    assert np.isnan(np.asarray(grads[0, 2, 0])).all() and np.isfinite(np.asarray(grads[0, :2])).all()


def test_a_nan_sink_makes_its_head_nan():
    q, k, v = qkv()
    out = jax_nkilib.attention(q, k, v, sinks=jnp.array([NAN, 0.5]), causal=True)
    np.testing.assert_array_equal(nan_rows(out), np.broadcast_to(np.array([True, False]), (1, 8, 2)))
    assert_close(out[..., 1, :], idiomatic_attention(q, k, v, sinks=jnp.array([0.0, 0.5]))[..., 1, :], jnp.float32)


def test_rows_that_see_no_key_stay_zero_next_to_nan_rows():
    q, k, v = qkv(sq=12, sk=4)
    out = jax_nkilib.attention(q.at[0, 1].set(NAN), k, v, sliding_window=2, causal=True)  # queries 5.. see no key
    assert np.all(np.asarray(out[:, 5:]) == 0) and nan_rows(out)[0, 1].all() and not nan_rows(out)[0, 2:].any()


def test_kernel_native_cte_statistics_of_a_nan_row_are_nan():
    q = random((2, 128, 4)).at[1, 7].set(NAN)
    k, v = random((2, 4, 128), seed=1), random((2, 128, 4), seed=2)
    out, neg_max, recip = attention_cte(q, k, v, scale=0.5, cache_softmax=True)
    assert np.isnan(np.asarray(out[1, 7])).all() and np.isfinite(np.asarray(out[0])).all()
    # statistics [B, 128, Sq/128]: query 7 is partition 7 of tile 0
    assert np.isnan(float(neg_max[1, 7, 0])) and np.isnan(float(recip[1, 7, 0]))
    assert np.isfinite(np.asarray(neg_max[0])).all()


def test_kv_parallel_merge_keeps_nan_partials_and_empty_rows():
    out = jnp.ones((2, 3, 4))
    row_max = jnp.array([[0.0, -jnp.inf, 0.0], [1.0, -jnp.inf, NAN]])
    row_sum = jnp.array([[1.0, 0.0, 1.0], [2.0, 0.0, NAN]])
    merged = np.asarray(merge_partials(out, row_max, row_sum))
    np.testing.assert_allclose(merged[0], 1.0)
    assert np.all(merged[1] == 0) and np.isnan(merged[2]).all()


def test_kernel_native_tkg_nan_sink_is_nan():
    q, ka, va = random((1, 2, 1, 8)), random((1, 1, 1, 8), seed=1), random((1, 1, 1, 8), seed=2)
    cache = random((1, 1, 8, 8), seed=3)
    mask = jnp.ones((8, 1, 2, 1), jnp.uint8)
    out = attention_tkg(q, ka, va, cache, cache, mask, sink=jnp.array([[NAN], [0.0]]), tp_k_prior=True)
    assert np.isnan(np.asarray(out[0, 0])).all() and np.isfinite(np.asarray(out[0, 1])).all()


# ------------------------------------------------------------------------------------------------ stale slots
GARBAGE = [(NAN, float("inf")), (-float("inf"), NAN)]  # (keys, values) past the valid length


def test_prefix_slots_past_prior_len_never_influence_the_result():
    q, k, v = qkv()
    kp, vp = random((1, 1, 6, 4), seed=5), random((1, 1, 6, 4), seed=6)
    used = 4
    fn = jax.jit(lambda a, b, c, kp_, vp_, n: jax_nkilib.attention(a, b, c, prefix=(kp_, vp_, n), causal=True))
    grad_fn = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3, 4)))
    want = idiomatic_attention(q, k, v, prefix=(kp[:, :, :used], vp[:, :, :used], used))  # the valid slots only
    for garbage_k, garbage_v in GARBAGE:
        stale_k, stale_v = kp.at[:, :, used:].set(garbage_k), vp.at[:, :, used:].set(garbage_v)
        assert_close(fn(q, k, v, stale_k, stale_v, used), want, jnp.float32)
        grads = grad_fn(q, k, v, stale_k, stale_v, used)
        assert all(np.isfinite(np.asarray(g)).all() for g in grads)
        assert np.all(np.asarray(grads[3][:, :, used:]) == 0) and np.all(np.asarray(grads[4][:, :, used:]) == 0)


def test_decode_cache_slots_past_cache_len_never_influence_the_result():
    q, k_new, v_new = random((2, 2, 4, 8)), random((2, 2, 2, 8), seed=1), random((2, 2, 2, 8), seed=2)
    k_cache, v_cache = random((2, 2, 16, 8), seed=3), random((2, 2, 16, 8), seed=4)
    lengths = jnp.array([3, 9], jnp.int32)
    slots = np.arange(16)[None, None, :, None] >= np.asarray(lengths)[:, None, None, None]
    want = decode_attention_oracle(q, k_new, v_new, k_cache, v_cache, lengths)
    step = jax.jit(jax_nkilib.decode_attention)
    for garbage_k, garbage_v in GARBAGE:
        stale_k, stale_v = jnp.where(slots, garbage_k, k_cache), jnp.where(slots, garbage_v, v_cache)
        out, _, _ = step(q, k_new, v_new, stale_k, stale_v, lengths)
        assert_close(out, want, jnp.float32, reduction=16)


def test_decode_paged_stale_blocks_and_slots_never_influence_the_result():
    q, k_new, v_new = random((2, 1, 2, 8)), random((2, 1, 1, 8), seed=1), random((2, 1, 1, 8), seed=2)
    pool_k, pool_v = random((6, 1, 4, 8), seed=3), random((6, 1, 4, 8), seed=4)
    table = jnp.array([[2, 0, 5, 1], [3, 4, 1, 0]], jnp.int32)
    lengths = jnp.array([5, 2], jnp.int32)
    flat = [
        np.transpose(np.asarray(p)[np.asarray(table)], (0, 2, 1, 3, 4)).reshape(2, 1, 16, 8) for p in (pool_k, pool_v)
    ]
    want = decode_attention_oracle(q, k_new, v_new, *flat, lengths)
    # block 5 holds sequence 0's positions 8..11 (past its length 5) and is nobody else's: fill it with NaN;
    # block 0 holds positions 4..7 of sequence 0 (4 is valid) and 12..15 of sequence 1 (stale): its slot 3 is NaN
    stale_k, stale_v = (p.at[5].set(NAN).at[0, :, 3].set(NAN) for p in (pool_k, pool_v))
    out, _, _ = jax_nkilib.decode_attention(q, k_new, v_new, stale_k, stale_v, lengths, block_table=table)
    assert_close(out, want, jnp.float32, reduction=16)


def test_kernel_native_tkg_ignores_slots_no_query_sees():
    q, ka, va = random((2, 2, 1, 8)), random((2, 1, 1, 8), seed=1), random((2, 1, 1, 8), seed=2)
    k_prior, v_prior = random((2, 1, 128, 8), seed=3), random((2, 1, 128, 8), seed=4)
    positions = jnp.array([[7], [40]], jnp.int32)
    slots = np.arange(128)[None, None, :, None]
    stale = slots >= np.asarray(positions)[:, 0, None, None, None]
    kw = dict(rope_pos_ids=positions, use_pos_id=True, tp_k_prior=True, curr_sprior=128)
    mask = jnp.ones((1, 2, 2, 1), jnp.uint8)
    out = attention_tkg(q, ka, va, jnp.where(stale, NAN, k_prior), jnp.where(stale, jnp.inf, v_prior), mask, **kw)
    want, _ = attention_tkg_oracle(
        q, ka, va, k_prior, v_prior, mask, rope_pos_ids=positions, use_pos_id=True, tp_k_prior=True, curr_sprior=128
    )
    assert_close(out, want, jnp.float32, reduction=128)
