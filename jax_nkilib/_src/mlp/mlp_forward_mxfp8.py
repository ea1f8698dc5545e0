"""``mlp_forward_mxfp8_nki`` (catalog row 67, docs-only; experimental/mlp_mxfp8): the MXFP8 SwiGLU MLP forward.

``out = (silu(x Wg^T) * (x Wu^T)) Wd^T`` with every matmul in MXFP8 (the datapath and its roundings: :mod:`.math`).
Operands: ``hidden [S, H]``, ``gate_up_weights [2I, H]`` (rows ``0..I-1`` are ``Wg``, ``I..2I-1`` are ``Wu``),
``down_weights [H, I]``, each raw (float), pre-swizzled (``*_is_swizzled=True``: ``[H/4, 4S]``, ``[H/4, 8I]``,
``[I/4, 4H]``) or pre-quantized (with ``hidden_scales`` / ``gate_up_scales`` / ``down_scales``: uint32 x4 words
``[H/4, S]``, ``[H/4, 2I]``, ``[I/4, H]`` and uint8 scales), see :mod:`.operands`. The kernel's scratch argument
``intermediate_hbm`` is dropped; the checkpoint buffers become flags: ``save_gate_pre``, ``save_gate_act``,
``save_up`` and ``save_hidden`` each add an output ``[S, I]`` (``gate_pre``, ``gate_act``, ``up``, ``intermediate``
= the gated activation, in that order after ``output [S, H]``), all of ``dtype``. The tile knobs, ``spill_reload``
and ``use_scale_packing`` do not change the results; ``fp8_x4_dtype`` is accepted but, as in the kernel, not used
(the matmuls quantize to float8_e4m3fn).

Reverse mode binds ``mlp_backward_mxfp8_nki``: the forward runs with all four checkpoints saved (residuals named
``"mlp_forward_mxfp8_nki.<name>"``, see ``jax_nkilib.checkpoint_policies``), and the backward kernel takes them, so
on Neuron the forward and its VJP are two kernel calls (the upstream gradient is passed as bfloat16, the backward
kernel's input type).
Gradients reach raw and pre-swizzled operands (a pre-swizzled operand's gradient is swizzled too); pre-quantized
operands get none, and the checkpoint outputs carry no gradient. The gradient is the kernel's: MXFP8 matmuls of the
upstream gradient with the quantized-activation checkpoints (a straight-through estimate of the quantization), not
the derivative of this piecewise-constant forward; pre-quantized weights reach the backward kernel dequantized.

Neuron limits (else the reference runs): bfloat16 raw/pre-swizzled operands; ``H`` (raw ``hidden`` or
``gate_up_weights``) and ``I`` (raw ``down_weights``) multiples of 128; with ``run_with_lnc2`` (default True, as
in the kernel) LNC must be 2 and S even. MX matmuls need Trn3.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import Vjp, make_kernel
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..quant import mx
from . import mxfp8_reference as math
from .mlp_backward_mxfp8 import mlp_backward_mxfp8_nki
from .mxfp8_operands import (
    PREQUANTIZED,
    RAW,
    SCALE_DTYPES,
    SWIZZLED,
    WORD_DTYPES,
    MatmulOperand,
    bf16_operand_limits,
    bind_dims,
    free_layout,
    lnc2_limits,
    mode_of,
    values,
)

HIDDEN = MatmulOperand("hidden", "S", "H", "hidden_scales", "hidden_is_swizzled")
GATE_UP = MatmulOperand("gate_up_weights", "I", "H", "gate_up_scales", "gate_up_is_swizzled", f_times=2)
DOWN = MatmulOperand("down_weights", "H", "I", "down_scales", "down_is_swizzled")
OPERANDS = (HIDDEN, GATE_UP, DOWN)
SAVES = ("save_gate_pre", "save_gate_act", "save_up", "save_hidden")
CHECKPOINTS = ("gate_pre", "gate_act", "up", "intermediate")
OUTPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
FP8_X4_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
TILE_KNOBS = ("gate_up_tiles_m", "gate_up_tiles_n", "gate_up_tiles_k", "down_tiles_m", "down_tiles_n", "down_tiles_k")
DGT_MIN_K = 128  # the kernel's DMA-transpose load of a raw operand needs K % 128 == 0


def reference_mlp_forward_mxfp8(
    hidden, gate_up_weights, down_weights, hidden_scales=None, gate_up_scales=None, down_scales=None, **params
):
    """JAX reference: ``(output, *requested checkpoints)``."""
    operands = dict(
        hidden=hidden,
        gate_up_weights=gate_up_weights,
        down_weights=down_weights,
        hidden_scales=hidden_scales,
        gate_up_scales=gate_up_scales,
        down_scales=down_scales,
    )
    (x, qx), (w, qw), (d, qd) = (values(spec, operands, params) for spec in OPERANDS)
    out, *checkpoints = math.forward(x, w, d, (qx, qw, qd), params["dtype"])
    return (out,) + tuple(value for value, flag in zip(checkpoints, SAVES) if params[flag])


def _check(call: CallInfo) -> None:
    p, function = call.params, call.function
    bind_dims(call, OPERANDS)
    if p["dtype"] not in OUTPUT_DTYPES:
        raise TypeError(f"{function}: dtype must be one of {', '.join(map(str, OUTPUT_DTYPES))}; got {p['dtype']}")
    if p["fp8_x4_dtype"] not in FP8_X4_DTYPES:
        raise TypeError(
            f"{function}: fp8_x4_dtype must be float8_e4m3fn or float8_e5m2 (the x4 formats' element "
            f"types); got {p['fp8_x4_dtype']}"
        )
    for knob in TILE_KNOBS:
        if p[knob] < 1:
            raise ValueError(f"{function}: {knob} must be >= 1; got {p[knob]}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, bf16_operand_limits(call, OPERANDS)
    for spec in OPERANDS:
        if mode_of(spec, call.avals, call.params) == RAW and dims[spec.k] % DGT_MIN_K:
            unmet.append(
                f"{spec.k}={dims[spec.k]} must be a multiple of {DGT_MIN_K} for the DMA-transpose load of "
                f"the unswizzled `{spec.name}`"
            )
    return unmet + lnc2_limits(call, {"S": dims["S"]})


def _raw_hidden(call: CallInfo) -> bool:
    return mode_of(HIDDEN, call.avals, call.params) == RAW


# ------------------------------------------------------------------------------------------------- reverse mode
def _forward_saving(kernel, operands, params):
    outs = kernel.call(operands, dict(params, **dict.fromkeys(SAVES, True)))
    checkpoints = dict(zip(CHECKPOINTS, outs[1:]))
    user = (outs[0],) + tuple(out for out, flag in zip(outs[1:], SAVES) if params[flag])
    return user, (operands, checkpoints)


def _backward(kernel, residuals, params, cotangents):
    operands, checkpoints = residuals
    modes = [mode_of(spec, operands, params) for spec in OPERANDS]
    raw = [
        value.astype(jnp.bfloat16) if mode == PREQUANTIZED else value
        for (value, _), mode in zip((values(spec, operands, params) for spec in OPERANDS), modes)
    ]
    grads = mlp_backward_mxfp8_nki(
        cotangents[0].astype(jnp.bfloat16),
        raw[0],
        raw[2],
        raw[1],
        **checkpoints,
        run_with_lnc2=params["run_with_lnc2"],
        spill_reload=params["spill_reload"],
        use_scale_packing=params["use_scale_packing"],
    )
    result = {}
    for spec, mode, grad in zip(OPERANDS, modes, grads):  # the backward's (dX, dW_gu, dW_down)
        if mode != PREQUANTIZED:
            result[spec.name] = mx.swizzle_wrapx(grad) if mode == SWIZZLED else grad
    return result


MLP_FORWARD_MXFP8_SPEC = KernelSpec(
    name="mlp_forward_mxfp8_nki",
    entry_point="jax_nkilib_kernels.mxfp8:mlp_forward_mxfp8_nki",
    operands=(
        Operand.of(
            "hidden",
            free_layout("hidden"),
            dtypes=FLOAT_DTYPES + WORD_DTYPES,
            doc="[S, H]; pre-swizzled [H/4, 4S]; pre-quantized [H/4, S] uint32 words",
        ),
        Operand.of(
            "gate_up_weights",
            free_layout("gate_up"),
            dtypes=FLOAT_DTYPES + WORD_DTYPES,
            doc="[2I, H] (gate rows then up rows); pre-swizzled [H/4, 8I]; pre-quantized [H/4, 2I]",
        ),
        Operand.of(
            "down_weights",
            free_layout("down"),
            dtypes=FLOAT_DTYPES + WORD_DTYPES,
            doc="[H, I]; pre-swizzled [I/4, 4H]; pre-quantized [I/4, H]",
        ),
        Operand.of(
            "hidden_scales",
            free_layout("hidden_scales"),
            dtypes=SCALE_DTYPES,
            optional=True,
            doc="e8m0 scales of a pre-quantized hidden: [H/4, S] or packed [ceil(H/2048)*128, S]",
        ),
        Operand.of(
            "gate_up_scales",
            free_layout("gate_up_scales"),
            dtypes=SCALE_DTYPES,
            optional=True,
            doc="scales of pre-quantized gate_up_weights: [H/4, 2I] or packed",
        ),
        Operand.of(
            "down_scales",
            free_layout("down_scales"),
            dtypes=SCALE_DTYPES,
            optional=True,
            doc="scales of pre-quantized down_weights: [I/4, H] or packed",
        ),
    ),
    params=(
        Param("run_with_lnc2", True, bool, "split S over the two logical cores of LNC=2 (the kernel's default)"),
        *(
            Param(knob, 1 if knob.endswith("_n") else 8, int, "matmul tiles per block (performance only)")
            for knob in TILE_KNOBS
        ),
        Param("fp8_x4_dtype", "float8_e4m3fn", "dtype-x4", "accepted, unused by the kernel (e4m3fn matmuls)"),
        *(
            Param(flag, False, bool, f"also return the `{name}` checkpoint [S, I]")
            for flag, name in zip(SAVES, CHECKPOINTS)
        ),
        Param("dtype", "bfloat16", "dtype", "output, intermediate and checkpoint dtype"),
        Param("spill_reload", True, bool, "spill quantized operands to HBM (performance only)"),
        Param("use_scale_packing", True, bool, "pack the kernel's internal scales (performance only)"),
        *(Param(spec.swizzled, False, bool, f"`{spec.name}` is given wrapX-swizzled") for spec in OPERANDS),
    ),
    outputs=(),
    output_avals=lambda call: [
        ("output", call.shape("S, H"), call.params["dtype"]),
        *(
            (name, call.shape("S, I"), call.params["dtype"])
            for name, flag in zip(CHECKPOINTS, SAVES)
            if call.params[flag]
        ),
    ],
    reference=reference_mlp_forward_mxfp8,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan({"hidden": "hidden_rows"}, outputs=dict.fromkeys(("output",) + CHECKPOINTS, 0), when=_raw_hidden),
    ),
    mac_count=lambda call: 3 * call.dims["S"] * call.dims["H"] * call.dims["I"],
    nondifferentiable_outputs=CHECKPOINTS,
    family="mlp",
    catalog="row 67",
    support={
        "idiomatic": "",
        "vjp": "mlp_backward_mxfp8_nki kernel (the forward saves its four checkpoints)",
        "notes": "MXFP8 (e4m3fn, wrapX blocks, alternative emax) SwiGLU; raw, pre-swizzled or pre-quantized "
        f"operands; Neuron (Trn3): bf16 operands, H and I % {DGT_MIN_K} for raw ones, LNC=2 with "
        "run_with_lnc2; device adapter jax_nkilib_kernels/mxfp8.py",
    },
)

mlp_forward_mxfp8_nki = make_kernel(MLP_FORWARD_MXFP8_SPEC, vjp=Vjp(_forward_saving, _backward))
