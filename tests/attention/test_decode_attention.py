"""jax_nkilib.decode_attention: per-sequence cache lengths, GQA, functional cache update, transformations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from tests.attention.oracle import decode_attention_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close


def problem(batch=2, s_new=2, heads=4, kv_heads=2, d=8, max_len=16, dtype=jnp.float32):
    return (
        random((batch, s_new, heads, d), dtype, 0),
        random((batch, s_new, kv_heads, d), dtype, 1),
        random((batch, s_new, kv_heads, d), dtype, 2),
        random((batch, kv_heads, max_len, d), dtype, 3),
        random((batch, kv_heads, max_len, d), dtype, 4),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [dict(), dict(s_new=1, kv_heads=1), dict(kv_heads=4, s_new=3)])
def test_matches_oracle_and_updates_the_cache(dtype, shape):
    q, k_new, v_new, k_cache, v_cache = problem(dtype=dtype, **shape)
    lengths = jnp.array([0, 9], jnp.int32)
    out, k2, v2 = jax_nkilib.decode_attention(q, k_new, v_new, k_cache, v_cache, lengths)
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, decode_attention_oracle(q, k_new, v_new, k_cache, v_cache, lengths), dtype, reduction=16)
    s_new = q.shape[1]
    for b, n in enumerate([0, 9]):
        np.testing.assert_array_equal(k2[b, :, n : n + s_new], np.swapaxes(np.asarray(k_new[b]), 0, 1))
        np.testing.assert_array_equal(v2[b, :, :n], v_cache[b, :, :n])
        np.testing.assert_array_equal(v2[b, :, n + s_new :], v_cache[b, :, n + s_new :])


def test_jit_generation_loop_and_vmap():
    q, k_new, v_new, k_cache, v_cache = problem(s_new=1)
    step = jax.jit(jax_nkilib.decode_attention)
    lengths = jnp.array([2, 5], jnp.int32)
    for _ in range(3):  # three decode steps, feeding the updated caches back
        out, k_cache2, v_cache2 = step(q, k_new, v_new, k_cache, v_cache, lengths)
        assert_close(out, decode_attention_oracle(q, k_new, v_new, k_cache, v_cache, lengths), jnp.float32)
        k_cache, v_cache, lengths = k_cache2, v_cache2, lengths + 1
    stacked = jax.vmap(jax_nkilib.decode_attention, in_axes=(0, None, None, None, None, None))(
        jnp.stack([q, -q]), k_new, v_new, k_cache, v_cache, lengths
    )
    assert_close(stacked[0][1], decode_attention_oracle(-q, k_new, v_new, k_cache, v_cache, lengths), jnp.float32)


def test_neuron_lowering_is_the_tkg_kernel():
    args = problem(max_len=256)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax_nkilib.decode_attention, *args, jnp.array([3, 4], jnp.int32))
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "attention_tkg" and cfg["params"]["use_pos_id"] is True
    assert cfg["params"]["curr_sprior"] == 256 and cfg["params"]["tp_k_prior"] is True


@pytest.mark.parametrize(
    "change, error, fragment",
    [
        (lambda a: (a[0][0],) + a[1:], ValueError, "`q` must have layout [batch, s_new, heads, head_dim] (rank 4)"),
        (
            lambda a: a[:3] + (a[3][:, :1], a[4][:, :1]) + a[5:],
            ValueError,
            "`k_cache` must have layout [batch, kv_heads",
        ),
        (lambda a: a[:3] + (a[3][:, :, :3], a[4][:, :, :3]) + a[5:], ValueError, "must leave room"),
        (lambda a: a[:5] + (jnp.zeros(2),), TypeError, "`cache_len` must be an integer array"),
        # issue 11: checked before jnp.asarray, the user's argument and axis named (not the kernel's)
        (lambda a: (None,) + a[1:], TypeError, "jax_nkilib.decode_attention: `q` must be an array; got NoneType"),
        (lambda a: a[:5] + ("3",), TypeError, "`cache_len` must be an array; got str"),
        (lambda a: a[:1] + (a[1].astype(jnp.int32),) + a[2:], TypeError, "`k_new` must have a floating dtype"),
        (lambda a: a[:3] + (a[3].astype(jnp.int8),) + a[4:], TypeError, "`k_cache` must have a floating dtype"),
        (
            lambda a: tuple(x[:0] for x in a),
            ValueError,
            "`q` must have layout [batch, s_new, heads, head_dim] with batch >= 1",
        ),
        (
            lambda a: (a[0][:, :, :0],) + a[1:],
            ValueError,
            "`q` must have layout [batch, s_new, heads, head_dim] with heads >= 1",
        ),
    ],
)
def test_bad_inputs(change, error, fragment):
    args = problem() + (jnp.array([1, 2], jnp.int32),)
    with pytest.raises(error) as info:
        jax_nkilib.decode_attention(*change(args))
    assert fragment in str(info.value)
    assert "k_active" not in str(info.value) and "dimension B" not in str(info.value)


@pytest.mark.parametrize("scale, error", [(float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError)])
def test_bad_scale(scale, error):
    with pytest.raises(error, match="jax_nkilib.decode_attention: `scale` must be a finite Python float"):
        jax_nkilib.decode_attention(*problem(), jnp.array([1, 2], jnp.int32), scale=scale)


def test_paged_cache_matches_the_flat_cache():
    q, k_new, v_new, _, _ = problem(max_len=16)
    block_len, kv_heads = 4, 2
    k_pool, v_pool = (
        random((9, kv_heads, block_len, 8), jnp.float32, 7),
        random((9, kv_heads, block_len, 8), jnp.float32, 8),
    )
    table = jnp.array([[3, 0, 7, 1], [8, 2, 5, 4]], jnp.int32)
    lengths = jnp.array([5, 10], jnp.int32)
    out, k_pool2, v_pool2 = jax.jit(lambda *a: jax_nkilib.decode_attention(*a, block_table=table))(
        q, k_new, v_new, k_pool, v_pool, lengths
    )
    flat = [
        np.transpose(np.asarray(pool)[np.asarray(table)], (0, 2, 1, 3, 4)).reshape(2, kv_heads, 16, 8)
        for pool in (k_pool, v_pool)
    ]
    assert_close(out, decode_attention_oracle(q, k_new, v_new, *flat, lengths), jnp.float32, reduction=16)
    for b, n in enumerate([5, 10]):
        for i in range(2):
            position = n + i
            block = int(table[b, position // block_len])
            np.testing.assert_array_equal(k_pool2[block, :, position % block_len], k_new[b, i])
            np.testing.assert_array_equal(v_pool2[block, :, position % block_len], v_new[b, i])
    untouched = [blk for blk in range(9) if blk not in (0, 2, 5)]  # blocks that receive no new token
    np.testing.assert_array_equal(k_pool2[np.array(untouched)], k_pool[np.array(untouched)])
    with jax_nkilib.neuron.dry_run():
        pools = random((64, kv_heads, 32, 8)), random((64, kv_heads, 32, 8))
        big_table = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
        (cfg,) = kernel_configs(
            neuron_text(
                lambda *a: jax_nkilib.decode_attention(*a, block_table=big_table), q, k_new, v_new, *pools, lengths
            )
        )
    assert cfg["params"]["block_len"] == 32 and cfg["input_names"][-1] == "active_blocks_table"
