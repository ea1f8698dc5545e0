"""Adapters for the NKI Library's blockwise MoE kernels: ``moe_cte`` (``nkilib.core.moe.moe_cte``),
``blockwise_mm_bwd`` (``nkilib.experimental.moe.bwd``) and ``blockwise_mm_baseline_shard_hidden``
(``nkilib.experimental.moe.forward.bwmm_shard_on_H``).

jax_nkilib hands the config objects' fields over as plain values (enum member names, a ``(skip_token,
skip_weight)`` pair, ``ClampLimits``' four limits, the two MX scales, a dtype name): the adapters build the library's
``MoECTESpec``, ``ShardOnBlockConfig``, ``ShardOnIConfig``, ``QuantizationConfig``, ``SkipMode`` and ``ClampLimits``
from them and call the kernel bodies inline. ``spec`` is merged into the fields before lowering (it always arrives
as ``None``). The shard-on-H kernel fills its optional checkpoint buffers in place; its adapter returns them with the
output. Not yet run on Trainium by this project.
"""

import nki
import nki.language as nl

from jax_nkilib_kernels._library import body, load

_library_moe_cte = load("core.moe.moe_cte.moe_cte", "moe_cte")
MoECTESpec = load("core.moe.moe_cte.moe_cte", "MoECTESpec")
MoECTEImplementation = load("core.moe.moe_cte.moe_cte", "MoECTEImplementation")
ShardOnBlockConfig = load("core.moe.moe_cte.moe_cte", "ShardOnBlockConfig")
ShardOnIConfig = load("core.moe.moe_cte.moe_cte", "ShardOnIConfig")
QuantizationConfig = load("core.moe.moe_cte.moe_cte", "QuantizationConfig")
SkipMode = load("core.moe.moe_cte.moe_cte_utils", "SkipMode")
BlockShardStrategy = load("core.moe.moe_cte.moe_cte_utils", "BlockShardStrategy")
ActFnType = load("core.utils.common_types", "ActFnType")
ExpertAffinityScaleMode = load("core.utils.common_types", "ExpertAffinityScaleMode")

_library_blockwise_mm_bwd = load("experimental.moe.bwd.blockwise_mm_backward", "blockwise_mm_bwd")
BwdSkipMode = load("experimental.moe.bwd.moe_bwd_parameters", "SkipMode")
ClampLimits = load("experimental.moe.bwd.moe_bwd_parameters", "ClampLimits")
BwdActFnType = load("experimental.moe.bwd.moe_bwd_parameters", "ActFnType")
ShardOption = load("experimental.moe.bwd.moe_bwd_parameters", "ShardOption")
AffinityOption = load("experimental.moe.bwd.moe_bwd_parameters", "AffinityOption")
KernelTypeOption = load("experimental.moe.bwd.moe_bwd_parameters", "KernelTypeOption")

_library_shard_hidden = load("experimental.moe.forward.bwmm_shard_on_H", "blockwise_mm_baseline_shard_hidden")

_library_shard_on_i_mx = load("core.moe.moe_cte.bwmm_shard_on_I_mx", "blockwise_mm_shard_intermediate_mx")
_library_shard_on_i_mx_hybrid = load("core.moe.moe_cte.bwmm_shard_on_I_mx", "blockwise_mm_shard_intermediate_mx_hybrid")

_moe_cte_body = body(_library_moe_cte)
_shard_on_i_mx_body = body(_library_shard_on_i_mx)
_shard_on_i_mx_hybrid_body = body(_library_shard_on_i_mx_hybrid)
_blockwise_mm_bwd_body = body(_library_blockwise_mm_bwd)
_shard_hidden_body = body(_library_shard_hidden)


def _member(enum_class, name):
    return enum_class[getattr(name, "name", name)]


@nki.jit
def moe_cte(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    conditions=None,
    gate_and_up_proj_bias=None,
    down_proj_bias=None,
    gate_up_proj_scale=None,
    down_proj_scale=None,
    block_size=None,
    spec=None,
    implementation=None,
    n_block_per_iter=1,
    block_sharding_strategy="PING_PONG",
    n_static_blocks=-1,
    n_dynamic_blocks=55,
    checkpoint_activation=False,
    expert_affinity_multiply_on_I=False,
    num_static_block=None,
    activation_function="SiLU",
    skip_dma=None,
    compute_dtype="bfloat16",
    is_tensor_update_accumulating=True,
    expert_affinities_scaling_mode="POST_SCALE",
    gate_clamp_upper_limit=None,
    gate_clamp_lower_limit=None,
    up_clamp_upper_limit=None,
    up_clamp_lower_limit=None,
):
    """The library ``moe_cte`` with a ``MoECTESpec`` built from the fields (and, for ``shard_on_block_mx``, a
    ``QuantizationConfig`` of the uint8 MX scales; the kernel views the uint16/uint32 weight words as its x4 types
    itself): its output (and checkpoints). The library dispatcher has no ``shard_on_i_mx[_hybrid]`` branch (it
    returns ``None``), so those implementations call ``blockwise_mm_shard_intermediate_mx[_hybrid]`` directly."""
    skip_token, skip_weight = skip_dma or (False, False)
    implementation_name = getattr(implementation, "name", implementation)
    if implementation_name == "shard_on_i_mx_hybrid":
        return _shard_on_i_mx_hybrid_body(
            conditions,
            hidden_states,
            expert_affinities_masked,
            gate_up_proj_weight,
            down_proj_weight,
            token_position_to_id,
            block_to_expert,
            gate_and_up_proj_bias=gate_and_up_proj_bias,
            down_proj_bias=down_proj_bias,
            gate_up_proj_scale=gate_up_proj_scale,
            down_proj_scale=down_proj_scale,
            block_size=block_size,
            num_static_block=num_static_block,
            activation_function=_member(ActFnType, activation_function),
            skip_dma=SkipMode(skip_token, skip_weight),
            compute_dtype=getattr(nl, str(compute_dtype)),
            is_tensor_update_accumulating=is_tensor_update_accumulating,
            expert_affinities_scaling_mode=_member(ExpertAffinityScaleMode, expert_affinities_scaling_mode),
            gate_clamp_upper_limit=gate_clamp_upper_limit,
            gate_clamp_lower_limit=gate_clamp_lower_limit,
            up_clamp_lower_limit=up_clamp_lower_limit,
            up_clamp_upper_limit=up_clamp_upper_limit,
        )
    if implementation_name == "shard_on_i_mx":
        return _shard_on_i_mx_body(
            hidden_states,
            expert_affinities_masked,
            gate_up_proj_weight,
            down_proj_weight,
            token_position_to_id,
            block_to_expert,
            gate_and_up_proj_bias=gate_and_up_proj_bias,
            down_proj_bias=down_proj_bias,
            gate_up_proj_scale=gate_up_proj_scale,
            down_proj_scale=down_proj_scale,
            block_size=block_size,
            activation_function=_member(ActFnType, activation_function),
            skip_dma=SkipMode(skip_token, skip_weight),
            compute_dtype=getattr(nl, str(compute_dtype)),
            is_tensor_update_accumulating=is_tensor_update_accumulating,
            expert_affinities_scaling_mode=_member(ExpertAffinityScaleMode, expert_affinities_scaling_mode),
            gate_clamp_upper_limit=gate_clamp_upper_limit,
            gate_clamp_lower_limit=gate_clamp_lower_limit,
            up_clamp_lower_limit=up_clamp_lower_limit,
            up_clamp_upper_limit=up_clamp_upper_limit,
        )
    library_spec = MoECTESpec(
        implementation=_member(MoECTEImplementation, implementation),
        shard_on_block=ShardOnBlockConfig(
            n_block_per_iter=n_block_per_iter,
            block_sharding_strategy=_member(BlockShardStrategy, block_sharding_strategy),
            n_static_blocks=n_static_blocks,
            n_dynamic_blocks=n_dynamic_blocks,
        ),
        shard_on_I=ShardOnIConfig(
            checkpoint_activation=checkpoint_activation,
            expert_affinity_multiply_on_I=expert_affinity_multiply_on_I,
            num_static_block=num_static_block,
        ),
    )
    return _moe_cte_body(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        block_size,
        library_spec,
        conditions=conditions,
        gate_and_up_proj_bias=gate_and_up_proj_bias,
        down_proj_bias=down_proj_bias,
        quantization_config=QuantizationConfig(gate_up_proj_scale=gate_up_proj_scale, down_proj_scale=down_proj_scale),
        activation_function=_member(ActFnType, activation_function),
        skip_dma=SkipMode(skip_token, skip_weight),
        compute_dtype=getattr(nl, str(compute_dtype)),
        is_tensor_update_accumulating=is_tensor_update_accumulating,
        expert_affinities_scaling_mode=_member(ExpertAffinityScaleMode, expert_affinities_scaling_mode),
        gate_clamp_upper_limit=gate_clamp_upper_limit,
        gate_clamp_lower_limit=gate_clamp_lower_limit,
        up_clamp_upper_limit=up_clamp_upper_limit,
        up_clamp_lower_limit=up_clamp_lower_limit,
    )


@nki.jit
def blockwise_mm_bwd(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    gate_up_proj_act_checkpoint_T,
    down_proj_act_checkpoint,
    token_position_to_id,
    block_to_expert,
    output_hidden_states_grad,
    block_size=None,
    skip_dma=None,
    compute_dtype="bfloat16",
    is_tensor_update_accumulating=True,
    shard_option="SHARD_ON_HIDDEN",
    affinity_option="AFFINITY_ON_H",
    kernel_type_option="DROPLESS",
    clamp_limits=None,
    bias=False,
    activation_type="SiLU",
    block_tile_size=None,
):
    """The library ``blockwise_mm_bwd``: ``(dhidden, daffinities, dW_gate_up, dW_down[, dbias_gu, dbias_down])``."""
    skip_token, skip_weight = skip_dma or (False, False)
    linear_upper, linear_lower, non_linear_upper, non_linear_lower = clamp_limits or (None, None, None, None)
    return _blockwise_mm_bwd_body(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        gate_up_proj_act_checkpoint_T,
        down_proj_act_checkpoint,
        token_position_to_id,
        block_to_expert,
        output_hidden_states_grad,
        block_size,
        skip_dma=BwdSkipMode(skip_token=skip_token, skip_weight=skip_weight),
        compute_dtype=getattr(nl, str(compute_dtype)),
        is_tensor_update_accumulating=is_tensor_update_accumulating,
        shard_option=_member(ShardOption, shard_option),
        affinity_option=_member(AffinityOption, affinity_option),
        kernel_type_option=_member(KernelTypeOption, kernel_type_option),
        clamp_limits=ClampLimits(
            linear_clamp_upper_limit=linear_upper,
            linear_clamp_lower_limit=linear_lower,
            non_linear_clamp_upper_limit=non_linear_upper,
            non_linear_clamp_lower_limit=non_linear_lower,
        ),
        bias=bias,
        activation_type=_member(BwdActFnType, activation_type),
        block_tile_size=block_tile_size,
    )


@nki.jit
def blockwise_mm_baseline_shard_hidden(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    gate_up_activations_T=None,
    down_activations=None,
    block_size=None,
    skip_dma=None,
    compute_dtype="bfloat16",
    is_tensor_update_accumulating=True,
    expert_affinities_scaling_mode="POST_SCALE",
):
    """The library kernel's output, then the checkpoint buffers it filled (those given)."""
    skip_token, skip_weight = skip_dma or (False, False)
    output = _shard_hidden_body(
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        block_size,
        token_position_to_id,
        block_to_expert,
        gate_up_activations_T=gate_up_activations_T,
        down_activations=down_activations,
        skip_dma=SkipMode(skip_token, skip_weight),
        compute_dtype=getattr(nl, str(compute_dtype)),
        is_tensor_update_accumulating=is_tensor_update_accumulating,
        expert_affinities_scaling_mode=_member(ExpertAffinityScaleMode, expert_affinities_scaling_mode),
    )
    filled = tuple(buffer for buffer in (gate_up_activations_T, down_activations) if buffer is not None)
    return (output,) + filled if filled else output
