"""Arg specs of the MoE all-to-all dispatch kernels: ``permute_a2av`` / ``unpermute_a2av`` (collectives over the EP
ranks, run inside ``jax.shard_map``: their operands are global arrays, per-rank blocks stacked along axis 0), the
all-to-all metadata builders and ``permute_routed_tokens``."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

RANKS, T, H = 8, 3, 5  # EP ranks (the 8 devices); tokens and hidden per rank, odd
_X = P("x")
_EP = Sharding((("x", RANKS),), (_X, _X, _X), (_X, _X), collective=True)
_ONE_DEVICE_EACH = (("x", RANKS),)


def _routing(rng):
    """Per-rank ``send_indices [T, EP]`` (sentinel ``T`` past the counts) and counts ``[1, EP]``, stacked."""
    counts = rng.integers(0, T + 1, (RANKS, RANKS))
    indices = np.full((RANKS, T, RANKS), T)
    for r in range(RANKS):
        for d in range(RANKS):
            indices[r, : counts[r, d], d] = rng.permutation(T)[: counts[r, d]]
    return jnp.asarray(indices.reshape(RANKS * T, RANKS), jnp.int32), jnp.asarray(counts, jnp.int32)


def _dispatch(rng):
    indices, counts = _routing(rng)
    return normal(rng, (RANKS * T, H)), indices, counts


def _combine(rng):
    indices, counts = _routing(rng)
    return normal(rng, (RANKS * RANKS * T, H)), indices, counts


def _expert_index(rng, tokens, k, experts):
    """Top-k routing: ``k`` distinct experts per token."""
    return jnp.asarray(np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]), jnp.int32)


def _routed_tokens(dtype, tokens=6, cols=5, k=4, experts=8):
    def build(rng):
        index = _expert_index(rng, tokens, k, experts)
        affinity = np.zeros((tokens, experts))
        np.put_along_axis(affinity, np.asarray(index), rng.uniform(0.1, 1.0, (tokens, k)), axis=1)
        return normal(rng, (tokens, cols), dtype), index, jnp.asarray(affinity, jnp.bfloat16)

    return build


_REPLICATED = Sharding(_ONE_DEVICE_EACH, (P(),), P())

register(
    ArgSpec(
        "permute_a2av",
        nki.permute_a2av,
        ("hidden_states", "send_indices", "send_counts"),
        _dispatch,
        kwargs={"replica_group": "x"},
        kernels=("permute_a2av",),
        grad=("hidden_states",),
        grad_output=lambda out: out[0],
        sharding=_EP,
        bad=BadInput("send_counts", drop_last_axis, "send_counts"),
    ),
    ArgSpec(
        "unpermute_a2av",
        nki.unpermute_a2av,
        ("output", "send_indices", "recv_counts"),
        _combine,
        kwargs={"replica_group": "x"},
        kernels=("unpermute_a2av",),
        grad=("output",),
        sharding=Sharding((("x", RANKS),), (_X, _X, _X), _X, collective=True),
        bad=BadInput("output", lambda y: y[: y.shape[0] // 2], "output"),
    ),
    ArgSpec(
        "build_all_to_all_v_metadata",
        nki.build_all_to_all_v_metadata,
        ("expert_index",),
        lambda rng: (_expert_index(rng, 7, 3, 16),),
        kwargs={"replica_group_size": 4, "E": 16},
        kernels=("build_all_to_all_v_metadata",),
        sharding=_REPLICATED,
        bad=BadInput("E", lambda _: 15, "E"),
    ),
    ArgSpec(
        "build_all2all_dispatch_metadata",
        nki.build_all2all_dispatch_metadata,
        ("expert_index",),
        lambda rng: (_expert_index(rng, 7, 3, 16),),
        kwargs={"num_experts": 16, "num_elements_per_token": 9, "replica_group_size": 4},
        kernels=("build_all2all_dispatch_metadata",),
        sharding=_REPLICATED,
        bad=BadInput("expert_index", drop_last_axis, "expert_index"),
    ),
    ArgSpec(
        "permute_routed_tokens",
        nki.permute_routed_tokens,
        ("hidden_input", "expert_index", "expert_affinities_masked"),
        _routed_tokens(jnp.bfloat16),
        kernels=("permute_routed_tokens",),
        sharding=Sharding(_ONE_DEVICE_EACH, (P(), P(), P()), P()),
        bad=BadInput("expert_affinities_masked", lambda a: a.astype(jnp.float32), "expert_affinities_masked"),
    ),
    ArgSpec(
        "permute_routed_tokens_fp8",
        nki.permute_routed_tokens,
        ("hidden_input", "expert_index", "expert_affinities_masked"),
        _routed_tokens(jnp.float8_e4m3fn, tokens=4, cols=6, k=2),
        kernels=("permute_routed_tokens",),
        bad=BadInput("expert_index", lambda i: i[:3], "expert_index"),
    ),
)
