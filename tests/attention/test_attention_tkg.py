"""jax_nkilib.nki.attention_tkg (flat KV cache) against the float64 oracle; config fields; transformations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import attention_tkg
from tests.attention.oracle import attention_tkg_oracle
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
    out = attention_tkg(*args, mask, sink=sink, tp_k_prior=tp_k_prior, bs=2, q_head=4, s_active=3, d_head=8,
                               full_sprior=16)
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
    out, k_out = attention_tkg(q, k_active, v_active, k_prior, v_prior, active_mask, inv_freqs, pos, start,
                               use_pos_id=True, fuse_rope=True, curr_sprior=16)
    want_out, want_k = attention_tkg_oracle(q, k_active, v_active, k_prior, v_prior, active_mask, inv_freqs, pos,
                                            start, use_pos_id=True, fuse_rope=True, curr_sprior=16)
    assert_close(out, want_out, jnp.float32, reduction=16)
    assert_close(k_out, want_k, jnp.float32)


def test_no_scaling_without_fuse_rope():
    args = inputs()
    mask = jnp.ones((16, 2, 4, 3), jnp.uint8)
    out = attention_tkg(*args, mask)
    scaled = attention_tkg(args[0] / np.sqrt(8), *args[1:], mask)
    assert not np.allclose(out, scaled, atol=1e-3)
    assert_close(out, attention_tkg_oracle(*args, mask)[0], jnp.float32)


def test_jit_vmap_and_gradients():
    args = inputs(dtype=jnp.float64)
    mask = random_mask(16, 2, 4, 3)
    fn = lambda *a: attention_tkg(*a, mask)  # noqa: E731
    np.testing.assert_allclose(jax.jit(fn)(*args), fn(*args), rtol=1e-12)
    qs = jnp.stack([args[0], -args[0]])
    out = jax.vmap(fn, in_axes=(0, None, None, None, None))(qs, *args[1:])
    np.testing.assert_allclose(out[1], fn(-args[0], *args[1:]), rtol=1e-12)
    assert "scan" not in str(jax.make_jaxpr(jax.vmap(fn, in_axes=(0, None, None, None, None)))(qs, *args[1:]))
    check_grads(fn, args, order=1, modes=["rev"])
    sink = random((4, 1), jnp.float64, 6)
    check_grads(lambda s: attention_tkg(*args, mask, sink=s), (sink,), order=1, modes=["rev"])


def test_inside_shard_map():
    mesh = mesh_1d()
    args = inputs(batch=8)
    mask = random_mask(16, 8, 4, 3)
    specs = (P("data"),) * 5 + (P(None, "data"),)
    fn = jax.shard_map(lambda *a: attention_tkg(*a), mesh=mesh, in_specs=specs, out_specs=P("data"))
    out = jax.jit(fn)(*shard(mesh, specs, *args, mask))
    assert_close(out, attention_tkg_oracle(*args, mask)[0], jnp.float32)


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
    out = attention_tkg(q, k_active, v_active, *pools, active, rope_pos_ids=pos, active_blocks_table=table,
                           block_len=4, use_pos_id=True, tp_k_prior=True, curr_sprior=16, full_sprior=16)
    with pytest.raises(ValueError, match="`full_sprior`=20 does not match the operands, whose full_sprior is 16"):
        attention_tkg(q, k_active, v_active, *pools, active, rope_pos_ids=pos, active_blocks_table=table,
                      block_len=4, use_pos_id=True, tp_k_prior=True, curr_sprior=16, full_sprior=20)
    flat = [np.asarray(pool)[np.asarray(table)].reshape(2, 1, 16, 8) for pool in pools]
    want, _ = attention_tkg_oracle(q, k_active, v_active, *flat, active, rope_pos_ids=pos, tp_k_prior=True,
                                   use_pos_id=True, curr_sprior=16)
    assert_close(out, want, jnp.float32, reduction=16)
    batched = jax.vmap(lambda a, t: attention_tkg(a, k_active, v_active, *pools, active, rope_pos_ids=pos,
                                                  active_blocks_table=t, block_len=4, use_pos_id=True,
                                                  tp_k_prior=True, curr_sprior=16))(jnp.stack([q, -q]),
                                                                                       jnp.stack([table, table]))
    np.testing.assert_allclose(batched[0], out, rtol=1e-6)
    with pytest.raises(ValueError, match="use_pos_id=True and tp_k_prior=True"):
        attention_tkg(q, k_active, v_active, *pools, jnp.ones((16, 2, 4, 3), jnp.uint8), active_blocks_table=table,
                      block_len=4, tp_k_prior=True)
