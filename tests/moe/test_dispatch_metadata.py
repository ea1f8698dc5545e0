"""The all-to-all metadata builders (catalog rows 75-76) against NumPy oracles written from the kernels' semantics:
expert ``e`` lives on rank ``e // (E // R)``; ``build_all_to_all_v_metadata`` counts (token, k) pairs per rank in
rows (uint32 [3, R]); ``build_all2all_dispatch_metadata`` counts tokens per rank once each, times the elements per
token (float32 [4, R]). Counts are compared exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import kernel_configs


def oracle_a2av(expert_index, ranks, experts):
    per_rank = experts // ranks
    counts = np.zeros(ranks, np.int64)
    for e in np.asarray(expert_index).ravel():
        if 0 <= e < ranks * per_rank:
            counts[e // per_rank] += 1
    return np.stack([counts, np.cumsum(counts) - counts, np.zeros(ranks, np.int64)])


def oracle_dispatch(expert_index, experts, elements, ranks):
    per_rank = experts // ranks
    counts = np.zeros(ranks, np.int64)
    for row in np.asarray(expert_index):
        counts[sorted({e // per_rank for e in row if 0 <= e < ranks * per_rank})] += 1
    counts *= elements
    zeros = np.zeros(ranks, np.int64)
    return np.stack([counts, np.cumsum(counts) - counts, zeros, zeros])


def top_k(tokens, k, experts, seed, only=None):
    """``k`` distinct experts per token, drawn from ``only`` (default every expert)."""
    rng = np.random.default_rng(seed)
    pool = np.arange(experts) if only is None else np.asarray(only)
    return jnp.asarray(np.stack([rng.permutation(pool)[:k] for _ in range(tokens)]), jnp.int32)


CASES = [  # tokens, k, experts, ranks
    (7, 3, 16, 4),
    (1, 1, 8, 8),
    (33, 2, 64, 8),
    (128, 8, 256, 16),
]


@pytest.mark.parametrize("tokens, k, experts, ranks", CASES)
def test_all_to_all_v_metadata_matches_oracle(tokens, k, experts, ranks):
    index = top_k(tokens, k, experts, seed=tokens)
    out = jax.jit(lambda i: nki.build_all_to_all_v_metadata(i, replica_group_size=ranks, E=experts))(index)
    assert out.dtype == jnp.uint32 and out.shape == (3, ranks)
    np.testing.assert_array_equal(np.asarray(out, np.int64), oracle_a2av(index, ranks, experts))


@pytest.mark.parametrize("tokens, k, experts, ranks", CASES)
def test_dispatch_metadata_matches_oracle(tokens, k, experts, ranks):
    index = top_k(tokens, k, experts, seed=tokens + 1)
    out = nki.build_all2all_dispatch_metadata(
        index, num_experts=experts, num_elements_per_token=7, replica_group_size=ranks
    )
    assert out.dtype == jnp.float32 and out.shape == (4, ranks)
    np.testing.assert_array_equal(np.asarray(out, np.int64), oracle_dispatch(index, experts, 7, ranks))


def test_uneven_loads_leave_ranks_empty():
    """Experts only on ranks 1 and 3 of 4: the others get zero counts and repeat the displacement."""
    index = top_k(9, 2, 16, seed=3, only=[4, 5, 6, 12, 15])
    a2av = np.asarray(nki.build_all_to_all_v_metadata(index, replica_group_size=4, E=16), np.int64)
    np.testing.assert_array_equal(a2av, oracle_a2av(index, 4, 16))
    assert a2av[0, 0] == a2av[0, 2] == 0 and a2av[0].sum() == 18
    assert a2av[1, 0] == a2av[1, 1] and a2av[1, 2] == a2av[1, 3]
    dispatch = nki.build_all2all_dispatch_metadata(
        index, num_experts=16, num_elements_per_token=3, replica_group_size=4
    )
    np.testing.assert_array_equal(np.asarray(dispatch, np.int64), oracle_dispatch(index, 16, 3, 4))


def test_worked_example_dedup():
    """E=8 over 4 ranks (2 experts each): token 0 -> experts 0, 1 (rank 0 twice), token 1 -> 2, 5 (ranks 1, 2),
    token 2 -> 7, 6 (rank 3 twice)."""
    index = jnp.asarray([[0, 1], [2, 5], [7, 6]], jnp.int32)
    a2av = nki.build_all_to_all_v_metadata(index, replica_group_size=4, E=8)
    np.testing.assert_array_equal(np.asarray(a2av), [[2, 1, 1, 2], [0, 2, 3, 4], [0, 0, 0, 0]])
    dispatch = nki.build_all2all_dispatch_metadata(
        index, num_experts=8, num_elements_per_token=10, replica_group_size=4
    )
    np.testing.assert_array_equal(np.asarray(dispatch), [[10, 10, 10, 10], [0, 10, 20, 30], [0] * 4, [0] * 4])


def test_experts_beyond_the_ranks_are_not_counted():
    """num_experts=10 over 4 ranks: 2 experts each (rounded down), experts 8 and 9 belong to no rank."""
    index = jnp.asarray([[8, 0], [9, 3], [7, 8]], jnp.int32)
    out = nki.build_all2all_dispatch_metadata(index, num_experts=10, num_elements_per_token=1, replica_group_size=4)
    np.testing.assert_array_equal(np.asarray(out, np.int64), oracle_dispatch(index, 10, 1, 4))
    np.testing.assert_array_equal(np.asarray(out)[0], [1, 1, 0, 1])


def test_vmap_over_routings():
    index = jnp.stack([top_k(5, 2, 8, seed=s) for s in range(3)])
    out = jax.vmap(lambda i: nki.build_all_to_all_v_metadata(i, replica_group_size=2, E=8))(index)
    for s in range(3):
        np.testing.assert_array_equal(np.asarray(out[s], np.int64), oracle_a2av(index[s], 2, 8))


# ---------------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_name_the_argument():
    index = top_k(4, 2, 8, seed=0)
    with pytest.raises(ValueError, match="E=8 experts must split evenly over replica_group_size=3"):
        nki.build_all_to_all_v_metadata(index, replica_group_size=3, E=8)
    with pytest.raises(ValueError, match="`has_rdispls`=True is not supported"):
        nki.build_all_to_all_v_metadata(index, replica_group_size=2, E=8, has_rdispls=True)
    with pytest.raises(TypeError, match="replica_group_size"):
        nki.build_all_to_all_v_metadata(index, E=8)
    with pytest.raises(ValueError, match="num_experts=2 gives no expert to each of the replica_group_size=4"):
        nki.build_all2all_dispatch_metadata(index, num_experts=2, num_elements_per_token=1, replica_group_size=4)
    with pytest.raises(TypeError, match="expert_index"):
        nki.build_all2all_dispatch_metadata(
            index.astype(jnp.float32), num_experts=8, num_elements_per_token=1, replica_group_size=4
        )


# ------------------------------------------------------------------------------------------------ Neuron limits
def _lower(fn, *args):
    with jax_nkilib.neuron.dry_run():
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("neuron",)).as_text()


def test_neuron_limits_fall_back_with_the_reason():
    many_tokens = jax.ShapeDtypeStruct((129, 2), jnp.int32)
    with pytest.warns(NeuronFallbackWarning, match="T=129 tokens must be <= 128"):
        text = _lower(
            lambda i: nki.build_all2all_dispatch_metadata(
                i, num_experts=8, num_elements_per_token=1, replica_group_size=4
            ),
            many_tokens,
        )
    assert kernel_configs(text) == []
    with pytest.warns(NeuronFallbackWarning, match="E=192 must be <= 128 or a multiple of 128"):
        _lower(lambda i: nki.build_all_to_all_v_metadata(i, replica_group_size=4, E=192), many_tokens)
    text = _lower(lambda i: nki.build_all_to_all_v_metadata(i, replica_group_size=4, E=256), many_tokens)
    assert [config["func_name"] for config in kernel_configs(text)] == ["build_all_to_all_v_metadata"]
