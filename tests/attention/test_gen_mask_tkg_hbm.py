"""jax_nkilib.nki.gen_mask_tkg_hbm (flat cache) against a NumPy oracle of the catalog/torch-reference semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.nki import gen_mask_tkg_hbm
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.sharding import mesh_1d, shard

BS, HEADS, S_ACTIVE, S_PRIOR = 2, 3, 3, 256
POS = jnp.array([[5, 6, 7, 9, 10, 11]], jnp.int32)


def oracle(pos, start=None, active=None, bs=BS, heads=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR):
    """Natural-order mask [bs, heads, s_active, s_prior], then rows t * 128 + p <- slot p * tiles + t."""
    pos = np.asarray(pos, np.float64)[0].reshape(bs, s_active)
    natural = np.zeros((bs, heads, s_active, s_prior), np.float32)
    for b in range(bs):
        for i in range(s_active):
            for k in range(s_prior):
                if start is None:
                    seen = k < pos[b, 0]
                else:
                    lo, hi = float(np.asarray(start)[0, b * s_active + i]), pos[b, i]
                    seen = (lo <= k < hi) if lo <= hi else (k >= lo or k < hi)
                natural[b, :, i, k] = seen
    if active is not None:
        for j in range(s_active):
            natural[:, :, :, s_prior - s_active + j] = np.asarray(active)[j, :bs]  # [b, h, i]
    tiles = s_prior // 128
    out = np.zeros((s_prior, bs, heads, s_active), np.float32)
    for t in range(tiles):
        for p in range(128):
            out[t * 128 + p] = natural[..., p * tiles + t]
    return out


@pytest.mark.parametrize("case", ["lengths", "window", "wrap", "active"])
def test_matches_oracle(case):
    start = active = None
    if case == "window":
        start = jnp.array([[2, 3, 4, 0, 8, 9]], jnp.int32)
    elif case == "wrap":
        start = jnp.array([[200, 3, 250, 6, 7, 8]], jnp.int32)
    elif case == "active":
        active = jnp.asarray(np.tril(np.ones((S_ACTIVE, S_ACTIVE)))[:, None, None, :].repeat(BS, 1).repeat(HEADS, 2)
                             .astype(np.uint8))
    out = jax.jit(lambda *a: gen_mask_tkg_hbm(*a, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR))(
        POS, start, active)
    assert out.shape == (S_PRIOR, BS, HEADS, S_ACTIVE) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, oracle(POS, start, active))


def test_vmap_and_replicated_shard_map():
    stacked = jnp.stack([POS, POS + 1])
    out = jax.vmap(lambda p: gen_mask_tkg_hbm(p, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR))(stacked)
    np.testing.assert_array_equal(out[1], oracle(POS + 1))
    mesh = mesh_1d()
    fn = jax.shard_map(lambda p: gen_mask_tkg_hbm(p, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR),
                       mesh=mesh, in_specs=P(), out_specs=P())
    np.testing.assert_array_equal(jax.jit(fn)(shard(mesh, (P(),), POS)), oracle(POS))


def test_neuron_lowering():
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(lambda p: gen_mask_tkg_hbm(p, bs=BS, q_head=HEADS, s_active=S_ACTIVE,
                                                                       s_prior=S_PRIOR), POS))
    assert cfg["func_name"] == "gen_mask_tkg_hbm" and cfg["params"]["s_prior"] == S_PRIOR


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE), "`s_prior` is required"),
    (dict(bs=3, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR), "[1, bs * s_active] = [1, 9]"),
    (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=200), "multiple of 128"),
    (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR, block_len=16), "not bound yet"),
])
def test_bad_inputs(kwargs, fragment):
    with pytest.raises(ValueError) as info:
        gen_mask_tkg_hbm(POS, **kwargs)
    assert fragment in str(info.value)
