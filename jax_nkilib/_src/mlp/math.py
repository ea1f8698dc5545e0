"""The MLP kernel's math, written once: the reference (with the kernel's roundings and FP8 activation quantization)
and the smooth function whose VJP is the backward (no roundings; quantization is the identity) are two
instantiations of :func:`mlp_forward`.

Rounding points of the reference, in the path's compute dtype ``c`` (``c`` = the hidden dtype, except that the CTE
path computes float32 inputs in bfloat16, as the kernel's ``compute_data_type`` does): the fused-add sum, the
normalized input, CTE's float weights and biases as loaded, the gate/up product, and the down projection after its
dequantization and bias. Everything else (statistics, matmul accumulation, dequantization, bias, clamps,
activation, product) is float32 (float64 for float64 inputs).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from ..common_types import ActFnType, NormType, QuantizationType
from ..quant.fp8 import fp8_max, saturate

TKG_TOKEN_THRESHOLD = 96  # TKG_BS_SEQLEN_THRESHOLD: B*S at or below it runs the token-generation path
QUANT_BOUND = fp8_max(jnp.float8_e4m3)  # 240: the kernel clips activations to the Trainium2 E4M3 range
ROW_SCALE_FLOOR = 1e-6  # _MINVAL of the kernel's row quantization
SWISH_BETA = 1.702  # ActFnType.Swish is nl.gelu_apprx_sigmoid: x * sigmoid(1.702 x)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def is_tkg(tokens: int, force_cte_mode: bool) -> bool:
    """The kernel's dispatch: token generation (TKG) when ``B*S <= 96`` unless ``force_cte_mode``."""
    return tokens <= TKG_TOKEN_THRESHOLD and not force_cte_mode


def compute_dtype(io_dtype, tkg: bool):
    """The dtype intermediates are stored in: the input's, but bfloat16 for float32 inputs on the CTE path."""
    io_dtype = jnp.dtype(io_dtype)
    return jnp.dtype(jnp.bfloat16) if (not tkg and io_dtype == jnp.float32) else io_dtype


def activation(x, fn: ActFnType):
    """The kernel's activation functions (``nl.silu``, ``nl.gelu``, ``nl.gelu_apprx_tanh``,
    ``nl.gelu_apprx_sigmoid``, ``nl.relu``)."""
    if fn == ActFnType.SiLU:
        return x * jax.nn.sigmoid(x)
    if fn == ActFnType.GELU:
        return 0.5 * x * (1.0 + lax.erf(x / math.sqrt(2.0)))
    if fn == ActFnType.GELU_Tanh_Approx:
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    if fn == ActFnType.Swish:
        return x * jax.nn.sigmoid(SWISH_BETA * x)
    if fn == ActFnType.ReLU:
        return jnp.maximum(x, 0.0)
    raise AssertionError(fn)


def normalize(s, norm_type: NormType, gamma, beta, eps: float):
    """RMS norm ``s * rsqrt(mean(s^2) + eps) [* gamma]`` or LayerNorm ``(s - mean) * rsqrt(var + eps) * gamma
    [+ beta]`` (biased variance) over the last axis, in ``s``'s dtype.

    Private to the MLP for now; it should be folded with ``jax_nkilib._src.norm`` once that module exists.
    """
    if norm_type == NormType.NO_NORM:
        return s
    if norm_type == NormType.LAYER_NORM:
        mean = jnp.mean(s, axis=-1, keepdims=True)
        centered = s - mean
        out = centered * lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    else:
        out = s * lax.rsqrt(jnp.mean(s * s, axis=-1, keepdims=True) + eps)
    if norm_type != NormType.RMS_NORM_SKIP_GAMMA:
        out = out * gamma.reshape(-1).astype(s.dtype)
    if beta is not None and norm_type == NormType.LAYER_NORM:
        out = out + beta.reshape(-1).astype(s.dtype)
    return out


def clamp(x, upper: float | None, lower: float | None):
    """``min(x, upper)`` then ``max(., lower)``, each when given (the kernel's order)."""
    if upper is not None:
        x = jnp.minimum(x, upper)
    if lower is not None:
        x = jnp.maximum(x, lower)
    return x


def _row0(scale, acc):
    """Row 0 of a ``[128, n]`` scale (the 128 rows are the kernel's per-partition copies of one vector)."""
    return scale[0].astype(acc)


def unswizzle_down(down, lnc: int):
    """``use_tkg_down_proj_optimized_layout``: the given ``[I, H]`` tensor holds ``W`` as ``[I, lnc, H/(128 lnc),
    128]`` of ``W``'s ``[I, lnc, 128, H/(128 lnc)]``; this returns ``W``."""
    inter, hidden = down.shape
    return down.reshape(inter, lnc, hidden // 128 // lnc, 128).transpose(0, 1, 3, 2).reshape(inter, hidden)


def quantize_activation(v, kind: QuantizationType, fmt, in_scale, clipping_bound: float, rounded: Callable):
    """FP8 activation quantization of the CTE path: ``(q, dequant scale)`` with ``v ~= q * scale``.

    ROW: per row (the last axis), clip to ``+-quant_clipping_bound`` when it is > 0; scale
    ``d = max(absmax * (1/240), 1e-6)``; ``q = fp8(v * (1/d))``. STATIC: ``q = fp8(clip(c(v * (1/in_scale)),
    +-240))`` with ``c`` the compute-dtype rounding. The FP8 format ``fmt`` is the consuming weight's; casts round to
    nearest even.
    """
    acc = v.dtype
    if kind == QuantizationType.ROW:
        if clipping_bound > 0:
            v = jnp.clip(v, -clipping_bound, clipping_bound)
        inv_bound = jnp.asarray(1.0 / QUANT_BOUND, jnp.float32).astype(acc)
        dequant = jnp.maximum(jnp.max(jnp.abs(v), axis=-1, keepdims=True) * inv_bound, ROW_SCALE_FLOOR)
        quant = saturate(v * (1.0 / dequant), fmt, QUANT_BOUND)
        return quant.astype(acc), dequant
    dequant = in_scale[0, 0].astype(acc)
    quant = saturate(rounded(v * (1.0 / dequant)), fmt, QUANT_BOUND)
    return quant.astype(acc), dequant


def mlp_forward(ops: Mapping[str, Any], p: Mapping[str, Any], *, exact: bool, lnc: int = 1):
    """``(out, fused_add_out or None)`` in the accumulation dtype (float32, or float64 for float64 inputs).

    ``exact=False`` is the kernel's numerics (roundings and, on the CTE path, FP8 activation quantization);
    ``exact=True`` is the same math without them: the function whose VJP is the backward.
    """
    hidden = ops["hidden_tensor"]
    batch, seq, _ = hidden.shape
    acc = jnp.promote_types(hidden.dtype, jnp.float32)
    tkg = is_tkg(batch * seq, p["force_cte_mode"])
    c = compute_dtype(hidden.dtype, tkg)
    quant = p["quantization_type"]
    quantize_acts = quant != QuantizationType.NONE and not tkg and not exact

    def rounded(v, dtype=c):
        return v if exact else v.astype(dtype).astype(acc)

    def loaded(v):  # CTE loads float weights and biases into compute-dtype tiles; TKG keeps their dtype
        return v.astype(acc) if tkg else rounded(v.astype(acc))

    x = hidden.astype(acc)
    add_out = None
    if ops.get("fused_add_tensor") is not None:
        store = p["store_fused_add_result"]
        x = rounded(x + ops["fused_add_tensor"].astype(acc), p["output_dtype"] if (tkg and store) else c)
        add_out = x if store else None
    else:
        x = rounded(x)
    n = x
    if p["normalization_type"] != NormType.NO_NORM:
        n = rounded(normalize(x, p["normalization_type"], ops.get("normalization_weights_tensor"),
                              ops.get("normalization_bias_tensor"), p["eps"]))

    def project(inp, in_dequant, weight, scale, bias):
        w = weight.astype(acc) if quant != QuantizationType.NONE else loaded(weight)
        out = jnp.einsum("bsh,hi->bsi", inp, w, preferred_element_type=acc)
        if quant != QuantizationType.NONE:
            out = out * _row0(scale, acc) * in_dequant
        if bias is not None:
            out = out + loaded(bias).reshape(-1)
        return out

    inp, in_dequant = n, 1.0
    if quantize_acts:
        inp, in_dequant = quantize_activation(n, quant, ops["up_proj_weights_tensor"].dtype,
                                              ops.get("gate_up_in_scale"), p["quant_clipping_bound"], rounded)
    up = clamp(project(inp, in_dequant, ops["up_proj_weights_tensor"], ops.get("up_w_scale"),
                       ops.get("up_proj_bias_tensor")), p["up_clamp_upper_limit"], p["up_clamp_lower_limit"])
    if p["skip_gate_proj"]:
        inter = activation(up, p["activation_fn"])
    else:
        gate = clamp(project(inp, in_dequant, ops["gate_proj_weights_tensor"], ops.get("gate_w_scale"),
                             ops.get("gate_proj_bias_tensor")), p["gate_clamp_upper_limit"],
                     p["gate_clamp_lower_limit"])
        inter = activation(gate, p["activation_fn"]) * up
    inter = rounded(inter)

    down = ops["down_proj_weights_tensor"]
    if p["use_tkg_down_proj_optimized_layout"]:
        down = unswizzle_down(down, lnc)
    inter_dequant = 1.0
    if quantize_acts:
        inter, inter_dequant = quantize_activation(inter, quant, down.dtype, ops.get("down_in_scale"),
                                                   p["quant_clipping_bound"], rounded)
    out = rounded(project(inter, inter_dequant, down, ops.get("down_w_scale"), ops.get("down_proj_bias_tensor")))
    return out, add_out
