"""``output_projection_cte`` (catalog 1.13): ``out [B, S, H] = attention · weight (+ bias)`` for prefill.

Layouts: ``attention [B, N, D, S]`` (heads and head dim before the sequence), ``weight [N * D, H]`` (row ``n * D +
d``), ``bias [1, H]``; FP8 ``STATIC``: ``input_scales``, ``weight_scales [128, 1]`` float32 (element ``[0, 0]``, see
``numerics``). ``out[b, s, h] = sum_{n, d} attention[b, n, d, s] * weight[n * D + d, h] + bias[0, h]``.

Dtypes: without quantization ``weight`` has the attention's dtype; ``STATIC`` takes ``float8_e4m3``/``e4m3fn``
weights and quantizes the attention to ``float8_e4m3`` with the kernel's clamp 240 (see ``output_math``). The result
is rounded to the attention's dtype, then cast to ``output_dtype`` (default: the attention's dtype).

``MX``: ``weight [N * D / 4, H]`` uint16 ``float4_e2m1fn_x4`` words (``W[4k + j, h]`` in nibble ``j`` of word ``[k,
h]``), ``weight_scales [N * D / 32, H]`` uint8 e8m0 (one per 32 consecutive rows of ``W``), no ``input_scales``. The
kernel MX-quantizes the attention on the fly to MXFP8 (e4m3fn) in blocks of 32 consecutive ``n * D + d`` per token
(OCP emax 8, the golden ``output_projection_cte_mx_torch_ref``'s ``quantize_to_mx_fp8``): ``out = mx(attention) @ W
(+ bias)``, accumulated in float32 and returned as bfloat16 (``output_dtype`` must be None or bfloat16). The weight
words and scales get no cotangent; the attention's gradient passes the quantization straight through.

Not bound: ``STATIC_MX``, and ``MX`` with a pre-quantized attention (``input_scales``; rejected with ``ValueError``).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import QuantizationType
from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..quant.fp8 import FP8_WEIGHT_DTYPES
from .matmul_numerics import differentiable_vjp
from .output_projection_reference import (
    MAX_HEAD_DIM,
    MX_WORDS,
    check_formats,
    project,
    project_mx,
    require_scales,
)

CTE_FP8 = jnp.dtype(jnp.float8_e4m3)  # the kernel quantizes the attention to float8_e4m3 ...
CTE_FP8_BOUND = 240.0  # ... clamped at 240, whatever the weights' FP8 format
MAX_TOKENS = 131072  # B * S
MAX_HIDDEN = 20705  # H: the kernel's validated limit
MAX_HEADS = 17  # N: the kernel's validated limit


def reference_output_projection_cte(
    attention,
    weight,
    bias=None,
    input_scales=None,
    weight_scales=None,
    *,
    quantization_type=QuantizationType.NONE,
    output_dtype=None,
):
    """JAX reference on the attention's kernel layout ``[B, N, D, S]``."""
    _, n, d, _ = attention.shape
    if quantization_type == QuantizationType.MX:
        return (project_mx(attention, "bnds->bsnd", weight, weight_scales, bias),)
    out = project(
        attention,
        "bnds,ndh->bsh",
        weight.reshape(n, d, weight.shape[1]),
        bias,
        quantization_type=quantization_type,
        input_scale=input_scales,
        weight_scale=weight_scales,
        fp8_dtype=CTE_FP8,
        bound=CTE_FP8_BOUND,
    )
    return (out if output_dtype is None else out.astype(output_dtype),)


def _check_mx(call: CallInfo) -> None:
    avals, dims, function = call.avals, call.dims, call.function
    nd = dims["N"] * dims["D"]
    if nd % 32 or dims["ND4"] * 4 != nd:
        raise ValueError(
            f"{function}: quantization_type=MX needs N * D % 32 == 0 and `weight` [N * D / 4, H] = "
            f"[{nd // 4}, H] x4 words; got N * D = {nd} and {dims['ND4']} weight rows"
        )
    if jnp.dtype(avals["weight"].dtype) != MX_WORDS:
        raise TypeError(
            f"{function}: quantization_type=MX needs `weight` as uint16 float4_e2m1fn_x4 words [N * D / "
            f"4, H]; got {avals['weight'].dtype}"
        )
    if jnp.dtype(avals["attention"].dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{function}: quantization_type=MX takes a floating `attention` (float32, bfloat16, float16); "
            f"got {avals['attention'].dtype} (a pre-quantized attention is not bound)"
        )
    if avals.get("input_scales") is not None:
        raise ValueError(
            f"{function}: quantization_type=MX does not take `input_scales` (the kernel's pre-quantized "
            "attention path is not bound; the attention is MX-quantized on the fly)"
        )
    scale = avals.get("weight_scales")
    if scale is None or jnp.dtype(scale.dtype) != jnp.uint8 or dims["NDS"] != nd // 32:
        got = "none" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
        raise ValueError(
            f"{function}: quantization_type=MX requires `weight_scales` as uint8 e8m0 scales [N * D / "
            f"32, H] = [{nd // 32}, {dims['H']}]; got {got}"
        )
    out_dtype = call.params["output_dtype"]
    if out_dtype is not None and jnp.dtype(out_dtype) != jnp.bfloat16:
        raise TypeError(
            f"{function}: quantization_type=MX returns bfloat16; `output_dtype` must be None or bfloat16, "
            f"got {out_dtype}"
        )


def _check(call: CallInfo) -> None:
    dims, function = call.dims, call.function
    if call.params["quantization_type"] == QuantizationType.MX:
        _check_mx(call)
        return
    if jnp.dtype(call.avals["weight"].dtype) == MX_WORDS:
        raise TypeError(f"{function}: uint16 `weight` holds MXFP4 x4 words; pass quantization_type=MX")
    if call.avals.get("weight_scales") is not None and call.avals["weight_scales"].dtype != jnp.float32:
        raise TypeError(
            f"{function}: `weight_scales` must be float32 [128, 1] for quantization_type="
            f"{call.params['quantization_type'].name}; got {call.avals['weight_scales'].dtype}"
        )
    if dims["ND"] != dims["N"] * dims["D"]:
        raise ValueError(
            f"{function}: `weight` must be [N * D, H] = [{dims['N'] * dims['D']}, H] for attention "
            f"[B, N={dims['N']}, D={dims['D']}, S]; got {dims['ND']} rows"
        )
    check_formats(call, "attention", (QuantizationType.NONE, QuantizationType.STATIC, QuantizationType.MX))
    static = call.params["quantization_type"] == QuantizationType.STATIC
    require_scales(call, ("input_scales", "weight_scales") if static else (), ("input_scales", "weight_scales"))
    out_dtype = call.params["output_dtype"]
    if out_dtype is not None and jnp.dtype(out_dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{function}: `output_dtype` must be a floating dtype (float32, bfloat16, float16); got {out_dtype}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    if dims["B"] * dims["S"] > MAX_TOKENS:
        unmet.append(f"B * S = {dims['B'] * dims['S']} exceeds {MAX_TOKENS}")
    if dims["D"] > MAX_HEAD_DIM:
        unmet.append(f"head dim D={dims['D']} exceeds {MAX_HEAD_DIM}")
    if dims["H"] > MAX_HIDDEN:
        unmet.append(f"H={dims['H']} exceeds {MAX_HIDDEN} (the kernel's validated limit)")
    if dims["N"] > MAX_HEADS:
        unmet.append(f"N={dims['N']} heads exceeds {MAX_HEADS} (the kernel's validated limit)")
    if dims["H"] % call.lnc:
        unmet.append(f"H={dims['H']} must be divisible by LNC={call.lnc}")
    return unmet


def _outputs(call: CallInfo):
    """``out [B, S, H]``: bfloat16 for MX, else ``output_dtype`` (default: the attention's dtype)."""
    p = call.params
    if p["quantization_type"] == QuantizationType.MX:
        dtype = jnp.bfloat16
    else:
        dtype = call.avals["attention"].dtype if p["output_dtype"] is None else p["output_dtype"]
    return [("out", call.shape("B, S, H"), dtype)]


def _by_format(mx_layout: str, layout: str) -> dict:
    return {q: mx_layout if q == QuantizationType.MX else layout for q in QuantizationType}


OUTPUT_PROJECTION_CTE_SPEC = KernelSpec(
    name="output_projection_cte",
    entry_point="nkilib.core.output_projection.output_projection_cte.output_projection_cte:output_projection_cte",
    operands=(
        Operand.of("attention", "B, N, D, S", doc="attention output, heads before the sequence"),
        Operand.switched(
            "weight",
            "quantization_type",
            _by_format("ND4, H", "ND, H"),
            dtypes=FLOAT_DTYPES + FP8_WEIGHT_DTYPES + (MX_WORDS,),
            doc="[N * D, H]; FP8 for STATIC; MX: [N * D / 4, H] uint16 x4 words",
            device_dtype=lambda params, dtype: "float4_e2m1fn_x4" if dtype == MX_WORDS else None,
        ),
        Operand.of("bias", "1, H", optional=True),
        Operand.of("input_scales", "128, 1", dtypes=(jnp.float32,), optional=True, doc="STATIC input scale"),
        Operand.switched(
            "weight_scales",
            "quantization_type",
            _by_format("NDS, H", "128, 1"),
            dtypes=(jnp.float32, jnp.uint8),
            optional=True,
            doc="STATIC weight scale; MX: [N * D / 32, H] uint8",
        ),
    ),
    params=(
        Param("quantization_type", QuantizationType.NONE, QuantizationType, "NONE, STATIC (FP8) or MX (MXFP4)"),
        Param("output_dtype", None, "dtype", "output dtype (default: the attention's)"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_output_projection_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {"attention": "B", "weight": None, "bias": None, "input_scales": None, "weight_scales": None},
            outputs={"out": 0},
        ),
    ),
    neuron_split_dims=("B", "S"),
    mac_count=lambda call: call.dims["B"] * call.dims["S"] * call.dims["N"] * call.dims["D"] * call.dims["H"],
    family="projection",
    catalog="1.13",
    support={
        "idiomatic": "output_projection",
        "vjp": "JAX (differentiates the reference; FP8 operands get no cotangent)",
        "notes": f"NONE, FP8 STATIC and MX (MXFP4 weights); STATIC_MX not bound. Neuron: D <= {MAX_HEAD_DIM}, "
        f"N <= {MAX_HEADS}, H <= {MAX_HIDDEN}, B*S <= {MAX_TOKENS}, H % LNC == 0",
    },
)

output_projection_cte = make_kernel(OUTPUT_PROJECTION_CTE_SPEC, vjp=differentiable_vjp)
