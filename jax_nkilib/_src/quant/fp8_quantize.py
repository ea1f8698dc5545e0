"""The NKI Library's shared FP8 quantization helpers (catalog row 86, ``core/quantization/fp8_quantize.py``):
``static_quantization``, ``row_quantization`` and ``pre_combine_dequant_scales``.

The library functions work on SBUF tiles (the MLP and MoE token-generation kernels call them); the device adapters in
``jax_nkilib_kernels/quant.py`` load the HBM operands into SBUF, call them and store the results. Tensors are tiles
``[P, F]`` (``P`` the partition axis). Arithmetic is float32 (float64 for float64 inputs); ``h(.)`` rounds to
``hidden_state``'s dtype, ``fp8(.)`` casts to an FP8 format rounding to nearest even; ``M(d)`` is the format's
largest finite value (240 for ``float8_e4m3``, Trainium2's E4M3; 448 for ``float8_e4m3fn``; 57344 for
``float8_e5m2``: the library's ``get_max_positive_value_for_dtype``). Scales are float32
(``pre_combine_dequant_scales`` also takes float64 on CPU). ``hidden_state`` may be bfloat16 (what the kernels
document), float16 or float32 on Neuron, and float64 on CPU (the reference computes it in float64; Neuron lowers the
reference for it)::

    static_quantization(hidden_state [P, F], input_dequant_scale [P, 1], quant_scale=None [P, 1], dtype)
        s = quant_scale if given else 1 / input_dequant_scale          (per partition)
        quantized = fp8_dtype(clip(h(hidden_state * s), -M(dtype), M(dtype)))
        -> (quantized [P, F] of dtype, input_dequant_scale unchanged)

    row_quantization(hidden_state, dtype, output_dtype=None)
      [P, F]:              a row is a partition;                         -> quantized [P, F] in h's dtype
      [P0, BxS, F0]:       token t is hidden_state[:, t, :] (P0 x F0 values)
        d = max(absmax(row or token) * float32(1 / M(dtype)), MINVAL)      (dequant_scale)
        quantized = h(hidden_state * (1 / d))                            (not clipped, not FP8)
        rank 3 with output_dtype: quantized = fp8_output_dtype(clip(h(hidden_state * (1 / d)), +-M(output_dtype)))
        -> (quantized, dequant_scale [P, 1] or [P0, BxS, 1], the same value on every partition of a token)

    pre_combine_dequant_scales(input_dequant_scale [P, 1], weight_dequant_scale [P, F_w])
        -> weight_dequant_scale * input_dequant_scale  [P, F_w] float32

``MINVAL`` is :data:`~jax_nkilib._src.quant.fp8.ROW_SCALE_FLOOR` = 1e-6, **an assumption**: the kernel imports it
from ``core/quantization/constants.py``, which no source available to this project contains; 1e-6 is the floor of
the library's other row quantizations (rmsnorm_quant, the 2.29 MLP kernel). It keeps all-zero rows finite
(quantized 0, scale 1e-6). Rank 2 ignores ``output_dtype``, as the kernel does: its rows come back in
``hidden_state``'s dtype, to be cast by the caller. ``1 / x`` is float32 division here; the kernel uses
``nisa.reciprocal``. NaN and inf are not defined by the kernel; the reference keeps IEEE semantics: static clips
+-inf to +-M and keeps NaN; a NaN in a row/token makes its scale and all its elements NaN; an inf gives scale inf,
NaN at the inf and 0 elsewhere.

Layer 1 drops the kernel's ``sbm`` and its destination buffers (``quantized``, ``dequant_scale``). The rank-3 path of
``row_quantization`` is one primitive for both ranks (the rank of ``hidden_state`` picks the layout and the outputs).
Gradients: quantized values and row scales are non-differentiable
(zero cotangents); static's passed-through ``input_dequant_scale`` has the identity gradient;
``pre_combine_dequant_scales`` is differentiable (a product).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..framework.hardware import PARTITIONS, SBUF_PARTITION_BYTES
from ..framework.primitive import make_kernel, reference_vjp, zero_cotangents
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Output, Param, accumulation_dtype, dtype_value
from .fp8 import FP8_DTYPES, ROW_SCALE_FLOOR, fp8_max, saturate

ENTRY_MODULE = "jax_nkilib_kernels.quant"
SCALE_DTYPES = (jnp.dtype(jnp.float32),)
COMBINE_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))  # float64 on CPU only (gradient checks)
_FP8_NAMES = ", ".join(d.name for d in FP8_DTYPES)


def _fp8_dtype(value, where: str) -> np.dtype:
    """One of the FP8 formats, as a dtype."""
    dtype = None if value is None else dtype_value(value, where)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"{where} must be an FP8 dtype ({_FP8_NAMES}); got {dtype}")
    return dtype


def _optional_fp8_dtype(value, where: str) -> np.dtype | None:
    """``None`` or one of the FP8 formats."""
    return None if value is None else _fp8_dtype(value, where)


# ----------------------------------------------------------------------------------------------------- references
def _scaled(hidden, quant_scale):
    """``h(hidden * quant_scale)``: the product in float32 (float64), stored in ``hidden``'s dtype."""
    wide = accumulation_dtype(hidden.dtype)
    return (hidden.astype(wide) * quant_scale.astype(wide)).astype(hidden.dtype)


def row_dequant_scale(absmax, dtype):
    """``max(absmax * float32(1 / M(dtype)), MINVAL)`` in float32."""
    inverse = jnp.float32(1.0 / fp8_max(dtype))
    return jnp.maximum(absmax.astype(jnp.float32) * inverse, jnp.float32(ROW_SCALE_FLOOR))


def reference_static_quantization(hidden_state, input_dequant_scale, quant_scale=None, *, dtype):
    """JAX reference: ``(quantized, input_dequant_scale)`` (see the module doc)."""
    if quant_scale is None:
        quant_scale = jnp.float32(1.0) / input_dequant_scale
    return saturate(_scaled(hidden_state, quant_scale), dtype), input_dequant_scale


def reference_row_quantization(hidden_state, *, dtype, output_dtype=None):
    """JAX reference of both ranks: ``(quantized, dequant_scale)`` (see the module doc)."""
    if hidden_state.ndim == 2:
        reduced, output_dtype = (1,), None  # the kernel's rank-2 path ignores output_dtype
    else:
        reduced = (0, 2)
    absmax = jnp.max(jnp.abs(hidden_state), axis=reduced, keepdims=True)
    dequant = jnp.broadcast_to(row_dequant_scale(absmax, dtype), hidden_state.shape[:-1] + (1,))
    quantized = _scaled(hidden_state, jnp.float32(1.0) / dequant)
    return (quantized if output_dtype is None else saturate(quantized, output_dtype)), dequant


def reference_pre_combine_dequant_scales(input_dequant_scale, weight_dequant_scale):
    """JAX reference: ``(weight_dequant_scale * input_dequant_scale,)``."""
    return (weight_dequant_scale * input_dequant_scale,)


# ----------------------------------------------------------------------------------------------- limits and rules
def _tile_limits(call: CallInfo, partitions: str, bytes_per_partition: int) -> list[str]:
    unmet = []
    if call.dims[partitions] > PARTITIONS:
        unmet.append(f"{partitions}={call.dims[partitions]} exceeds the {PARTITIONS} SBUF partitions")
    if bytes_per_partition > SBUF_PARTITION_BYTES:
        unmet.append(f"SBUF capacity: about {bytes_per_partition} bytes per partition exceed {SBUF_PARTITION_BYTES}")
    return unmet


def _itemsize(call: CallInfo, name: str) -> int:
    return np.dtype(call.avals[name].dtype).itemsize


def _static_limits(call: CallInfo) -> list[str]:
    # hidden (scaled in place) and the FP8 tile, plus the scales
    return _tile_limits(call, "P", call.dims["F"] * (_itemsize(call, "hidden_state") + 1) + 12)


def _row_limits(call: CallInfo) -> list[str]:
    size = _itemsize(call, "hidden_state")
    if not _tokens(call):  # hidden, its absolute values and the quantized tile (in hidden's dtype), plus the scales
        return _tile_limits(call, "P", 3 * call.dims["F"] * size + 8)
    # hidden, float32 absolute values, the product (and the FP8 tile with output_dtype), plus four scale rows
    per_token = call.dims["F0"] * (2 * size + 4 + (1 if call.params["output_dtype"] is not None else 0)) + 16
    return _tile_limits(call, "P0", call.dims["BxS"] * per_token)


def _tokens(call: CallInfo) -> bool:
    """Whether ``row_quantization`` runs on tokens ``[P0, BxS, F0]`` (rank 3) rather than rows ``[P, F]``."""
    return call.avals["hidden_state"].ndim == 3


def _row_outputs(call: CallInfo):
    """``quantized`` like ``hidden_state`` (rank 3 with ``output_dtype``: in that FP8 dtype) and float32
    ``dequant_scale`` ``[P, 1]`` or ``[P0, BxS, 1]``."""
    hidden = call.avals["hidden_state"]
    fp8 = _tokens(call) and call.params["output_dtype"] is not None
    return [
        ("quantized", hidden.shape, call.params["output_dtype"] if fp8 else hidden.dtype),
        ("dequant_scale", hidden.shape[:-1] + (1,), jnp.float32),
    ]


def _require_rank(function, operands, params):
    hidden = operands["hidden_state"]
    if jnp.ndim(hidden) not in (2, 3):
        raise ValueError(
            f"{function}: argument `hidden_state` must have layout [P, F] or [P0, BxS, F0] (rank 2 or "
            f"3); got shape {jnp.shape(hidden)}"
        )
    return operands, params


def _combine_check(call: CallInfo) -> None:
    dtypes = {name: np.dtype(aval.dtype) for name, aval in call.avals.items()}
    if len(set(dtypes.values())) > 1:
        raise TypeError(
            f"{call.function}: `input_dequant_scale` and `weight_dequant_scale` must have the same dtype "
            f"(float32); got {dtypes['input_dequant_scale']} and {dtypes['weight_dequant_scale']}"
        )


def _combine_limits(call: CallInfo) -> list[str]:
    return _tile_limits(call, "P", 2 * call.dims["F_w"] * _itemsize(call, "weight_dequant_scale") + 4)


def _passthrough_cotangent(kernel, operands, params, outs, cotangents):
    """``quantized`` carries no gradient; the passed-through scale has the identity gradient."""
    return {} if cotangents[1] is None else {"input_dequant_scale": cotangents[1]}


# ---------------------------------------------------------------------------------------------------------- specs
_DTYPE = Param(
    "dtype", "float8_e4m3fn", "dtype", "FP8 format: its largest value M bounds the scaling", normalizer=_fp8_dtype
)
_OUTPUT_DTYPE = Param(
    "output_dtype",
    None,
    "dtype",
    "rank 3: clip to +-M(output_dtype) and return FP8 (ignored by rank 2, as in the kernel)",
    normalizer=_optional_fp8_dtype,
)
_HIDDEN_DOC = "tile to quantize (the kernel documents bfloat16)"
_ROW_SUPPORT = {
    "idiomatic": "",
    "vjp": "none (quantized values and scales have zero cotangents)",
    "notes": "rank 2 [P, F] quantizes rows and returns hidden's dtype (output_dtype ignored, as in the kernel); rank "
    "3 [P0, BxS, F0] quantizes tokens across P0 and F0, FP8 with output_dtype; MINVAL = 1e-6 assumed "
    f"(constants.py not available); Neuron: P <= {PARTITIONS} (split along "
    "P / BxS beyond it), SBUF capacity; device adapter jax_nkilib_kernels/quant.py",
}

STATIC_QUANTIZATION_SPEC = KernelSpec(
    name="static_quantization",
    entry_point=f"{ENTRY_MODULE}:static_quantization",
    operands=(
        Operand.of("hidden_state", "P, F", doc=_HIDDEN_DOC),
        Operand.of("input_dequant_scale", "P, 1", dtypes=SCALE_DTYPES, doc="per-partition dequant scale (returned)"),
        Operand.of(
            "quant_scale",
            "P, 1",
            dtypes=SCALE_DTYPES,
            optional=True,
            doc="pre-computed 1 / input_dequant_scale (used as given)",
        ),
    ),
    params=(_DTYPE,),
    outputs=(),
    output_avals=lambda call: [
        ("quantized", call.shape("P, F"), call.params["dtype"]),
        ("input_dequant_scale_out", call.shape("P, 1"), call.avals["input_dequant_scale"].dtype),
    ],
    reference=reference_static_quantization,
    neuron_limits=_static_limits,
    fold_plans=(
        FoldPlan(
            dict.fromkeys(("hidden_state", "input_dequant_scale", "quant_scale"), "P"),
            outputs={"quantized": 0, "input_dequant_scale_out": 0},
        ),
    ),
    neuron_split_dims=("P", "F"),
    mac_count=lambda call: 2 * call.dims["P"] * call.dims["F"],
    family="quant",
    catalog="row 86",
    nondifferentiable_outputs=("quantized",),
    support={
        "idiomatic": "",
        "vjp": "identity for the passed-through input_dequant_scale; quantized has zero cotangents",
        "notes": "per-partition scales [P, 1]; the product is rounded to hidden's dtype before the clip; Neuron: "
        f"P <= {PARTITIONS} (split along P or F beyond it), SBUF capacity; device adapter jax_nkilib_kernels/quant.py",
    },
)

ROW_QUANTIZATION_SPEC = KernelSpec(
    name="row_quantization",
    entry_point=f"{ENTRY_MODULE}:row_quantization",
    operands=(
        Operand.of(
            "hidden_state", "P, F", "P0, BxS, F0", doc=_HIDDEN_DOC + "; one row per partition, or token t is [:, t, :]"
        ),
    ),
    params=(_DTYPE, _OUTPUT_DTYPE),
    outputs=(),
    output_avals=_row_outputs,
    reference=reference_row_quantization,
    prepare=_require_rank,
    neuron_limits=_row_limits,
    fold_plans=(
        FoldPlan(
            {"hidden_state": "P"}, outputs={"quantized": 0, "dequant_scale": 0}, when=lambda call: not _tokens(call)
        ),
        FoldPlan({"hidden_state": "BxS"}, outputs={"quantized": 1, "dequant_scale": 1}, when=_tokens),
    ),
    neuron_split_dims=("P", "BxS"),
    mac_count=lambda call: 3 * math.prod(call.avals["hidden_state"].shape),
    family="quant",
    catalog="row 86",
    nondifferentiable_outputs=("quantized", "dequant_scale"),
    support=_ROW_SUPPORT,
)

PRE_COMBINE_DEQUANT_SCALES_SPEC = KernelSpec(
    name="pre_combine_dequant_scales",
    entry_point=f"{ENTRY_MODULE}:pre_combine_dequant_scales",
    operands=(
        Operand.of("input_dequant_scale", "P, 1", dtypes=COMBINE_DTYPES, doc="per-partition activation scale"),
        Operand.of("weight_dequant_scale", "P, F_w", dtypes=COMBINE_DTYPES, doc="weight dequant scales"),
    ),
    params=(),
    outputs=(Output.of("combined", "P, F_w", "weight_dequant_scale"),),
    reference=reference_pre_combine_dequant_scales,
    check=_combine_check,
    neuron_limits=_combine_limits,
    fold_plans=(FoldPlan({"input_dequant_scale": "P", "weight_dequant_scale": "P"}, outputs=("P",)),),
    neuron_split_dims=("P", "F_w"),
    mac_count=lambda call: call.dims["P"] * call.dims["F_w"],
    family="quant",
    catalog="row 86",
    support={
        "idiomatic": "",
        "vjp": "JAX (differentiates the product)",
        "notes": f"float32 (float64 on CPU only); Neuron: P <= {PARTITIONS} (split beyond it), SBUF capacity; device "
        "adapter jax_nkilib_kernels/quant.py",
    },
)

static_quantization = make_kernel(STATIC_QUANTIZATION_SPEC, vjp=_passthrough_cotangent)
# zero gradients: quantized values and row scales, no cotangent flows to hidden_state
row_quantization = make_kernel(ROW_QUANTIZATION_SPEC, vjp=zero_cotangents)
pre_combine_dequant_scales = make_kernel(PRE_COMBINE_DEQUANT_SCALES_SPEC, vjp=reference_vjp)
