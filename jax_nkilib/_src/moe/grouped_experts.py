"""Dropless expert MLPs over routed tokens as a blockwise grouped matmul (the reference path of ``jax_nkilib.moe``).

The ``M`` (token, expert) pairs are sorted by expert and laid out in blocks of ``block`` rows, each block holding rows
of one expert (an expert's last block is padded with empty rows), the scheme of the ``moe_cte`` kernel. A scan over
the blocks computes, for block ``n`` of expert ``e``,
``y = (act(x @ W_gate[e] + b_gate[e]) * (x @ W_up[e] + b_up[e])) @ W_down[e] + b_down[e]``, skipping unused blocks.
The work is that of the ``M`` routed rows plus at most ``block - 1`` padding rows per expert; no one-hot dispatch
over all experts is formed. (``jax.lax.ragged_dot`` is not used: XLA:CPU expands it into a dense product per group,
64 times the work and 2.3 GB of temporaries for 8192 rows, 64 experts, 1024x512, measured with jax 0.10.2.)

Reverse mode is a hand-written VJP that recomputes each block's activations (nothing but the blocked inputs is
saved) and accumulates the weight gradients per expert. For remat policies the blocked rows are named
``moe.x_blocks`` and the experts' output ``moe.y`` (``jax_nkilib.checkpoint_policies``). Matmuls accumulate in
float32 (float64 for float64 inputs); results are cast to the inputs' dtype.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..framework import compat, registry
from ..framework.activations import activation
from ..framework.checkpoint_policies import name_operands, name_outputs
from ..framework.common_types import ActFnType
from ..framework.spec import accumulation_dtype

MIN_BLOCK, MAX_BLOCK = 8, 128


class BlockLayout(NamedTuple):
    """Where each routed pair sits: ``row_pair [blocks * block]`` (the pair in each blocked row; ``M`` for a padding
    row), ``block_expert [blocks]`` and ``block_used [blocks]`` (blocks past the last expert's are unused)."""

    row_pair: jax.Array
    block_expert: jax.Array
    block_used: jax.Array
    block: int


def block_size_for(pairs: int, num_experts: int) -> int:
    """A power of two in ``[8, 128]`` near ``pairs / (2 num_experts)``: padding costs at most half the rows on
    average when experts are evenly loaded, while blocks stay large enough for an efficient matmul."""
    target = max(pairs // (2 * num_experts), 1)
    return int(min(MAX_BLOCK, max(MIN_BLOCK, 2 ** math.floor(math.log2(target)))))


def block_layout(expert_ids, num_experts: int, block: int | None = None) -> BlockLayout:
    """The blocked layout of pairs with experts ``expert_ids [M]`` (int; an id outside ``[0, num_experts)`` is
    dropped: it lands in no block). Static shapes: ``cdiv(M, block) + min(num_experts, M)`` blocks always suffice."""
    (pairs,) = expert_ids.shape
    block = block or block_size_for(pairs, num_experts)
    blocks = -(-pairs // block) + min(num_experts, pairs)
    ids = expert_ids.astype(jnp.int32)
    ids = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # dropped pairs: group `num_experts`, last
    counts = jnp.bincount(ids, length=num_experts + 1)
    padded = (-(-counts // block) * block).at[num_experts].set(0)  # the dropped group gets no rows
    padded_end = jnp.cumsum(padded)
    order = jnp.argsort(ids, stable=True)
    sorted_ids = ids[order]
    rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[sorted_ids]  # rank in its group
    target = jnp.where(sorted_ids < num_experts, (padded_end - padded)[sorted_ids] + rank, blocks * block)
    row_pair = jnp.full((blocks * block,), pairs, jnp.int32).at[target].set(order.astype(jnp.int32), mode="drop")
    first_row = compat.varying_like(jnp.arange(blocks, dtype=jnp.int32) * block, padded_end)  # JAX 0.7's searchsorted
    block_expert = jnp.searchsorted(padded_end[:num_experts], first_row, side="right").astype(jnp.int32)
    block_used = block_expert < num_experts
    return BlockLayout(row_pair, jnp.minimum(block_expert, num_experts - 1), block_used, block)


class ExpertWeights(NamedTuple):
    """``gate_up [E, H, 2, I]`` (gate ``[..., 0, :]``, up ``[..., 1, :]``), ``down [E, I, H]``, ``gate_up_bias
    [E, 2, I]``, ``down_bias [E, H]`` (zeros when the call has none)."""

    gate_up: jax.Array
    down: jax.Array
    gate_up_bias: jax.Array
    down_bias: jax.Array


def _block_forward(x, weights: ExpertWeights, e, fn: ActFnType, acc):
    """One block: ``(y, (gate, up))`` for rows ``x [b, H]`` of expert ``e`` (``acc`` the accumulation dtype)."""
    gate_up = jax.lax.dynamic_index_in_dim(weights.gate_up, e, keepdims=False)  # [H, 2, I]
    h = jnp.einsum("bh,hti->bti", x, gate_up, preferred_element_type=acc)
    h = h + jax.lax.dynamic_index_in_dim(weights.gate_up_bias, e, keepdims=False).astype(acc)
    gate, up = h[:, 0], h[:, 1]
    inner = (activation(gate, fn) * up).astype(x.dtype)
    down = jax.lax.dynamic_index_in_dim(weights.down, e, keepdims=False)  # [I, H]
    y = jnp.dot(inner, down, preferred_element_type=acc)
    y = y + jax.lax.dynamic_index_in_dim(weights.down_bias, e, keepdims=False).astype(acc)
    return y.astype(x.dtype), (gate, up)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def expert_blocks(x_blocks, block_expert, block_used, weights: ExpertWeights, fn: ActFnType):
    """``y [blocks, b, H]``: each used block's rows ``x_blocks [blocks, b, H]`` through its expert's MLP (unused
    blocks give 0)."""
    return _expert_blocks_forward(x_blocks, block_expert, block_used, weights, fn)


def _expert_blocks_forward(x_blocks, block_expert, block_used, weights, fn):
    acc = accumulation_dtype(x_blocks.dtype)

    def step(_, inputs):
        x, e, used = inputs
        empty = compat.varying_like(jnp.zeros(x.shape, x.dtype), x, *weights)  # shard_map: the branches' types
        y = jax.lax.cond(used, lambda: _block_forward(x, weights, e, fn, acc)[0], lambda: empty)
        return None, y

    return jax.lax.scan(step, None, (x_blocks, block_expert, block_used))[1]


_NAME = "moe"  # remat names: moe.x_blocks (the blocked rows, an operand) and moe.y (the experts' output)
registry.register_checkpointed(_NAME, ("x_blocks",))


def _expert_blocks_fwd(x_blocks, block_expert, block_used, weights, fn):
    (x_blocks,) = name_operands(_NAME, {"x_blocks": x_blocks}).values()
    out = _expert_blocks_forward(x_blocks, block_expert, block_used, weights, fn)
    (out,) = name_outputs(_NAME, {"y": out}, ("x_blocks",))
    return out, (x_blocks, block_expert, block_used, weights)


def _expert_blocks_bwd(fn, residuals, dy_blocks):
    """Per used block of expert ``e``: ``dinner = dy W_down[e]^T``, ``d(gate, up)`` through ``act(gate) * up``,
    ``dx = d(gate, up) W_gate_up[e]^T``; ``W_down[e] += inner^T dy``, ``W_gate_up[e] += x^T d(gate, up)``."""
    x_blocks, block_expert, block_used, weights = residuals
    acc = accumulation_dtype(x_blocks.dtype)
    refs = (x_blocks, dy_blocks, *weights)  # inside shard_map, the carries vary over every axis these vary over
    zeros = ExpertWeights(*(compat.varying_like(jnp.zeros(w.shape, acc), *refs) for w in weights))

    def used_block(grads, x, dy, e):
        _, (gate, up) = _block_forward(x, weights, e, fn, acc)
        act, act_vjp = jax.vjp(lambda g: activation(g, fn), gate)
        inner = act * up
        down = jax.lax.dynamic_index_in_dim(weights.down, e, keepdims=False).astype(acc)
        dinner = jnp.dot(dy.astype(acc), down.T)
        (dgate,) = act_vjp(dinner * up)
        dh = jnp.stack([dgate, dinner * act], axis=1)  # [b, 2, I]
        gate_up = jax.lax.dynamic_index_in_dim(weights.gate_up, e, keepdims=False).astype(acc)
        dx = jnp.einsum("bti,hti->bh", dh, gate_up)
        rows = x.astype(acc)
        update = ExpertWeights(
            jnp.einsum("bh,bti->hti", rows, dh),
            jnp.dot(inner.astype(x.dtype).astype(acc).T, dy.astype(acc)),
            dh.sum(0),
            dy.astype(acc).sum(0),
        )
        grads = ExpertWeights(*(g.at[e].add(u) for g, u in zip(grads, update)))
        return grads, dx.astype(x.dtype)

    def step(grads, inputs):
        x, dy, e, used = inputs
        empty = compat.varying_like(jnp.zeros(x.shape, x.dtype), *refs)
        return jax.lax.cond(used, lambda: used_block(grads, x, dy, e), lambda: (grads, empty))

    grads, dx_blocks = jax.lax.scan(step, zeros, (x_blocks, dy_blocks, block_expert, block_used))
    # in shard_map: a weight replicated over a mesh axis that splits the tokens gets the sum of the shards'
    # gradients, and so does x over an axis that splits the intermediate dimension (tensor parallelism)
    grads = ExpertWeights(*(compat.sum_over_extra_varying(g, w).astype(w.dtype) for g, w in zip(grads, weights)))
    return compat.sum_over_extra_varying(dx_blocks, x_blocks), None, None, grads


expert_blocks.defvjp(_expert_blocks_fwd, _expert_blocks_bwd)


def routed_experts(x, token_of_pair, weight_of_pair, expert_of_pair, weights: ExpertWeights, fn: ActFnType):
    """``out [T, H] = sum over pairs p of weight_of_pair[p] * MLP_{expert_of_pair[p]}(x[token_of_pair[p]])`` for
    ``x [T, H]`` and pair vectors ``[M]``; pairs whose expert is outside ``[0, E)`` contribute nothing. The combine
    accumulates in float32 (float64 for float64 inputs)."""
    tokens, hidden = x.shape
    (pairs,) = token_of_pair.shape
    num_experts = weights.gate_up.shape[0]
    layout = block_layout(expert_of_pair, num_experts)
    padding = layout.row_pair == pairs
    token_of_row = jnp.where(padding, tokens, token_of_pair.astype(jnp.int32)[jnp.minimum(layout.row_pair, pairs - 1)])
    x_padded = jnp.concatenate([x, jnp.zeros((1, hidden), x.dtype)])
    x_blocks = x_padded[token_of_row].reshape(-1, layout.block, hidden)
    y = expert_blocks(x_blocks, layout.block_expert, layout.block_used, weights, fn).reshape(-1, hidden)
    acc = accumulation_dtype(x.dtype)
    weight_of_row = jnp.where(padding, 0, weight_of_pair.astype(acc)[jnp.minimum(layout.row_pair, pairs - 1)])
    out = jnp.zeros((tokens + 1, hidden), acc).at[token_of_row].add(y.astype(acc) * weight_of_row[:, None])
    return out[:tokens].astype(x.dtype)
