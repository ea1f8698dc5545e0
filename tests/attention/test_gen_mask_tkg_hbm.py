"""jax_nkilib.nki.gen_mask_tkg_hbm (flat and block caches) against a NumPy oracle of the torch-reference semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import gen_mask_tkg_hbm
from tests.attention.oracle import block_rows
from tests.support.hlo import kernel_configs, neuron_text

BS, HEADS, S_ACTIVE, S_PRIOR = 2, 3, 3, 256
POS = jnp.array([[5, 6, 7, 9, 10, 11]], jnp.int32)


def oracle(pos, start=None, active=None, bs=BS, heads=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR, block=0):
    """Natural-order mask [bs, heads, s_active, s_prior], then rows t * 128 + p <- slot p * tiles + t (flat cache), or
    the block-cache rows for the kernel's resized block length `block`."""
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
    if block:
        return block_rows(natural, block)
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
        active = jnp.asarray(
            np.tril(np.ones((S_ACTIVE, S_ACTIVE)))[:, None, None, :].repeat(BS, 1).repeat(HEADS, 2).astype(np.uint8)
        )
    out = jax.jit(lambda *a: gen_mask_tkg_hbm(*a, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR))(
        POS, start, active
    )
    assert out.shape == (S_PRIOR, BS, HEADS, S_ACTIVE) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, oracle(POS, start, active))


def test_vmap_of_a_block_cache_mask_at_lnc2():
    # vmap and the replicated shard_map of the flat-cache mask: the conformance spec gen_mask_tkg_hbm
    stacked = jnp.stack([POS, POS + 1])
    with jax_nkilib.config(lnc=2):  # block cache, s_prior split over 2 programs: L = gcd(4, 512 / 256) = 2
        out = jax.vmap(lambda p: gen_mask_tkg_hbm(p, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=512, block_len=4))(
            stacked
        )
    np.testing.assert_array_equal(out[1], oracle(POS + 1, s_prior=512, block=2))


def test_neuron_lowering():
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(
            neuron_text(lambda p: gen_mask_tkg_hbm(p, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR), POS)
        )
    assert cfg["func_name"] == "gen_mask_tkg_hbm" and cfg["params"]["s_prior"] == S_PRIOR
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        (cfg,) = kernel_configs(
            neuron_text(
                lambda p: gen_mask_tkg_hbm(p, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=512, block_len=4), POS
            )
        )
    assert cfg["params"]["block_len"] == 4 and cfg["grid"] == 2  # the kernel resizes block_len itself


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE), "missing required parameter `s_prior`"),
        (dict(bs=3, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR), "[1, bs * s_active] = [1, 9]"),
        (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=200), "multiple of 128"),
        (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR, block_len=-4), "must be 0 (flat cache) or"),
        (dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=S_PRIOR, block_len=48), "multiple of block_len=48"),
    ],
)
def test_bad_inputs(kwargs, fragment):
    with pytest.raises(TypeError if "required" in fragment else ValueError) as info:
        gen_mask_tkg_hbm(POS, **kwargs)
    assert fragment in str(info.value)
    with jax_nkilib.config(lnc=2), pytest.raises(ValueError, match="and of 256 .128 per program"):
        gen_mask_tkg_hbm(POS, bs=BS, q_head=HEADS, s_active=S_ACTIVE, s_prior=384, block_len=4)  # s_prior split


# Expected resized block lengths L, worked out by hand from resize_cache_block_len_for_attention_tkg_kernel:
# L = gcd(block_len, s_prior / (n * 128)), n = 2 when LNC=2 splits s_prior (bs odd, or bs * heads * s_active <= 128
# and s_prior > 256; gen_mask_tkg_hbm resizes as for attention_tkg without fuse_rope), with flash-attention tiling
# (s_prior / n > 8192) also dividing 64 and the last tile's length / 128.
BLOCK_CASES = [  # (lnc, s_prior, block_len, kwargs, L)
    (1, 256, 16, {}, 2),  # 2 tiles: 16 -> 2
    (1, 2048, 16, {}, 16),  # 16 tiles: not resized
    (1, 512, 4, {}, 4),
    (2, 512, 4, {}, 2),  # s_prior split over 2 programs: 2 tiles each
    (2, 256, 4, {}, 2),  # batch split (s_prior <= 256, bs even): as LNC=1
    (1, 12288, 96, dict(bs=1, q_head=1, s_active=1), 32),  # flash-attention tiles of 8192 + 4096: gcd(96, 96, 64, 32)
    (1, 12288, 96, dict(bs=1, q_head=1, s_active=1, enable_fa_s_prior_tiling=False), 96),
]


@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: f"lnc{c[0]}-s{c[1]}-blk{c[2]}-L{c[4]}")
def test_block_cache_order_matches_oracle(case):
    lnc, s_prior, block_len, kwargs, reduced = case
    shape = dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE)
    flags = {k: v for k, v in kwargs.items() if k not in shape}
    shape |= {k: v for k, v in kwargs.items() if k in shape}
    pos = POS if shape["bs"] == BS else jnp.array([[7001]], jnp.int32)
    active = None
    if shape["bs"] == BS:  # a causal active block, placed at the last s_active slots before the shuffle
        active = jnp.asarray(
            np.tril(np.ones((S_ACTIVE, S_ACTIVE)))[:, None, None, :].repeat(BS, 1).repeat(HEADS, 2).astype(np.uint8)
        )
    with jax_nkilib.config(lnc=lnc):
        out = jax.jit(
            lambda p, a: gen_mask_tkg_hbm(p, None, a, s_prior=s_prior, block_len=block_len, **shape, **flags)
        )(pos, active)
    want = oracle(pos, None, active, shape["bs"], shape["q_head"], shape["s_active"], s_prior, block=reduced)
    np.testing.assert_array_equal(out, want)
    other = oracle(
        pos, None, active, shape["bs"], shape["q_head"], shape["s_active"], s_prior, block=1 if reduced > 1 else 2
    )
    assert not np.array_equal(want, other)  # the case tells block lengths apart
