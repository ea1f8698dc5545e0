"""``jax_nkilib.nki.mlp`` (catalog 1.9): the NKI Library's fused MLP kernel (``nkilib.core.mlp.mlp``, tag 2.29).

Math, per token row (``T = B*S`` rows of ``hidden_tensor [B, S, H]``)::

    x = hidden [+ fused_add]                  -> the second output ``add_out`` when store_fused_add_result
    n = norm(x)                               RMS_NORM: x rsqrt(mean x^2 + eps) g; RMS_NORM_SKIP_GAMMA: without g;
                                              LAYER_NORM: (x - mean) rsqrt(var + eps) g [+ b]; NO_NORM: x
    gate = clamp_g(n Wg [+ bg]); up = clamp_u(n Wu [+ bu])    clamp: min(., upper) then max(., lower)
    h = act(gate) * up                        (skip_gate_proj: h = act(up); Wg is not read)
    out = h Wd [+ bd]

Activations: SiLU ``x sigmoid(x)``; GELU (erf); GELU_Tanh_Approx; Swish, which in this kernel is
``nl.gelu_apprx_sigmoid`` = ``x sigmoid(1.702 x)`` (not SiLU); ReLU (kernel 2.32+).

Layouts: weights ``Wg, Wu [H, I]``, ``Wd [I, H]``; biases ``[1, I]`` / ``[1, H]``; norm weight and bias ``[1, H]``;
FP8 dequantization scales ``[128, I]`` (gate/up) and ``[128, H]`` (down) for ROW, ``[128, 1]`` for STATIC; input
scales ``[128, 1]``. The 128 rows of a scale are the kernel's per-partition copies of one vector and must be equal;
row 0 is used. ``use_tkg_down_proj_optimized_layout`` takes ``Wd`` in the kernel's LNC-dependent swizzle (see
``math.unswizzle_down``). Outputs ``out [B, S, H]`` and, with ``store_fused_add_result``, ``add_out [B, S, H]``, both
of ``output_dtype`` (default: the hidden dtype).

Dispatch and numerics. ``B*S <= 96`` and not ``force_cte_mode`` runs the TKG path, otherwise CTE; the reference
models the path that runs (``math`` lists the rounding points). The paths differ: CTE computes float32 inputs in
bfloat16 (``compute_data_type``; ``float32_compute="float32"``, jax_nkilib's own param that the kernel never sees,
makes the reference compute them in float32, as ``jax_nkilib.mlp`` asks by default), and only CTE quantizes
activations for FP8 weights. FP8 (ROW, STATIC): weights
are ``float8_e4m3`` (Trainium2, max 240) or ``float8_e4m3fn`` (the kernel reads it as ``float8_e4m3`` before
Trainium3: the encodings agree up to 240); the projection is ``(a W) * w_scale * a_scale``.
TKG keeps activations in the compute dtype (``a_scale = 1``, in-scales unused); CTE quantizes the gate/up input and
the intermediate to the consuming weight's FP8 format (ROW: per row, ``d = max(absmax/240, 1e-6)`` after clipping
to ``quant_clipping_bound`` when > 0; STATIC: ``clip(a / in_scale, +-240)``), see ``math.quantize_activation``.

MX (``quantization_type=MX``, the kernel's ``mlp_tkg_mx``; TKG only, so B*S <= 96 and not force_cte_mode; RMS_NORM,
RMS_NORM_SKIP_GAMMA or NO_NORM; no fused_add, no use_tkg_down_proj_optimized_layout). Weights are x4 words
(``float8_e4m3fn_x4`` / ``float8_e5m2_x4``: uint32 or int32, byte ``j`` = lane ``j``; ``float4_e2m1fn_x4``:
uint16, nibble ``j`` = lane ``j``), their element type given by ``mx_weight_dtype`` (the x4 dtype the kernel reads),
with dense uint8 e8m0 scales, one per 8 partitions x 4 lanes (``value = element * 2**(scale - 127)``):

* gate/up ``[128, H/512, I]``, scales ``[16, H/512, I]``: lane ``j`` of word ``[p, t, i]`` is ``W[j H/4 + 128 t + p,
  i]``; H % 512 == 0;
* down ``[P_I, ceil(I/512), H]``, scales ``[P_I/8, ceil(I/512), H]`` with ``P_I = min(128, I/4)``: lane ``j`` of word
  ``[q, k, h]`` is ``W[512 k + j R_k + q, h]``, ``R_k`` = (size of I tile ``k``) / 4, rows ``q >= R_k`` of a partial
  last tile are padding; I % 32 == 0;
* gate/up biases ``[P_I, ceil(I/512), 4]`` in the same (q, k, j) order over I; down bias ``[1, H]``.

The kernel quantizes the activations online to MXFP8 ``float8_e4m3fn`` (``nisa.quantize_mx``, OCP scale rule,
:mod:`jax_nkilib._src.quant.mx`): the gate/up input in the layout of the gate/up words (blocks of 8 consecutive
``p`` x the 4 lanes of one token and tile) and the intermediate (after its rounding to the compute dtype) in the
down words' layout; the matmuls are exact products of the decoded values accumulated in float32 (oracle:
``test_mlp_common.norm_mlp_ref_mx``, ``_gate_up_proj_golden_mx``, ``_down_proj_golden_mx``). Neuron needs bfloat16
or float16 hidden states (``quantize_mx``'s inputs); the reference quantizes float32 ones as they are.

STATIC_MX (the kernel's "FP8 tensor-wise quantization with 4x perf mode", CTE only: B*S > 96 or force_cte_mode) is
STATIC with float8 weights in the kernel's swizzles (H % 512 == I % 512 == 0), see ``math.unswizzle_static_mx_gate_up``
and ``math.unswizzle_static_mx_down``: gate/up ``W.reshape(2, H/512, 128, 2, I/512, 128, 4).transpose(2, 1, 4, 6, 5,
0, 3).reshape(H, I)``, down ``W.reshape(I/512, 128, 4, H).transpose(1, 0, 3, 2).reshape(I, H)``; scales as STATIC
(``[128, 1]`` weight and input scales); the activations are quantized as STATIC; the raw projections accumulate in
bfloat16 (rounded once in the reference; the kernel's partial-sum roundings are not modelled).

Not bound: ROW_MX (not in the 2.29 kernel's supported quantization types; a TKG path with x4 words in 2.32+), the
2.32+ ``gate_up_w_layout`` (``MLPGateUpWeightLayout``) parameter and its swizzles, FP8 pre-quantized
hidden input (``[B, S, H+4]`` with a packed row scale), ``[T, H]`` and SBUF
hidden layouts, and ``store_output_in_sbuf`` (there is no SBUF in JAX; ``True`` is rejected).

Reverse mode: JAX math. The backward is ``jax.vjp`` of ``math.mlp_forward(exact=True)`` (the same math without the
roundings; activation quantization, FP8 and MX alike, is the identity, a straight-through estimate). Gradients flow
to the hidden state, fused add, weights, biases, norm weight and bias, and the FP8 (ROW, STATIC, STATIC_MX)
dequantization scales (row 0); FP8 and MX weights, MX scales and the static input scales get none.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..framework.common_types import ActFnType, NormType, QuantizationType
from ..framework.hardware import PARTITIONS
from ..framework.precision import FLOAT32_COMPUTE_PARAM, bfloat16_compute_note, computes_in_bfloat16
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import FLOAT_DTYPES, NEURON_FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..quant import mx
from ..quant.fp8 import FP8_WEIGHT_DTYPES
from .mlp_reference import (
    MX_TILE,
    STATIC_MX_TILE,
    STATIC_TYPES,
    TKG_TOKEN_THRESHOLD,
    is_tkg,
    mlp_forward,
)

UNBOUND_MX_TYPES = (QuantizationType.ROW_MX,)
MX_WORD_DTYPES = (jnp.dtype(jnp.uint32), jnp.dtype(jnp.int32), jnp.dtype(jnp.uint16))
MX_WEIGHT_DTYPES = tuple(mx.X4_WORD_DTYPES)
SCALES = ("gate_w_scale", "up_w_scale", "down_w_scale")
IN_SCALES = ("gate_up_in_scale", "down_in_scale")
CLAMPS = ("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit", "up_clamp_lower_limit")


def _by_quantization(row: str, other: str, mx_layout: str | None = None) -> dict:
    cases = {member: (row if member == QuantizationType.ROW else other) for member in QuantizationType}
    return cases if mx_layout is None else {**cases, QuantizationType.MX: mx_layout}


def reference_mlp(
    hidden_tensor,
    gate_proj_weights_tensor,
    up_proj_weights_tensor,
    down_proj_weights_tensor,
    normalization_weights_tensor=None,
    gate_proj_bias_tensor=None,
    up_proj_bias_tensor=None,
    down_proj_bias_tensor=None,
    normalization_bias_tensor=None,
    fused_add_tensor=None,
    gate_w_scale=None,
    up_w_scale=None,
    down_w_scale=None,
    gate_up_in_scale=None,
    down_in_scale=None,
    *,
    lnc=1,
    **params,
):
    """JAX reference of the ``mlp`` kernel: ``(out,)`` or ``(out, add_out)``."""
    ops = dict(locals())
    out, add_out = mlp_forward(ops, params, exact=False, lnc=lnc)
    dtype = params["output_dtype"]
    return (out.astype(dtype),) + (() if add_out is None else (add_out.astype(dtype),))


def _tkg(call: CallInfo) -> bool:
    return is_tkg(call.dims["B"] * call.dims["S"], call.params["force_cte_mode"])


def _reject_unbound(params, function: str) -> None:
    quant = params["quantization_type"]
    if quant in UNBOUND_MX_TYPES:
        raise ValueError(
            f"{function}: quantization_type={quant.name} is not bound in jax_nkilib (the pinned NKI "
            "Library 2.29 mlp does not support it); use NONE, ROW, STATIC, STATIC_MX (CTE) or MX (TKG)"
        )
    if params["store_output_in_sbuf"]:
        raise ValueError(
            f"{function}: store_output_in_sbuf=True is not applicable in JAX (there is no SBUF to leave "
            "the output in); the output is returned"
        )


def _check_mx(call: CallInfo, weights: list[str]) -> None:
    """MX (TKG only): x4 words of ``mx_weight_dtype``, uint8 scales, RMS or no norm, no fused add."""
    avals, p, function, dims = call.avals, call.params, call.function, call.dims
    if not _tkg(call):
        raise ValueError(
            f"{function}: quantization_type=MX runs only on the TKG path (B*S <= 96, force_cte_mode="
            f"False); got B*S={dims['B'] * dims['S']}, force_cte_mode={p['force_cte_mode']}"
        )
    if p["normalization_type"] == NormType.LAYER_NORM:
        raise ValueError(
            f"{function}: quantization_type=MX supports RMS_NORM, RMS_NORM_SKIP_GAMMA or NO_NORM, not LAYER_NORM"
        )
    if avals.get("fused_add_tensor") is not None:
        raise ValueError(f"{function}: quantization_type=MX does not support fused_add_tensor")
    if p["use_tkg_down_proj_optimized_layout"]:
        raise ValueError(
            f"{function}: quantization_type=MX takes down weights [P_I, ceil(I/512), H], not "
            "use_tkg_down_proj_optimized_layout"
        )
    fmt = np.dtype(p["mx_weight_dtype"])
    if fmt not in MX_WEIGHT_DTYPES:
        raise TypeError(
            f"{function}: mx_weight_dtype must be one of {', '.join(map(str, MX_WEIGHT_DTYPES))}; got {fmt}"
        )
    words = mx.X4_WORD_DTYPES[fmt]
    wrong = [f"{name} ({avals[name].dtype})" for name in weights if np.dtype(avals[name].dtype) not in words]
    if wrong:
        raise TypeError(
            f"{function}: quantization_type=MX with mx_weight_dtype={fmt} needs x4 words of dtype "
            f"{' or '.join(map(str, words))} (gate/up [128, H/512, I], down [P_I, ceil(I/512), H]); got "
            f"{', '.join(wrong)}"
        )
    needed = [name for name in SCALES if not (name == "gate_w_scale" and p["skip_gate_proj"])]
    missing = [name for name in needed if avals.get(name) is None]
    if missing:
        raise ValueError(
            f"{function}: quantization_type=MX needs {', '.join(missing)} (uint8, gate/up [16, H/512, I], "
            "down [P_I/8, ceil(I/512), H])"
        )
    wrong = [f"{name} ({avals[name].dtype})" for name in needed if np.dtype(avals[name].dtype) != np.uint8]
    if wrong:
        raise TypeError(f"{function}: quantization_type=MX needs uint8 scales; got {', '.join(wrong)}")
    given = [name for name in IN_SCALES if avals.get(name) is not None]
    if given:
        raise ValueError(f"{function}: {', '.join(given)} are STATIC input scales; MX quantizes activations itself")
    inter = dims["I"]
    if inter % mx.BLOCK_SIZE:
        raise ValueError(f"{function}: quantization_type=MX needs I % 32 == 0; got I={inter}")
    rows, tiles = min(128, inter // 4), -(-inter // MX_TILE)
    if (dims["PI"], dims["NI"]) != (rows, tiles):
        raise ValueError(
            f"{function}: down_proj_weights_tensor must be [P_I, ceil(I/512), H] = [{rows}, {tiles}, "
            f"{dims['H']}] for I={inter} (P_I = min(128, I/4)); got "
            f"{tuple(avals['down_proj_weights_tensor'].shape)}"
        )


def _check_quantization(call: CallInfo) -> None:
    avals, p, function = call.avals, call.params, call.function
    quant = p["quantization_type"]
    weights = [
        name
        for name in ("gate_proj_weights_tensor", "up_proj_weights_tensor", "down_proj_weights_tensor")
        if not (name == "gate_proj_weights_tensor" and p["skip_gate_proj"])
    ]
    if quant == QuantizationType.MX:
        return _check_mx(call, weights)
    mx_words = [name for name in weights if np.dtype(avals[name].dtype) in MX_WORD_DTYPES]
    if mx_words:
        raise TypeError(f"{function}: integer (MX x4 word) weights ({', '.join(mx_words)}) need quantization_type=MX")
    uint8 = [name for name in SCALES if avals.get(name) is not None and np.dtype(avals[name].dtype) == np.uint8]
    if uint8:
        raise TypeError(
            f"{function}: uint8 scales ({', '.join(uint8)}) are MX scales; quantization_type="
            f"{quant.name} takes float32 scales"
        )
    if quant == QuantizationType.NONE:
        fp8 = [name for name in weights if np.dtype(avals[name].dtype) in FP8_WEIGHT_DTYPES]
        if fp8:
            raise TypeError(
                f"{function}: FP8 weights ({', '.join(fp8)}) need quantization_type=ROW, STATIC or "
                "STATIC_MX and their dequantization scales"
            )
        given = [name for name in SCALES + IN_SCALES if avals.get(name) is not None]
        if given:
            raise ValueError(
                f"{function}: {', '.join(given)} are only used with quantization_type ROW, STATIC or STATIC_MX"
            )
        return
    wrong = [
        f"{name} ({avals[name].dtype})" for name in weights if np.dtype(avals[name].dtype) not in FP8_WEIGHT_DTYPES
    ]
    if wrong:
        raise TypeError(
            f"{function}: quantization_type={quant.name} needs float8_e4m3 or float8_e4m3fn weights; got "
            f"{', '.join(wrong)}"
        )
    layout = "[128, I] (gate, up) and [128, H] (down)" if quant == QuantizationType.ROW else "[128, 1]"
    needed = [name for name in SCALES if not (name == "gate_w_scale" and p["skip_gate_proj"])]
    if quant in STATIC_TYPES:
        needed += list(IN_SCALES)
    missing = [name for name in needed if avals.get(name) is None]
    if missing:
        raise ValueError(
            f"{function}: quantization_type={quant.name} needs {', '.join(missing)} (float32, weight "
            f"scales {layout}, input scales [128, 1])"
        )
    if quant == QuantizationType.ROW:
        given = [name for name in IN_SCALES if avals.get(name) is not None]
        if given:
            raise ValueError(
                f"{function}: {', '.join(given)} are STATIC input scales; ROW quantization computes row scales itself"
            )
    if quant == QuantizationType.STATIC_MX:
        _check_static_mx(call)


def _check_static_mx(call: CallInfo) -> None:
    """STATIC_MX: CTE only; the swizzled weights need H and I multiples of 512."""
    p, dims, function = call.params, call.dims, call.function
    if _tkg(call):
        raise ValueError(
            f"{function}: quantization_type=STATIC_MX runs only on the CTE path (B*S > 96 or "
            f"force_cte_mode=True); got B*S={dims['B'] * dims['S']}, force_cte_mode={p['force_cte_mode']}"
        )
    if dims["H"] % STATIC_MX_TILE or dims["I"] % STATIC_MX_TILE:
        raise ValueError(
            f"{function}: quantization_type=STATIC_MX takes swizzled weights (gate/up [H, I] as "
            "[128, H/512, I/512, 4, 128, 2, 2], down [I, H] as [128, I/512, H, 4]) and needs H % 512 == 0 "
            f"and I % 512 == 0; got H={dims['H']}, I={dims['I']}"
        )


def _check(call: CallInfo) -> None:
    avals, p, function = call.avals, call.params, call.function
    _reject_unbound(p, function)
    norm = p["normalization_type"]
    if norm in (NormType.RMS_NORM, NormType.LAYER_NORM) and avals.get("normalization_weights_tensor") is None:
        raise ValueError(f"{function}: normalization_type={norm.name} needs normalization_weights_tensor [1, H]")
    if avals.get("normalization_bias_tensor") is not None and norm != NormType.LAYER_NORM:
        raise ValueError(
            f"{function}: normalization_bias_tensor is only supported with LAYER_NORM; got "
            f"normalization_type={norm.name}"
        )
    if p["store_fused_add_result"] and avals.get("fused_add_tensor") is None:
        raise ValueError(f"{function}: store_fused_add_result=True needs fused_add_tensor [B, S, H]")
    if not jnp.issubdtype(p["output_dtype"], jnp.floating) or np.dtype(p["output_dtype"]) not in FLOAT_DTYPES:
        raise TypeError(
            f"{function}: output_dtype must be one of float32, bfloat16, float16, float64; got {p['output_dtype']}"
        )
    if p["use_tkg_down_proj_optimized_layout"]:
        if not _tkg(call) or p["use_tkg_down_proj_column_tiling"]:
            raise ValueError(
                f"{function}: use_tkg_down_proj_optimized_layout needs the TKG path (B*S <= 96, "
                "force_cte_mode=False) with use_tkg_down_proj_column_tiling=False"
            )
        if call.dims["H"] % (128 * call.lnc):
            raise ValueError(
                f"{function}: use_tkg_down_proj_optimized_layout needs H % (128 * LNC) == 0; got "
                f"H={call.dims['H']}, LNC={call.lnc}"
            )
    _check_quantization(call)


def _neuron_limits(call: CallInfo) -> list[str]:
    p, dims, unmet = call.params, call.dims, []
    if dims["H"] % PARTITIONS:
        unmet.append(f"H={dims['H']} must be a multiple of {PARTITIONS}")
    if _tkg(call):
        if call.lnc == 2 and (dims["H"] // PARTITIONS) % 2:
            unmet.append(f"TKG at LNC=2 splits H/{PARTITIONS}={dims['H'] // PARTITIONS} over 2 cores: it must be even")
    else:
        if any(p[name] is not None for name in CLAMPS):
            unmet.append("gate/up clamps run only on the TKG path (B*S <= 96, force_cte_mode=False)")
        if p["quantization_type"] != QuantizationType.NONE and call.avals.get("down_proj_bias_tensor") is not None:
            unmet.append("the CTE path has no down projection bias with FP8 quantization")
    if p["quantization_type"] == QuantizationType.MX:
        if np.dtype(call.avals["hidden_tensor"].dtype) not in MX_HIDDEN_DTYPES:
            unmet.append("MX quantizes the hidden state with nisa.quantize_mx, which takes bfloat16 or float16")
        if (dims["H"] // MX_TILE) % call.lnc:
            unmet.append(f"MX at LNC={call.lnc} splits H/512={dims['H'] // MX_TILE} tiles over the cores")
    if p["activation_fn"] == ActFnType.ReLU:
        unmet.append("ReLU needs NKI Library 2.32 (2.29's mlp has SiLU, GELU, GELU_Tanh_Approx, Swish)")
    if np.dtype(p["output_dtype"]) not in NEURON_FLOAT_DTYPES:
        unmet.append(f"output_dtype {p['output_dtype']} is not a Neuron dtype")
    return unmet


def _neuron_notes(call: CallInfo) -> list[str]:
    """The CTE path computes float32 inputs in bfloat16 (the reference follows ``float32_compute``)."""
    if not computes_in_bfloat16(call.avals["hidden_tensor"].dtype, _tkg(call)):
        return []
    return [bfloat16_compute_note("mlp's CTE path", call.params["float32_compute"])]


def _mlp_vjp(kernel, operands, params, outs, cotangents):
    """Backward by ``jax.vjp`` of the smooth math (``mlp_forward(exact=True)``) at the call's operands."""
    skip = {"gate_proj_weights_tensor", "gate_w_scale"} if params["skip_gate_proj"] else set()
    names = [
        name
        for name, value in operands.items()
        if value is not None and name not in skip and name not in IN_SCALES and np.dtype(value.dtype) in FLOAT_DTYPES
    ]

    def smooth(named):
        out, add_out = mlp_forward(named, params, exact=True, lnc=params["lnc"])
        return (out,) if add_out is None else (out, add_out)

    return pull_back(smooth, operands, names, cotangents)


def _mac_count(call: CallInfo) -> int:
    projections = 2 if call.params["skip_gate_proj"] else 3
    return projections * call.dims["B"] * call.dims["S"] * call.dims["H"] * call.dims["I"]


MX_HIDDEN_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_WEIGHT_DTYPES = FLOAT_DTYPES + FP8_WEIGHT_DTYPES + MX_WORD_DTYPES
_F32 = (jnp.float32,)
_SCALE_DTYPES = (jnp.float32, jnp.uint8)
_MX_GATE_UP = "128, H/512, I"  # x4 words; lane j of [p, t, i] is W[j H/4 + 128 t + p, i]
_MX_DOWN = "PI, NI, H"  # x4 words; P_I = min(128, I/4), NI = ceil(I/512); lanes along I (math.mx_inter_index)
_MX_GU_BIAS = "PI, NI, 4"


def _mx_device_dtype(params, dtype) -> str | None:
    """MX weights reach the kernel as the x4 type of ``mx_weight_dtype`` (``float8_e4m3fn_x4``...), the dtype the
    kernel reads their element type from; other weights as they are."""
    return f"{params['mx_weight_dtype'].name}_x4" if dtype in MX_WORD_DTYPES else None


def _prepare(function, operands, params):
    """Refuse the formats not bound, and resolve ``output_dtype=None`` to the hidden dtype."""
    _reject_unbound(params, function)
    if params["output_dtype"] is None:
        params["output_dtype"] = np.dtype(jnp.asarray(operands["hidden_tensor"]).dtype)
    return operands, params


MLP_SPEC = KernelSpec(
    name="mlp",
    entry_point="nkilib.core.mlp.mlp:mlp",
    operands=(
        Operand.of("hidden_tensor", "B, S, H", doc="input hidden states"),
        Operand.switched(
            "gate_proj_weights_tensor",
            "quantization_type",
            _by_quantization("H, I", "H, I", _MX_GATE_UP),
            dtypes=_WEIGHT_DTYPES,
            doc="gate projection (unread when skip_gate_proj)",
            device_dtype=_mx_device_dtype,
        ),
        Operand.switched(
            "up_proj_weights_tensor",
            "quantization_type",
            _by_quantization("H, I", "H, I", _MX_GATE_UP),
            dtypes=_WEIGHT_DTYPES,
            doc="up projection",
            device_dtype=_mx_device_dtype,
        ),
        Operand.switched(
            "down_proj_weights_tensor",
            "quantization_type",
            _by_quantization("I, H", "I, H", _MX_DOWN),
            dtypes=_WEIGHT_DTYPES,
            doc="down projection",
            device_dtype=_mx_device_dtype,
        ),
        Operand.of("normalization_weights_tensor", "1, H", optional=True, doc="RMS/Layer norm gamma"),
        Operand.switched(
            "gate_proj_bias_tensor", "quantization_type", _by_quantization("1, I", "1, I", _MX_GU_BIAS), optional=True
        ),
        Operand.switched(
            "up_proj_bias_tensor", "quantization_type", _by_quantization("1, I", "1, I", _MX_GU_BIAS), optional=True
        ),
        Operand.of("down_proj_bias_tensor", "1, H", optional=True),
        Operand.of("normalization_bias_tensor", "1, H", optional=True, doc="LayerNorm beta"),
        Operand.of("fused_add_tensor", "B, S, H", optional=True, doc="residual added to hidden first"),
        Operand.switched(
            "gate_w_scale",
            "quantization_type",
            _by_quantization("128, I", "128, 1", "16, H/512, I"),
            dtypes=_SCALE_DTYPES,
            optional=True,
            doc="gate dequantization scale (ROW [128, I], STATIC [128, 1]; MX uint8 [16, H/512, I])",
        ),
        Operand.switched(
            "up_w_scale",
            "quantization_type",
            _by_quantization("128, I", "128, 1", "16, H/512, I"),
            dtypes=_SCALE_DTYPES,
            optional=True,
            doc="up dequantization scale (ROW [128, I], STATIC [128, 1]; MX uint8 [16, H/512, I])",
        ),
        Operand.switched(
            "down_w_scale",
            "quantization_type",
            _by_quantization("128, H", "128, 1", "PI/8, NI, H"),
            dtypes=_SCALE_DTYPES,
            optional=True,
            doc="down dequantization scale (ROW [128, H], STATIC [128, 1]; MX uint8 [P_I/8, NI, H])",
        ),
        Operand.of("gate_up_in_scale", "128, 1", dtypes=_F32, optional=True, doc="STATIC gate/up input scale"),
        Operand.of("down_in_scale", "128, 1", dtypes=_F32, optional=True, doc="STATIC down input scale"),
    ),
    params=(
        Param("store_fused_add_result", False, bool, "also return hidden + fused_add"),
        Param("activation_fn", ActFnType.SiLU, ActFnType),
        Param("normalization_type", NormType.NO_NORM, NormType),
        Param(
            "quantization_type",
            QuantizationType.NONE,
            QuantizationType,
            "NONE, ROW, STATIC, STATIC_MX (CTE, swizzled FP8 weights) or MX (TKG); ROW_MX not bound",
        ),
        Param(
            "mx_weight_dtype",
            "float8_e4m3fn",
            "dtype",
            "MX: the x4 weights' element type (the kernel reads it "
            "from the x4 dtype): float8_e4m3fn or float8_e5m2 (32-bit words), float4_e2m1fn (uint16 words)",
            to_kernel=False,
        ),
        Param("quant_clipping_bound", 0.0, float, "CTE ROW activation clip (0: none)"),
        Param("output_dtype", None, "dtype", "default: the hidden dtype"),
        Param("store_output_in_sbuf", False, bool, "not applicable in JAX (must be False)"),
        Param("eps", 1e-6, float),
        Param("skip_gate_proj", False, bool, "h = act(up)"),
        Param("use_tkg_gate_up_proj_column_tiling", True, bool, "TKG tiling (no numeric effect)"),
        Param("use_tkg_down_proj_column_tiling", True, bool, "TKG tiling (no numeric effect)"),
        Param("use_tkg_down_proj_optimized_layout", False, bool, "down weights in the kernel's swizzled layout"),
        Param("gate_clamp_upper_limit", None, float),
        Param("gate_clamp_lower_limit", None, float),
        Param("up_clamp_upper_limit", None, float),
        Param("up_clamp_lower_limit", None, float),
        Param("force_cte_mode", False, bool, "run the CTE path even when B*S <= 96"),
        FLOAT32_COMPUTE_PARAM,
    ),
    outputs=(),
    output_avals=lambda call: [
        (name, call.shape("B, S, H"), call.params["output_dtype"])
        for name in ("out", "add_out")[: 2 if call.params["store_fused_add_result"] else 1]
    ],
    prepare=_prepare,
    reference=reference_mlp,
    reference_takes_lnc=True,
    check=_check,
    neuron_limits=_neuron_limits,
    neuron_notes=_neuron_notes,
    # Rows are independent, but folding a vmapped axis into B changes B*S and may switch TKG -> CTE (different
    # numerics): fold only calls that already run CTE; TKG calls run per element under lax.map.
    fold_plans=(
        FoldPlan(
            {"hidden_tensor": "B", "fused_add_tensor": "B"},
            outputs={"out": 0, "add_out": 0},
            when=lambda call: not _tkg(call),
        ),
    ),
    mac_count=_mac_count,
    family="mlp",
    catalog="1.9",
    support={
        "idiomatic": "mlp",
        "vjp": "JAX (jax.vjp of the smooth MLP math; straight-through FP8 activation quantization)",
        "notes": f"CTE/TKG dispatch at B*S = {TKG_TOKEN_THRESHOLD} (CTE computes float32 in bfloat16; "
        "jax_nkilib.mlp in float32 off Neuron unless asked); FP8 ROW/STATIC; "
        "MX (MXFP8/MXFP4 x4 weights, TKG); STATIC_MX (swizzled FP8 weights, CTE); ROW_MX, "
        f"gate_up_w_layout (2.32), pre-quantized input and SBUF output not bound; Neuron: H % {PARTITIONS}, "
        "clamps TKG only",
    },
)


mlp = make_kernel(MLP_SPEC, vjp=_mlp_vjp)

__all__ = ["MLP_SPEC", "mlp", "reference_mlp"]
