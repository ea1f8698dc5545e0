"""The expert MLP and routing combination of the token-generation MoE kernels (``moe_tkg``, ``moe_block_tkg``),
written once from the kernels' semantics (nki-library ``core/moe/moe_tkg``, ``core/mlp/mlp_tkg``).

One expert ``e`` on tokens ``x [N, H]`` (float32 math, float64 for float64 inputs; ``io`` = the hidden dtype):

    g = x @ (Wgu[e, :, 0, :] * s_gu[e, 0]) + b_gu[e, 0]      clamped: min(., gate_upper), then max(., gate_lower)
    u = x @ (Wgu[e, :, 1, :] * s_gu[e, 1]) + b_gu[e, 1]      clamped: min(., up_upper), then max(., up_lower)
    h = act(g) * u                                            (rounded to io on the selective path)
    y = io(h @ (Wd[e] * s_d[e]) + b_d[e])

``s_gu [E_L, 2, I]`` and ``s_d [E_L, H]`` are the FP8 row (per output column) dequantization scales, 1 when absent.
A token's output is ``sum_k io(y_{e_k} * c_k)`` over its contributions: ``c = 1`` (``NO_SCALE``) or its affinity
rounded to io (``POST_SCALE``). The sum runs in float32 (the kernel accumulates in io) and is rounded once to the
output dtype.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..framework import compat
from ..mlp.mlp_reference import (
    activation,
    clamp,
    decode_mx_down,
    decode_mx_gate_up,
    mx_bias_vector,
    mx_quantize_inter,
)

EXPERT_WEIGHTS = (
    "expert_gate_up_weights",
    "expert_down_weights",
    "expert_gate_up_bias",
    "expert_down_bias",
    "expert_gate_up_weights_scale",
    "expert_down_weights_scale",
)


@dataclasses.dataclass(frozen=True)
class Datapath:
    """How the experts compute: ``io`` the hidden dtype; ``round_intermediate`` (the selective path stores
    ``act(g) * u`` in io); ``mx_format`` the element type of MX x4 weight words (``None``: dense weights);
    ``quantize`` the MXFP8 round trip of the intermediate (off for the straight-through VJP)."""

    io: np.dtype
    round_intermediate: bool
    mx_format: np.dtype | None = None
    quantize: bool = True


def _rounded(v, io):
    return v.astype(io).astype(v.dtype)


def dense_expert(weights, inter: int, mx_format):
    """One expert's weights in the dense layouts (``[H, 2, I]``, ``[I, H]``, ``[2, I]``, ``[H]``, row scales), MX
    words decoded (their scales folded in)."""
    if mx_format is None:
        return weights
    gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale = weights
    projections = [decode_mx_gate_up(gate_up[:, c], gate_up_scale[:, c], mx_format) for c in (0, 1)]
    bias = None
    if gate_up_bias is not None:
        bias = jnp.stack([mx_bias_vector(gate_up_bias[:, c], inter) for c in (0, 1)])
    return (jnp.stack(projections, 1), decode_mx_down(down, down_scale, mx_format, inter), bias, down_bias, None, None)


def expert_output(x, weights, p, path: Datapath):
    """``y [N, H]`` (accumulation dtype, already rounded to io) of one expert on ``x [N, H]``; ``weights`` are that
    expert's slices of :data:`EXPERT_WEIGHTS` (``None`` where absent)."""
    inter = weights[0].shape[-1]
    gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale = dense_expert(weights, inter, path.mx_format)
    acc = x.dtype
    w = gate_up.astype(acc)  # [H, 2, I]
    if gate_up_scale is not None:
        w = w * gate_up_scale.astype(acc)[None]
    projected = jnp.einsum("nh,hci->nci", x, w, precision=lax.Precision.HIGHEST)
    if gate_up_bias is not None:
        projected = projected + gate_up_bias.astype(acc)
    gate = clamp(projected[:, 0], p["gate_clamp_upper_limit"], p["gate_clamp_lower_limit"])
    up = clamp(projected[:, 1], p["up_clamp_upper_limit"], p["up_clamp_lower_limit"])
    hidden = activation(gate, p["activation_fn"]) * up
    if path.round_intermediate or path.mx_format is not None:
        hidden = _rounded(hidden, path.io)
    if path.mx_format is not None and path.quantize:
        hidden = mx_quantize_inter(hidden)
    d = down.astype(acc)  # [I, H]
    if down_scale is not None:
        d = d * down_scale.astype(acc)[None]
    y = jnp.dot(hidden, d, precision=lax.Precision.HIGHEST)
    if down_bias is not None:
        y = y + down_bias.astype(acc)
    return _rounded(y, path.io)


def dense_combination(x, weights, coefficients, p, path: Datapath):
    """``sum_e io(y_e(x) * coefficients[:, e])`` over every local expert (a scan, O(T * I) memory), float32."""

    def step(total, expert):
        *slices, coefficient = expert
        y = expert_output(x, slices, p, path)
        return total + _rounded(y * coefficient[:, None], path.io), None

    present = [w for w in weights if w is not None]
    total = compat.varying_like(jnp.zeros(x.shape, x.dtype), x, coefficients, *present)
    total, _ = lax.scan(step, total, (*weights, coefficients.T))
    return total


def gathered_combination(x, weights, expert_index, coefficients, p, path: Datapath):
    """``sum_k io(y_{index[t, k]}(x_t) * coefficients[t, k])`` with each token's experts gathered (for few tokens
    and many experts: ``T * K`` expert evaluations instead of ``E_L``)."""
    index = jnp.clip(expert_index, 0, weights[0].shape[0] - 1)

    def one(x_t, index_t, coefficient_t):
        def contribution(e, c):
            slices = [None if w is None else w[e] for w in weights]
            return _rounded(expert_output(x_t[None], slices, p, path)[0] * c, path.io)

        return jnp.sum(jax.vmap(contribution)(index_t, coefficient_t), axis=0)

    return jax.vmap(one)(x, index, coefficients)


def local_affinities(affinities, expert_index, rank_id, local_experts: int, mask: bool, acc):
    """All-expert mode's affinities of this rank's experts ``[T, E_L]``: columns ``rank * E_L + j`` of
    ``affinities``, each times (with ``mask``) how often token ``t`` selected that expert in ``expert_index``."""
    offset = rank_id.reshape(()).astype(jnp.int32) * local_experts
    tokens = affinities.shape[0]
    sliced = lax.dynamic_slice(affinities.astype(acc), (jnp.int32(0), offset), (tokens, local_experts))
    if not mask:
        return sliced
    experts = offset + jnp.arange(local_experts, dtype=jnp.int32)
    selected = expert_index.astype(jnp.int32)[:, :, None] == experts[None, None, :]  # [T, K, E_L]
    return sliced * jnp.sum(selected, axis=1).astype(acc)
