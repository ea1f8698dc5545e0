"""The blockwise routing metadata builder: exactly the NumPy oracle's layout, enough blocks for any routing, and
``moe_cte`` on its output equal to a dense float64 MoE for top-1/2/8, 8 and 64 experts and uneven loads."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nkilib import nki
from jax_nkilib._src.moe.blockwise_routing import blockwise_routing, num_blocks, with_padding_row
from tests.moe.blockwise_oracles import dense_moe, routing
from tests.support.numerics import assert_close, f64


def choose(rng, tokens, top_k, experts, skew=None, unused=()):
    """Distinct experts per token, drawn with probabilities ``skew`` (uniform by default), never from ``unused``."""
    p = np.ones(experts) if skew is None else np.asarray(skew, float)
    p[list(unused)] = 0.0
    p /= p.sum()
    index = np.stack([rng.choice(experts, top_k, replace=False, p=p) for _ in range(tokens)]).astype(np.int32)
    return index, rng.uniform(0.1, 1.0, (tokens, top_k))


CASES = [  # tokens, top_k, experts, block, skew, unused experts
    (13, 1, 8, 4, None, ()),
    (16, 2, 8, 4, [8, 4, 1, 1, 1, 1, 0.5, 0.5], (3,)),
    (9, 8, 8, 8, None, ()),
    (40, 2, 64, 4, None, (0, 5, 63)),
    (24, 8, 64, 16, np.linspace(1, 6, 64), tuple(range(40, 64))),
    (5, 2, 64, 128, None, ()),
]


@pytest.mark.parametrize("tokens, top_k, experts, block, skew, unused", CASES)
def test_metadata_is_the_oracle_layout(tokens, top_k, experts, block, skew, unused):
    rng = np.random.default_rng(tokens * experts + top_k)
    index, weights = choose(rng, tokens, top_k, experts, skew, unused)
    got = jax.jit(lambda i, w: blockwise_routing(i, w, num_experts=experts, block_size=block))(index, weights)
    affinities, slots, owners, conditions = routing(index, weights, experts, block)
    np.testing.assert_array_equal(got[1], slots)
    np.testing.assert_array_equal(got[2], owners)
    np.testing.assert_array_equal(got[3], conditions)
    np.testing.assert_array_equal(np.asarray(got[0]), affinities)  # scattered, not computed: exact
    assert got[1].dtype == got[2].dtype == got[3].dtype == jnp.int32
    assert got[0].dtype == jnp.asarray(weights).dtype and got[0].shape == ((tokens + 1) * experts, 1)


@pytest.mark.parametrize("experts, block", [(8, 4), (64, 16), (64, 1)])
def test_the_static_block_count_covers_the_worst_case(experts, block):
    """E - 1 experts with one token each and every other assignment on one expert: every block is used."""
    tokens, top_k = 3 * block + experts, 1
    index = np.zeros((tokens, top_k), np.int32)
    index[: experts - 1, 0] = np.arange(1, experts)
    r = blockwise_routing(index, np.ones((tokens, top_k), np.float32), num_experts=experts, block_size=block)
    n_blocks = num_blocks(tokens, top_k, experts, block)
    assert r.block_to_expert.shape == (n_blocks, 1) and r.token_position_to_id.shape == (n_blocks * block,)
    assert int(r.conditions.sum()) == n_blocks and r.conditions[-1] == 0


def test_padding_slots_point_at_the_padding_row_with_zero_affinity():
    rng = np.random.default_rng(3)
    index, weights = choose(rng, 10, 2, 8, unused=(2, 6))
    r = blockwise_routing(index, weights, num_experts=8, block_size=8)
    affinities = np.asarray(r.expert_affinities_masked).reshape(11, 8)
    assert not affinities[10].any() and not affinities[:, [2, 6]].any()
    assert set(np.asarray(r.block_to_expert).ravel()[: int(r.conditions.sum())]) == set(range(8)) - {2, 6}
    counts = np.bincount(np.asarray(r.token_position_to_id), minlength=11)
    np.testing.assert_array_equal(counts[:10], 2)


@pytest.mark.parametrize("tokens, top_k, experts, block, skew, unused", CASES)
@pytest.mark.parametrize("dtype, implementation", [(jnp.float32, "shard_on_i"), (jnp.bfloat16, "shard_on_block")])
def test_moe_cte_on_the_metadata_is_the_dense_moe(tokens, top_k, experts, block, skew, unused, dtype, implementation):
    rng = np.random.default_rng(tokens + 7 * top_k)
    hidden, inter = 24, 12
    index, weights = choose(rng, tokens, top_k, experts, skew, unused)
    x = with_padding_row(jnp.asarray(rng.standard_normal((tokens, hidden)), dtype))
    gate_up = jnp.asarray(rng.standard_normal((experts, hidden, 2, inter)) * 0.3, dtype)
    down = jnp.asarray(rng.standard_normal((experts, inter, hidden)) * 0.3, dtype)

    @jax.jit
    def layer(x, index, weights, gate_up, down):
        r = blockwise_routing(index, weights.astype(dtype), num_experts=experts, block_size=block)
        out = nki.moe_cte(
            x,
            r.expert_affinities_masked,
            gate_up,
            down,
            r.token_position_to_id,
            r.block_to_expert,
            block_size=block,
            implementation=implementation,
        )
        return (out.sum(axis=1) if out.ndim == 3 else out)[:tokens]

    got = layer(x, index, jnp.asarray(weights), gate_up, down)
    w = f64(jnp.asarray(weights, dtype))
    expected = dense_moe(f64(x)[:tokens], index, w, f64(gate_up), f64(down))
    assert got.dtype == dtype
    assert_close(got, expected, dtype, reduction=hidden, ops=4 * top_k)


def test_bad_inputs_name_the_argument():
    index, weights = np.zeros((4, 2), np.int32), np.ones((4, 2), np.float32)
    with pytest.raises(TypeError, match="expert_index"):
        blockwise_routing(index.astype(np.float32), weights, num_experts=4, block_size=2)
    with pytest.raises(TypeError, match="expert_weights"):
        blockwise_routing(index, weights[:, :1], num_experts=4, block_size=2)
    with pytest.raises(ValueError, match="block_size"):
        blockwise_routing(index, weights, num_experts=4, block_size=0)


def test_vmaps_over_a_batch_of_routings():
    rng = np.random.default_rng(9)
    batch = [choose(rng, 6, 2, 8) for _ in range(3)]
    index, weights = np.stack([b[0] for b in batch]), np.stack([b[1] for b in batch])
    got = jax.vmap(lambda i, w: blockwise_routing(i, w, num_experts=8, block_size=4))(index, weights)
    for n, (i, w) in enumerate(batch):
        np.testing.assert_array_equal(got.token_position_to_id[n], routing(i, w, 8, 4)[1])
