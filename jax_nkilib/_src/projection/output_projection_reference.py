"""The math both output-projection kernels share: ``out = attention · W (+ bias)``, optionally FP8-quantized.

* ``NONE``: ``out = round_io(attention @ W + bias)``, accumulated in float32 (float64 for float64 inputs).
* ``STATIC``: ``q = fp8(clip(attention * (1 / in_scale), ±bound))``; ``out = round_io(round_io(q @ W *
  (w_scale * in_scale)) + bias)`` with FP8 weights ``W`` and per-tensor scales.
* ``MX`` (``output_projection_cte`` only): ``out = bf16(mx(attention) @ W + bias)``, see :func:`project_mx`.
* ``ROW`` (``output_projection_tkg`` only): the attention is not quantized; ``out = round_io(round_io(attention @ W *
  w_scale[h]) + bias)`` with one scale per output column ``h``.

``round_io`` rounds to the attention's dtype (the kernels' result buffers).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import QuantizationType
from ..framework.spec import CallInfo, accumulation_dtype
from ..quant import mx
from ..quant.fp8 import FP8_WEIGHT_DTYPES
from .matmul_numerics import contract, first_element, mx_activation, mx_weight, quantize, rounded

MX_WORDS = jnp.dtype(jnp.uint16)  # float4_e2m1fn_x4 weight words
MAX_HEAD_DIM = 128  # both output projection kernels hold the head dim D on at most 128 partitions

NOT_BOUND_FORMATS = {
    QuantizationType.STATIC_MX: "STATIC_MX (FP8 x4-packed weights through the MX engine)",
    QuantizationType.ROW_MX: "ROW_MX",
}


def project(
    attention,
    subscripts: str,
    weight,
    bias,
    *,
    quantization_type,
    input_scale=None,
    weight_scale=None,
    fp8_dtype=None,
    bound=None,
    round_scaled_input=False,
):
    """The projection in the attention's dtype; ``subscripts`` contracts ``attention`` with ``weight [n, d, h]``."""
    io = attention.dtype
    acc = accumulation_dtype(io)
    x = attention.astype(acc)
    if quantization_type == QuantizationType.STATIC:
        in_s, w_s = first_element(input_scale, acc), first_element(weight_scale, acc)
        scaled = x * (1.0 / in_s)
        if round_scaled_input:  # the TKG kernel writes the scaled input back to its io-dtype buffer first
            scaled = rounded(scaled, io, acc)
        y = rounded(contract(subscripts, quantize(scaled, fp8_dtype, bound), weight, acc) * (w_s * in_s), io, acc)
    elif quantization_type == QuantizationType.ROW:
        y = rounded(contract(subscripts, x, weight, acc) * weight_scale[0].astype(acc), io, acc)
    else:
        y = contract(subscripts, x, weight, acc)
    if bias is not None:
        y = y + bias[0].astype(acc)
    return y.astype(io)


def project_mx(attention, to_bsnd: str, words, scales, bias):
    """``MX``: ``mx(attention) @ W (+ bias)`` as bfloat16; ``to_bsnd`` einsum-permutes the attention to ``[B, S, N,
    D]``, ``W [N * D, H]`` is decoded from MXFP4 x4 ``words`` and e8m0 ``scales``, ``mx`` is the MXFP8 round trip
    along ``N * D`` (:func:`numerics.mx_activation`)."""
    acc = accumulation_dtype(attention.dtype)
    x = jnp.einsum(to_bsnd, attention.astype(acc))
    x = mx_activation(x.reshape(*x.shape[:2], -1))
    y = contract("bsk,kh->bsh", x, mx_weight(words, scales, mx.FP4_DTYPE), acc)
    if bias is not None:
        y = y + bias[0].astype(acc)
    return y.astype(jnp.bfloat16)


def check_formats(call: CallInfo, attention: str, allowed: tuple) -> None:
    """Quantization type, weight dtype and the presence of scales for the call's ``quantization_type``."""
    avals, function, qtype = call.avals, call.function, call.params["quantization_type"]
    if qtype in NOT_BOUND_FORMATS:
        raise ValueError(
            f"{function}: quantization_type={qtype.name}: {NOT_BOUND_FORMATS[qtype]} is not bound in "
            f"jax_nkilib (its packed format and the hardware MX quantizer are not emulated); use NONE, "
            f"{', '.join(q.name for q in allowed if q != QuantizationType.NONE)}"
        )
    if qtype not in allowed:
        raise ValueError(
            f"{function}: quantization_type={qtype.name} is not supported by this kernel; use "
            f"{' or '.join(q.name for q in allowed)}"
        )
    weight = jnp.dtype(avals["weight"].dtype)
    if qtype == QuantizationType.NONE:
        if weight != jnp.dtype(avals[attention].dtype):
            raise TypeError(
                f"{function}: `weight` must have the dtype of `{attention}` ({avals[attention].dtype}) "
                f"without quantization; got {weight}"
            )
    elif weight not in FP8_WEIGHT_DTYPES:
        raise TypeError(
            f"{function}: quantization_type={qtype.name} needs FP8 weights (float8_e4m3 or "
            f"float8_e4m3fn); got `weight` of dtype {weight}"
        )
    elif jnp.dtype(avals[attention].dtype) not in (
        jnp.dtype(jnp.float32),
        jnp.dtype(jnp.bfloat16),
        jnp.dtype(jnp.float16),
    ):
        raise TypeError(
            f"{function}: quantized projections take float32, bfloat16 or float16 `{attention}`; got "
            f"{avals[attention].dtype}"
        )


def require_scales(call: CallInfo, needed: tuple[str, ...], scale_names: tuple[str, ...]) -> None:
    """Exactly the scale operands ``needed`` are given."""
    qtype = call.params["quantization_type"].name
    for name in scale_names:
        given = call.avals.get(name) is not None
        if name in needed and not given:
            raise ValueError(f"{call.function}: quantization_type={qtype} requires `{name}`")
        if name not in needed and given:
            raise ValueError(
                f"{call.function}: `{name}` is only used with quantized weights; got it with quantization_type={qtype}"
            )
