"""jax_nkilib.nki.gen_mask_tkg (program 0) against a NumPy oracle of its torch reference's semantics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import gen_mask_tkg
from tests.support.hlo import kernel_configs, neuron_text

BS, HEADS, S_ACTIVE = 2, 3, 2
POS_ROW = np.array([70, 71, 200, 201])


def positions(row=POS_ROW):
    return jnp.asarray(np.broadcast_to(row, (128, len(row))).astype(np.int32))


def oracle(row, start_row=None, active=None, *, s_ctx, n_tile, offset=0, block_len=0, strided=True, batch_offset=0):
    """Natural mask, the tile window from `offset`, then the kernel's (p, f) placement of each slot."""
    natural = np.zeros((BS, HEADS, S_ACTIVE, s_ctx), np.float32)
    for b in range(BS):
        for i in range(S_ACTIVE):
            end = row[b * S_ACTIVE + i]
            for k in range(s_ctx):
                if start_row is None:
                    natural[b, :, i, k] = k < row[b * S_ACTIVE]
                else:
                    lo = start_row[b * S_ACTIVE + i]
                    natural[b, :, i, k] = (lo <= k < end) if lo <= end else (k >= lo or k < end)
    if active is not None:
        for j in range(S_ACTIVE):
            natural[..., s_ctx - S_ACTIVE + j] = active[j, batch_offset : batch_offset + BS]
    window = natural[..., offset : offset + n_tile * 128]
    out = np.zeros((128, n_tile, BS, HEADS, S_ACTIVE), np.float32)
    for k in range(n_tile * 128):
        if block_len:
            fold, rest = divmod(k, block_len * 128)
            p, r = divmod(rest, block_len)
            f = fold * block_len + r
        elif strided:
            p, f = divmod(k, n_tile)
        else:
            f, p = divmod(k, 128)
        out[p, f] = window[..., k]
    return out


@pytest.mark.parametrize("layout", [dict(), dict(strided_mm1=False), dict(block_len=2)])
@pytest.mark.parametrize("window", [False, True])
def test_matches_oracle(layout, window):
    start_row = np.array([60, 70, 250, 3]) if window else None
    out = jax.jit(
        lambda p, s: gen_mask_tkg(
            p,
            s,
            bs=BS,
            q_head=HEADS,
            s_active=S_ACTIVE,
            is_s_prior_sharded=False,
            s_prior_per_shard=512,
            n_sprior_tile=2,
            s_prior_offset=128,
            **layout,
        )
    )(positions(), None if start_row is None else positions(start_row))
    want = oracle(
        POS_ROW,
        start_row,
        s_ctx=512,
        n_tile=2,
        offset=128,
        block_len=layout.get("block_len", 0),
        strided=layout.get("strided_mm1", True),
    )
    assert out.shape == (128, 2, BS, HEADS, S_ACTIVE) and out.dtype == jnp.float32
    np.testing.assert_array_equal(out, want)


def test_active_mask_with_batch_offset():
    active = (np.random.default_rng(0).uniform(size=(S_ACTIVE, 4, HEADS, S_ACTIVE)) < 0.5).astype(np.uint8)
    out = gen_mask_tkg(
        positions(),
        None,
        jnp.asarray(active),
        bs=BS,
        q_head=HEADS,
        s_active=S_ACTIVE,
        is_s_prior_sharded=False,
        s_prior_per_shard=256,
        n_sprior_tile=2,
        batch_offset=1,
    )
    np.testing.assert_array_equal(out, oracle(POS_ROW, None, active, s_ctx=256, n_tile=2, batch_offset=1))


def test_neuron_lowering():
    # vmap == a loop: the conformance spec gen_mask_tkg (these keyword arguments)
    kwargs = dict(
        bs=BS, q_head=HEADS, s_active=S_ACTIVE, is_s_prior_sharded=False, s_prior_per_shard=256, n_sprior_tile=2
    )
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(lambda p: gen_mask_tkg(p, **kwargs), positions()))
    assert cfg["entry_point"] == "jax_nkilib_kernels.attention:gen_mask_tkg" and cfg["params"]["n_sprior_tile"] == 2


@pytest.mark.parametrize(
    "change, fragment",
    [
        (dict(s_prior_offset=200), "exceeds s_prior_per_shard"),
        (dict(block_len=3), "multiple of block_len"),
        (dict(n_sprior_tile_total=4), "not bound yet"),
        (dict(bs=4), "at least bs * s_active = 8"),
    ],
)
def test_bad_inputs(change, fragment):
    kwargs = (
        dict(bs=BS, q_head=HEADS, s_active=S_ACTIVE, is_s_prior_sharded=False, s_prior_per_shard=256, n_sprior_tile=2)
        | change
    )
    with pytest.raises(ValueError) as info:
        gen_mask_tkg(positions(), **kwargs)
    assert fragment in str(info.value)
    with jax_nkilib.config(lnc=2), pytest.raises(ValueError, match="bind it at LNC=1"):
        gen_mask_tkg(
            positions(),
            bs=BS,
            q_head=HEADS,
            s_active=S_ACTIVE,
            is_s_prior_sharded=True,
            s_prior_per_shard=256,
            n_sprior_tile=2,
        )
