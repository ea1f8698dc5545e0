"""jax_nkilib.nki.attention_tkg (flat and block KV caches) vs the float64 oracle; config fields; transformations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import attention_tkg, gen_mask_tkg_hbm
from tests.attention.oracle import attention_tkg_oracle, block_attention_tkg_oracle, block_rows
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard


def inputs(batch=2, heads=4, s_active=3, d=8, s_full=16, cache_batch=None, dtype=jnp.float32, tp_k_prior=False):
    cache_batch = cache_batch or batch
    q = random((batch, heads, s_active, d), dtype, 0)
    k_active, v_active = random((batch, 1, s_active, d), dtype, 1), random((batch, 1, s_active, d), dtype, 2)
    k_prior = random((cache_batch, 1, s_full, d) if tp_k_prior else (cache_batch, 1, d, s_full), dtype, 3)
    v_prior = random((cache_batch, 1, s_full, d), dtype, 4)
    return q, k_active, v_active, k_prior, v_prior


def random_mask(s_prior, batch, heads, s_active, seed=5):
    mask = (np.random.default_rng(seed).uniform(size=(s_prior, batch, heads, s_active)) < 0.6).astype(np.uint8)
    mask[:, 0, 0, 0] = 0  # one query sees nothing
    return jnp.asarray(mask)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tp_k_prior", [False, True])
def test_given_mask_matches_oracle(dtype, tp_k_prior):
    args = inputs(cache_batch=3, dtype=dtype, tp_k_prior=tp_k_prior)  # an extra cache buffer row
    mask = random_mask(12, 2, 4, 3)  # curr_sprior 12 of 16 slots
    sink = random((4, 1), jnp.float32, 6)
    out = attention_tkg(
        *args, mask, sink=sink, tp_k_prior=tp_k_prior, bs=2, q_head=4, s_active=3, d_head=8, full_sprior=16
    )
    want_out, want_k = attention_tkg_oracle(*args, mask, sink=sink, tp_k_prior=tp_k_prior)
    assert out.shape == (2, 4, 8, 3) and out.dtype == dtype
    assert_close(out, want_out, dtype, reduction=12)
    no_sink = attention_tkg(*args, mask, tp_k_prior=tp_k_prior)
    assert np.all(np.asarray(no_sink[0, 0, :, 0]) == 0) and np.all(np.isfinite(no_sink))


@pytest.mark.parametrize("window", [None, "normal", "wrap"])
def test_fused_rope_and_position_masks(window):
    q, k_active, v_active, k_prior, v_prior = inputs(s_full=20)
    pos = jnp.array([[5, 6, 7], [9, 10, 11]], jnp.int32)
    inv_freqs = jnp.asarray(1.0 / 10000 ** (np.arange(4) / 4), jnp.float32)[:, None]
    start = None
    if window == "normal":
        start = jnp.array([[2, 3, 4], [6, 7, 8]], jnp.int32)
    elif window == "wrap":
        start = jnp.array([[14, 14, 15], [13, 3, 4]], jnp.int32)
    active_mask = jnp.ones((3, 2, 4, 3), jnp.uint8)  # ignored with use_pos_id, as in the kernel
    out, k_out = attention_tkg(
        q,
        k_active,
        v_active,
        k_prior,
        v_prior,
        active_mask,
        inv_freqs,
        pos,
        start,
        use_pos_id=True,
        fuse_rope=True,
        curr_sprior=16,
    )
    want_out, want_k = attention_tkg_oracle(
        q,
        k_active,
        v_active,
        k_prior,
        v_prior,
        active_mask,
        inv_freqs,
        pos,
        start,
        use_pos_id=True,
        fuse_rope=True,
        curr_sprior=16,
    )
    assert_close(out, want_out, jnp.float32, reduction=16)
    assert_close(k_out, want_k, jnp.float32)


def test_no_scaling_without_fuse_rope():
    args = inputs()
    mask = jnp.ones((16, 2, 4, 3), jnp.uint8)
    out = attention_tkg(*args, mask)
    scaled = attention_tkg(args[0] / np.sqrt(8), *args[1:], mask)
    assert not np.allclose(out, scaled, atol=1e-3)
    assert_close(out, attention_tkg_oracle(*args, mask)[0], jnp.float32)


def test_vmap_of_the_queries_folds_and_sink_gradients():
    args = inputs(dtype=jnp.float64)
    mask = random_mask(16, 2, 4, 3)
    fn = lambda *a: attention_tkg(*a, mask)  # noqa: E731
    qs = jnp.stack([args[0], -args[0]])
    assert "scan" not in str(jax.make_jaxpr(jax.vmap(fn, in_axes=(0, None, None, None, None)))(qs, *args[1:]))
    sink = random((4, 1), jnp.float64, 6)
    check_grads(lambda s: attention_tkg(*args, mask, sink=s), (sink,), order=1, modes=["rev"])


def test_neuron_lowering():
    args = inputs(s_full=256)
    mask = jnp.ones((128, 2, 4, 3), jnp.uint8)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(lambda *a: attention_tkg(*a), *args, mask))
        assert cfg["entry_point"] == "jax_nkilib_kernels.attention:attention_tkg"
        assert cfg["output_names"] == ["out"]
        with pytest.warns(NeuronFallbackWarning, match="curr_sprior=100 must be a multiple of 128"):
            text = neuron_text(lambda *a: attention_tkg(*a), *args, mask[:100])
        assert "AwsNeuronCustomNativeKernel" not in text


BAD = [
    (dict(active_blocks_table=jnp.zeros((2, 4), jnp.uint32)), ValueError, "a block KV cache needs"),
    (dict(block_len=16), ValueError, "a block KV cache needs"),
    (dict(qk_in_sb=True), ValueError, "`qk_in_sb` places tensors in SBUF"),
    (dict(fuse_rope=True), ValueError, "fuse_rope needs inv_freqs"),
    (dict(bs=3), ValueError, "`bs`=3 does not match the operands, whose B is 2"),
    (dict(curr_sprior=8), ValueError, "curr_sprior=8 does not match the mask's S_prior=16"),
    (dict(start_pos_ids=jnp.zeros((2, 3), jnp.int32)), ValueError, "needs use_pos_id=True"),
    (dict(use_pos_id=True, rope_pos_ids=jnp.zeros((2, 3), jnp.int32)), ValueError, "`mask`"),
    (dict(sink=jnp.zeros((4,))), ValueError, "`sink`"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    kwargs, error, fragment = case
    args = inputs()
    with pytest.raises(error, match=fragment.replace("(", "\\(").replace("*", "\\*")):
        attention_tkg(*args, jnp.ones((16, 2, 4, 3), jnp.uint8), **kwargs)
    with pytest.raises(ValueError, match="B_cache=1 is smaller than B=2"):
        attention_tkg(*args[:3], args[3][:1], args[4][:1], jnp.ones((16, 2, 4, 3), jnp.uint8))


def test_block_kv_cache_equals_the_gathered_flat_cache():
    q, k_active, v_active, _, _ = inputs()
    pools = random((10, 4, 8), jnp.float32, 7), random((10, 4, 8), jnp.float32, 8)  # 10 blocks of 4 slots
    table = jnp.array([[3, 0, 7, 1], [9, 2, 5, 4]], jnp.uint32)
    pos = jnp.array([[5, 6, 7], [9, 10, 11]], jnp.int32)
    active = jnp.ones((3, 2, 4, 3), jnp.uint8)
    out = attention_tkg(
        q,
        k_active,
        v_active,
        *pools,
        active,
        rope_pos_ids=pos,
        active_blocks_table=table,
        block_len=4,
        use_pos_id=True,
        tp_k_prior=True,
        curr_sprior=16,
        full_sprior=16,
    )
    with pytest.raises(ValueError, match="`full_sprior`=20 does not match the operands, whose full_sprior is 16"):
        attention_tkg(
            q,
            k_active,
            v_active,
            *pools,
            active,
            rope_pos_ids=pos,
            active_blocks_table=table,
            block_len=4,
            use_pos_id=True,
            tp_k_prior=True,
            curr_sprior=16,
            full_sprior=20,
        )
    flat = [np.asarray(pool)[np.asarray(table)].reshape(2, 1, 16, 8) for pool in pools]
    want, _ = attention_tkg_oracle(
        q, k_active, v_active, *flat, active, rope_pos_ids=pos, tp_k_prior=True, use_pos_id=True, curr_sprior=16
    )
    assert_close(out, want, jnp.float32, reduction=16)
    batched = jax.vmap(
        lambda a, t: attention_tkg(
            a,
            k_active,
            v_active,
            *pools,
            active,
            rope_pos_ids=pos,
            active_blocks_table=t,
            block_len=4,
            use_pos_id=True,
            tp_k_prior=True,
            curr_sprior=16,
        )
    )(jnp.stack([q, -q]), jnp.stack([table, table]))
    np.testing.assert_allclose(batched[0], out, rtol=1e-6)
    with pytest.raises(ValueError, match="the layout for tp_k_prior=False"):  # a block pool needs tp_k_prior=True
        attention_tkg(
            q,
            k_active,
            v_active,
            *pools,
            active,
            rope_pos_ids=pos,
            active_blocks_table=table,
            block_len=4,
            use_pos_id=True,
            curr_sprior=16,
        )


def block_cache(batch=2, heads=4, s_active=3, d=8, block_len=16, n_blocks=16, dtype=jnp.float32, seed=10):
    """q, k_active, v_active, k_pool, v_pool [n_blocks * batch + 3, block_len, d], a shuffled uint32 table."""
    q, k_active, v_active, _, _ = inputs(batch, heads, s_active, d, dtype=dtype)
    total = n_blocks * batch + 3
    pools = random((total, block_len, d), dtype, seed), random((total, block_len, d), dtype, seed + 1)
    table = np.random.default_rng(seed).permutation(total)[: batch * n_blocks].reshape(batch, n_blocks)
    return (q, k_active, v_active, *pools, jnp.asarray(table, jnp.uint32))


def natural_random_mask(batch, heads, s_active, s_prior, seed=12):
    """[B, H, s_a, S] in slot order; query (0, 0, 0) sees nothing."""
    natural = (np.random.default_rng(seed).uniform(size=(batch, heads, s_active, s_prior)) < 0.6).astype(np.uint8)
    natural[0, 0, 0] = 0
    return natural


# (lnc, block_len, n_blocks, L): L is the kernel's resized block length, by hand: gcd(block_len, S / (n * 128)) with
# n = 2 programs splitting S = n_blocks * block_len at LNC=2 (here B * H * s_a = 24 <= 128 and S > 256).
GIVEN_MASK_CASES = [(1, 16, 16, 2), (1, 2, 128, 2), (1, 8, 64, 4), (2, 8, 64, 2)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", GIVEN_MASK_CASES, ids=lambda c: f"lnc{c[0]}-blk{c[1]}-L{c[3]}")
def test_given_mask_on_block_cache_matches_oracle(case, dtype):
    lnc, block_len, n_blocks, reduced = case
    *args, table = block_cache(block_len=block_len, n_blocks=n_blocks, dtype=dtype)
    s_prior = block_len * n_blocks
    rows = jnp.asarray(block_rows(natural_random_mask(2, 4, 3, s_prior), reduced))
    sink = random((4, 1), jnp.float32, 6)
    with jax_nkilib.config(lnc=lnc):
        out = jax.jit(
            lambda *a: attention_tkg(
                *a,
                sink=sink,
                active_blocks_table=table,
                block_len=block_len,
                tp_k_prior=True,
                strided_mm1=False,
                full_sprior=s_prior,
            )
        )(*args, rows)
    want = block_attention_tkg_oracle(*args, table, rows, reduced, sink=sink)
    assert out.shape == (2, 4, 8, 3) and out.dtype == dtype
    assert_close(out, want, dtype, reduction=s_prior)
    other = block_attention_tkg_oracle(*args, table, rows, 1 if reduced > 1 else 2, sink=sink)
    assert np.max(np.abs(want - other)) > 1e-2  # the case tells block lengths apart


@pytest.mark.parametrize("lnc", [1, 2])
def test_gen_mask_tkg_hbm_block_mask_drives_attention_tkg(lnc):
    """The two kernels agree on the block order: gen_mask_tkg_hbm's block mask on the block cache is the position
    mask on the gathered flat cache (S = 512, block_len 8: L = 4 at LNC=1, 2 at LNC=2)."""
    *args, table = block_cache(block_len=8, n_blocks=64)
    pos = jnp.array([[300, 301, 302], [17, 18, 19]], jnp.int32)
    causal = jnp.asarray(np.tril(np.ones((3, 3), np.uint8)).T[:, None, None, :].repeat(2, 1).repeat(4, 2))
    with jax_nkilib.config(lnc=lnc):
        mask = gen_mask_tkg_hbm(pos.reshape(1, 6), None, causal, bs=2, q_head=4, s_active=3, s_prior=512, block_len=8)
        out = attention_tkg(*args, mask, active_blocks_table=table, block_len=8, tp_k_prior=True, strided_mm1=False)
    flat = [np.asarray(pool)[np.asarray(table)].reshape(2, 1, 512, 8) for pool in args[3:5]]
    want, _ = attention_tkg_oracle(
        *args[:3], *flat, causal, rope_pos_ids=pos, tp_k_prior=True, use_pos_id=True, curr_sprior=512
    )
    assert_close(out, want, jnp.float32, reduction=512)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_given_block_mask_jit_vmap_shard_map_and_gradients():
    *args, table = block_cache(block_len=16, n_blocks=16)
    rows = jnp.asarray(block_rows(natural_random_mask(2, 4, 3, 256), 2))
    flags = dict(active_blocks_table=table, block_len=16, tp_k_prior=True, strided_mm1=False)
    fn = lambda q, *a: attention_tkg(q, *args[1:], *a, **flags)  # noqa: E731
    want = block_attention_tkg_oracle(*args, table, rows, 2)
    qs = jnp.stack([args[0], -args[0]])
    for lnc, reduced in ((1, 2), (2, 2)):  # LNC=2: B * H * s_a <= 128 and S = 256: the batch is split, L as LNC=1
        with jax_nkilib.config(lnc=lnc):
            out = jax.jit(jax.vmap(fn, in_axes=(0, None)))(qs, rows)
            jaxpr = str(jax.make_jaxpr(jax.vmap(fn, in_axes=(0, None)))(qs, rows))
        assert ("while" in jaxpr or "scan" in jaxpr) == (lnc == 2)  # folded into B only where L cannot change
        assert_close(out[0], want, jnp.float32, reduction=256)
        assert_close(
            out[1], block_attention_tkg_oracle(-args[0], *args[1:], table, rows, reduced), jnp.float32, reduction=256
        )
    grads = jax.grad(lambda q: (fn(q, rows) ** 2).sum())(args[0])
    flat_rows = jnp.asarray(
        np.asarray(rows)[block_rows(np.arange(256)[None, None, None], 2)[:, 0, 0, 0].argsort()]
    )  # slot order
    flat = [np.asarray(pool)[np.asarray(table)].reshape(2, 1, 256, 8) for pool in args[3:5]]
    flat_grads = jax.grad(
        lambda q: (
            attention_tkg(q, *args[1:3], jnp.asarray(flat[0]), jnp.asarray(flat[1]), flat_rows, tp_k_prior=True) ** 2
        ).sum()
    )(args[0])
    np.testing.assert_allclose(grads, flat_grads, rtol=1e-5, atol=1e-6)
    mesh = mesh_1d()
    q8, ka8, va8, *pools8, table8 = block_cache(batch=8, block_len=16, n_blocks=16)
    rows8 = jnp.asarray(block_rows(natural_random_mask(8, 4, 3, 256), 2))
    specs = (P("data"),) * 3 + (P(), P(), P(None, "data"), P("data"))
    sharded = jax.shard_map(
        lambda q, ka, va, kp, vp, m, t: attention_tkg(
            q, ka, va, kp, vp, m, active_blocks_table=t, block_len=16, tp_k_prior=True, strided_mm1=False
        ),
        mesh=mesh,
        in_specs=specs,
        out_specs=P("data"),
    )
    out = jax.jit(sharded)(*shard(mesh, specs, q8, ka8, va8, *pools8, rows8, table8))
    assert_close(out, block_attention_tkg_oracle(q8, ka8, va8, *pools8, table8, rows8, 2), jnp.float32, reduction=256)


def test_given_block_mask_neuron_lowering_and_bad_inputs():
    *args, table = block_cache(block_len=16, n_blocks=16)
    rows = jnp.ones((256, 2, 4, 3), jnp.uint8)
    flags = dict(active_blocks_table=table, block_len=16, tp_k_prior=True, strided_mm1=False)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(lambda *a: attention_tkg(*a, **flags), *args, rows)
    (cfg,) = kernel_configs(text)
    assert text.count("stablehlo.custom_call") == 1 and cfg["grid"] == 2
    assert cfg["params"]["block_len"] == 16 and cfg["input_names"][-1] == "active_blocks_table"
    bad = [
        (dict(flags, strided_mm1=True), rows, "needs strided_mm1=False"),
        (flags, rows[:128], "must cover all n_blocks * block_len = 256 slots"),
        (dict(flags, tp_k_prior=False), rows, "the layout for tp_k_prior=False"),
    ]
    for kwargs, mask, fragment in bad:
        with pytest.raises(ValueError, match=fragment.replace("*", "\\*")):
            attention_tkg(*args, mask, **kwargs)
    *args, table = block_cache(batch=1, block_len=12, n_blocks=32)  # S = 384: split over 2 programs at LNC=2
    mask = jnp.ones((384, 1, 4, 3), jnp.uint8)
    attention_tkg(*args, mask, **dict(flags, active_blocks_table=table, block_len=12))  # LNC=1: L = gcd(12, 3)
    with jax_nkilib.config(lnc=2), pytest.raises(ValueError, match="multiple of block_len=12 and of 256"):
        attention_tkg(*args, mask, **dict(flags, active_blocks_table=table, block_len=12))
