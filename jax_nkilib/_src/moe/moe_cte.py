"""``moe_cte`` (catalog 1.10, row 10): the blockwise (dropless) MoE context-encoding kernel,
``nkilib/core/moe/moe_cte/moe_cte.py`` dispatching to ``bwmm_shard_on_block.py`` and ``bwmm_shard_on_I.py``
(oracles ``moe_cte_torch.py:moe_cte_torch_ref`` and ``test_moe_cte_common.generate_blockwise_numpy_golden``).

Operands in the kernel's layouts: ``hidden_states [T+1, H]`` (row ``T`` is the padding token; ``[T, H]`` with
``skip_dma.skip_token``, where padding slots hold ``-1``), ``expert_affinities_masked [(T+1)*E, 1]``,
``gate_up_proj_weight [E, H, 2, I]``, ``down_proj_weight [E, I, H]``, ``token_position_to_id [N*B]``,
``block_to_expert [N, 1]``, ``conditions [N+1]`` (``shard_on_i_hybrid``), biases ``[E, 2, I]`` and ``[E, H]`` (or
``[E, 1, H]``; both or neither: the kernels ignore a lone bias). :mod:`.blockwise_routing` builds the routing
operands. The math is :mod:`.blockwise_math`'s, with the implementations' differences:

* ``shard_on_block``: ``PRE_SCALE`` scales the gathered tokens; with ``is_tensor_update_accumulating`` (the default)
  the output is ``[T+1, 2, H]``, the kernel's two per-core slots after its final reduction: slot 0 holds the sum,
  slot 1 zeros (sum over axis 1 to use it; the kernel hard-codes 2 slots whatever the LNC degree).
  ``PRE_SCALE_DELAYED`` and ``HI_LO`` are rejected (the kernel asserts).
* ``shard_on_i`` / ``shard_on_i_dropping`` / ``shard_on_i_hybrid``: output ``[T+1, H]``; ``PRE_SCALE`` (and
  ``PRE_SCALE_DELAYED``) multiply the gate and up projections after bias and clamp;
  ``expert_affinity_multiply_on_I`` multiplies ``act(g) * u`` instead of the output. ``shard_on_i`` with
  ``checkpoint_activation`` and ``shard_on_i_dropping`` (always) also return ``gate_up_activations_T [N, 2, I, B]``
  (in the gate/up weight's dtype) and, unless ``expert_affinity_multiply_on_I``, ``down_activations [N, B, H]`` (the
  down weight's dtype). ``shard_on_i_hybrid`` processes blocks ``b < max(num_static_block, sum(conditions))``
  (``num_static_block`` defaults to ``N - E``): padding blocks beyond must hold only the padding token.
* ``shard_on_block_mx`` (Trainium3, LNC 2): MXFP4/MXFP8 weights with uint8 scales ``gate_up_proj_scale`` /
  ``down_proj_scale`` (the library's ``QuantizationConfig``), on-chip MXFP8 quantization of the gathered rows and of
  the intermediate; output ``[2, T+1, H]`` (slot 0 the sum, slot 1 zeros); no ``conditions`` (its dynamic loop is
  not bound). Layouts and math: :mod:`.moe_cte_mx`.
* ``shard_on_i_mx`` / ``shard_on_i_mx_hybrid`` (Trainium3, LNC 2): the same MX operands and math, ``I`` split over
  the cores, output ``[T+1, H]``; the hybrid takes ``conditions [N+1]`` and processes blocks ``b < max(
  num_static_block, sum(conditions))`` like ``shard_on_i_hybrid``, but ``num_static_block`` defaults to ``N - E``
  rounded down to even. The library's ``moe_cte`` dispatcher has no branch for either (it returns ``None``): the
  device adapter calls their own entry points ``bwmm_shard_on_I_mx.blockwise_mm_shard_intermediate_mx[_hybrid]``.

Every block's contribution is rounded to the output dtype and accumulated in it. The padding row ``T`` of the
output holds what the padding slots add there (the kernel's row ``T`` is not meaningful either). ``compute_dtype``
(except for the MX implementations, where it types the gathered rows before their quantization),
``skip_dma.skip_weight`` and the shard-on-block loop knobs only change how the kernel runs.

Reverse mode: for ``shard_on_i`` and ``shard_on_i_dropping`` with ``POST_SCALE``, no
``expert_affinity_multiply_on_I``, SiLU or Swish and ``is_tensor_update_accumulating``, the forward runs with
``checkpoint_activation`` and the VJP binds ``blockwise_mm_bwd`` on the checkpoints (gradients for hidden states,
affinities, both weights and both biases); every other call differentiates the JAX reference (for the MX
implementations straight through their MXFP8 round trips). The checkpoint outputs carry no gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import ActFnType, ExpertAffinityScaleMode
from ..framework.primitive import Vjp, make_kernel, reference_vjp
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, NEURON_FLOAT_DTYPES, CallInfo, KernelSpec, Operand, Param
from . import moe_cte_mx
from .blockwise_math import BlockOptions, blockwise_forward
from .blockwise_mm_bwd import blockwise_mm_bwd
from .moe_cte_config import (
    BLOCK_SIZE,
    BLOCKWISE_LOOP_PARAMS,
    BLOCKWISE_OPERANDS,
    BlockShardStrategy,
    MoECTEImplementation,
    check_blockwise_routing,
    moe_cte_spec,
    spec_fields,
)
from .moe_tkg import MX_WORD_FORMATS
from .moe_tkg import _mx_device_dtype as mx_device_dtype

Impl = MoECTEImplementation
I_SHARDED = (Impl.shard_on_i, Impl.shard_on_i_hybrid, Impl.shard_on_i_dropping)
MX_IMPLEMENTATIONS = (Impl.shard_on_block_mx, Impl.shard_on_i_mx, Impl.shard_on_i_mx_hybrid)
HYBRID = (Impl.shard_on_i_hybrid, Impl.shard_on_i_mx_hybrid)
KERNEL_ACTIVATIONS = (ActFnType.SiLU, ActFnType.Swish)  # compute_intermediate_states implements only these
TILE = 128
SHARD_ON_I_BLOCK_MULTIPLE = 256
SHARD_ON_I_H_RANGE = (512, 8192)
PSUM_SIZE = 512


def separate_outputs(params) -> bool:
    """shard_on_block's per-core output slots ``[T+1, 2, H]`` (shard_on_block_mx: ``[2, T+1, H]``)."""
    impl = params["implementation"]
    return impl in (Impl.shard_on_block, Impl.shard_on_block_mx) and params["is_tensor_update_accumulating"]


def slot_axis(params) -> int:
    return 0 if params["implementation"] == Impl.shard_on_block_mx else 1


def returns_checkpoints(params) -> bool:
    impl = params["implementation"]
    return impl == Impl.shard_on_i_dropping or (impl == Impl.shard_on_i and params["checkpoint_activation"])


def block_options(params) -> BlockOptions:
    impl = params["implementation"]
    hooks = moe_cte_mx.quantizers(params["compute_dtype"]) if impl in MX_IMPLEMENTATIONS else {}
    return BlockOptions(
        **hooks,
        block_size=params["block_size"],
        activation_function=params["activation_function"],
        scaling_mode=params["expert_affinities_scaling_mode"],
        prescale_on_projections=impl in I_SHARDED,
        multiply_on_I=impl in (Impl.shard_on_i, Impl.shard_on_i_dropping) and params["expert_affinity_multiply_on_I"],
        gate_clamp=(params["gate_clamp_upper_limit"], params["gate_clamp_lower_limit"]),
        up_clamp=(params["up_clamp_upper_limit"], params["up_clamp_lower_limit"]),
        skip_token=params["skip_dma"][0],
        accumulate=params["is_tensor_update_accumulating"],
    )


def default_static_blocks(impl, n_blocks: int, n_experts: int) -> int:
    """The hybrids' static loop length without ``num_static_block``: ``N - E`` (MX: rounded down to even)."""
    static = n_blocks - n_experts
    return static - static % 2 if impl == Impl.shard_on_i_mx_hybrid else static


def _active_blocks(conditions, params, n_blocks, n_experts):
    impl = params["implementation"]
    if impl not in HYBRID:
        return None
    static = params["num_static_block"]
    static = default_static_blocks(impl, n_blocks, n_experts) if static is None else static
    count = jnp.maximum(jnp.sum(conditions.astype(jnp.int32)), static)
    return jnp.arange(n_blocks) < count


def reference_moe_cte(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    token_position_to_id,
    block_to_expert,
    conditions,
    gate_and_up_proj_bias,
    down_proj_bias,
    gate_up_proj_scale=None,
    down_proj_scale=None,
    **params,
):
    """JAX reference of ``moe_cte`` (see the module docstring): ``output`` (+ checkpoints)."""
    rows, experts = hidden_states.shape[0], gate_up_proj_weight.shape[0]
    if params["implementation"] in MX_IMPLEMENTATIONS:
        gate_up_proj_weight, down_proj_weight, gate_and_up_proj_bias = moe_cte_mx.decode_weights(
            gate_up_proj_weight, down_proj_weight, gate_up_proj_scale, down_proj_scale, gate_and_up_proj_bias
        )
    n_blocks = block_to_expert.shape[0]
    out, gate_up_t, down = blockwise_forward(
        hidden_states,
        expert_affinities_masked.reshape(rows, experts),
        gate_up_proj_weight,
        down_proj_weight,
        token_position_to_id,
        block_to_expert,
        gate_and_up_proj_bias,
        down_proj_bias,
        block_options(params),
        active=_active_blocks(conditions, params, n_blocks, experts),
    )
    if separate_outputs(params):
        out = jnp.stack([out, jnp.zeros_like(out)], axis=slot_axis(params))
    if not returns_checkpoints(params):
        return (out,)
    gate_up_t = gate_up_t.astype(gate_up_proj_weight.dtype)
    if params["expert_affinity_multiply_on_I"]:
        return out, gate_up_t
    return out, gate_up_t, down.astype(down_proj_weight.dtype)


# ------------------------------------------------------------------------------------------------ config merging
def _prepare(function, operands, params):
    """Merge ``spec=MoECTESpec(...)`` into the config fields; the implementation is required one way or the other."""
    spec = params.pop("spec")
    params["spec"] = None
    if spec is not None:
        defaults = {param.name: param for param in MOE_CTE_SPEC.params}
        for name, value in spec_fields(spec).items():
            given = params[name]
            default = defaults[name].normalize(defaults[name].default, function)
            if given != default and given != value:
                raise ValueError(f"{function}: `{name}`={given!r} contradicts spec={spec!r}; give one of them")
            params[name] = value
    if params["implementation"] is None:
        raise TypeError(f"{function}: give `spec=MoECTESpec(implementation=...)` or `implementation=`")
    return operands, params


# ---------------------------------------------------------------------------------------------------- validation
def _check(call: CallInfo) -> None:
    dims, p, function = call.dims, call.params, call.function
    impl = p["implementation"]
    if impl in MX_IMPLEMENTATIONS:
        moe_cte_mx.check(call)
    else:
        moe_cte_mx.check_dense(call)
    check_blockwise_routing(call)
    conditions = call.avals.get("conditions")
    if conditions is not None and conditions.shape != (dims["N"] + 1,):
        raise ValueError(f"{function}: conditions must be [N+1] = [{dims['N'] + 1}]; got {list(conditions.shape)}")
    if impl in HYBRID and conditions is None:
        raise TypeError(f"{function}: {impl.name} needs `conditions` [N+1] (1 for used blocks, then 0)")
    if (call.avals.get("gate_and_up_proj_bias") is None) != (call.avals.get("down_proj_bias") is None):
        raise ValueError(
            f"{function}: give both gate_and_up_proj_bias [E, 2, I] and down_proj_bias [E, H], or neither (the "
            "kernels ignore a lone bias)"
        )
    if impl == Impl.shard_on_block:
        if p["expert_affinities_scaling_mode"] == ExpertAffinityScaleMode.PRE_SCALE_DELAYED:
            raise ValueError(f"{function}: shard_on_block rejects expert_affinities_scaling_mode=PRE_SCALE_DELAYED")
        if p["block_sharding_strategy"] != BlockShardStrategy.PING_PONG:
            raise ValueError(f"{function}: shard_on_block supports only block_sharding_strategy=PING_PONG")
    if p["checkpoint_activation"] and impl != Impl.shard_on_i:
        raise ValueError(
            f"{function}: checkpoint_activation applies to shard_on_i only (shard_on_i_dropping always returns "
            f"the checkpoints; {impl.name} never does)"
        )
    if p["expert_affinity_multiply_on_I"] and impl not in (Impl.shard_on_i, Impl.shard_on_i_dropping):
        raise ValueError(f"{function}: expert_affinity_multiply_on_I applies to shard_on_i and shard_on_i_dropping")


def _output_avals(call: CallInfo):
    p, d = call.params, call.dims
    hidden = call.avals["hidden_states"]
    shape = (d["T"], d["H"])
    if separate_outputs(p):
        shape = (2, d["T"], d["H"]) if slot_axis(p) == 0 else (d["T"], 2, d["H"])
    outs = [("output", shape, hidden.dtype)]
    if returns_checkpoints(p):
        outs.append(
            ("gate_up_activations_T", (d["N"], 2, d["I"], p["block_size"]), call.avals["gate_up_proj_weight"].dtype)
        )
        if not p["expert_affinity_multiply_on_I"]:
            outs.append(("down_activations", (d["N"], p["block_size"], d["H"]), call.avals["down_proj_weight"].dtype))
    return outs


def _neuron_limits(call: CallInfo) -> list[str]:
    p, d = call.params, call.dims
    impl, block = p["implementation"], p["block_size"]
    unmet = []
    if p["activation_function"] not in KERNEL_ACTIVATIONS:
        unmet.append("activation_function SiLU or Swish (the kernels compute no other)")
    if impl in MX_IMPLEMENTATIONS:
        return unmet + moe_cte_mx.neuron_limits(call)
    if any(call.avals[n].dtype not in NEURON_FLOAT_DTYPES for n in ("hidden_states", "gate_up_proj_weight")):
        unmet.append("float32/bfloat16/float16 tensors")
    if impl == Impl.shard_on_block:
        if block % TILE:
            unmet.append(f"block_size % {TILE} == 0")
        if p["is_tensor_update_accumulating"]:
            if call.lnc != 2:
                unmet.append("LNC=2 (at LNC=1 the kernel leaves its second output slot uninitialized)")
            reduced = d["T"] - (0 if p["skip_dma"][0] else 1)
            if reduced % TILE:
                unmet.append(f"T % {TILE} == 0 (the final reduction runs over whole tiles of {TILE} tokens)")
    else:
        low, high = SHARD_ON_I_H_RANGE
        if block % SHARD_ON_I_BLOCK_MULTIPLE:
            unmet.append(f"block_size % {SHARD_ON_I_BLOCK_MULTIPLE} == 0")
        if not low <= d["H"] <= high or d["H"] % PSUM_SIZE:
            unmet.append(f"{low} <= H <= {high} and H % {PSUM_SIZE} == 0")
        if d["I"] % 16:
            unmet.append("I % 16 == 0")
        if p["skip_dma"][1]:
            unmet.append("skip_dma.skip_weight False (the I-sharded kernels assert it)")
        if impl == Impl.shard_on_i_hybrid and call.lnc != 2:
            unmet.append("LNC=2 (shard_on_i_hybrid's dynamic loop runs on two cores)")
    return unmet


# ---------------------------------------------------------------------------------------------------------- VJP
def bwd_kernel_applies(params) -> bool:
    """Whether ``blockwise_mm_bwd`` differentiates this call (its forward is POST_SCALE on H, SiLU/Swish)."""
    return (
        params["implementation"] in (Impl.shard_on_i, Impl.shard_on_i_dropping)
        and params["expert_affinities_scaling_mode"] == ExpertAffinityScaleMode.POST_SCALE
        and not params["expert_affinity_multiply_on_I"]
        and params["activation_function"] in KERNEL_ACTIVATIONS
        and params["is_tensor_update_accumulating"]
    )


def _forward(kernel, operands, params):
    if not bwd_kernel_applies(params):
        outs = kernel.call(operands, params)
        return outs, (operands, outs, False)
    with_checkpoints = dict(params, checkpoint_activation=params["implementation"] == Impl.shard_on_i)
    outs = kernel.call(operands, with_checkpoints)
    user_outs = outs if returns_checkpoints(params) else outs[:1]
    return user_outs, (operands, outs, True)


def _backward(kernel, residuals, params, cotangents):
    operands, outs, applies = residuals
    if not applies:
        return reference_vjp(kernel, operands, params, outs, cotangents)
    _, gate_up_t, down = outs
    hidden = operands["hidden_states"]
    bias = operands["gate_and_up_proj_bias"] is not None
    dy = cotangents[0]
    grads = blockwise_mm_bwd(
        hidden,
        operands["expert_affinities_masked"],
        operands["gate_up_proj_weight"],
        operands["down_proj_weight"],
        gate_up_t,
        down,
        operands["token_position_to_id"],
        operands["block_to_expert"],
        jnp.zeros_like(hidden) if dy is None else dy.astype(hidden.dtype),
        block_size=params["block_size"],
        skip_dma=params["skip_dma"],
        compute_dtype=operands["gate_and_up_proj_bias"].dtype if bias else params["compute_dtype"],
        clamp_limits=(
            params["up_clamp_upper_limit"],
            params["up_clamp_lower_limit"],
            params["gate_clamp_upper_limit"],
            params["gate_clamp_lower_limit"],
        ),
        bias=bias,
        activation_type=params["activation_function"],
    )
    result = dict(zip(("hidden_states", "expert_affinities_masked", "gate_up_proj_weight", "down_proj_weight"), grads))
    if bias:
        result["gate_and_up_proj_bias"] = grads[4]
        result["down_proj_bias"] = grads[5].reshape(operands["down_proj_bias"].shape)
    return result


# gate/up and down weights: dense (the bf16 implementations) or MX x4 words (shard_on_block_mx, :mod:`.moe_cte_mx`)
MX_CAPABLE_WEIGHTS = (
    Operand.of(
        "gate_up_proj_weight",
        "E, H, 2, I",
        "E, 128, 2, H/512, I",
        dtypes=FLOAT_DTYPES + tuple(MX_WORD_FORMATS),
        doc="[E, H, 2, I]; MX: x4 words [E, 128, 2, H/512, I]",
        device_dtype=mx_device_dtype,
    ),
    Operand.of(
        "down_proj_weight",
        "E, I, H",
        "E, P_I, N_I, H",
        dtypes=FLOAT_DTYPES + tuple(MX_WORD_FORMATS),
        doc="[E, I, H]; MX: x4 words [E, P_I, N_I, H]",
        device_dtype=mx_device_dtype,
    ),
)

_CLAMPS = tuple(f"{which}_clamp_{side}_limit" for which in ("gate", "up") for side in ("upper", "lower"))

MOE_CTE_SPEC = KernelSpec(
    name="moe_cte",
    entry_point="jax_nkilib_kernels.moe_cte:moe_cte",
    operands=(
        *BLOCKWISE_OPERANDS[:2],
        *MX_CAPABLE_WEIGHTS,
        *BLOCKWISE_OPERANDS[4:],
        Operand.of("conditions", "N1", dtypes=INT_DTYPES, optional=True, doc="[N+1] used blocks (hybrid)"),
        Operand.of("gate_and_up_proj_bias", "E, 2, I", "E, P_I, 2, N_I, 4", optional=True, doc="MX: P_I, N_I tiles"),
        Operand.of("down_proj_bias", "E, H", "E, 1, H", dtypes=FLOAT_DTYPES, optional=True),
        Operand.of(
            "gate_up_proj_scale",
            "E, 16, 2, H/512, I",
            dtypes=(jnp.uint8,),
            optional=True,
            doc="shard_on_block_mx: uint8 MX scales (QuantizationConfig.gate_up_proj_scale)",
        ),
        Operand.of(
            "down_proj_scale",
            "E, P_I/8, N_I, H",
            dtypes=(jnp.uint8,),
            optional=True,
            doc="shard_on_block_mx: uint8 MX scales (QuantizationConfig.down_proj_scale)",
        ),
    ),
    params=(
        BLOCK_SIZE,
        Param("spec", None, object, "MoECTESpec (or give its fields)", to_kernel=False, normalizer=moe_cte_spec),
        Param("implementation", None, MoECTEImplementation, "MoECTESpec.implementation"),
        Param("n_block_per_iter", 1, int, "ShardOnBlockConfig: blocks per loop iteration (performance)"),
        Param("block_sharding_strategy", "PING_PONG", BlockShardStrategy, "ShardOnBlockConfig"),
        Param("n_static_blocks", -1, int, "ShardOnBlockConfig (MX only)"),
        Param("n_dynamic_blocks", 55, int, "ShardOnBlockConfig (MX only)"),
        Param("checkpoint_activation", False, bool, "ShardOnIConfig: also return the activation checkpoints"),
        Param("expert_affinity_multiply_on_I", False, bool, "ShardOnIConfig: scale act(g)*u by the affinity"),
        Param("num_static_block", None, int, "ShardOnIConfig: hybrid static blocks (default N - E)"),
        Param("activation_function", "SiLU", ActFnType),
        *BLOCKWISE_LOOP_PARAMS,
        *(Param(name, None, float, "clamp of the projection (min(., upper) then max(., lower))") for name in _CLAMPS),
    ),
    outputs=(),
    output_avals=_output_avals,
    prepare=_prepare,
    reference=reference_moe_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: 3 * call.dims["NB"] * call.dims["H"] * call.dims["I"],
    nondifferentiable_outputs=("gate_up_activations_T", "down_activations"),
    family="moe",
    catalog="1.10",
    support={
        "idiomatic": "moe",
        "vjp": "blockwise_mm_bwd for shard_on_i/shard_on_i_dropping (POST_SCALE, SiLU/Swish); JAX elsewhere",
        "notes": "implementations shard_on_block, shard_on_i, shard_on_i_hybrid, shard_on_i_dropping, "
        "shard_on_block_mx, shard_on_i_mx, shard_on_i_mx_hybrid (MXFP4/MXFP8, trn3, LNC 2, POST_SCALE; "
        "shard_on_block_mx without conditions; the I-sharded MX kernels through their own entry points: the library "
        "dispatcher has no branch for them); shard_on_block accumulating output [T+1, 2, H], shard_on_block_mx "
        "[2, T+1, H]; device adapter jax_nkilib_kernels/moe_cte.py",
    },
)

moe_cte = make_kernel(MOE_CTE_SPEC, Vjp(_forward, _backward))
