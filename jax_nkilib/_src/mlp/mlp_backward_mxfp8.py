"""``mlp_backward_mxfp8_nki`` (catalog row 68, docs-only; experimental/mlp_mxfp8): the MXFP8 SwiGLU MLP backward.

Returns ``(hidden_states_grad [S, H], gate_up_weight_grad [2I, H], down_proj_weight_grad [H, I])``, all bfloat16,
for the forward ``out = (silu(x Wg^T) * (x Wu^T)) Wd^T`` (datapath and roundings: :mod:`.math`).

Operands, in the kernel's order: ``output_grad [S, H]`` and ``hidden_states [S, H]`` (raw floats); ``down_proj_weight
[H, I]`` (raw; required unless ``down_weight_T`` is given pre-quantized); ``gate_up_weights [2I, H]`` (required: raw,
or pre-quantized ``[H/4, 2I]`` words with ``gate_up_weights_scales``, then used only to recompute checkpoints and
``gate_up_weight_T`` must be given); the optional pre-quantized transposed copies, each with its scales (uint32 x4
words and uint8 scales, see :mod:`.operands`): ``gate_up_weight_T [2I/4, H]`` (phase 2, contraction 2I),
``down_weight_T [H/4, I]`` (phase 1, contraction H), ``output_grad_T [S/4, H]`` (phase 4) and ``hidden_states_T
[S/4, H]`` (phase 3, contraction S); and the optional forward checkpoints ``gate_pre``, ``gate_act``, ``up``,
``intermediate [S, I]`` (read as bfloat16; missing ones are recomputed). The kernel's ``clamp_limits: ClampLimits``
is given as its four fields (``linear_*`` act on ``up``, ``non_linear_*`` on ``gate_pre``): the recomputed
projections are clamped and the gradients masked where the checkpoint is outside the open interval.
``matmul_config`` (tile sizes) is not exposed: the kernel picks it; ``spill_reload``, ``use_scale_packing`` do not
change the results and ``fp8_x4_dtype`` is not used by the kernel (the matmuls quantize to float8_e4m3fn).

Not differentiable (it is the backward of ``mlp_forward_mxfp8_nki``). Neuron limits (else the reference runs):
bfloat16 raw operands and checkpoints; S and I multiples of 128 (internal transposes), H too unless
``gate_up_weight_T`` and ``output_grad_T`` are pre-quantized; with ``run_with_lnc2`` (default True, as in the
kernel) LNC = 2 and S, I, H even. MX matmuls need Trn3.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, CallInfo, KernelSpec, Operand, Output, Param
from . import mxfp8_reference as math
from .mxfp8_operands import (
    PREQUANTIZED,
    SCALE_DTYPES,
    WORD_DTYPES,
    MatmulOperand,
    bf16_operand_limits,
    bind_dims,
    free_layout,
    lnc2_limits,
    values,
)

OUTPUT_GRAD = MatmulOperand("output_grad", "S", "H")
HIDDEN_STATES = MatmulOperand("hidden_states", "S", "H")
DOWN_PROJ = MatmulOperand("down_proj_weight", "H", "I")
GATE_UP = MatmulOperand("gate_up_weights", "I", "H", "gate_up_weights_scales", f_times=2)
GATE_UP_T = MatmulOperand("gate_up_weight_T", "H", "I", "gate_up_weight_T_scales", k_times=2)
DOWN_T = MatmulOperand("down_weight_T", "I", "H", "down_weight_T_scales")
OUTPUT_GRAD_T = MatmulOperand("output_grad_T", "H", "S", "output_grad_T_scales")
HIDDEN_T = MatmulOperand("hidden_states_T", "H", "S", "hidden_states_T_scales")
PREQUANTIZED_ONLY = (GATE_UP_T, DOWN_T, OUTPUT_GRAD_T, HIDDEN_T)
CHECKPOINTS = tuple(MatmulOperand(name, "S", "I") for name in ("gate_pre", "gate_act", "up", "intermediate"))
OPERANDS = (OUTPUT_GRAD, HIDDEN_STATES, DOWN_PROJ, GATE_UP) + PREQUANTIZED_ONLY + CHECKPOINTS
DGT_MIN_K = 128


def _copy(spec: MatmulOperand, raw, ops, params):
    """``(value [F, K], quantize)`` of a transposed operand: its pre-quantized copy, or the raw matrix ``[K, F]``
    transposed into a bfloat16 buffer (the kernel's DMA transpose)."""
    if ops[spec.name] is not None:
        return values(spec, ops, params)
    return raw.astype(jnp.bfloat16).T, True


def reference_mlp_backward_mxfp8(
    output_grad,
    hidden_states,
    down_proj_weight=None,
    gate_up_weights=None,
    gate_up_weight_T=None,
    gate_up_weight_T_scales=None,
    gate_up_weights_scales=None,
    down_weight_T=None,
    down_weight_T_scales=None,
    output_grad_T=None,
    output_grad_T_scales=None,
    hidden_states_T=None,
    hidden_states_T_scales=None,
    gate_pre=None,
    gate_act=None,
    up=None,
    intermediate=None,
    **params,
):
    """JAX reference: ``(hidden_states_grad, gate_up_weight_grad, down_proj_weight_grad)``."""
    ops = dict(locals())
    clamps = {name: params[name] for name in math.CLAMPS}
    gate_up, quantize_gate_up = values(GATE_UP, ops, params)
    checkpoints = math.recompute(
        hidden_states, gate_up, quantize_gate_up, (gate_pre, gate_act, up, intermediate), clamps
    )
    return math.backward(
        output_grad,
        checkpoints,
        _copy(DOWN_T, down_proj_weight, ops, params),
        _copy(GATE_UP_T, gate_up_weights, ops, params),
        _copy(HIDDEN_T, hidden_states, ops, params),
        _copy(OUTPUT_GRAD_T, output_grad, ops, params),
        clamps,
    )


def _check(call: CallInfo) -> None:
    avals, function = call.avals, call.function
    for spec in PREQUANTIZED_ONLY:
        if (avals.get(spec.name) is None) != (avals.get(spec.scales) is None):
            raise ValueError(
                f"{function}: `{spec.name}` (pre-quantized, layout {spec.layout_text(PREQUANTIZED)}) "
                f"and `{spec.scales}` go together"
            )
    if avals.get("gate_up_weights") is None:
        raise TypeError(
            f"{function}: missing required tensor argument `gate_up_weights` with layout [2*I, H] (or "
            "pre-quantized [H/4, 2*I] with `gate_up_weights_scales`)"
        )
    if avals.get("down_proj_weight") is None and avals.get("down_weight_T") is None:
        raise ValueError(
            f"{function}: give `down_proj_weight` [H, I], or `down_weight_T` pre-quantized with `down_weight_T_scales`"
        )
    if avals.get("gate_up_weights_scales") is not None and avals.get("gate_up_weight_T") is None:
        raise ValueError(
            f"{function}: pre-quantized `gate_up_weights` cannot be transposed by the kernel: give "
            "`gate_up_weight_T` (layout [2*I/4, H]) with `gate_up_weight_T_scales` too"
        )
    bind_dims(call, OPERANDS)


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, avals = call.dims, call.avals
    unmet = bf16_operand_limits(call, (OUTPUT_GRAD, HIDDEN_STATES, DOWN_PROJ, GATE_UP) + CHECKPOINTS)
    transposed = {"S": "the transposed intermediate and gradients", "I": "the transposed gradients"}
    raw_h = [spec.name for spec in (GATE_UP_T, OUTPUT_GRAD_T) if avals.get(spec.name) is None]
    if raw_h:
        transposed["H"] = f"the transposes that replace {' and '.join(raw_h)}"
    for name, reason in transposed.items():
        if dims[name] % DGT_MIN_K:
            unmet.append(f"{name}={dims[name]} must be a multiple of {DGT_MIN_K} for {reason}")
    return unmet + lnc2_limits(call, {name: dims[name] for name in ("S", "I", "H")})


def _operand(spec: MatmulOperand, doc: str, optional: bool = True) -> Operand:
    dtypes = FLOAT_DTYPES + (WORD_DTYPES if spec.scales else ())
    return Operand.of(spec.name, free_layout(spec.name), dtypes=dtypes, optional=optional, doc=doc)


def _scales(name: str, doc: str) -> Operand:
    return Operand.of(name, free_layout(name), dtypes=SCALE_DTYPES, optional=True, doc=doc)


MLP_BACKWARD_MXFP8_SPEC = KernelSpec(
    name="mlp_backward_mxfp8_nki",
    entry_point="jax_nkilib_kernels.mxfp8:mlp_backward_mxfp8_nki",
    operands=(
        _operand(OUTPUT_GRAD, "[S, H] incoming gradient", optional=False),
        _operand(HIDDEN_STATES, "[S, H] forward input", optional=False),
        _operand(DOWN_PROJ, "[H, I] down projection (unless down_weight_T is given)"),
        _operand(GATE_UP, "[2I, H] gate/up weights (required); pre-quantized [H/4, 2I] with gate_up_weights_scales"),
        _operand(GATE_UP_T, "pre-quantized [2I/4, H] (contraction 2I)"),
        _scales("gate_up_weight_T_scales", "scales of gate_up_weight_T: [2I/4, H] or packed"),
        _scales("gate_up_weights_scales", "scales of pre-quantized gate_up_weights: [H/4, 2I] or packed"),
        _operand(DOWN_T, "pre-quantized [H/4, I] (contraction H)"),
        _scales("down_weight_T_scales", "scales of down_weight_T: [H/4, I] or packed"),
        _operand(OUTPUT_GRAD_T, "pre-quantized [S/4, H] (contraction S)"),
        _scales("output_grad_T_scales", "scales of output_grad_T: [S/4, H] or packed"),
        _operand(HIDDEN_T, "pre-quantized [S/4, H] (contraction S)"),
        _scales("hidden_states_T_scales", "scales of hidden_states_T: [S/4, H] or packed"),
        *(_operand(spec, f"[S, I] forward checkpoint `{spec.name}` (else recomputed)") for spec in CHECKPOINTS),
    ),
    params=(
        Param("run_with_lnc2", True, bool, "split the phases over the two logical cores of LNC=2"),
        Param("fp8_x4_dtype", "float8_e4m3fn", "dtype-x4", "accepted, unused by the kernel (e4m3fn matmuls)"),
        Param("spill_reload", True, bool, "spill quantized operands to HBM (performance only)"),
        Param("use_scale_packing", True, bool, "pack the kernel's internal scales (performance only)"),
        *(Param(name, None, float, "ClampLimits field") for name in math.CLAMPS),
    ),
    outputs=(
        Output.of("hidden_states_grad", "S, H", "bfloat16"),
        Output.of("gate_up_weight_grad", "2*I, H", "bfloat16"),
        Output.of("down_proj_weight_grad", "H, I", "bfloat16"),
    ),
    reference=reference_mlp_backward_mxfp8,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: 6 * call.dims["S"] * call.dims["H"] * call.dims["I"],
    family="mlp",
    catalog="row 68",
    support={
        "idiomatic": "",
        "vjp": "not differentiable (it is the backward of mlp_forward_mxfp8_nki)",
        "notes": "MXFP8 SwiGLU backward with recompute and clamp limits; Neuron (Trn3): bf16 operands, S and I "
        f"(and H) % {DGT_MIN_K}, LNC=2 with run_with_lnc2; matmul_config not exposed; adapter "
        "jax_nkilib_kernels/mxfp8.py",
    },
)

mlp_backward_mxfp8_nki = make_kernel(MLP_BACKWARD_MXFP8_SPEC)
