"""Normalization and FP8 quantization in JAX layouts: ``rms_norm``, ``layer_norm``, ``quantize_fp8``,
``dequantize_fp8``.

Each normalizes or quantizes over the last axis of ``x [..., H]``. On Neuron ``rms_norm``/``layer_norm`` are the
``rmsnorm_tkg``/``layernorm_tkg`` kernels and ``quantize_fp8`` (E4M3 formats) is ``rmsnorm_quant_kernel`` with
``norm_type=NO_NORM``; elsewhere the kernels' JAX references run. Layout glue: the tokens become the kernels' ``B*S``
axis; the norm kernels' output ``[128, B*S, H/128]`` becomes ``[..., H]`` by a transpose and a reshape (at
LNC=2 the two ``H`` halves are additionally regrouped). Token counts past the TKG kernels' SBUF capacity
become several kernel calls over equal token slices.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument, is_array
from ..framework.common_types import DtypeMode, NormType, QuantizationType
from ..framework.hardware import PARTITIONS
from ..framework.spec import FP8_DTYPES, accumulation_dtype
from ..framework.validation import check_operand_layouts, check_positive_finite, static_float
from ..norm.layernorm_tkg import layernorm_rows, layernorm_tkg
from ..norm.rmsnorm_quant import compute_dtype, rmsnorm_quant_kernel, row_quantize, static_quantize
from ..norm.rmsnorm_tkg import rmsnorm_tkg
from ..norm.tkg_output import from_kernel_order
from ..quant.fp8 import SCALE_BYTES, fp8_max, saturate, scale_from_bytes
from ..sharding import auto

_KERNEL_MODES = {np.dtype(jnp.float8_e4m3): DtypeMode.NON_OCP, np.dtype(jnp.float8_e4m3fn): DtypeMode.OCP}
QUANT_MODES = ("row", "static")


def _check_norm_args(where: str, x, **vectors) -> int:
    """``x [..., H]`` and the ``[H]`` vectors given (``None``: absent); returns ``H``."""
    dims = check_operand_layouts(where, {"x": "..., H", **dict.fromkeys(vectors, "H")}, positive=("H",), x=x, **vectors)
    auto.leading(x.ndim - 1, where)
    return dims["H"]


def _norm_call(kernel, x, vectors, params):
    """Run a TKG norm kernel on ``x [..., H]`` (tokens as ``B``, ``S = 1``) and return ``[..., H]``."""
    hidden = x.shape[-1]
    tokens = math.prod(x.shape[:-1])
    operands = {
        "input": x.reshape(tokens, 1, hidden),
        **{k: None if v is None else v.reshape(1, hidden) for k, v in vectors.items()},
    }
    (tiles,) = kernel.call(operands, params)  # [128, tokens, H/128]
    return from_kernel_order(tiles, params["lnc"]).reshape(x.shape)


RMS_NORM_SHARDING = auto.register_rule(auto.ShardingRule("jax_nkilib.rms_norm", free=auto.LEADING))
LAYER_NORM_SHARDING = auto.register_rule(auto.ShardingRule("jax_nkilib.layer_norm", free=auto.LEADING))
auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.dequantize_fp8",
        free={"*": "every axis"},
        note="pure JAX: explicit shardings propagate through jnp (no kernel, no shard_map)",
    )
)
QUANTIZE_FP8_SHARDING = auto.register_rule(
    auto.ShardingRule("jax_nkilib.quantize_fp8", free=auto.LEADING, note="a static scale is replicated")
)


def _plan_rows(rule, x, **per_hidden):
    """Plan a row-wise op on ``x [..., H]``: rows shard freely; ``[H]`` operands (and a scalar scale) replicate."""
    operands = [auto.ShardedArgument("x", x, auto.leading(x.ndim - 1) + "h")]
    operands += [
        auto.ShardedArgument(name, value, None if value is None or jnp.ndim(value) == 0 else "h")
        for name, value in per_hidden.items()
    ]
    return auto.plan(rule, operands)


def rms_norm(x, weight=None, *, eps: float = 1e-6):
    """RMS normalization over the last axis: ``x * rsqrt(mean(x^2) + eps) * weight``.

    Args:
      x: ``[..., H]``, any float dtype; the result has ``x``'s shape and dtype.
      weight: ``[H]`` gain (default 1), applied in float32.
      eps: added to the mean square, inside the square root (1e-6, the kernel's and Flax's default); a static
        finite float >= 0.

    Differentiable in ``x`` and ``weight`` (JAX backward). Statistics in float32 (float64 for float64 inputs). On
    Neuron this is ``rmsnorm_tkg``; an ``H`` that is not a multiple of 128 is zero-padded to one (with
    ``hidden_actual=H``, so the mean is over ``H``) and the output sliced back (a pad and a slice around the kernel).
    """
    hidden = _check_norm_args("jax_nkilib.rms_norm", x, weight=weight)
    eps = static_float("jax_nkilib.rms_norm", "eps", eps, minimum=0.0)
    x = jnp.asarray(x)
    sharded = _plan_rows(RMS_NORM_SHARDING, x, weight=weight)
    if sharded:
        return sharded.run(lambda x, weight, axes: rms_norm(x, weight, eps=eps), auto.leading(x.ndim - 1) + "h")
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    gamma = jnp.ones((hidden,), x.dtype) if weight is None else jnp.asarray(weight)
    padded = -hidden % PARTITIONS
    if padded:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, padded)])
        gamma = jnp.pad(gamma, (0, padded))
    params = rmsnorm_tkg.params(eps=eps, hidden_actual=hidden if padded else None)
    y = _norm_call(rmsnorm_tkg, x, {"gamma": gamma}, params)
    return y[..., :hidden] if padded else y


def layer_norm(x, weight=None, bias=None, *, eps: float = 1e-6):
    """Layer normalization over the last axis: ``(x - mean) * rsqrt(var + eps) * weight + bias``.

    Args:
      x: ``[..., H]``, any float dtype; the result has ``x``'s shape and dtype.
      weight, bias: ``[H]`` gain and offset (default: none).
      eps: added to the variance (1e-6, the kernel's and Flax's default; PyTorch uses 1e-5); a static finite
        float >= 0.

    Accurate on any data, including rows with a large mean: the kernel computes the variance in one pass,
    ``mean(x^2) - mean^2``, which cancels catastrophically when ``|mean| >> std`` (NaN past a mean of about 3000
    with unit variance in float32). LayerNorm is exactly invariant to a per-row shift, so the op first subtracts
    each row's mean, computed in float32 (float64 for float64 inputs) and rounded to ``x``'s dtype, with no
    gradient (the result does not depend on it): ``x - m`` is rounded to ``x``'s dtype (exact when the row is near
    its mean, by Sterbenz's lemma) and is what the kernel normalizes, in float32 with each step rounded to ``x``'s
    dtype as on the kernel's tiles. Differentiable in ``x``, ``weight`` and ``bias`` (JAX backward). On Neuron this
    is the shift (a row mean and a subtraction in XLA) plus one ``layernorm_tkg`` call when ``H % 128 == 0``; other
    widths have no kernel (padding would change the mean) and run the same math in JAX. The kernel-native
    ``jax_nkilib.nki.layernorm_tkg`` keeps the kernel's one-pass numerics.
    """
    hidden = _check_norm_args("jax_nkilib.layer_norm", x, weight=weight, bias=bias)
    eps = static_float("jax_nkilib.layer_norm", "eps", eps, minimum=0.0)
    x = jnp.asarray(x)
    weight = None if weight is None else jnp.asarray(weight)
    bias = None if bias is None else jnp.asarray(bias)
    sharded = _plan_rows(LAYER_NORM_SHARDING, x, weight=weight, bias=bias)
    if sharded:
        return sharded.run(
            lambda x, weight, bias, axes: layer_norm(x, weight, bias, eps=eps), auto.leading(x.ndim - 1) + "h"
        )
    if x.size == 0:
        return jnp.zeros(x.shape, x.dtype)
    x = _minus_row_mean(x)
    if hidden % PARTITIONS:
        return layernorm_rows(x, weight, bias, eps)
    gamma = jnp.ones((hidden,), x.dtype) if weight is None else weight
    return _norm_call(layernorm_tkg, x, {"gamma": gamma, "beta": bias}, layernorm_tkg.params(eps=eps))


def _minus_row_mean(x):
    """``x - m`` in ``x``'s dtype, ``m`` each row's mean (accumulated wide, rounded to ``x``'s dtype, no gradient):
    the one-pass variance of the result has no cancellation, and LayerNorm of it equals LayerNorm of ``x``."""
    wide = accumulation_dtype(x.dtype)
    shift = jax.lax.stop_gradient(jnp.mean(x.astype(wide), axis=-1, keepdims=True).astype(x.dtype))
    return (x.astype(wide) - shift.astype(wide)).astype(x.dtype)


def _check_quantize_args(x, mode, scale, dtype):
    where = "jax_nkilib.quantize_fp8"
    _check_norm_args(where, x)
    if mode not in QUANT_MODES:
        raise ValueError(f"{where}: mode must be one of {QUANT_MODES}; got {mode!r}")
    try:
        dtype = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise TypeError(f"{where}: dtype must be an FP8 dtype; got {dtype!r}") from None
    if dtype not in FP8_DTYPES:
        raise TypeError(f"{where}: dtype must be one of {', '.join(map(str, FP8_DTYPES))}; got {dtype}")
    if mode == "row" and scale is not None:
        raise ValueError(f"{where}: mode='row' computes its scales; pass scale only with mode='static'")
    if mode == "static":
        if scale is None:
            raise ValueError(f"{where}: mode='static' needs `scale`, the float32 dequantization scale (a scalar)")
        _require_scale(where, scale)
        if jnp.size(scale) != 1:
            raise ValueError(f"{where}: static `scale` must be one value (a scalar); got shape {jnp.shape(scale)}")
        check_positive_finite(where, "scale", scale, "the static dequantization scale")
    return dtype


def _require_scale(where: str, scale) -> None:
    """A scale is a Python number or a float (or int) array; checked before any ``jnp.asarray``."""
    if isinstance(scale, (int, float, np.integer, np.floating)) and not isinstance(scale, (bool, np.bool_)):
        return
    if not is_array(scale) or not (
        jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer)
    ):
        got = f"{scale.dtype} array" if hasattr(scale, "dtype") else type(scale).__name__
        raise TypeError(f"{where}: `scale` must be a float array or a Python number; got {got}")


def quantize_fp8(x, *, mode: str = "row", scale=None, dtype=jnp.float8_e4m3):
    """Quantize ``x [..., H]`` to FP8 with a float32 dequantization scale: ``x ~ q * scale``.

    Args:
      x: ``[..., H]``, any float dtype.
      mode: ``"row"``: one scale per row (the last axis), ``scale = max(max|x| / fp8_max, 1e-6)``, so the largest
        magnitude of a row maps to ``fp8_max``; ``"static"``: the given ``scale`` for the whole tensor,
        ``q = clip(x / scale, +-fp8_max)``.
      scale: the static dequantization scale (a scalar; ``mode="static"`` only), finite and > 0 (checked when it
        is concrete; a traced 0 gives +-fp8_max and NaN for zeros, as the kernel's reciprocal does).
      dtype: ``jnp.float8_e4m3`` (Trainium2's E4M3, largest 240; the kernel's default format), ``jnp.float8_e4m3fn``
        (OCP, 448; the kernel's ``dtype_mode=OCP``) or ``jnp.float8_e5m2`` (57344).

    Returns ``(q, scale)``: ``q`` of ``x``'s shape in ``dtype``; ``scale`` float32 ``[..., 1]`` (row) or ``[]``
    (static). Values are rounded to nearest even after saturating at +-fp8_max. The computation follows the kernel:
    ``x`` is read as bfloat16 (float64 inputs stay float64), the reciprocal scale multiplies; all-zero rows get
    scale 1e-6 and ``q = 0``.

    Non-finite elements (the contract of every jax_nkilib quantizer: ``quantize_fp8``, ``quantize_weight_fp8``,
    ``quantize_mx``): a NaN or +-inf element does not take part in its scale's max (row mode: the row's other
    elements quantize as if it were 0); it becomes NaN (NaN) or +-fp8_max (+-inf, saturated) itself. Static mode
    needs nothing more (its scale is given). On Neuron the row mode is the kernel on ``x`` with non-finite elements
    replaced by 0, and those elements patched afterwards (elementwise glue around the one kernel call); the
    kernel-native ``jax_nkilib.nki.rmsnorm_quant_kernel`` keeps the kernel's own behaviour (a NaN makes its row
    NaN, an inf its row's scale inf and its other elements 0).

    Not differentiable: ``q`` and the row scale carry zero cotangents (no straight-through estimator). On Neuron,
    ``float8_e4m3`` and ``float8_e4m3fn`` are ``rmsnorm_quant_kernel(norm_type=NO_NORM)`` with ``dtype_mode``
    NON_OCP and OCP (its packed ``[..., H+4]`` output is split by a slice and a bitcast); ``float8_e5m2``, which the
    kernel cannot write, runs the same math in JAX.
    """
    dtype = _check_quantize_args(x, mode, scale, dtype)
    x = jnp.asarray(x)
    hidden = x.shape[-1]
    if mode == "static":
        scale = jnp.asarray(scale, jnp.float32).reshape(())
    sharded = _plan_rows(QUANTIZE_FP8_SHARDING, x, scale=scale)
    if sharded:
        rows = auto.leading(x.ndim - 1)
        return sharded.run(
            lambda x, scale, axes: quantize_fp8(x, mode=mode, scale=scale, dtype=dtype),
            (rows + "h", rows + "_" if mode == "row" else None),
        )
    if x.size == 0:
        return jnp.zeros(x.shape, dtype), (jnp.zeros(x.shape[:-1] + (1,), jnp.float32) if scale is None else scale)
    if mode == "row":
        finite = jnp.isfinite(x)
        q, row_scale = _quantize_rows(jnp.where(finite, x, jnp.zeros((), x.dtype)), dtype)
        return jnp.where(finite, q, saturate(x, dtype)), row_scale
    if dtype not in _KERNEL_MODES:
        return _quantize_in_jax(x, mode, scale, dtype)
    rows = x.reshape(1, -1, hidden)
    params = rmsnorm_quant_kernel.params(
        norm_type=NormType.NO_NORM, quantization_type=QuantizationType.STATIC, dtype_mode=_KERNEL_MODES[dtype]
    )
    in_scale = jnp.broadcast_to(scale, (PARTITIONS, 1))
    (out,) = rmsnorm_quant_kernel.call({"hidden": rows, "input_dequant_scale": in_scale}, params)
    return out.reshape(x.shape), scale


def _quantize_rows(x, dtype):
    """Row mode on finite ``x``: the kernel (E4M3 formats) or its math in JAX (float8_e5m2)."""
    if dtype not in _KERNEL_MODES:
        return _quantize_in_jax(x, "row", None, dtype)
    hidden = x.shape[-1]
    params = rmsnorm_quant_kernel.params(
        norm_type=NormType.NO_NORM, quantization_type=QuantizationType.ROW, dtype_mode=_KERNEL_MODES[dtype]
    )
    (out,) = rmsnorm_quant_kernel.call({"hidden": x.reshape(1, -1, hidden)}, params)
    raw = jax.lax.bitcast_convert_type(out, jnp.uint8)  # slice bytes: FP8 copies may canonicalize NaN codes
    q = jax.lax.bitcast_convert_type(raw[..., :hidden], out.dtype)
    return q.reshape(x.shape), scale_from_bytes(raw[..., hidden : hidden + SCALE_BYTES]).reshape(x.shape[:-1] + (1,))


def _quantize_in_jax(x, mode, scale, dtype):
    """The kernel's quantization math for the format it does not write, float8_e5m2 (no kernel call)."""
    tile_dtype = compute_dtype(x.dtype)
    t = jax.lax.stop_gradient(x).astype(tile_dtype).astype(jnp.promote_types(tile_dtype, jnp.float32))
    fp8_range = fp8_max(dtype)
    if mode == "row":
        q, row_scale = row_quantize(t, fp8_range)
        return saturate(q, dtype), row_scale[..., None]
    return saturate(static_quantize(t, scale, fp8_range, tile_dtype), dtype), scale


def dequantize_fp8(q, scale, dtype=jnp.float32):
    """``q * scale`` in float32, returned in ``dtype`` (a float dtype): the inverse of :func:`quantize_fp8`
    (``scale`` ``[..., 1]`` per row or a scalar, a float array or a Python number; anything that broadcasts against
    ``q``). Differentiable in ``scale``; pure JAX."""
    where = "jax_nkilib.dequantize_fp8"
    array_argument(where, "q", q, dtypes=None)
    if np.dtype(q.dtype) not in FP8_DTYPES:
        raise TypeError(f"{where}: `q` must have an FP8 dtype ({', '.join(map(str, FP8_DTYPES))}); got {q.dtype}")
    _require_scale(where, scale)
    try:
        out_dtype = np.dtype(jnp.dtype(dtype))
    except TypeError:
        out_dtype = None
    if out_dtype is None or not jnp.issubdtype(out_dtype, jnp.floating):
        raise TypeError(f"{where}: `dtype` must be a float dtype (e.g. jnp.float32); got {dtype!r}")
    scale = jnp.asarray(scale)
    try:
        jnp.broadcast_shapes(jnp.shape(scale), q.shape)
    except ValueError:
        raise ValueError(
            f"{where}: `scale` of shape {jnp.shape(scale)} does not broadcast against q of shape "
            f"{tuple(q.shape)} (row scales are [..., 1])"
        ) from None
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)
