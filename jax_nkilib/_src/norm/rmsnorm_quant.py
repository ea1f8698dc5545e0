"""``rmsnorm_quant_kernel`` (catalog 1.16): optional RMS normalization, then FP8 quantization along the last axis.

Layouts: ``hidden [B, S, H]``; ``ln_w [H]`` or ``[1, H]``; ``input_dequant_scale [128, 1]`` float32 (one value
broadcast over the partitions); 2.32's ``pre_norm_gamma [H]`` or ``[1, H]`` and ``residual [B, S, H]``. Outputs:
``out`` in the FP8 format of ``dtype_mode`` (below), ``[B, S, H+4]`` (ROW) or ``[B, S, H]`` (STATIC), then
``residual_out [B, S, H]`` in ``hidden``'s dtype when ``residual`` is given. The kernel also takes a 2-D
``[outer, H]`` input: pass ``hidden[None]``.

Math, per row (the last axis) on the kernel's bfloat16 tiles (``bf(.)`` rounds to bfloat16; everything else is
float32; float64 inputs, which the kernel cannot take, compute in float64 without rounding)::

    t = bf(hidden)
    with pre_norm_gamma:  t = bf(t * rsqrt(sum(t^2) * (1/H) + bf(eps)) * pre_norm_gamma)   (needs residual)
    with residual:        t = bf(t + bf(residual));  residual_out = t in hidden's dtype
    RMS_NORM:             t = bf(t * rsqrt(sum(t^2) * (1/H) + bf(eps)) * ln_w)
    ROW:     a = max|t|;  if lower_bound > 1e-6: a = min(a, lower_bound), t = clip(t, +-lower_bound)
             s = max(a * float32(1/M), 1e-6);  q = fp8(t * (1/s));  out[..., :H] = q, out[..., H:] = bytes(s)
    STATIC:  q = fp8(clip(bf(t * (1/input_dequant_scale[0, 0])), +-M))

``dtype_mode`` picks the FP8 format ``fp8`` of ``out`` and its largest value ``M`` (nothing else changes):
``NON_OCP`` ``float8_e4m3`` (Trainium2's E4M3, M = 240; the default), ``OCP`` ``float8_e4m3fn`` (M = 448; the
library documents it for Trainium3), ``AUTO`` the target's choice, resolved when the call is traced from the Neuron
platform target (``$NEURON_PLATFORM_TARGET_OVERRIDE``, default ``trn2``): ``trn3*`` gives OCP, anything else
NON_OCP. The kernel gets AUTO resolved. ``fp8`` rounds to nearest even after clipping to +-M. The ``1e-6``
floor keeps zero rows finite (all-zero ``q``, scale ``1e-6``). ``bytes(s)`` are the four bytes of the float32 ``s``,
byte ``j`` = bits ``8j..8j+7`` (little-endian), each stored as an ``fp8`` element: read them back with
``lax.bitcast_convert_type`` (:func:`jax_nkilib._src.quant.fp8.scale_from_bytes`).
Bitcast the output to uint8 before slicing, concatenating or stacking it: some XLA:CPU ops (concatenate,
dynamic_update_slice) canonicalize FP8 NaN encodings, which scale bytes can look like; vmap over a batched ``ln_w``
(``lax.map``, which stacks the outputs) can therefore change low scale bits on CPU. ``lower_bound`` is, despite its
name, an upper clip on magnitudes. The kernel reads the static scale of row ``r`` from partition ``r % 128`` of
``input_dequant_scale``; the reference uses element ``[0, 0]``, the scale being documented as one value broadcast to
``[128, 1]``.

NaN and inf are not defined by the kernel; the reference keeps IEEE semantics: a NaN anywhere in a row makes its
ROW scale and its elements NaN; a +-inf element in a ROW row gives scale inf, NaN at that element and 0 elsewhere;
STATIC clips +-inf to +-M and keeps NaN. The test oracle of the kernel puts ``eps`` outside the square root
(``1/(rms + eps)``) and has no scale floor; this follows the kernel (``rsqrt(mean + eps)``, floor ``1e-6``).

``out``'s dtype is that of ``dtype_mode``; AUTO is resolved from the platform target when the call is traced and
the kernel receives the resolved mode (OCP or NON_OCP).
Gradients: ``out`` is quantized (zero cotangents, no straight-through estimator); ``residual_out`` is differentiable
in ``hidden``, ``residual`` and ``pre_norm_gamma``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..framework import config
from ..framework.common_types import DtypeMode, NormType, QuantizationType
from ..framework.platform import is_trn3
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype
from ..quant.fp8 import fp8_max, saturate, scale_to_bytes

MODE_DTYPES = {DtypeMode.NON_OCP: jnp.dtype(jnp.float8_e4m3), DtypeMode.OCP: jnp.dtype(jnp.float8_e4m3fn)}
MIN_DEQUANT_SCALE = 1e-6
LOWER_BOUND_EPS = 1e-6  # the kernel clips only when lower_bound > 1e-6
MAX_B, MAX_S, MAX_H = 2, 32768, 16384  # the kernel's asserted limits for [B, S, H] inputs


def resolve_dtype_mode(mode: DtypeMode, target: str | None = None) -> DtypeMode:
    """``AUTO`` -> OCP on a ``trn3*`` Neuron platform target (default: the one in force), NON_OCP elsewhere."""
    if mode != DtypeMode.AUTO:
        return mode
    return DtypeMode.OCP if is_trn3(target or config.current_target()) else DtypeMode.NON_OCP


def quant_dtype(mode: DtypeMode):
    """The FP8 dtype of ``out`` for a ``dtype_mode``."""
    return MODE_DTYPES[resolve_dtype_mode(mode)]


def compute_dtype(dtype):
    """The kernel's bfloat16 tiles, or float64 for float64 inputs (the reference's exact mode)."""
    return jnp.dtype(jnp.float64) if jnp.dtype(dtype) == jnp.float64 else jnp.dtype(jnp.bfloat16)


def _tile(x, tile_dtype):
    """``x`` rounded to the tile dtype, returned in float32 (float64 in exact mode) for the next operation."""
    return x.astype(tile_dtype).astype(accumulation_dtype(tile_dtype))


def rms_normalize_tile(t, gamma, eps: float, tile_dtype):
    """``bf(t * rsqrt(sum(t^2) * (1/H) + bf(eps)) * gamma)`` over the last axis (``t`` already on the tile)."""
    wide = accumulation_dtype(tile_dtype)
    h = t.shape[-1]
    eps_tile = jnp.asarray(eps, tile_dtype).astype(wide)
    mean_sq = jnp.sum(t * t, axis=-1, keepdims=True) * jnp.asarray(1.0 / h, wide)
    inv_rms = jax.lax.rsqrt(mean_sq + eps_tile)
    return _tile(t * inv_rms * gamma.reshape(-1).astype(wide), tile_dtype)


def residual_tile(hidden, residual, pre_norm_gamma, eps: float, tile_dtype=None):
    """The tile after the optional pre-norm and residual add (``hidden`` alone when ``residual`` is None).

    ``tile_dtype`` defaults to the kernel's (:func:`compute_dtype`); a wide dtype gives the unrounded math."""
    tile_dtype = compute_dtype(hidden.dtype) if tile_dtype is None else tile_dtype
    t = _tile(hidden, tile_dtype)
    if pre_norm_gamma is not None:
        t = rms_normalize_tile(t, pre_norm_gamma, eps, tile_dtype)
    if residual is not None:
        t = _tile(t + _tile(residual, tile_dtype), tile_dtype)
    return t


def row_quantize(t, fp8_range: float, lower_bound: float = 0.0):
    """``(q, s)``: ``t [..., H]`` (float32/64 values) quantized per row; ``s [...]`` the float32 dequant scale.

    ``a = max|t|`` (clipped with ``t`` to ``lower_bound`` when it is > 1e-6), ``s = max(a * float32(1/range),
    1e-6)``, ``q = t * (1/s)`` (in float32 or float64), unrounded: cast it with :func:`saturate`."""
    wide = t.dtype
    a = jnp.max(jnp.abs(t), axis=-1, keepdims=True)
    if lower_bound > LOWER_BOUND_EPS:
        a = jnp.minimum(a, lower_bound)
        t = jnp.clip(t, -lower_bound, lower_bound)
    s = jnp.maximum(a.astype(jnp.float32) * jnp.float32(1.0 / fp8_range), jnp.float32(MIN_DEQUANT_SCALE))
    q = t * (1.0 / s).astype(wide)
    return q, s[..., 0]


def static_quantize(t, dequant_scale, fp8_range: float, tile_dtype):
    """``clip(bf(t * (1/dequant_scale)), +-range)`` (float32/64 values; cast with :func:`saturate`)."""
    quant_scale = (1.0 / jnp.asarray(dequant_scale, jnp.float32)).astype(t.dtype)
    return jnp.clip(_tile(t * quant_scale, tile_dtype), -fp8_range, fp8_range)


def reference_rmsnorm_quant_kernel(
    hidden,
    ln_w=None,
    input_dequant_scale=None,
    pre_norm_gamma=None,
    residual=None,
    *,
    lower_bound=0.0,
    norm_type=NormType.RMS_NORM,
    quantization_type=QuantizationType.ROW,
    eps=1e-6,
    dtype_mode=DtypeMode.NON_OCP,
):
    """JAX reference of ``rmsnorm_quant_kernel`` (the module docstring's math)."""
    out_dtype = quant_dtype(dtype_mode)
    tile_dtype = compute_dtype(hidden.dtype)
    t = residual_tile(hidden, residual, pre_norm_gamma, eps, tile_dtype)
    residual_out = None if residual is None else t.astype(hidden.dtype)
    if norm_type == NormType.RMS_NORM:
        t = rms_normalize_tile(t, ln_w, eps, tile_dtype)
    fp8_range = fp8_max(out_dtype)
    if quantization_type == QuantizationType.ROW:
        q, s = row_quantize(t, fp8_range, lower_bound)
        # joined as uint8: XLA:CPU's concatenate canonicalizes FP8 NaN encodings, which scale bytes may look like
        pieces = [jax.lax.bitcast_convert_type(saturate(q, out_dtype), jnp.uint8), scale_to_bytes(s, jnp.uint8)]
        out = jax.lax.bitcast_convert_type(jnp.concatenate(pieces, axis=-1), out_dtype)
    else:
        out = saturate(static_quantize(t, input_dequant_scale[0, 0], fp8_range, tile_dtype), out_dtype)
    return (out,) if residual_out is None else (out, residual_out)


def _check(call: CallInfo) -> None:
    p, avals, function = call.params, call.avals, call.function
    if p["norm_type"] not in (NormType.RMS_NORM, NormType.NO_NORM):
        raise ValueError(f"{function}: norm_type must be RMS_NORM or NO_NORM; got {p['norm_type'].name}")
    if p["quantization_type"] not in (QuantizationType.ROW, QuantizationType.STATIC):
        raise ValueError(f"{function}: quantization_type must be ROW or STATIC; got {p['quantization_type'].name}")
    if p["lower_bound"] < 0 or p["eps"] < 0:
        raise ValueError(
            f"{function}: lower_bound and eps must be >= 0; got lower_bound={p['lower_bound']}, eps={p['eps']}"
        )
    if p["norm_type"] == NormType.RMS_NORM and avals.get("ln_w") is None:
        raise ValueError(f"{function}: norm_type=RMS_NORM needs `ln_w` with layout [H] or [1, H]")
    if p["quantization_type"] == QuantizationType.STATIC and avals.get("input_dequant_scale") is None:
        raise ValueError(f"{function}: quantization_type=STATIC needs `input_dequant_scale` [128, 1] float32")
    if avals.get("pre_norm_gamma") is not None and avals.get("residual") is None:
        raise ValueError(f"{function}: `pre_norm_gamma` needs `residual` [B, S, H] (the kernel asserts it)")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    for name, limit in (("B", MAX_B), ("S", MAX_S), ("H", MAX_H)):
        if dims[name] > limit:
            unmet.append(f"{name}={dims[name]} exceeds the kernel's maximum {limit}")
    if dims["B"] * dims["S"] < call.lnc:
        unmet.append(f"B*S={dims['B'] * dims['S']} rows cannot be split over LNC={call.lnc} programs")
    return unmet


def _vjp(kernel, operands, params, outs, cotangents):
    """Only ``residual_out`` carries gradients (``out`` is quantized): differentiate the pre-norm + residual add, in
    float32 (float64) without the tile rounding."""
    if operands["residual"] is None:
        return {}
    names = [name for name in ("hidden", "residual", "pre_norm_gamma") if operands[name] is not None]

    def residual_out(named):
        wide = accumulation_dtype(operands["hidden"].dtype)
        return (residual_tile(named["hidden"], named["residual"], named["pre_norm_gamma"], params["eps"], wide),)

    return pull_back(residual_out, operands, names, cotangents[1:2])


_GAMMA = ("H", "1, H")


def _outputs(call: CallInfo):
    """``out``: FP8 of ``dtype_mode``, ``[B, S, H + 4]`` for ROW (the packed float32 scale) or ``[B, S, H]`` for
    STATIC; ``residual_out`` like ``hidden`` when ``residual`` is given."""
    extra = 4 if call.params["quantization_type"] == QuantizationType.ROW else 0
    out = [("out", call.shape("B, S, H")[:2] + (call.dims["H"] + extra,), MODE_DTYPES[call.params["dtype_mode"]])]
    if call.avals.get("residual") is not None:
        out.append(("residual_out", call.avals["hidden"].shape, call.avals["hidden"].dtype))
    return out


RMSNORM_QUANT_SPEC = KernelSpec(
    name="rmsnorm_quant_kernel",
    entry_point="jax_nkilib_kernels.norm:rmsnorm_quant_kernel",
    operands=(
        Operand.of("hidden", "B, S, H", doc="input hidden states"),
        Operand.of("ln_w", *_GAMMA, optional=True, doc="RMS norm gamma (needed with norm_type=RMS_NORM)"),
        Operand.of(
            "input_dequant_scale",
            "128, 1",
            dtypes=(jnp.float32,),
            optional=True,
            doc="static dequant scale, one value broadcast to [128, 1] (STATIC)",
        ),
        Operand.of("pre_norm_gamma", *_GAMMA, optional=True, doc="gamma of an RMS norm before the residual add (2.32)"),
        Operand.of("residual", "B, S, H", optional=True, doc="residual added before the norm; returned (2.32)"),
    ),
    params=(
        Param("lower_bound", 0.0, float, "clip magnitudes (inputs and ROW scale) to this bound when > 1e-6"),
        Param("norm_type", "RMS_NORM", NormType, "RMS_NORM or NO_NORM"),
        Param("quantization_type", "ROW", QuantizationType, "ROW (per-row scale packed in the output) or STATIC"),
        Param("eps", 1e-6, float, "RMS norm epsilon (rounded to bfloat16 by the kernel)"),
        Param(
            "dtype_mode",
            "NON_OCP",
            DtypeMode,
            "FP8 E4M3 of the output: NON_OCP float8_e4m3 (240), OCP "
            "float8_e4m3fn (448), AUTO (OCP on a trn3 platform target, resolved at trace time)",
        ),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_rmsnorm_quant_kernel,
    resolve_params=lambda params: dict(params, dtype_mode=resolve_dtype_mode(params["dtype_mode"], params["target"])),
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {"hidden": "S", "residual": "S", "ln_w": None, "input_dequant_scale": None, "pre_norm_gamma": None},
            outputs={"out": 1, "residual_out": 1},
        ),
    ),
    neuron_split_dims=("B", "S"),
    mac_count=lambda call: 4 * math.prod(call.avals["hidden"].shape),
    family="norm",
    catalog="1.16",
    nondifferentiable_outputs=("out",),
    support={
        "idiomatic": "quantize_fp8",
        "vjp": "JAX for residual_out; the quantized output has zero cotangents",
        "notes": "ROW packs the float32 scale into 4 trailing FP8 bytes (little-endian); dtype_mode AUTO "
        f"follows the platform target at trace time; Neuron: B <= {MAX_B}, S <= {MAX_S}, H <= {MAX_H}; device "
        "adapter jax_nkilib_kernels/norm.py",
    },
)


rmsnorm_quant_kernel = make_kernel(RMSNORM_QUANT_SPEC, vjp=_vjp)
