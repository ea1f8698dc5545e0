"""The blockwise (dropless) MoE computation the NKI Library's ``moe_cte`` family and ``blockwise_mm_bwd`` share,
written block by block like the kernels: block ``b`` gathers its ``B`` tokens ``ids = token_position_to_id[b*B:
(b+1)*B]`` of ``hidden_states``, runs expert ``e = block_to_expert[b]``'s MLP on them and scatter-adds the result
into the output rows ``ids``. One ``lax.scan`` step per block: never a dense one-hot over all experts.

Per block (``x`` the gathered rows, ``a = affinities[ids, e]`` rounded to ``hidden_states``' dtype):

* ``PRE_SCALE`` on the input (``shard_on_block``): ``x <- a x``;
* the MX kernels quantize ``x`` (``BlockOptions.quantize_input``) and, before the down projection, ``h``
  (``quantize_intermediate``) on chip;
* ``g, u = x @ W_gu[e, :, 0], x @ W_gu[e, :, 1]`` (+ bias ``b_gu[e]``), clamped (``min(., upper)`` then
  ``max(., lower)``); this ``[2, I, B]`` pair is the gate/up checkpoint;
* ``PRE_SCALE`` on the projections (the I-sharded kernels): ``g, u <- a g, a u``;
* ``h = act(g) * u`` (times ``a`` with ``expert_affinity_multiply_on_I``);
* ``d = h @ W_down[e]`` (+ ``b_down[e]``): the down checkpoint ``[B, H]``;
* ``POST_SCALE``: ``y = a d``; the output rows ``ids`` accumulate ``y`` rounded to the output dtype, block after
  block (the kernels' read-add-write of the rows in the I/O dtype), or, without ``is_tensor_update_accumulating``,
  are overwritten with it (a later block wins; rows no block writes stay zero, where the kernels leave them
  unwritten).

Products and sums run in float32 (float64 for float64 inputs). Blocks whose expert is out of range (``e >= E``)
contribute nothing. With ``skip_token`` a token id of ``-1`` reads a zero row and writes nowhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from ..framework.activations import activation, clamp
from ..framework.common_types import ActFnType, ExpertAffinityScaleMode
from ..framework.compat import varying_like
from ..framework.spec import accumulation_dtype


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """The static choices of one blockwise MoE computation (see the module docstring)."""

    block_size: int
    activation_function: ActFnType = ActFnType.SiLU
    scaling_mode: ExpertAffinityScaleMode = ExpertAffinityScaleMode.POST_SCALE
    prescale_on_projections: bool = False  # the I-sharded kernels scale g, u (after bias and clamp), not x
    multiply_on_I: bool = False
    gate_clamp: tuple[float | None, float | None] = (None, None)  # (upper, lower)
    up_clamp: tuple[float | None, float | None] = (None, None)
    skip_token: bool = False
    accumulate: bool = True  # is_tensor_update_accumulating: add into the rows, else overwrite them
    quantize_input: Callable | None = None  # the MX kernels' on-chip round trip of the (pre-scaled) input rows
    quantize_intermediate: Callable | None = None  # ... and of act(g) * u before the down projection

    @property
    def prescale(self) -> bool:
        return self.scaling_mode in (ExpertAffinityScaleMode.PRE_SCALE, ExpertAffinityScaleMode.PRE_SCALE_DELAYED)


def _dot(a, b):
    return jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)


def padded_rows(hidden, affinities, skip_token: bool):
    """``hidden [rows, H]`` and ``affinities [rows, E]`` with a zero row appended when ``skip_token`` (where token
    id ``-1`` then points), as they are."""
    if not skip_token:
        return hidden, affinities
    zeros = lambda x: jnp.zeros((1, x.shape[1]), x.dtype)  # noqa: E731
    return jnp.concatenate([hidden, zeros(hidden)]), jnp.concatenate([affinities, zeros(affinities)])


def block_token_ids(token_position_to_id, block_size: int, rows: int, skip_token: bool):
    """``[N, B]`` row indices; with ``skip_token`` the ``-1`` entries point at the appended zero row ``rows``."""
    ids = token_position_to_id.reshape(-1, block_size).astype(jnp.int32)
    return jnp.where(ids < 0, rows, ids) if skip_token else ids


def gate_up_block(x, affinity, w_gate_up, gate_up_bias, opts: BlockOptions):
    """``(g, u)`` ``[B, I]`` of one block: projections, bias, clamps (the checkpointed values)."""
    wide = x.dtype
    if opts.prescale and not opts.prescale_on_projections:
        x = affinity * x
    if opts.quantize_input is not None:
        x = opts.quantize_input(x)
    hidden, _, inter = w_gate_up.shape
    gu = _dot(x, w_gate_up.astype(wide).reshape(hidden, 2 * inter)).reshape(-1, 2, inter)
    g, u = gu[:, 0], gu[:, 1]
    if gate_up_bias is not None:
        g, u = g + gate_up_bias[0].astype(wide), u + gate_up_bias[1].astype(wide)
    return clamp(g, *opts.gate_clamp), clamp(u, *opts.up_clamp)


def expert_block(x, affinity, weights, opts: BlockOptions):
    """One block's ``(y, (g, u), d)``: output contribution ``[B, H]``, gate/up and down activations."""
    w_gate_up, w_down, gate_up_bias, down_bias = weights
    g, u = gate_up_block(x, affinity, w_gate_up, gate_up_bias, opts)
    if opts.prescale and opts.prescale_on_projections and not opts.multiply_on_I:
        g_in, u_in = affinity * g, affinity * u
    else:
        g_in, u_in = g, u
    h = activation(g_in, opts.activation_function) * u_in
    if opts.multiply_on_I:
        h = affinity * h
    if opts.quantize_intermediate is not None:
        h = opts.quantize_intermediate(h)
    d = _dot(h, w_down.astype(x.dtype))
    if down_bias is not None:
        d = d + down_bias.reshape(-1).astype(x.dtype)
    post = opts.scaling_mode == ExpertAffinityScaleMode.POST_SCALE and not opts.multiply_on_I
    return (affinity * d if post else d), (g, u), d


def _take(x, index):
    return None if x is None else jax.lax.dynamic_index_in_dim(x, index, keepdims=False)


def blockwise_forward(
    hidden,
    affinities,
    w_gate_up,
    w_down,
    token_position_to_id,
    block_to_expert,
    gate_up_bias,
    down_bias,
    opts: BlockOptions,
    active=None,
):
    """``(out [rows, H], gate_up_T [N, 2, I, B], down [N, B, H])`` over every block (or those ``active [N]``
    marks): ``out`` in ``hidden``'s dtype, the checkpoints in the accumulation dtype (zero for skipped blocks).
    ``affinities`` is ``[rows, E]``."""
    rows, dtype = hidden.shape[0], hidden.dtype
    wide = accumulation_dtype(dtype)
    experts = w_gate_up.shape[0]
    hidden_p, affinities_p = padded_rows(hidden, affinities, opts.skip_token)
    ids = block_token_ids(token_position_to_id, opts.block_size, rows, opts.skip_token)
    block_expert = block_to_expert.reshape(-1).astype(jnp.int32)
    active = jnp.ones(block_expert.shape, bool) if active is None else active

    def step(out, xs):
        block_ids, e, on = xs
        valid = on & (e >= 0) & (e < experts)
        e = jnp.clip(e, 0, experts - 1)
        x = hidden_p[block_ids].astype(wide)
        a = affinities_p[block_ids, e].astype(dtype).astype(wide)[:, None]
        weights = (_take(w_gate_up, e), _take(w_down, e), _take(gate_up_bias, e), _take(down_bias, e))
        y, (g, u), d = expert_block(x, a, weights, opts)
        if opts.accumulate:
            out = out.at[block_ids].add(jnp.where(valid, y, 0).astype(out.dtype), mode="drop")
        else:
            out = out.at[block_ids].set(jnp.where(valid, y.astype(out.dtype), out[block_ids]), mode="drop")
        gate_up_t = jnp.where(valid, jnp.stack([g.T, u.T]), 0)
        return out, (gate_up_t, jnp.where(valid, d, 0))

    # inside shard_map the carry varies over the mesh axes its inputs vary over
    operands = [v for v in (hidden, affinities, w_gate_up, w_down, gate_up_bias, down_bias) if v is not None]
    out0 = varying_like(jnp.zeros((hidden_p.shape[0], hidden.shape[1]), dtype), *operands)
    out, (gate_up_t, down) = jax.lax.scan(step, out0, (ids, block_expert, active))
    return out[:rows], gate_up_t, down
