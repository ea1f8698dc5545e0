"""``ms_deformable_attention`` and ``ms_deformable_attention_bwd`` (catalog rows 54, 55, docs-only): multi-scale
deformable attention (Deformable DETR) and its backward kernel.

Sources: the NKI Library API reference (aws-neuron-sdk ``nki/library/api/ms-deformable-attention.rst`` and
``ms-deformable-attention-bwd.rst``, nki-library 2.32,
``nkilib.experimental.deformable_attention``) and, for the exact arithmetic, the 2.32 kernel source
``experimental/deformable_attention/ms_deformable_attention.py`` and its torch references (public code index; absent
from tag 2.29 and the snapshot's main). The math is :mod:`.deformable_math`'s.

Layouts: ``value [B, L, N_h, C_h]`` (``value_layout="BLNC"``) or ``[B, N_h, L, C_h]`` (``"BNLC"``), ``L = sum of
H_l * W_l`` per ``spatial_shapes`` (static ``((H_0, W_0), ...)``) with level ``l`` at rows ``level_start_index[l]``;
``sampling_locations [B, N_q, N_h, N_l, N_p, 2]`` (``"BQHLP2"``, last axis ``(x, y)`` in ``[0, 1]``) or ``[B, 2, N_q,
N_h, N_l, N_p]`` (``"B2QHLP"``); ``attention_weights [B, N_q, N_h, N_l, N_p]``. Forward: ``output [B, N_q, N_h *
C_h]`` in ``value``'s dtype. Backward: ``(grad_value, grad_sampling_locations, grad_attention_weights)`` in the
layouts and dtypes of ``value``, ``sampling_locations`` and ``attention_weights``.

Dtype policy: float32 arithmetic (float64 for float64 inputs), results rounded to the output dtypes.

Reverse mode: the forward's VJP is the backward kernel; the backward kernel's reference is the exact derivative of
the forward math (bilinear sampling is piecewise linear in the locations: the derivative is one-sided at integer
pixel coordinates, and zero for a corner clamped or zeroed at the border). The backward kernel's own VJP (second
order) differentiates that reference.

Neuron: the kernel splits ``N_q`` over the logical cores (LNC 1 or 2). It floors the pixel coordinates into the value
dtype, so bfloat16 values need maps of at most 256 pixels per side; it stages ``attention_weights`` in the value
dtype, so both must share it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from .deformable_math import (
    LOCATION_LAYOUTS,
    PADDING_MODES,
    VALUE_LAYOUTS,
    canonical_locations,
    canonical_value,
    deformable_attention_math,
)

BF16_EXACT_PIXELS = 256  # the kernel floors coordinates into the value dtype: bfloat16 holds integers <= 256 exactly
NEURON_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))

VALUE_CASES = {"BLNC": "B, L, N_h, C_h", "BNLC": "B, N_h, L, C_h"}
LOCATION_CASES = {"BQHLP2": "B, N_q, N_h, N_l, N_p, 2", "B2QHLP": "B, 2, N_q, N_h, N_l, N_p"}
WEIGHTS_LAYOUT = "B, N_q, N_h, N_l, N_p"
_FORWARD_NAMES = ("value", "sampling_locations", "attention_weights")
_GRAD_NAMES = tuple(f"grad_{name}" for name in _FORWARD_NAMES)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def normalize_spatial_shapes(value, where: str) -> tuple[tuple[int, int], ...]:
    expected = "a non-empty tuple of (H_l, W_l) pairs of positive ints, one per level"
    if value is None:
        raise TypeError(f"{where} is required: {expected}")
    if not isinstance(value, (tuple, list)) or not value:
        raise TypeError(f"{where} must be {expected}; got {value!r}")
    shapes = []
    for pair in value:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(_is_int(v) for v in pair):
            raise TypeError(f"{where} must be {expected}; got {value!r}")
        if min(pair) <= 0:
            raise ValueError(f"{where} must be {expected}; got {value!r}")
        shapes.append((int(pair[0]), int(pair[1])))
    return tuple(shapes)


def _level_start_index(value, where: str) -> tuple[int, ...]:
    expected = "a tuple of non-negative ints, the start row of each level in L"
    if value is None:
        raise TypeError(f"{where} is required: {expected}")
    if not isinstance(value, (tuple, list)) or not all(_is_int(v) for v in value):
        raise TypeError(f"{where} must be {expected}; got {value!r}")
    if any(v < 0 for v in value):
        raise ValueError(f"{where} must be {expected}; got {value!r}")
    return tuple(int(v) for v in value)


PARAMS = (
    Param(
        "spatial_shapes", None, tuple, "((H_0, W_0), ...) per level", required=True, normalizer=normalize_spatial_shapes
    ),
    Param(
        "level_start_index", None, tuple, "start row of each level in L", required=True, normalizer=_level_start_index
    ),
    Param("value_layout", "BLNC", VALUE_LAYOUTS, "BLNC: value [B, L, N_h, C_h]; BNLC: [B, N_h, L, C_h]"),
    Param(
        "sampling_locations_layout",
        "BQHLP2",
        LOCATION_LAYOUTS,
        "BQHLP2: [B, N_q, N_h, N_l, N_p, 2]; B2QHLP: [B, 2, N_q, N_h, N_l, N_p]",
    ),
    Param("align_corners", False, bool, "[0, 1] maps to [0, size-1] (True) or [-0.5, size-0.5] (False)"),
    Param("padding_mode", "zeros", PADDING_MODES, "out-of-map corners count zero, or are clamped to the edge"),
)

FORWARD_OPERANDS = (
    Operand.switched("value", "value_layout", VALUE_CASES),
    Operand.switched("sampling_locations", "sampling_locations_layout", LOCATION_CASES, doc="(x, y) in [0, 1]"),
    Operand.of("attention_weights", WEIGHTS_LAYOUT),
)


def _math(value, sampling_locations, attention_weights, params):
    x, y = canonical_locations(sampling_locations, params["sampling_locations_layout"])
    return deformable_attention_math(
        canonical_value(value, params["value_layout"]),
        params["spatial_shapes"],
        params["level_start_index"],
        x,
        y,
        attention_weights,
        align_corners=params["align_corners"],
        padding_mode=params["padding_mode"],
    )


def reference_ms_deformable_attention(value, sampling_locations, attention_weights, **params):
    """JAX reference of ``ms_deformable_attention``: ``(output [B, N_q, N_h * C_h],)`` in ``value``'s dtype."""
    return (_math(value, sampling_locations, attention_weights, params).astype(value.dtype),)


def reference_ms_deformable_attention_bwd(grad_output, value, sampling_locations, attention_weights, **params):
    """JAX reference of ``ms_deformable_attention_bwd``: the derivative of the forward math, pulled back from
    ``grad_output``, as ``(grad_value, grad_sampling_locations, grad_attention_weights)`` in the inputs' dtypes."""
    inputs = (value, sampling_locations, attention_weights)
    out, pull_back = jax.vjp(lambda *args: _math(*args, params), *inputs)
    grads = pull_back(grad_output.astype(out.dtype))
    return tuple(grad.astype(x.dtype) for grad, x in zip(grads, inputs))


def _check(call: CallInfo) -> None:
    p, dims, function = call.params, call.dims, call.function
    shapes, starts = p["spatial_shapes"], p["level_start_index"]
    if len(shapes) != dims["N_l"] or len(starts) != dims["N_l"]:
        raise ValueError(
            f"{function}: spatial_shapes and level_start_index need one entry per level N_l={dims['N_l']} (the "
            f"N_l axis of sampling_locations and attention_weights); got {len(shapes)} and {len(starts)}"
        )
    for level, ((height, width), start) in enumerate(zip(shapes, starts)):
        if start + height * width > dims["L"]:
            raise ValueError(
                f"{function}: level {level} ({height}x{width} at row {start}) runs past L={dims['L']}, the spatial "
                f"axis of value ({p['value_layout']})"
            )


def _neuron_limits(call: CallInfo) -> list[str]:
    avals, unmet = call.avals, []
    dtype = jnp.dtype(avals["value"].dtype)
    if dtype not in NEURON_DTYPES:
        unmet.append(f"value must be float32 or bfloat16; got {dtype}")
    if jnp.dtype(avals["attention_weights"].dtype) != dtype:
        unmet.append(f"attention_weights must have value's dtype {dtype}; got {avals['attention_weights'].dtype}")
    widest = max(max(shape) for shape in call.params["spatial_shapes"])
    if dtype == jnp.bfloat16 and widest > BF16_EXACT_PIXELS:
        unmet.append(f"bfloat16 values need levels of at most {BF16_EXACT_PIXELS} pixels per side; got {widest}")
    return unmet


def _mac_count(call: CallInfo) -> int:
    dims = call.dims
    return 4 * dims["B"] * dims["N_q"] * dims["N_h"] * dims["N_l"] * dims["N_p"] * dims["C_h"]


def _forward_output(call: CallInfo):
    dims = call.dims
    return (("output", (dims["B"], dims["N_q"], dims["N_h"] * dims["C_h"]), call.avals["value"].dtype),)


def _backward_outputs(call: CallInfo):
    return tuple(
        (grad, tuple(call.avals[name].shape), call.avals[name].dtype) for grad, name in zip(_GRAD_NAMES, _FORWARD_NAMES)
    )


def _forward_vjp(kernel, operands, params, outs, cotangents):
    """The backward kernel on the forward's operands and params."""
    bwd_params = ms_deformable_attention_bwd.params(**{param.name: params[param.name] for param in PARAMS})
    grads = ms_deformable_attention_bwd.call({"grad_output": cotangents[0], **operands}, bwd_params)
    return dict(zip(_FORWARD_NAMES, grads))


def _check_backward(call: CallInfo) -> None:
    _check(call)
    dims = call.dims
    if dims["H_C"] != dims["N_h"] * dims["C_h"]:
        raise ValueError(
            f"{call.function}: grad_output must be [B, N_q, N_h * C_h] = [{dims['B']}, {dims['N_q']}, "
            f"{dims['N_h'] * dims['C_h']}] (the forward's output); got last axis {dims['H_C']}"
        )


MS_DEFORMABLE_ATTENTION_SPEC = KernelSpec(
    name="ms_deformable_attention",
    entry_point="nkilib.experimental.deformable_attention.ms_deformable_attention:ms_deformable_attention",
    operands=FORWARD_OPERANDS,
    params=PARAMS,
    outputs=(),
    output_avals=_forward_output,
    reference=reference_ms_deformable_attention,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(FoldPlan(dict.fromkeys(_FORWARD_NAMES, "B"), outputs={"output": 0}),),
    mac_count=_mac_count,
    family="attention",
    catalog="row 54",
    support={
        "idiomatic": "deformable_attention",
        "vjp": "ms_deformable_attention_bwd (the backward kernel)",
        "notes": "docs-only kernel (2.32); spatial shapes and level starts static; BLNC/BNLC values, BQHLP2/B2QHLP "
        "locations, zeros/border padding; Neuron: float32/bfloat16 value and attention_weights of one dtype, "
        f"bfloat16 levels <= {BF16_EXACT_PIXELS} pixels per side",
    },
)

MS_DEFORMABLE_ATTENTION_BWD_SPEC = KernelSpec(
    name="ms_deformable_attention_bwd",
    entry_point="nkilib.experimental.deformable_attention.ms_deformable_attention_bwd:ms_deformable_attention_bwd",
    operands=(Operand.of("grad_output", "B, N_q, H_C", doc="cotangent of the output [B, N_q, N_h * C_h]"),)
    + FORWARD_OPERANDS,
    params=PARAMS,
    outputs=(),
    output_avals=_backward_outputs,
    reference=reference_ms_deformable_attention_bwd,
    check=_check_backward,
    neuron_limits=_neuron_limits,
    fold_plans=(FoldPlan(dict.fromkeys(("grad_output", *_FORWARD_NAMES), "B"), outputs=dict.fromkeys(_GRAD_NAMES, 0)),),
    mac_count=lambda call: 3 * _mac_count(call),
    family="attention",
    catalog="row 55",
    support={
        "idiomatic": "deformable_attention (its VJP)",
        "vjp": "JAX (the reference's derivative: second order)",
        "notes": "docs-only kernel (2.32); the VJP of ms_deformable_attention; outputs in the inputs' layouts and "
        "dtypes; Neuron limits as the forward's",
    },
)


ms_deformable_attention_bwd = make_kernel(MS_DEFORMABLE_ATTENTION_BWD_SPEC, reference_vjp)
ms_deformable_attention = make_kernel(MS_DEFORMABLE_ATTENTION_SPEC, _forward_vjp)
