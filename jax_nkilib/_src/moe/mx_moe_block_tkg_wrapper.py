"""``mx_moe_block_tkg_wrapper`` (docs-only, catalog row 69; NKI Library API reference 2.32
``mx-moe-block-tkg-wrapper.rst``): :mod:`.moe_block_tkg` for MX expert weights handed over as raw unsigned words, as
NxD passes them (uint16 for ``float4_e2m1fn_x4``, uint32 for ``float8_e4m3fn_x4``); the wrapper reinterprets them as
the x4 types and calls ``moe_block_tkg``.

In JAX, MX words are unsigned words anyway, so the math, layouts and outputs are exactly ``moe_block_tkg``'s with MX
weights (see that module); here the words reach the library function as the unsigned words it expects. The
differences are the wrapper's signature: ``router_act_fn``, ``expert_affinities_scaling_mode``, ``hidden_act_fn``
and ``router_mm_dtype`` default to None there (the wrapper forwards them to ``moe_block_tkg``, which needs values),
so they are required here, and the 2.32 static-quantization ``expert_gate_up_input_scale`` /
``expert_down_input_scale`` must be None (their semantics are not documented). Needs an NKI Library that ships the
wrapper (2.32 docs); elsewhere the Neuron lowering falls back to the reference.
"""

from __future__ import annotations

import dataclasses

from ..framework.common_types import ActFnType, ExpertAffinityScaleMode, RouterActFnType
from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, Operand, Param
from .moe_block_tkg import MOE_BLOCK_TKG_SPEC, block_vjp, check_block
from .moe_block_tkg import __doc__ as BLOCK_DOC
from .moe_tkg import mx_format

INPUT_SCALES = ("expert_gate_up_input_scale", "expert_down_input_scale")
REQUIRED_HERE = {
    "router_act_fn": RouterActFnType,
    "expert_affinities_scaling_mode": ExpertAffinityScaleMode,
    "hidden_act_fn": ActFnType,
    "router_mm_dtype": "dtype",
}


def _check(call: CallInfo) -> None:
    if mx_format(call.avals["expert_gate_up_weights"].dtype) is None:
        raise TypeError(
            f"{call.function}: `expert_gate_up_weights` must be MX x4 words (uint16 for float4_e2m1fn_x4, uint32 for "
            f"float8_e4m3fn_x4); got {call.avals['expert_gate_up_weights'].dtype}"
        )
    given = [name for name in INPUT_SCALES if call.avals.get(name) is not None]
    if given:
        raise ValueError(f"{call.function}: `{given[0]}` (static quantization) is not bound and must be None")
    check_block(call)


def _param(param: Param) -> Param:
    if param.name not in REQUIRED_HERE:
        return param
    return Param(param.name, None, REQUIRED_HERE[param.name], param.doc + " (required here)", required=True)


MX_MOE_BLOCK_TKG_WRAPPER_SPEC = dataclasses.replace(
    MOE_BLOCK_TKG_SPEC,
    name="mx_moe_block_tkg_wrapper",
    entry_point="nkilib.experimental.moe_block.mx_moe_block_tkg_wrapper:mx_moe_block_tkg_wrapper",
    operands=tuple(
        dataclasses.replace(op, device_dtype=None)
        for op in MOE_BLOCK_TKG_SPEC.operands  # words stay words
    )
    + tuple(
        Operand.of(name, "E_L, 1", optional=True, doc="static quantization: must be None") for name in INPUT_SCALES
    ),
    params=tuple(_param(param) for param in MOE_BLOCK_TKG_SPEC.params),
    check=_check,
    catalog="3",
    support={
        "vjp": "JAX (moe_block_tkg's reference, straight through the MX round trips)",
        "notes": "docs-only (NKI Library 2.32): moe_block_tkg with MX weights given as unsigned words; the enum and "
        "dtype flags the wrapper defaults to None are required; static input scales n/a",
    },
)

mx_moe_block_tkg_wrapper = make_kernel(MX_MOE_BLOCK_TKG_WRAPPER_SPEC, block_vjp)
mx_moe_block_tkg_wrapper.__doc__ += "\nSemantics (from the module documentation):\n\n" + __doc__ + "\n" + BLOCK_DOC
