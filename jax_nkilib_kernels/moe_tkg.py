"""Adapters for the NKI Library's token-generation MoE subkernel (``nkilib.core.moe.moe_tkg.moe_tkg``) and for
``topk_reduce`` (``nkilib.experimental.subkernels.topk_reduce``; main moved it to ``experimental.collectives``).

``moe_tkg`` is a plain function (not ``@nki.jit``) that allocates its ``[T, H]`` output in shared HBM and returns
it: the adapter is the ``@nki.jit`` entry point that calls it with HBM operands, views MX weight words (uint16 /
uint32) as ``float4_e2m1fn_x4`` / ``float8_e4m3fn_x4``, maps the enum member names and the NumPy output dtype to the
library's, and keeps the output in HBM (``output_in_sbuf=False``). The MX-only and static
quantization arguments are left at their defaults.

``topk_reduce`` is an ``@nki.jit`` kernel whose 2.32 release adds ``token_base_index`` (default 1, ids packed
1-based) where 2.29 reads ids 0-based: the adapter passes the keyword where the library takes it and refuses a
nonzero base where it does not, so both releases compute the same thing. Not yet run on Trainium by this project.
"""

import inspect

import nki
import nki.language as nl

from jax_nkilib_kernels._library import body, load

_library_moe_tkg = load("core.moe.moe_tkg.moe_tkg", "moe_tkg")
ActFnType = load("core.utils.common_types", "ActFnType")
ExpertAffinityScaleMode = load("core.utils.common_types", "ExpertAffinityScaleMode")
_library_topk_reduce = load("experimental.subkernels.topk_reduce", "topk_reduce")


def _library_enum(enum_class, value):
    """The library's member of ``enum_class`` with the name of ``value`` (a jax_nkilib member or a name)."""
    return enum_class[getattr(value, "name", value)]


def _x4(words):
    """MX weight words (uint16 / 32-bit) viewed as the library's x4 type; dense weights unchanged."""
    if words.dtype == nl.uint16:
        return words.view(nl.float4_e2m1fn_x4)
    if words.dtype == nl.uint32 or words.dtype == nl.int32:
        return words.view(nl.float8_e4m3fn_x4)
    return words


def _nl_dtype(dtype):
    """``nki.language``'s dtype of a NumPy dtype (``None`` stays ``None``)."""
    return None if dtype is None else getattr(nl, getattr(dtype, "name", str(dtype)))


@nki.jit
def moe_tkg(
    hidden_input,
    expert_gate_up_weights,
    expert_down_weights,
    expert_affinities,
    expert_index,
    rank_id=None,
    expert_gate_up_bias=None,
    expert_down_bias=None,
    expert_gate_up_weights_scale=None,
    expert_down_weights_scale=None,
    is_all_expert=None,
    mask_unselected_experts=False,
    expert_affinities_scaling_mode="NO_SCALE",
    activation_fn="SiLU",
    output_dtype=None,
    gate_clamp_upper_limit=None,
    gate_clamp_lower_limit=None,
    up_clamp_upper_limit=None,
    up_clamp_lower_limit=None,
    is_all_expert_dynamic=False,
    block_size=None,
):
    """``out [T, H]`` in HBM from the ``moe_tkg`` subkernel."""
    return _library_moe_tkg(
        hidden_input,
        _x4(expert_gate_up_weights),
        _x4(expert_down_weights),
        expert_affinities,
        expert_index,
        is_all_expert,
        rank_id=rank_id,
        expert_gate_up_bias=expert_gate_up_bias,
        expert_down_bias=expert_down_bias,
        expert_gate_up_weights_scale=expert_gate_up_weights_scale,
        expert_down_weights_scale=expert_down_weights_scale,
        mask_unselected_experts=mask_unselected_experts,
        expert_affinities_scaling_mode=_library_enum(ExpertAffinityScaleMode, expert_affinities_scaling_mode),
        activation_fn=_library_enum(ActFnType, activation_fn),
        output_dtype=_nl_dtype(output_dtype),
        gate_clamp_upper_limit=gate_clamp_upper_limit,
        gate_clamp_lower_limit=gate_clamp_lower_limit,
        up_clamp_upper_limit=up_clamp_upper_limit,
        up_clamp_lower_limit=up_clamp_lower_limit,
        output_in_sbuf=False,
        is_all_expert_dynamic=is_all_expert_dynamic,
        block_size=block_size,
    )


@nki.jit
def topk_reduce(input, T=None, K=None, token_base_index=0):
    """``out [T, H]`` in HBM from ``topk_reduce``, its token ids read with base ``token_base_index``."""
    kernel = body(_library_topk_reduce)
    newer = {}
    if "token_base_index" in inspect.signature(kernel).parameters:
        newer["token_base_index"] = token_base_index
    elif token_base_index != 0:
        raise ValueError("the installed NKI Library's topk_reduce reads token ids 0-based (no token_base_index)")
    return kernel(input, T, K, **newer)
