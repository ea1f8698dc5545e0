"""The routing metadata of the blockwise (dropless) MoE kernels (``moe_cte``, ``blockwise_mm_bwd``,
``blockwise_mm_baseline_shard_hidden``), built from a router's top-k choice in jitted JAX with static shapes.

Layout (the one the NKI Library's tests build, ``test_moe_cte_common.generate_token_position_to_id_and_experts``):
expert ``e`` owns ``ceil(count_e / B)`` consecutive blocks, in expert order; its tokens fill them in increasing
token id; the free slots, and the trailing blocks that no expert needs, hold the padding token id ``T`` (row ``T`` of
the kernels' ``hidden_states [T+1, H]``, whose affinities are zero). Trailing blocks are given to expert ``E - 1``.
``N = m + ceil((T*K - m) / B)`` with ``m = min(T*K, E - 1)`` blocks always suffice (the worst case: ``E - 1``
experts with one token each and the rest on one expert; the library's ``get_n_blocks`` for ``T*K >= E``).
An expert with no token gets no block. ``N`` is static: ``num_blocks(T, K, E, B)`` (``block_to_expert.shape[0]``).
``conditions [N+1]`` is 1 for the used blocks (a prefix) and 0 after (so its last entry is 0), as the hybrid kernels
need. :func:`with_padding_row` appends the padding row to the tokens.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..framework import compat


class BlockwiseRouting(NamedTuple):
    """Every routing operand of the blockwise MoE kernels (``T`` tokens, ``E`` experts, ``N`` blocks of ``B``)."""

    expert_affinities_masked: jax.Array  # [(T+1)*E, 1]: the weight of token t for expert e at t*E + e; row T zero
    token_position_to_id: jax.Array  # [N*B] int32: token id per block slot, T in padding slots
    block_to_expert: jax.Array  # [N, 1] int32
    conditions: jax.Array  # [N+1] int32: 1 for used blocks, then 0


def num_blocks(tokens: int, top_k: int, num_experts: int, block_size: int) -> int:
    """The static number of blocks that any routing of ``tokens * top_k`` assignments needs at most."""
    assignments = tokens * top_k
    singles = min(assignments, num_experts - 1)
    return max(1, singles + math.ceil((assignments - singles) / block_size))


def _check(expert_index, expert_weights, num_experts, block_size):
    where = "jax_nkilib blockwise_routing"
    if expert_index.ndim != 2 or not jnp.issubdtype(expert_index.dtype, jnp.integer):
        raise TypeError(
            f"{where}: expert_index must be an integer array [T, K]; got {expert_index.dtype} {expert_index.shape}"
        )
    if expert_weights.shape != expert_index.shape or not jnp.issubdtype(expert_weights.dtype, jnp.floating):
        raise TypeError(
            f"{where}: expert_weights must be a float array of expert_index's shape "
            f"{expert_index.shape} [T, K]; got {expert_weights.dtype} {expert_weights.shape}"
        )
    for name, value in (("num_experts", num_experts), ("block_size", block_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive Python int; got {value!r}")


def blockwise_routing(expert_index, expert_weights, *, num_experts: int, block_size: int) -> BlockwiseRouting:
    """The blockwise kernels' routing operands for ``expert_index [T, K]`` (distinct experts per token) and
    ``expert_weights [T, K]`` (the affinities, any float dtype, kept)."""
    expert_index, expert_weights = jnp.asarray(expert_index), jnp.asarray(expert_weights)
    _check(expert_index, expert_weights, num_experts, block_size)
    tokens, top_k = expert_index.shape
    n_blocks = num_blocks(tokens, top_k, num_experts, block_size)
    return BlockwiseRouting(*_build(expert_index, expert_weights, num_experts, block_size, n_blocks))


def with_padding_row(hidden_states):
    """``hidden_states [T, H]`` with the zero padding row ``T`` appended: the kernels' ``[T+1, H]``. (The
    kernels' output row ``T`` is to be dropped: ``out[:T]``.)"""
    return jnp.concatenate([hidden_states, jnp.zeros((1, hidden_states.shape[-1]), hidden_states.dtype)])


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _build(expert_index, expert_weights, num_experts, block_size, n_blocks):
    tokens, top_k = expert_index.shape
    flat_expert = expert_index.reshape(-1).astype(jnp.int32)
    flat_token = jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), top_k)

    counts = jnp.zeros(num_experts, jnp.int32).at[flat_expert].add(1)
    blocks = (counts + block_size - 1) // block_size
    block_end = jnp.cumsum(blocks)
    first_block = block_end - blocks
    first_assignment = jnp.cumsum(counts) - counts

    # stable: assignments of one expert stay in token order
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    rank = jnp.arange(tokens * top_k, dtype=jnp.int32) - first_assignment[sorted_expert]
    slot = first_block[sorted_expert] * block_size + rank
    token_position_to_id = jnp.full(n_blocks * block_size, tokens, jnp.int32).at[slot].set(flat_token[order])

    block = compat.varying_like(jnp.arange(n_blocks, dtype=jnp.int32), block_end)  # JAX 0.7's searchsorted in shard_map
    block_to_expert = jnp.minimum(jnp.searchsorted(block_end, block, side="right"), num_experts - 1)
    used = block_end[-1]
    conditions = (jnp.arange(n_blocks + 1) < used).astype(jnp.int32)

    affinities = jnp.zeros((tokens + 1, num_experts), expert_weights.dtype)
    affinities = affinities.at[flat_token, flat_expert].add(expert_weights.reshape(-1))
    return (
        affinities.reshape(-1, 1),
        token_position_to_id,
        block_to_expert.astype(jnp.int32).reshape(n_blocks, 1),
        conditions,
    )
