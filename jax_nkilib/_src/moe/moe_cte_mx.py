"""``moe_cte``'s MX implementations ``shard_on_block_mx`` (``nkilib/core/moe/moe_cte/bwmm_shard_on_block_mx.py``) and
``shard_on_i_mx`` / ``shard_on_i_mx_hybrid`` (``bwmm_shard_on_I_mx.py:blockwise_mm_shard_intermediate_mx[_hybrid]``;
golden of all three
``test/integration/nkilib/core/moe/moe_cte/test_utils.generate_blockwise_numpy_golden`` with MX weights): the operand
layouts, their decode to the dense blockwise math, the checks and the Neuron limits. The library's ``moe_cte``
dispatcher has no branch for the I-sharded two (it falls through and returns ``None``), so the device adapter calls
their entry points itself.

Weights are MX x4 words as in the MLP TKG MX layout (:mod:`..mlp.mlp_reference`), uint16 for MXFP4
(``float4_e2m1fn_x4``) or 32-bit for MXFP8 (``float8_e4m3fn_x4``; the kernel views them itself):
``gate_up_proj_weight [E, 128, 2, H/512, I]`` (lane ``j`` of ``[e, p, c, t, i]`` is row ``j H/4 + 128 t + p``) with
uint8 scales ``gate_up_proj_scale [E, 16, 2, H/512, I]``; ``down_proj_weight [E, P_I, N_I, H]`` (``P_I = min(128,
I/4)``, ``N_I = ceil(I/512)``, lanes along ``I``) with ``down_proj_scale [E, P_I/8, N_I, H]``; biases
``gate_and_up_proj_bias [E, P_I, 2, N_I, 4]`` and ``down_proj_bias [E, H]``.

Per block the kernel gathers the rows into ``compute_dtype`` tiles, quantizes them to MXFP8 (``float8_e4m3fn_x4``,
one scale per 8 partitions x 4 lanes of a token), runs the MX matmuls with the decoded weights (scales folded in),
adds the bias, clamps, forms ``act(g) * u`` in a bfloat16 tile (hard-coded), quantizes it to MXFP8 in the down
layout, projects, adds the down bias, multiplies by the affinity and accumulates into its core's slot of the output
``[2, T+1, H]`` in the I/O dtype; the final reduction leaves the sum in slot 0 and zeros in slot 1 (the reference
sums the blocks in order: the two cores' partial sums differ from it by rounding only). ``shard_on_i_mx`` splits
``I`` over the two cores (their down-projection halves summed), writes ``[T+1, H]`` (so does its hybrid) and may
overwrite instead of accumulate (``is_tensor_update_accumulating=False``). Only ``POST_SCALE`` is bound:
``shard_on_block_mx`` multiplies the output by the affinity whatever ``expert_affinities_scaling_mode`` says (it
stores the mode and never reads it), ``shard_on_i_mx`` asserts "PRE_SCALE mode not implemented" (its own default)
and leaves the affinity undefined for ``NO_SCALE``; the library's MX golden pre-scales the input for ``PRE_SCALE``
and its tests run ``POST_SCALE`` only.
Reverse mode differentiates this reference straight through the two MXFP8 round trips (hidden states, affinities and
biases get gradients; the integer words and scales none).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.common_types import ExpertAffinityScaleMode
from ..framework.platform import is_trn3
from ..framework.spec import CallInfo
from ..mlp.mlp_reference import decode_mx_down, decode_mx_gate_up, mx_bias_vector, mx_quantize_hidden, mx_quantize_inter
from .moe_tkg import MX_INTERMEDIATE_MULTIPLE, MX_WORD_FORMATS, mx_format

MX_TILE = 512
BLOCK_TILE = 128
SHARD_ON_I_BLOCK_MULTIPLE = 256  # shard_on_i_mx: B/128 tiles split over the two cores
SHARD_ON_I_INTER_MULTIPLE = 1024  # shard_on_i_mx: whole 512-tiles of I on each core
H_RANGE = (512, 8192)
SHARDS = 2  # the kernel asserts exactly two cores
SCALES = ("gate_up_proj_scale", "down_proj_scale")
INTERMEDIATE_TILE_DTYPE = jnp.bfloat16  # the kernels' act(g) * u tile


def decode_weights(gate_up, down, gate_up_scale, down_scale, gate_up_bias):
    """Dense ``[E, H, 2, I]``, ``[E, I, H]`` and ``[E, 2, I]`` (or ``None``) float32 of the MX operands (exact)."""
    fmt = mx_format(gate_up.dtype)
    inter = gate_up.shape[-1]
    projection = jax.vmap(lambda w, s: decode_mx_gate_up(w, s, fmt), in_axes=(1, 1), out_axes=1)  # over c
    dense_gate_up = jax.vmap(projection)(gate_up, gate_up_scale)
    dense_down = jax.vmap(lambda w, s: decode_mx_down(w, s, fmt, inter))(down, down_scale)
    bias = None
    if gate_up_bias is not None:
        bias = jax.vmap(jax.vmap(lambda b: mx_bias_vector(b, inter), in_axes=1))(gate_up_bias)
    return dense_gate_up, dense_down, bias


def _straight_through(round_trip, tile_dtype):
    """``round_trip`` of ``v`` rounded to ``tile_dtype`` in the forward, the identity in reverse mode."""

    def quantize(v):
        return v + jax.lax.stop_gradient(round_trip(v.astype(tile_dtype).astype(v.dtype)) - v)

    return quantize


def quantizers(compute_dtype) -> dict:
    """The ``BlockOptions`` hooks of the MX kernel's two on-chip MXFP8 round trips."""
    return {
        "quantize_input": _straight_through(mx_quantize_hidden, jnp.dtype(compute_dtype)),
        "quantize_intermediate": _straight_through(mx_quantize_inter, INTERMEDIATE_TILE_DTYPE),
    }


def is_mx(avals) -> bool:
    return jnp.dtype(avals["gate_up_proj_weight"].dtype) in MX_WORD_FORMATS


def check(call: CallInfo) -> None:
    """The MX implementations' operands: MX words of one format with their uint8 scales, the MX layouts, no
    ``conditions``, POST_SCALE (shard_on_block_mx: accumulating output)."""
    f, avals, d, p = call.function, call.avals, call.dims, call.params
    impl = p["implementation"].name
    words = [mx_format(avals[n].dtype) for n in ("gate_up_proj_weight", "down_proj_weight")]
    if words[0] is None or words[0] != words[1]:
        raise TypeError(
            f"{f}: {impl} takes MX x4 words of one format for gate_up_proj_weight [E, 128, 2, H/512, I] "
            "and down_proj_weight [E, P_I, N_I, H] (uint16 MXFP4 or uint32/int32 MXFP8); got "
            f"{avals['gate_up_proj_weight'].dtype} and {avals['down_proj_weight'].dtype}"
        )
    if avals["gate_up_proj_weight"].ndim != 5:
        raise ValueError(f"{f}: MX gate_up_proj_weight must be [E, 128, 2, H/512, I] x4 words")
    for name in SCALES:
        aval = avals.get(name)
        if aval is None or jnp.dtype(aval.dtype) != jnp.uint8:
            raise TypeError(
                f"{f}: {impl} needs uint8 MX scales gate_up_proj_scale [E, 16, 2, H/512, I] and "
                f"down_proj_scale [E, P_I/8, N_I, H]; `{name}` is {None if aval is None else aval.dtype}"
            )
    inter, hidden = d["I"], d["H"]
    if inter % MX_INTERMEDIATE_MULTIPLE:
        raise ValueError(f"{f}: MX weights are bound for I % {MX_INTERMEDIATE_MULTIPLE} == 0; got I={inter}")
    p_i, n_i = min(128, inter // 4), -(-inter // MX_TILE)
    expected = {
        "gate_up_proj_scale": (d["E"], 16, 2, hidden // MX_TILE, inter),
        "down_proj_weight": (d["E"], p_i, n_i, hidden),
        "down_proj_scale": (d["E"], p_i // 8, n_i, hidden),
    }
    if avals.get("gate_and_up_proj_bias") is not None:
        expected["gate_and_up_proj_bias"] = (d["E"], p_i, 2, n_i, 4)
    for name, shape in expected.items():
        if tuple(avals[name].shape) != shape:
            raise ValueError(
                f"{f}: with MX weights (H={hidden}, I={inter}) `{name}` must be {list(shape)}; got "
                f"{list(avals[name].shape)}"
            )
    if avals.get("conditions") is not None and impl != "shard_on_i_mx_hybrid":
        raise ValueError(
            f"{f}: {impl} takes no `conditions` here (shard_on_block_mx's static/dynamic block loop over conditions "
            "[N+2] is not bound; shard_on_i_mx has none: use shard_on_i_mx_hybrid); every block is processed"
        )
    if p["expert_affinities_scaling_mode"] != ExpertAffinityScaleMode.POST_SCALE:
        raise ValueError(
            f"{f}: {impl} takes expert_affinities_scaling_mode=POST_SCALE only (the MX kernels scale the expert "
            f"output by the affinity or fail otherwise); got {p['expert_affinities_scaling_mode'].name}"
        )
    if impl == "shard_on_block_mx" and not p["is_tensor_update_accumulating"]:
        raise ValueError(f"{f}: shard_on_block_mx requires is_tensor_update_accumulating=True (the kernel asserts it)")
    if p["checkpoint_activation"] or p["expert_affinity_multiply_on_I"]:
        raise ValueError(f"{f}: {impl} returns no checkpoints and scales on H only")


def check_dense(call: CallInfo) -> None:
    """The bf16 implementations take dense weights and no MX scales."""
    if is_mx(call.avals) or any(call.avals.get(n) is not None for n in SCALES):
        raise TypeError(
            f"{call.function}: MX weights and gate_up_proj_scale/down_proj_scale are for implementation "
            f"shard_on_block_mx and shard_on_i_mx; {call.params['implementation'].name} takes dense float weights"
        )


def neuron_limits(call: CallInfo) -> list[str]:
    p, d = call.params, call.dims
    unmet = []
    if not is_trn3(call.target):
        unmet.append("Neuron platform target trn3 (the MX matmuls are Trainium3's)")
    if call.lnc != SHARDS:
        unmet.append("LNC=2 (the kernel runs on exactly two cores)")
    low, high = H_RANGE
    if not low <= d["H"] <= high:
        unmet.append(f"{low} <= H <= {high}")
    if call.avals["hidden_states"].dtype != jnp.bfloat16:
        unmet.append("bfloat16 hidden_states (the library runs and tests the MX kernel in bfloat16 only)")
    if p["implementation"].name.startswith("shard_on_i_mx"):
        if p["block_size"] % SHARD_ON_I_BLOCK_MULTIPLE:
            unmet.append(f"block_size % {SHARD_ON_I_BLOCK_MULTIPLE} == 0")
        if d["I"] % SHARD_ON_I_INTER_MULTIPLE:
            unmet.append(f"I % {SHARD_ON_I_INTER_MULTIPLE} == 0")
        if p["skip_dma"][1]:
            unmet.append("skip_dma.skip_weight False (the kernel asserts it)")
        return unmet
    if p["block_size"] % BLOCK_TILE:
        unmet.append(f"block_size % {BLOCK_TILE} == 0")
    reduced = d["T"] - (0 if p["skip_dma"][0] else 1)
    if reduced % BLOCK_TILE:
        unmet.append(f"T % {BLOCK_TILE} == 0 (the final reduction runs over whole tiles of {BLOCK_TILE} tokens)")
    return unmet
