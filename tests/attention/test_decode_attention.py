"""jax_nkilib.decode_attention: per-sequence cache lengths, GQA, functional cache update, sliding window and sinks,
transformations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from tests.attention.oracle import decode_attention_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, use_mesh


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


# ------------------------------------------------------------------------------------ sliding window and sinks
def windowed_problem(dtype=jnp.float32, batch=3, s_new=2, heads=4, kv_heads=2, max_len=16):
    return problem(batch=batch, s_new=s_new, heads=heads, kv_heads=kv_heads, max_len=max_len, dtype=dtype)


LENGTHS = jnp.array([0, 5, 12], jnp.int32)  # an empty cache, a short one, one longer than the small windows


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("window", [1, 2, 5, 13, 16])  # 13: the largest that hides a key; 16: capacity
@pytest.mark.parametrize("shape", [dict(), dict(s_new=1, kv_heads=1, heads=2)])
def test_sliding_window_matches_oracle(dtype, window, shape):
    args = windowed_problem(dtype, **shape)
    if window < args[0].shape[1]:
        pytest.skip("window < s_new is rejected (test_bad_window_and_sinks)")
    out, k2, v2 = jax_nkilib.decode_attention(*args, LENGTHS, sliding_window=window)
    want = decode_attention_oracle(*args, LENGTHS, sliding_window=window)
    assert_close(out, want, dtype, reduction=16)
    full = jax_nkilib.decode_attention(*args, LENGTHS)
    for got, plain in zip((k2, v2), full[1:]):  # the window changes what is read, not what is written
        np.testing.assert_array_equal(got, plain)
    if window >= 14:  # capacity - s_new: no valid token (position <= 13) has a key before its window
        np.testing.assert_array_equal(out, full[0])
    elif window <= 5:  # sequence 2 (length 12) reads less than its whole cache
        assert not np.allclose(np.asarray(out[2], np.float32), np.asarray(full[0][2], np.float32))


def test_window_positions_one_past_the_edge():
    """With window w the token at position p sees exactly positions p - w + 1 .. p: a key at p - w, however large
    its score, has no influence, and the key at p - w + 1 has."""
    q, k_new, v_new, k_cache, v_cache = problem(batch=1, s_new=1, heads=1, kv_heads=1, d=4, max_len=16)
    q = jnp.ones_like(q)
    length, window = 10, 4  # position 10 sees 7, 8, 9 (cache) and 10 (new)
    lengths = jnp.array([length], jnp.int32)
    outside = k_cache.at[0, 0, length - window].set(50.0).at[0, 0, : length - window].set(-50.0)
    v_marked = v_cache.at[0, 0, length - window].set(1e3)
    out = jax_nkilib.decode_attention(q, k_new, v_new, outside, v_marked, lengths, sliding_window=window)[0]
    assert_close(
        out, decode_attention_oracle(q, k_new, v_new, outside, v_marked, lengths, sliding_window=window), jnp.float32
    )
    assert float(jnp.max(jnp.abs(out))) < 100  # the marked value (at p - w) is not read
    inside = v_cache.at[0, 0, length - window + 1].set(1e3)
    boosted = k_cache.at[0, 0, length - window + 1].set(50.0)
    out = jax_nkilib.decode_attention(q, k_new, v_new, boosted, inside, lengths, sliding_window=window)[0]
    assert float(jnp.max(out)) > 900  # the first position inside the window dominates


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sinks_shape", ["heads", "batch_heads"])
@pytest.mark.parametrize("shape", [dict(), dict(kv_heads=1), dict(kv_heads=4, s_new=3, max_len=20)])
def test_sinks_match_oracle(dtype, sinks_shape, shape):
    args = windowed_problem(dtype, **shape)
    heads = args[0].shape[2]
    sinks = {
        "heads": random((heads,), jnp.float32, 20, scale=2.0),
        "batch_heads": random((3, heads), jnp.float32, 21, scale=2.0),
    }[sinks_shape]
    out = jax_nkilib.decode_attention(*args, LENGTHS, sinks=sinks)[0]
    rounded = sinks.astype(dtype)  # sinks are rounded to q's dtype
    assert_close(out, decode_attention_oracle(*args, LENGTHS, sinks=rounded), dtype, reduction=16)


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("sinks_2d", [False, True])
def test_window_and_sinks_together(paged, sinks_2d):
    q, k_new, v_new, k_cache, v_cache = windowed_problem()
    sinks = random((3, 4) if sinks_2d else (4,), jnp.float32, 23)
    kwargs = dict(sliding_window=4, sinks=sinks)
    if paged:  # 4 blocks of 4 per sequence out of a pool of 13
        k_cache, v_cache = random((13, 2, 4, 8), jnp.float32, 24), random((13, 2, 4, 8), jnp.float32, 25)
        kwargs["block_table"] = jnp.array([[3, 0, 7, 1], [8, 2, 5, 4], [12, 9, 6, 10]], jnp.int32)
    args = (q, k_new, v_new, k_cache, v_cache, LENGTHS)
    out, k2, _ = jax.jit(lambda *a: jax_nkilib.decode_attention(*a, **kwargs))(*args)
    assert_close(out, decode_attention_oracle(*args, **kwargs), jnp.float32, reduction=16)
    plain = jax_nkilib.decode_attention(*args, block_table=kwargs.get("block_table"))
    np.testing.assert_array_equal(k2, plain[1])  # the same cache update


@pytest.mark.parametrize("sinks_shape", [(4,), (2, 4)])
def test_gradients_with_window_and_sinks_float64(sinks_shape):
    q, k_new, v_new, k_cache, v_cache = problem(
        batch=2, s_new=2, heads=4, kv_heads=2, d=4, max_len=12, dtype=jnp.float64
    )
    sinks = random(sinks_shape, jnp.float64, 26)
    lengths = jnp.array([2, 7], jnp.int32)
    fn = jax.jit(lambda *a: jax_nkilib.decode_attention(*a[:5], lengths, sliding_window=3, sinks=a[5])[0])
    check_grads(fn, (q, k_new, v_new, k_cache, v_cache, sinks), order=1, modes=["rev"])


def test_sinks_gradient_matches_the_oracle():
    """d/d sinks of sum(out * dy) against central differences of the float64 oracle."""
    args = problem(batch=2, s_new=1, heads=4, kv_heads=2, d=4, max_len=8, dtype=jnp.float64)
    lengths = jnp.array([1, 6], jnp.int32)
    sinks, dy = random((4,), jnp.float64, 27), random(args[0].shape, jnp.float64, 28)
    got = jax.jit(
        jax.grad(lambda s: jnp.sum(jax_nkilib.decode_attention(*args, lengths, sliding_window=3, sinks=s)[0] * dy))
    )(sinks)
    step, want = 1e-6, np.zeros(4)
    for h in range(4):
        plus, minus = (
            decode_attention_oracle(
                *args, lengths, sliding_window=3, sinks=np.asarray(sinks) + sign * step * np.eye(4)[h]
            )
            for sign in (1, -1)
        )
        want[h] = np.sum((plus - minus) * np.asarray(dy)) / (2 * step)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize(
    "kwargs, names, sink_shape, loop",
    [
        (dict(sliding_window=64), ["rope_pos_ids", "start_pos_ids"], None, False),
        (dict(sinks=jnp.zeros(4)), ["rope_pos_ids", "sink"], (4, 1), False),  # all 4 heads in each row
        (dict(sliding_window=8, sinks=jnp.zeros((2, 4))), ["rope_pos_ids", "start_pos_ids", "sink"], (4, 1), True),
    ],
)
def test_neuron_lowering_with_window_and_sinks_is_one_tkg_call(kwargs, names, sink_shape, loop):
    args = problem(max_len=256)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda *a: jax_nkilib.decode_attention(*a, **kwargs), *args, jnp.array([3, 4], jnp.int32))
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "attention_tkg" and cfg["params"]["use_pos_id"] is True
    assert cfg["input_names"][6:] == names
    specs = dict(zip(cfg["input_names"], cfg["input_specs"]))
    if sink_shape:
        assert specs["sink"][0] == list(sink_shape) and specs["q"][0][1] == 4
    # per-sequence sinks: one kernel call per sequence (the call sits in a loop over the batch)
    assert ("stablehlo.while" in text) == loop
    assert specs["q"][0][0] == (2 if loop else 4)  # rows: kv heads of one sequence, or of all


def test_the_mask_over_the_new_tokens_is_causal(monkeypatch):
    """The kernel loads the given [s_a, B, H, s_a] mask over the new tokens even with use_pos_id: it is causal."""
    from jax_nkilib._src.ops import attention as ops

    seen = []

    def spy(*args, **kwargs):
        seen.append(np.asarray(args[5]))
        return real(*args, **kwargs)

    real = ops.attention_tkg
    monkeypatch.setattr(ops, "attention_tkg", spy)
    jax_nkilib.decode_attention(*problem(s_new=3, max_len=16), jnp.array([1, 2], jnp.int32))
    (mask,) = seen
    assert mask.shape == (3, 4, 2, 3)  # [key j, rows, groups, query i]
    np.testing.assert_array_equal(mask, np.broadcast_to(np.tril(np.ones((3, 3)), 0).T[:, None, None, :], mask.shape))


def test_sinks_shard_with_the_heads():
    mesh = make_mesh((2, 4), ("data", "model"))
    q, k_new, v_new, k_cache, v_cache = problem(batch=2, s_new=1, heads=8, kv_heads=4, max_len=16)
    lengths = jnp.array([3, 9], jnp.int32)
    for sinks, spec in ((random((8,), seed=30), P("model")), (random((2, 8), seed=31), P("data", "model"))):
        want = jax_nkilib.decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, sliding_window=5, sinks=sinks)
        specs = (P("data", None, "model"),) * 3 + (P("data", "model"),) * 2 + (P("data"), spec)
        with use_mesh(mesh):
            placed = [
                jax.device_put(a, NamedSharding(mesh, s))
                for a, s in zip((q, k_new, v_new, k_cache, v_cache, lengths, sinks), specs)
            ]
            got = jax.jit(lambda *a: jax_nkilib.decode_attention(*a[:6], sliding_window=5, sinks=a[6]))(*placed)
        assert got[0].sharding.spec == P("data", None, "model", None)
        for g, w in zip(got, want):
            assert_close(g, w, jnp.float32, reduction=16)


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(sliding_window=0), ValueError, "`sliding_window` must be an int in [1, 2147483647]; got 0"),
        (dict(sliding_window=-3), ValueError, "`sliding_window` must be an int in [1,"),
        (dict(sliding_window=2.0), TypeError, "`sliding_window` must be an int in [1,"),
        (dict(sliding_window="4"), TypeError, "`sliding_window` must be an int in [1,"),
        (dict(sliding_window=True), TypeError, "`sliding_window` must be an int in [1,"),
        (dict(sliding_window=1), ValueError, "`sliding_window` must be at least s_new=2"),
        (dict(sinks=jnp.zeros(3)), ValueError, "`sinks` must have layout [heads]: dimension 0 (heads) should be 4"),
        (dict(sinks=jnp.zeros((3, 4))), ValueError, "`sinks` must have layout [batch, heads]: dimension 0 (batch)"),
        (dict(sinks=jnp.zeros((2, 4, 1))), ValueError, "`sinks` must have layout [heads] or [batch, heads]"),
        (dict(sinks=jnp.zeros(4, jnp.int32)), TypeError, "`sinks` [heads] or [batch, heads] must have a floating"),
        (dict(sinks=[0.0] * 4), TypeError, "`sinks` must be an array"),
    ],
)
def test_bad_window_and_sinks(kwargs, error, fragment):
    with pytest.raises(error) as info:
        jax_nkilib.decode_attention(*problem(), jnp.array([1, 2], jnp.int32), **kwargs)
    assert str(info.value).startswith("jax_nkilib.decode_attention: ") and fragment in str(info.value)


def test_traced_window_is_rejected():
    with pytest.raises(TypeError, match="`sliding_window` must be static"):
        jax.jit(lambda w: jax_nkilib.decode_attention(*problem(), jnp.array([1, 2], jnp.int32), sliding_window=w))(4)


def test_nan_before_the_window_or_in_another_heads_sink_stays_out():
    q, k_new, v_new, k_cache, v_cache = windowed_problem()
    lengths = jnp.array([3, 9, 12], jnp.int32)
    stale = [c.at[:, :, :5].set(jnp.nan) for c in (k_cache, v_cache)]  # before every window of 4 here but one
    out = jax_nkilib.decode_attention(q, k_new, v_new, *stale, lengths, sliding_window=4)[0]
    assert np.all(np.isnan(out[0])) and np.all(np.isfinite(out[1:]))  # sequence 0 (length 3) sees slots 0..2
    sinks = jnp.array([0.0, jnp.nan, 0.0, 0.0])
    out = jax_nkilib.decode_attention(q, k_new, v_new, k_cache, v_cache, lengths, sinks=sinks)[0]
    assert np.all(np.isnan(out[:, :, 1])) and np.all(np.isfinite(out[:, :, [0, 2, 3]]))
