"""``blockwise_mm_baseline_shard_hidden`` (catalog 1.23, row 29): the blockwise MoE forward with the hidden
dimension split over the cores (``nkilib/experimental/moe/forward/bwmm_shard_on_H.py``; test golden
``test/integration/nkilib/experimental/moe/test_bwmm_shard_on_H.py``).

Same operands and block math as ``moe_cte`` (:mod:`.blockwise_math`) without biases or clamps, SiLU only:
``PRE_SCALE`` scales the gathered tokens, ``POST_SCALE`` the expert's output; ``PRE_SCALE_DELAYED`` and
``NO_SCALE`` apply no affinity (the kernel has no branch for the delayed mode). Output ``[T+1, H]`` in
``hidden_states``' dtype. The checkpoint buffers are optional, as in the kernel, which fills them in place: given
``gate_up_activations_T [N, 2, I, B]`` and ``down_activations [N, B, H]`` (their values are not read), the call
also returns them filled (gate/up projections; the expert output before the affinity), aliased to the buffers on
Neuron. Reverse mode differentiates the JAX reference (the buffers get no cotangent).
"""

from __future__ import annotations

from ..framework.common_types import ActFnType, ExpertAffinityScaleMode
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import NEURON_FLOAT_DTYPES, CallInfo, KernelSpec, Operand
from .blockwise_math import BlockOptions, blockwise_forward
from .moe_cte_config import BLOCK_SIZE, BLOCKWISE_LOOP_PARAMS, BLOCKWISE_OPERANDS, check_blockwise_routing

Mode = ExpertAffinityScaleMode


def reference_blockwise_mm_baseline_shard_hidden(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    gate_up_activations_T,
    down_activations,
    *,
    block_size,
    skip_dma,
    compute_dtype,
    is_tensor_update_accumulating,
    expert_affinities_scaling_mode,
):
    """JAX reference: ``output`` (and the filled checkpoint buffers when given)."""
    del compute_dtype
    mode = expert_affinities_scaling_mode
    opts = BlockOptions(
        block_size=block_size,
        activation_function=ActFnType.SiLU,
        scaling_mode=Mode.NO_SCALE if mode == Mode.PRE_SCALE_DELAYED else mode,
        skip_token=skip_dma[0],
        accumulate=is_tensor_update_accumulating,
    )
    rows, experts = hidden_states.shape[0], gate_up_proj_weight.shape[0]
    out, gate_up_t, down = blockwise_forward(
        hidden_states,
        expert_affinities_masked.reshape(rows, experts),
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        None,
        None,
        opts,
    )
    outs = (out,)
    if gate_up_activations_T is not None:
        outs += (gate_up_t.astype(gate_up_activations_T.dtype),)
    if down_activations is not None:
        outs += (down.astype(down_activations.dtype),)
    return outs


def _check(call: CallInfo) -> None:
    dims, p, function = call.dims, call.params, call.function
    check_blockwise_routing(call)
    if "B" in dims and dims["B"] != p["block_size"]:
        raise ValueError(f"{function}: the checkpoint buffers' B={dims['B']} must equal block_size={p['block_size']}")


def _output_avals(call: CallInfo):
    outs = [("output", call.avals["hidden_states"].shape, call.avals["hidden_states"].dtype)]
    for name in ("gate_up_activations_T", "down_activations"):
        if call.avals.get(name) is not None:
            outs.append((name, call.avals[name].shape, call.avals[name].dtype))
    return outs


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet = []
    if call.dims["H"] % call.lnc:
        unmet.append(f"H % LNC == 0 (H={call.dims['H']})")
    if call.dims["I"] % 16:
        unmet.append("I % 16 == 0")
    if call.avals["hidden_states"].dtype not in NEURON_FLOAT_DTYPES:
        unmet.append("float32/bfloat16/float16 tensors")
    return unmet


BWMM_SHARD_ON_H_SPEC = KernelSpec(
    name="blockwise_mm_baseline_shard_hidden",
    entry_point="jax_nkilib_kernels.moe_cte:blockwise_mm_baseline_shard_hidden",
    operands=(
        *BLOCKWISE_OPERANDS,
        Operand.of("gate_up_activations_T", "N, 2, I, B", optional=True, doc="checkpoint buffer (filled)"),
        Operand.of("down_activations", "N, B, H", optional=True, doc="checkpoint buffer (filled)"),
    ),
    params=(
        BLOCK_SIZE,
        *BLOCKWISE_LOOP_PARAMS,
    ),
    outputs=(),
    output_avals=_output_avals,
    reference=reference_blockwise_mm_baseline_shard_hidden,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: 3 * call.dims["NB"] * call.dims["H"] * call.dims["I"],
    aliases={"gate_up_activations_T": "gate_up_activations_T", "down_activations": "down_activations"},
    nondifferentiable_outputs=("gate_up_activations_T", "down_activations"),
    family="moe",
    catalog="1.23",
    support={
        "vjp": "JAX (the reference's; blockwise_mm_bwd takes the checkpoints directly)",
        "notes": "SiLU, no bias/clamp; LNC all-reduce over H halves on device; checkpoint buffers filled in place; "
        "device adapter jax_nkilib_kernels/moe_cte.py",
    },
)

blockwise_mm_baseline_shard_hidden = make_kernel(BWMM_SHARD_ON_H_SPEC, reference_vjp)
