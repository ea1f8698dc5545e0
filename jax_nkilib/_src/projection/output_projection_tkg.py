"""``output_projection_tkg`` (catalog 1.14): ``out = attention · weight (+ bias)`` for decode (small ``B * S``).

Layouts: ``attention [D, B, N, S]`` (head dim first), ``weight [N * D, H]`` (row ``n * D + d``), ``bias [1, H]``;
``STATIC``: ``weight_scale``, ``input_scale [128, 1]`` float32 (element ``[0, 0]``); ``ROW``: ``weight_scale [128,
H]`` float32 (row 0: one scale per output column; the kernel wants all 128 rows equal), no ``input_scale``.

Output ``[B * S, H]`` with row ``b * S + s``; with ``TRANSPOSE_OUT=True`` ``[128, LNC, H / LNC / 128, B * S]``
holding ``out[h1, h0, h2, t] = out_flat[t, h0 * 128 * H2 + h1 * H2 + h2]`` (``H2 = H / LNC / 128``): the shape
depends on the LNC degree the call is made under. Dtype: the attention's.

Quantization (see ``output_math``): ``STATIC`` rounds ``attention / in_scale`` to the attention's dtype, clamps it to
the largest finite value of the weights' FP8 format and casts it to that format; ``ROW`` does not quantize the
attention. ``OUT_IN_SB=True`` (output left in SBUF for a fusing caller) has no meaning for a JAX call and is rejected.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import QuantizationType
from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..quant.fp8 import FP8_WEIGHT_DTYPES, fp8_max
from .matmul_numerics import differentiable_vjp
from .output_projection_reference import MAX_HEAD_DIM, check_formats, project, require_scales

MAX_TOKENS = 128  # B * S: the decode kernel's token limit


def transposed_out(out, lnc: int):
    """``[B * S, H]`` -> the ``TRANSPOSE_OUT`` layout ``[128, LNC, H / LNC / 128, B * S]``."""
    tokens, hidden = out.shape
    return jnp.transpose(out.reshape(tokens, lnc, 128, hidden // (lnc * 128)), (2, 1, 3, 0))


def reference_output_projection_tkg(
    attention,
    weight,
    bias=None,
    weight_scale=None,
    input_scale=None,
    *,
    quantization_type=QuantizationType.NONE,
    TRANSPOSE_OUT=False,
    OUT_IN_SB=False,
    lnc=1,
):
    """JAX reference on the attention's kernel layout ``[D, B, N, S]``."""
    del OUT_IN_SB
    d, _, n, _ = attention.shape
    out = project(
        attention,
        "dbns,ndh->bsh",
        weight.reshape(n, d, weight.shape[1]),
        bias,
        quantization_type=quantization_type,
        input_scale=input_scale,
        weight_scale=weight_scale,
        fp8_dtype=weight.dtype,
        bound=fp8_max(weight.dtype) if weight.dtype in FP8_WEIGHT_DTYPES else None,
        round_scaled_input=True,
    )
    out = out.reshape(-1, out.shape[-1])
    return (transposed_out(out, lnc) if TRANSPOSE_OUT else out,)


def _check(call: CallInfo) -> None:
    dims, p, function = call.dims, call.params, call.function
    if dims["ND"] != dims["N"] * dims["D"]:
        raise ValueError(
            f"{function}: `weight` must be [N * D, H] = [{dims['N'] * dims['D']}, H] for attention "
            f"[D={dims['D']}, B, N={dims['N']}, S]; got {dims['ND']} rows"
        )
    allowed = (QuantizationType.NONE, QuantizationType.STATIC, QuantizationType.ROW)
    check_formats(call, "attention", allowed)
    qtype = p["quantization_type"]
    needed = {QuantizationType.STATIC: ("weight_scale", "input_scale"), QuantizationType.ROW: ("weight_scale",)}
    require_scales(call, needed.get(qtype, ()), ("weight_scale", "input_scale"))
    if call.avals.get("weight_scale") is not None:
        expected = dims["H"] if qtype == QuantizationType.ROW else 1
        if dims["WS"] != expected:
            raise ValueError(
                f"{function}: `weight_scale` must be [128, {'H' if expected > 1 else 1}] = [128, "
                f"{expected}] for quantization_type={qtype.name}; got [128, {dims['WS']}]"
            )
    if p["OUT_IN_SB"]:
        raise ValueError(
            f"{function}: OUT_IN_SB=True leaves the output in SBUF for a kernel that fuses this one; a "
            "JAX call returns HBM arrays, so it must be False"
        )
    if p["TRANSPOSE_OUT"] and dims["H"] % (128 * call.lnc):
        raise ValueError(
            f"{function}: TRANSPOSE_OUT gives [128, LNC, H / LNC / 128, B * S]: H={dims['H']} must be "
            f"a multiple of 128 * LNC = {128 * call.lnc}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    if dims["B"] * dims["S"] > MAX_TOKENS:
        unmet.append(f"B * S = {dims['B'] * dims['S']} exceeds {MAX_TOKENS}")
    if dims["D"] > MAX_HEAD_DIM:
        unmet.append(f"head dim D={dims['D']} exceeds {MAX_HEAD_DIM}")
    if dims["H"] % call.lnc:
        unmet.append(f"H={dims['H']} must be divisible by LNC={call.lnc}")
    if call.params["TRANSPOSE_OUT"]:
        cap = 81920 if jnp.dtype(call.avals["weight"].dtype) == jnp.float32 else 163840
        if dims["N"] * dims["H"] > cap:
            unmet.append(f"with TRANSPOSE_OUT, N * H = {dims['N'] * dims['H']} exceeds {cap}")
    return unmet


def _outputs(call: CallInfo):
    """``out [B * S, H]``, or ``[128, LNC, H / LNC / 128, B * S]`` with ``TRANSPOSE_OUT``, in the attention's
    dtype."""
    dims, lnc = call.dims, call.lnc
    tokens = dims["B"] * dims["S"]
    shape = (128, lnc, dims["H"] // lnc // 128, tokens) if call.params["TRANSPOSE_OUT"] else (tokens, dims["H"])
    return [("out", shape, call.avals["attention"].dtype)]


def _transposed(call: CallInfo) -> bool:
    return call.params["TRANSPOSE_OUT"]


_UNBATCHED = {"weight": None, "bias": None, "weight_scale": None, "input_scale": None}
OUTPUT_PROJECTION_TKG_SPEC = KernelSpec(
    name="output_projection_tkg",
    entry_point="nkilib.core.output_projection.output_projection_tkg:output_projection_tkg",
    operands=(
        Operand.of("attention", "D, B, N, S", doc="attention output, head dim first"),
        Operand.of("weight", "ND, H", dtypes=FLOAT_DTYPES + FP8_WEIGHT_DTYPES, doc="[N * D, H]; FP8 for STATIC/ROW"),
        Operand.of("bias", "1, H", optional=True),
        Operand.of(
            "weight_scale", "128, WS", dtypes=(jnp.float32,), optional=True, doc="[128, 1] (STATIC) or [128, H] (ROW)"
        ),
        Operand.of("input_scale", "128, 1", dtypes=(jnp.float32,), optional=True, doc="STATIC input scale"),
    ),
    params=(
        Param("quantization_type", QuantizationType.NONE, QuantizationType, "NONE, STATIC or ROW (FP8 weights)"),
        Param("TRANSPOSE_OUT", False, bool, "output [128, LNC, H / LNC / 128, B * S] instead of [B * S, H]"),
        Param("OUT_IN_SB", False, bool, "output in SBUF (for fusing kernels; must be False here)"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_output_projection_tkg,
    reference_takes_lnc=True,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan({"attention": "B", **_UNBATCHED}, outputs={"out": 0}, when=lambda c: not _transposed(c)),
        FoldPlan({"attention": "B", **_UNBATCHED}, outputs={"out": 3}, when=_transposed),
    ),
    mac_count=lambda call: call.dims["B"] * call.dims["S"] * call.dims["ND"] * call.dims["H"],
    family="projection",
    catalog="1.14",
    support={
        "idiomatic": "output_projection",
        "vjp": "JAX (differentiates the reference; FP8 operands get no cotangent)",
        "notes": "NONE, FP8 STATIC and ROW; TRANSPOSE_OUT shape follows the LNC degree; OUT_IN_SB rejected. "
        f"Neuron: B*S <= {MAX_TOKENS}, D <= {MAX_HEAD_DIM}, H % LNC == 0",
    },
)

output_projection_tkg = make_kernel(OUTPUT_PROJECTION_TKG_SPEC, vjp=differentiable_vjp)
