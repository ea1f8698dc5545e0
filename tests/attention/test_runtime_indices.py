"""Issue 11: invalid run-time indices (decode_attention's cache_len and block_table, nki.attention_tkg's
active_blocks_table, attention's traced prefix length) never write anywhere, give NaN rows, and are reported by
jax.experimental.checkify under jax_nkilib.config(runtime_checks=True)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

import jax_nkilib
from jax_nkilib.nki import attention_tkg
from tests.attention.oracle import decode_attention_oracle, idiomatic_attention
from tests.support.data import random
from tests.support.numerics import assert_close


def flat_problem():
    """batch 2, s_new 1, heads 2, kv_heads 1, d 8, capacity 16 (valid lengths 0..14)."""
    return (
        random((2, 1, 2, 8)),
        random((2, 1, 1, 8), seed=1),
        random((2, 1, 1, 8), seed=2),
        random((2, 1, 16, 8), seed=3),
        random((2, 1, 16, 8), seed=4),
    )


def checker(fn):
    """``fn`` jitted under checkify with run-time checks on (traced once): returns ``(error message or None,
    outputs)``."""
    with jax_nkilib.config(runtime_checks=True):
        checked = jax.jit(checkify.checkify(fn, errors=checkify.user_checks))

    def run(*args):
        with jax_nkilib.config(runtime_checks=True):
            err, outs = checked(*args)
        return err.get(), outs

    return run


def test_an_invalid_cache_len_writes_nothing_and_gives_nan_rows():
    q, k_new, v_new, k_cache, v_cache = flat_problem()
    step = jax.jit(jax_nkilib.decode_attention)
    report = checker(lambda n: jax_nkilib.decode_attention(q, k_new, v_new, k_cache, v_cache, n))
    for bad_len in (-2, 15, 40):  # 15: one past the last valid length 16 - 2 * s_new = 14
        lengths = jnp.array([bad_len, 6], jnp.int32)
        out, k2, v2 = step(q, k_new, v_new, k_cache, v_cache, lengths)
        assert np.isnan(np.asarray(out[0])).all()
        np.testing.assert_array_equal(k2[0], k_cache[0])  # nothing written for sequence 0 (not at 14, nowhere)
        np.testing.assert_array_equal(v2[0], v_cache[0])
        assert_close(
            out[1],
            decode_attention_oracle(q, k_new, v_new, k_cache, v_cache, jnp.array([0, 6]))[1],
            jnp.float32,
            reduction=16,
        )
        np.testing.assert_array_equal(k2[1, :, 6], k_new[1, 0])  # sequence 1 is written as usual
        message, _ = report(lengths)
        assert f"jax_nkilib.decode_attention: cache_len[0] = {bad_len} is outside [0, 14]" in message
    message, (out, _, _) = report(jnp.array([0, 14], jnp.int32))  # both ends of the valid range
    assert message is None and np.isfinite(np.asarray(out)).all()


def test_checks_are_dropped_without_checkify_and_off_by_default():
    args = flat_problem()
    lengths = jnp.array([-1, 3], jnp.int32)
    with jax_nkilib.config(runtime_checks=True):  # no checkify: the check is dropped, the NaN contract stays
        out, _, _ = jax.jit(jax_nkilib.decode_attention)(*args, lengths)
    assert np.isnan(np.asarray(out[0])).all() and np.isfinite(np.asarray(out[1])).all()
    jaxpr = jax.make_jaxpr(jax_nkilib.decode_attention)(*args, lengths)
    assert not jaxpr.effects  # off by default: no check, no effect on dispatch


def test_a_block_table_entry_past_the_pool_writes_nothing_and_gives_nan_rows():
    q, k_new, v_new = random((2, 1, 2, 8)), random((2, 1, 1, 8), seed=1), random((2, 1, 1, 8), seed=2)
    pool_k, pool_v = random((6, 1, 4, 8), seed=3), random((6, 1, 4, 8), seed=4)
    lengths = jnp.array([5, 2], jnp.int32)
    fn = lambda t: jax_nkilib.decode_attention(q, k_new, v_new, pool_k, pool_v, lengths, block_table=t)  # noqa
    step, report = jax.jit(fn), checker(fn)
    for bad_block in (99, -1, 6):
        table = jnp.array([[2, 0, 5, 1], [3, 4, bad_block, 0]], jnp.int32)
        out, k2, v2 = step(table)
        assert np.isnan(np.asarray(out[1])).all() and np.isfinite(np.asarray(out[0])).all()
        changed = np.nonzero(np.any(np.asarray(k2) != np.asarray(pool_k), axis=(1, 2, 3)))[0]
        np.testing.assert_array_equal(changed, [0])  # only sequence 0's write, position 5 = block 0 slot 1
        np.testing.assert_array_equal(k2[0, :, 1], k_new[0, 0])
        np.testing.assert_array_equal(np.asarray(v2)[1:], np.asarray(pool_v)[1:])
        message, _ = report(table)
        assert f"block_table entry (sequence, block) [1 2] is {bad_block}, not a block of the caches" in message


def test_kernel_native_tkg_table_entry_past_the_pools_gives_nan_rows_and_a_report():
    q, ka, va = random((2, 2, 1, 8)), random((2, 1, 1, 8), seed=1), random((2, 1, 1, 8), seed=2)
    pools = random((4, 128, 8), seed=3), random((4, 128, 8), seed=4)
    table = jnp.array([[0, 1], [2, 7]], jnp.uint32)
    kw = dict(
        rope_pos_ids=jnp.array([[3], [130]], jnp.int32),
        use_pos_id=True,
        tp_k_prior=True,
        curr_sprior=256,
        block_len=128,
    )
    mask = jnp.ones((1, 2, 2, 1), jnp.uint8)
    report = checker(lambda t: attention_tkg(q, ka, va, *pools, mask, active_blocks_table=t, **kw))
    message, out = report(table)
    assert np.isnan(np.asarray(out[1])).all() and np.isfinite(np.asarray(out[0])).all()
    assert "jax_nkilib.nki.attention_tkg: active_blocks_table entry (row, block) [1 1] is 7" in message
    assert report(table.at[1, 1].set(3))[0] is None


def test_attention_traced_prior_len_out_of_range_gives_nan_and_a_report():
    q, k, v = random((1, 4, 2, 8)), random((1, 4, 1, 8), seed=1), random((1, 4, 1, 8), seed=2)
    kp, vp = random((1, 1, 6, 8), seed=3), random((1, 1, 6, 8), seed=4)
    report = checker(lambda n: jax_nkilib.attention(q, k, v, prefix=(kp, vp, n), causal=True))
    for bad in (-1, 7):
        message, out = report(jnp.int32(bad))
        assert np.isnan(np.asarray(out)).all()
        assert f"jax_nkilib.attention: prefix prior_len = {bad} is outside [0, 6]" in message
    message, out = report(jnp.int32(6))
    assert message is None
    assert_close(out, idiomatic_attention(q, k, v, prefix=(kp, vp, 6)), jnp.float32)
