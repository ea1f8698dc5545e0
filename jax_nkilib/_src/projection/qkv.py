"""``qkv`` (catalog 1.15): fused residual add, RMS/Layer norm, QKV projection (+ bias, FP8 STATIC/ROW weights), fused
RoPE and the fused KV-cache write. The math is in :mod:`qkv_math`.

Layouts (the kernel's): ``input [B, S, H]``, ``fused_qkv_weights [H, I]`` (``I = (nq + 2 nkv) d``, columns ``[Q | K
| V]`` head-major), ``bias [1, I]``, ``qkv_w_scale`` ``[1 or 128, 3]`` (STATIC, one per Q/K/V) or ``[1 or 128, I]``
(ROW), ``qkv_in_scale [1 or 128, 1]`` (STATIC), ``mlp_prev``, ``attention_prev [B, S, H]``, ``gamma_norm_weights``,
``layer_norm_bias [1, H]``, ``cos_cache``, ``sin_cache [B, S, d]``; KV cache: ``k_cache``, ``v_cache [B, max_S, nkv
d]`` (flat) or ``[num_blocks, block_size, nkv d]`` (``use_block_kv``, with ``slot_mapping [B, S]`` int32),
``k_scale``, ``v_scale [128, 1]`` float32.

The NKI ``qkv`` dispatches on shapes: ``qkv_tkg`` when ``S <= 96``, ``B * S <= 128`` and no fused RoPE, else
``qkv_cte``. The paths return different things; ``jax_nkilib.nki.qkv`` is one primitive (lowering to the entry point
``nkilib.core.qkv.qkv:qkv``) whose outputs follow the path the call takes:

* CTE path: ``out`` (``BSD [B, S, I]``, ``NBSd [I/d, B, S, d]``, ``NBdS [I/d, B, d, S]``); bfloat16 for
  ``STATIC``, else the input's dtype. Float32 inputs compute in bfloat16 (the reference too, unless
  ``float32_compute="float32"``: jax_nkilib's own param, never passed to the kernel, which ``qkv_projection`` sets
  by default).
* TKG path: ``out`` in the input's dtype, and ``fused_hidden [B, S, H]`` (the residual sum) when
  ``fused_residual_add``.
* KV-cache write (CTE path with ``k_scale`` and ``v_scale``, the kernel's condition for the cache write):
  ``(q [B, S, nq d], k_cache, v_cache)``, the caches updated (aliased to the input caches on Neuron). The TKG path
  ignores caches, so a cache write with TKG shapes is an error; caches without scales are ignored by the kernel and
  are an error too (pass ``k_scale = v_scale = ones`` for an unscaled cache).

MX (``quantization_type=MX``, CTE path only): ``fused_qkv_weights [H/4, I]`` uint32 words of four
``float8_e4m3fn`` (``weight_layout=MX_CONTIGUOUS``: ``W[4k + j, i]`` in byte ``j`` of word ``[k, i]``), ``qkv_w_scale
[H/32, I]`` uint8 e8m0 (one per 32 consecutive ``H`` rows); the activations are MX-quantized on the fly along ``H``
(see ``qkv_math``). ``is_h_dim_4h_transposed=True`` (MX only, without norm or residual add) takes the input with
``H`` stored as ``[4, H/4]``: stored ``[j * H/4 + r]`` is logical ``[4r + j]``. The MX weights and scales get no
cotangent; the activations' gradient passes the quantization straight through.

Not bound (rejected with ``ValueError``): ``STATIC_MX`` and ``ROW_MX``; ``MX_INTERLEAVED`` (the kernel takes it only
on its DMA-transpose MX paths, with FP8 input or static dequant scales ``qkv_in_scale``, whose input interleave is
not emulated); FP8 input; ``store_output_in_sbuf``.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import NormType, QKVOutputLayout, QKVWeightLayout, QuantizationType
from ..framework.hardware import PARTITIONS
from ..framework.precision import FLOAT32_COMPUTE_PARAM, bfloat16_compute_note, computes_in_bfloat16
from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, FP8_DTYPES, INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..quant.fp8 import FP8_WEIGHT_DTYPES
from .matmul_numerics import differentiable_vjp
from .output_projection_reference import NOT_BOUND_FORMATS
from .qkv_reference import TKG_MAX_SEQ, TKG_MAX_TOKENS, head_dim, reference_qkv, uses_tkg

ENTRY_POINT = "nkilib.core.qkv.qkv:qkv"
_F32 = (jnp.float32,)
_MX_WORDS = jnp.dtype(jnp.uint32)  # float8_e4m3fn_x4 words
CTE_MAX_HIDDEN = 24576  # qkv_cte: H
CTE_MAX_WIDTH = 4096  # qkv_cte: I, the fused q/k/v width
NBSD_HEAD_DIM = 128  # qkv_cte: the one head_dim of output_layout=NBSd
_OPERANDS = {
    operand.name: operand
    for operand in (
        Operand.of("input", "B, S, H", doc="hidden states"),
        Operand.switched(
            "fused_qkv_weights",
            "quantization_type",
            {q: "H4, I" if q == QuantizationType.MX else "H, I" for q in QuantizationType},
            dtypes=FLOAT_DTYPES + FP8_WEIGHT_DTYPES + (_MX_WORDS,),
            doc="[H, (nq + 2 nkv) d]; MX: [H/4, I] uint32 x4 words",
            device_dtype=lambda params, dtype: "float8_e4m3fn_x4" if dtype == _MX_WORDS else None,
        ),
        Operand.of("bias", "1, I", optional=True),
        Operand.of(
            "qkv_w_scale",
            "WR, WC",
            dtypes=_F32 + (jnp.uint8,),
            optional=True,
            doc="[1|128, 3] STATIC, [1|128, I] ROW, [H/32, I] uint8 MX",
        ),
        Operand.of("qkv_in_scale", "IR, 1", dtypes=_F32, optional=True, doc="[1|128, 1] STATIC"),
        Operand.of("mlp_prev", "B, S, H", optional=True),
        Operand.of("attention_prev", "B, S, H", optional=True),
        Operand.of("gamma_norm_weights", "1, H", optional=True),
        Operand.of("layer_norm_bias", "1, H", optional=True),
        Operand.of("cos_cache", "B, S, d", optional=True),
        Operand.of("sin_cache", "B, S, d", optional=True),
        Operand.switched(
            "k_cache",
            "use_block_kv",
            {False: "B, max_S, KV", True: "n_blocks, block, KV"},
            dtypes=FLOAT_DTYPES + FP8_DTYPES,
            optional=True,
        ),
        Operand.switched(
            "v_cache",
            "use_block_kv",
            {False: "B, max_S, KV", True: "n_blocks, block, KV"},
            dtypes=FLOAT_DTYPES + FP8_DTYPES,
            optional=True,
        ),
        Operand.of("k_scale", "128, 1", dtypes=_F32, optional=True),
        Operand.of("v_scale", "128, 1", dtypes=_F32, optional=True),
        Operand.of("slot_mapping", "B, S", dtypes=INT_DTYPES, optional=True, doc="flat cache slot of each token"),
    )
}
KERNEL_ORDER = tuple(_OPERANDS)
CACHE_OPERANDS = ("k_cache", "v_cache", "k_scale", "v_scale", "slot_mapping")
_NO_CACHE = tuple(name for name in KERNEL_ORDER if name not in CACHE_OPERANDS)

_PARAMS = {
    param.name: param
    for param in (
        Param("output_layout", QKVOutputLayout.BSD, QKVOutputLayout, "BSD, NBSd or NBdS"),
        Param("quantization_type", QuantizationType.NONE, QuantizationType, "NONE, STATIC, ROW (FP8) or MX (CTE only)"),
        Param("fused_residual_add", False, bool, "add mlp_prev and attention_prev first"),
        Param("fused_norm_type", NormType.NO_NORM, NormType, "norm before the projection"),
        Param("norm_eps", 1e-6, float),
        Param("hidden_actual", None, int, "RMS norm divisor (unpadded H)"),
        Param("fused_rope", False, bool, "RoPE on the Q and K heads"),
        Param("d_head", None, int),
        Param("num_q_heads", None, int),
        Param("num_kv_heads", None, int),
        Param("fp8_max", None, float, "KV quantization clamp (default: largest value of kv_dtype)"),
        Param("fp8_min", None, float, "KV quantization clamp (default: -fp8_max)"),
        Param("kv_dtype", None, "dtype", "dtype of the caches (default: the input's)"),
        Param("use_block_kv", False, bool, "block cache addressed by slot_mapping"),
        Param("block_size", None, int, "tokens per cache block"),
        Param("store_output_in_sbuf", False, bool, "must be False"),
        Param("use_auto_allocation", False, bool, "SBUF allocation mode (no numeric effect)"),
        Param("load_input_with_DMA_transpose", True, bool, "load strategy (no numeric effect)"),
        Param("is_h_dim_4h_transposed", False, bool, "MX: input H stored as [4, H/4]"),
        Param("weight_layout", QKVWeightLayout.CONTIGUOUS, QKVWeightLayout, "CONTIGUOUS; MX_CONTIGUOUS for MX"),
        FLOAT32_COMPUTE_PARAM,
    )
}
_CACHE_REQUIRED = CACHE_OPERANDS[:4]
CACHE_PARAMS = ("fp8_max", "fp8_min", "kv_dtype", "use_block_kv", "block_size")


# ------------------------------------------------------------------------------------------------------ checks
def _heads(call: CallInfo):
    p = call.params
    return (
        p["num_q_heads"],
        p["num_kv_heads"],
        head_dim(p["d_head"], p["num_q_heads"], p["num_kv_heads"], call.dims["I"]),
    )


def _check_formats(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    if p["store_output_in_sbuf"]:
        raise ValueError(
            f"{function}: store_output_in_sbuf=True leaves the output in SBUF for a fusing kernel; a "
            "JAX call returns HBM arrays, so it must be False"
        )
    qtype = p["quantization_type"]
    if qtype in (QuantizationType.STATIC_MX, QuantizationType.ROW_MX):
        raise ValueError(
            f"{function}: quantization_type={qtype.name}: {NOT_BOUND_FORMATS[qtype]} is not bound in "
            "jax_nkilib; use NONE, STATIC, ROW, or MX with MX_CONTIGUOUS [H/4, I] uint32 weights"
        )
    if qtype == QuantizationType.MX:
        _check_mx(call)
        return
    if p["weight_layout"] != QKVWeightLayout.CONTIGUOUS or p["is_h_dim_4h_transposed"]:
        raise ValueError(
            f"{function}: weight_layout={p['weight_layout'].name} and is_h_dim_4h_transposed="
            f"{p['is_h_dim_4h_transposed']} are MX options; quantization_type={qtype.name} takes "
            "CONTIGUOUS [H, I] weights and is_h_dim_4h_transposed=False"
        )
    weights, io = jnp.dtype(avals["fused_qkv_weights"].dtype), jnp.dtype(avals["input"].dtype)
    if weights == _MX_WORDS:
        raise TypeError(
            f"{function}: uint32 `fused_qkv_weights` are MX x4 words; pass quantization_type=MX and "
            "weight_layout=MX_CONTIGUOUS"
        )
    if avals.get("qkv_w_scale") is not None and jnp.dtype(avals["qkv_w_scale"].dtype) != jnp.float32:
        raise TypeError(
            f"{function}: `qkv_w_scale` must be float32 for quantization_type={qtype.name}; got "
            f"{avals['qkv_w_scale'].dtype}"
        )
    if qtype == QuantizationType.NONE and weights != io:
        raise TypeError(
            f"{function}: `fused_qkv_weights` must have the input's dtype ({io}) without quantization; got {weights}"
        )
    if qtype != QuantizationType.NONE and weights not in FP8_WEIGHT_DTYPES:
        raise TypeError(
            f"{function}: quantization_type={qtype.name} needs FP8 `fused_qkv_weights` (float8_e4m3 or "
            f"float8_e4m3fn); got {weights}"
        )
    given = {name: avals.get(name) is not None for name in ("qkv_w_scale", "qkv_in_scale")}
    needed = {QuantizationType.STATIC: ("qkv_w_scale", "qkv_in_scale"), QuantizationType.ROW: ("qkv_w_scale",)}
    for name, present in given.items():
        if present != (name in needed.get(qtype, ())):
            verb = "requires" if not present else "does not take"
            raise ValueError(f"{function}: quantization_type={qtype.name} {verb} `{name}`")
    if given["qkv_w_scale"]:
        width = 3 if qtype == QuantizationType.STATIC else dims["I"]
        if dims["WR"] not in (1, 128) or dims["WC"] != width:
            raise ValueError(
                f"{function}: `qkv_w_scale` must be [1 or 128, {'3' if width == 3 else 'I'}] = [1 or "
                f"128, {width}] for quantization_type={qtype.name}; got [{dims['WR']}, {dims['WC']}]"
            )
    if given["qkv_in_scale"] and dims["IR"] not in (1, 128):
        raise ValueError(f"{function}: `qkv_in_scale` must be [1 or 128, 1]; got [{dims['IR']}, 1]")
    if qtype == QuantizationType.STATIC and (p["num_q_heads"] is None or p["num_kv_heads"] is None):
        raise ValueError(
            f"{function}: quantization_type=STATIC needs num_q_heads and num_kv_heads (one weight "
            "scale per Q, K and V segment)"
        )


def _check_mx(call: CallInfo) -> None:
    """MX: x4 weights [H/4, I] uint32 in MX_CONTIGUOUS layout, scales [H/32, I] uint8, no qkv_in_scale."""
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    if p["weight_layout"] != QKVWeightLayout.MX_CONTIGUOUS:
        raise ValueError(
            f"{function}: quantization_type=MX takes weight_layout=MX_CONTIGUOUS ([H/4, I] x4 words, "
            f"W[4k + j, i] in byte j of word [k, i]); got {p['weight_layout'].name} (MX_INTERLEAVED "
            "belongs to the kernel's DMA-transpose paths with FP8 input or static dequant scales, not "
            "bound)"
        )
    weights, io = jnp.dtype(avals["fused_qkv_weights"].dtype), jnp.dtype(avals["input"].dtype)
    if weights != _MX_WORDS:
        raise TypeError(
            f"{function}: quantization_type=MX needs `fused_qkv_weights` as uint32 float8_e4m3fn_x4 "
            f"words [H/4, I]; got {weights}"
        )
    if io not in FLOAT_DTYPES:
        raise TypeError(
            f"{function}: quantization_type=MX takes a floating `input` (float32, bfloat16, float16); got {io}"
        )
    if dims["H"] % 32 or dims["H4"] * 4 != dims["H"]:
        raise ValueError(
            f"{function}: quantization_type=MX needs H % 32 == 0 and `fused_qkv_weights` [H/4, I] = "
            f"[{dims['H'] // 4}, I]; got H={dims['H']} and {dims['H4']} weight rows"
        )
    if avals.get("qkv_in_scale") is not None:
        raise ValueError(
            f"{function}: quantization_type=MX does not take `qkv_in_scale` (the static-dequant MX path "
            "with MX_INTERLEAVED weights is not bound)"
        )
    scale = avals.get("qkv_w_scale")
    if scale is None or jnp.dtype(scale.dtype) != jnp.uint8 or (dims["WR"], dims["WC"]) != (dims["H"] // 32, dims["I"]):
        got = "none" if scale is None else f"{scale.dtype} {tuple(scale.shape)}"
        raise ValueError(
            f"{function}: quantization_type=MX requires `qkv_w_scale` as uint8 e8m0 scales [H/32, I] = "
            f"[{dims['H'] // 32}, {dims['I']}]; got {got}"
        )
    if p["is_h_dim_4h_transposed"] and (p["fused_norm_type"] != NormType.NO_NORM or p["fused_residual_add"]):
        raise ValueError(
            f"{function}: is_h_dim_4h_transposed=True does not combine with a fused norm or the fused residual add"
        )


def _check_fusions(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    has = {name: avals.get(name) is not None for name in _NO_CACHE}
    if p["fused_residual_add"] != (has["mlp_prev"] and has["attention_prev"]) or (
        has["mlp_prev"] != has["attention_prev"]
    ):
        raise ValueError(
            f"{function}: fused_residual_add=True needs both `mlp_prev` and `attention_prev` [B, S, H], "
            f"and they are only used with it; got fused_residual_add={p['fused_residual_add']}, "
            f"mlp_prev {'given' if has['mlp_prev'] else 'absent'}, attention_prev "
            f"{'given' if has['attention_prev'] else 'absent'}"
        )
    norm = p["fused_norm_type"]
    if (norm in (NormType.RMS_NORM, NormType.LAYER_NORM)) != has["gamma_norm_weights"]:
        raise ValueError(
            f"{function}: `gamma_norm_weights` [1, H] is required by (and only used with) "
            f"fused_norm_type RMS_NORM or LAYER_NORM; got fused_norm_type={norm.name}"
        )
    if has["layer_norm_bias"] and norm != NormType.LAYER_NORM:
        raise ValueError(f"{function}: `layer_norm_bias` is only used with fused_norm_type=LAYER_NORM; got {norm.name}")
    if p["hidden_actual"] is not None and not 0 < p["hidden_actual"] <= dims["H"]:
        raise ValueError(f"{function}: hidden_actual={p['hidden_actual']} must be in [1, H={dims['H']}]")
    for name in ("num_q_heads", "num_kv_heads", "d_head"):
        if p[name] is not None and p[name] <= 0:
            raise ValueError(f"{function}: `{name}` must be positive; got {p[name]}")
    nq, nkv, d = _heads(call)
    if nq is not None and nkv is not None and (d is None or (nq + 2 * nkv) * d != dims["I"]):
        raise ValueError(
            f"{function}: (num_q_heads + 2 * num_kv_heads) * d_head = ({nq} + 2 * {nkv}) * {d} must "
            f"equal the weights' I={dims['I']}"
        )
    if p["output_layout"] != QKVOutputLayout.BSD and (d is None or dims["I"] % d):
        raise ValueError(
            f"{function}: output_layout={p['output_layout'].name} needs d_head (or num_q_heads and "
            f"num_kv_heads) dividing I={dims['I']}; got d_head={d}"
        )
    if p["fused_rope"] != (has.get("cos_cache", False) and has.get("sin_cache", False)) or has.get(
        "cos_cache", False
    ) != has.get("sin_cache", False):
        raise ValueError(
            f"{function}: fused_rope=True needs `cos_cache` and `sin_cache` [B, S, d_head], and they "
            f"are only used with it; got fused_rope={p['fused_rope']}"
        )
    if p["fused_rope"]:
        if nq is None or nkv is None:
            raise ValueError(f"{function}: fused_rope=True needs num_q_heads and num_kv_heads")
        if dims["d"] != d or d % 2:
            raise ValueError(
                f"{function}: cos_cache/sin_cache must be [B, S, d_head] with an even d_head={d}; got "
                f"last axis {dims['d']}"
            )


def _check_cache(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    if p["output_layout"] != QKVOutputLayout.BSD:
        raise ValueError(f"{function}: the fused KV-cache write needs output_layout=BSD; got {p['output_layout'].name}")
    if p["d_head"] is None or p["num_q_heads"] is None or p["num_kv_heads"] is None:
        raise ValueError(f"{function}: the fused KV-cache write needs d_head, num_q_heads and num_kv_heads")
    nq, nkv, d = _heads(call)
    if dims["KV"] != nkv * d:
        raise ValueError(
            f"{function}: k_cache/v_cache last axis must be num_kv_heads * d_head = {nkv * d}; got {dims['KV']}"
        )
    k, v = avals["k_cache"], avals["v_cache"]
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"{function}: `k_cache` and `v_cache` must have the same shape and dtype; got "
            f"{tuple(k.shape)} {k.dtype} and {tuple(v.shape)} {v.dtype}"
        )
    kv = jnp.dtype(avals["input"].dtype if p["kv_dtype"] is None else p["kv_dtype"])
    if jnp.dtype(k.dtype) != kv:
        raise TypeError(
            f"{function}: the caches' dtype {k.dtype} must be kv_dtype ({kv}, default: the input's "
            f"dtype); pass kv_dtype={jnp.dtype(k.dtype).name}"
        )
    if p["fp8_max"] is not None and p["fp8_min"] is not None and not p["fp8_min"] < p["fp8_max"]:
        raise ValueError(f"{function}: fp8_min={p['fp8_min']} must be below fp8_max={p['fp8_max']}")
    if p["use_block_kv"] != (avals.get("slot_mapping") is not None):
        raise ValueError(
            f"{function}: use_block_kv=True needs `slot_mapping` [B, S] (and block_size); a flat cache "
            f"[B, max_S, KV] takes neither; got use_block_kv={p['use_block_kv']}"
        )
    if p["use_block_kv"] and p["block_size"] != dims["block"]:
        raise ValueError(
            f"{function}: block_size={p['block_size']} must be given and match the caches' block axis ({dims['block']})"
        )
    if not p["use_block_kv"] and p["block_size"] is not None:
        raise ValueError(f"{function}: block_size is only used with use_block_kv=True")
    if not p["use_block_kv"] and dims["max_S"] < dims["S"]:
        raise ValueError(
            f"{function}: the flat caches hold max_S={dims['max_S']} positions, fewer than the "
            f"S={dims['S']} tokens written at positions 0..S-1"
        )
    if uses_tkg(dims["B"], dims["S"], p["fused_rope"]):
        raise ValueError(
            f"{function}: the fused KV-cache write runs only on qkv's CTE path (S > {TKG_MAX_SEQ}, B * S "
            f"> {TKG_MAX_TOKENS} or fused_rope); for B={dims['B']}, S={dims['S']} the kernel dispatches "
            "to qkv_tkg, which ignores the caches"
        )


def _path(call: CallInfo) -> str:
    """The kernel's device path for this call: ``"kv_cache"`` (CTE with the fused KV-cache write, when any cache
    operand is given), ``"tkg"`` (``S <= 96``, ``B * S <= 128``, no RoPE tables) or ``"cte"``."""
    avals = call.avals
    if any(avals.get(name) is not None for name in CACHE_OPERANDS):
        return "kv_cache"
    tables = avals.get("cos_cache") is not None or avals.get("sin_cache") is not None
    tkg = not tables and uses_tkg(call.dims["B"], call.dims["S"], call.params["fused_rope"])
    return "tkg" if tkg else "cte"  # (the CTE checks reject tables without fused_rope)


def _check_cache_arguments(call: CallInfo) -> None:
    """The cache operands come together, and the cache params only with them."""
    p, function = call.params, call.function
    if _path(call) == "kv_cache":
        missing = [name for name in _CACHE_REQUIRED if call.avals.get(name) is None]
        if missing:
            raise ValueError(
                f"{function}: the fused KV-cache write needs k_cache, v_cache ([B, max_S, KV] or "
                f"[num_blocks, block_size, KV]), k_scale and v_scale ([128, 1] float32); missing "
                f"{', '.join(missing)}. The kernel writes the caches only when both scales are given and "
                "ignores them otherwise: pass jnp.ones((128, 1), jnp.float32) for an unscaled cache"
            )
        return
    changed = [name for name in CACHE_PARAMS if p[name] != _PARAMS[name].default]
    if changed:
        raise ValueError(
            f"{function}: {', '.join(changed)} configure the fused KV-cache write; give k_cache, v_cache, "
            "k_scale and v_scale with them"
        )


def _check(call: CallInfo) -> None:
    _check_cache_arguments(call)
    path = _path(call)
    if path == "tkg":
        _check_tkg(call)
    _check_formats(call)
    _check_fusions(call)
    if path == "kv_cache":
        _check_cache(call)


def _check_tkg(call: CallInfo) -> None:
    p = call.params
    if (
        p["quantization_type"] == QuantizationType.MX
        or p["is_h_dim_4h_transposed"]
        or p["weight_layout"] != QKVWeightLayout.CONTIGUOUS
    ):
        raise ValueError(
            f"{call.function}: MX (quantization_type=MX, MX weight layouts, is_h_dim_4h_transposed) runs "
            f"only on qkv's CTE path; B={call.dims['B']}, S={call.dims['S']} dispatch to qkv_tkg (S <= "
            f"{TKG_MAX_SEQ} and B * S <= {TKG_MAX_TOKENS} without fused_rope)"
        )


# ------------------------------------------------------------------------------------------------ Neuron limits
def _common_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    if dims["H"] % PARTITIONS:
        unmet.append(f"H={dims['H']} must be a multiple of {PARTITIONS}")
    if call.params["output_layout"] == QKVOutputLayout.NBdS:
        unmet.append("output_layout=NBdS is not implemented by qkv_cte or qkv_tkg")
    return unmet


def _cte_limits(call: CallInfo) -> list[str]:
    dims, p, unmet = call.dims, call.params, _common_limits(call)
    if dims["H"] > CTE_MAX_HIDDEN:
        unmet.append(f"H={dims['H']} exceeds {CTE_MAX_HIDDEN}")
    if dims["I"] > CTE_MAX_WIDTH:
        unmet.append(f"I={dims['I']} exceeds {CTE_MAX_WIDTH}")
    if p["output_layout"] == QKVOutputLayout.NBSd and _heads(call)[2] != NBSD_HEAD_DIM:
        unmet.append(f"output_layout=NBSd needs d_head={NBSD_HEAD_DIM} on the CTE path; got {_heads(call)[2]}")
    if p["quantization_type"] == QuantizationType.ROW:
        unmet.append("qkv_cte applies no ROW weight scales (ROW is implemented by qkv_tkg only)")
    if p["quantization_type"] == QuantizationType.MX:
        if dims["H"] % 512:
            unmet.append(f"MX needs H % 512 == 0; got H={dims['H']}")
        if (dims["S"] // call.lnc) % 2:
            unmet.append(f"MX needs an even S per LNC shard; got S={dims['S']}, LNC={call.lnc}")
    return unmet


def _tkg_limits(call: CallInfo) -> list[str]:
    unmet = _common_limits(call)
    if call.params["fused_norm_type"] == NormType.RMS_NORM_SKIP_GAMMA:
        unmet.append("qkv_tkg does not implement RMS_NORM_SKIP_GAMMA")
    if (call.dims["H"] // PARTITIONS) % call.lnc:
        unmet.append(f"H / {PARTITIONS} = {call.dims['H'] // PARTITIONS} must be divisible by LNC={call.lnc}")
    return unmet


def _neuron_limits(call: CallInfo) -> list[str]:
    return _tkg_limits(call) if _path(call) == "tkg" else _cte_limits(call)


def _neuron_notes(call: CallInfo) -> list[str]:
    """The CTE path computes float32 inputs in bfloat16 (the reference follows ``float32_compute``)."""
    if not computes_in_bfloat16(call.avals["input"].dtype, _path(call) == "tkg"):
        return []
    return [bfloat16_compute_note("qkv's CTE path", call.params["float32_compute"])]


# -------------------------------------------------------------------------------------------------------- spec
def _outputs(call: CallInfo):
    """By path (see the module docstring): ``out`` (CTE: bfloat16 for STATIC), ``out`` and with
    ``fused_residual_add`` ``fused_hidden [B, S, H]`` (TKG), or ``q [B, S, nq d]`` and the updated caches (KV)."""
    p, dims, io = call.params, call.dims, call.avals["input"].dtype
    batch, seq, width = dims["B"], dims["S"], dims["I"]
    path = _path(call)
    if path == "kv_cache":
        q_width = width if p["d_head"] is None or p["num_q_heads"] is None else p["num_q_heads"] * p["d_head"]
        return [
            ("q", (batch, seq, q_width), io),
            *((name, call.avals[name].shape, call.avals[name].dtype) for name in ("k_cache", "v_cache")),
        ]
    d = _heads(call)[2]
    if p["output_layout"] == QKVOutputLayout.BSD or d is None:
        shape = (batch, seq, width)
    elif p["output_layout"] == QKVOutputLayout.NBSd:
        shape = (width // d, batch, seq, d)
    else:
        shape = (width // d, batch, d, seq)
    if path == "tkg":
        return [("out", shape, io)] + ([("fused_hidden", call.shape("B, S, H"), io)] if p["fused_residual_add"] else [])
    return [("out", shape, jnp.bfloat16 if p["quantization_type"] == QuantizationType.STATIC else io)]


def _reference(**arguments):
    """:func:`reference_qkv` on the path the kernel takes for these arguments."""
    x, tables = arguments["input"], (arguments["cos_cache"], arguments["sin_cache"])
    caches = any(arguments[name] is not None for name in CACHE_OPERANDS)
    tkg = not caches and tables == (None, None) and uses_tkg(x.shape[0], x.shape[1], arguments["fused_rope"])
    return reference_qkv(**arguments, tkg=tkg)


def _heads_first(call: CallInfo) -> bool:
    return call.params["output_layout"] != QKVOutputLayout.BSD


def _folds(heads_first: bool):
    """Fold plans into B: never on the TKG path (a larger B may change the path), nor into a block cache."""

    def when(call: CallInfo) -> bool:
        path = _path(call)
        return (
            path != "tkg"
            and _heads_first(call) == heads_first
            and not (path == "kv_cache" and call.params["use_block_kv"])
        )

    return when


_ROW_OPERANDS = ("input", "mlp_prev", "attention_prev", "cos_cache", "sin_cache")
_SHARED = {name: None for name in KERNEL_ORDER if name not in _ROW_OPERANDS}
_VJP = "JAX (differentiates the reference; FP8 operands get no cotangent)"

QKV_SPEC = KernelSpec(
    name="qkv",
    entry_point=ENTRY_POINT,
    operands=tuple(_OPERANDS.values()),
    params=tuple(_PARAMS.values()),
    outputs=(),
    output_avals=_outputs,
    reference=_reference,
    check=_check,
    neuron_limits=_neuron_limits,
    neuron_notes=_neuron_notes,
    fold_plans=(
        FoldPlan(
            {**_SHARED, **dict.fromkeys(_ROW_OPERANDS + ("k_cache", "v_cache"), "B")},
            {"out": 0, "q": 0, "k_cache": 0, "v_cache": 0},
            _folds(heads_first=False),
        ),
        FoldPlan({**_SHARED, **dict.fromkeys(_ROW_OPERANDS, "B")}, {"out": 1}, _folds(heads_first=True)),
    ),
    aliases={"k_cache": "k_cache", "v_cache": "v_cache"},
    nondifferentiable_outputs=("k_cache", "v_cache"),
    mac_count=lambda call: call.dims["B"] * call.dims["S"] * call.dims["H"] * call.dims["I"],
    family="qkv",
    catalog="1.15",
    support={
        "idiomatic": "qkv_projection",
        "vjp": _VJP,
        "notes": f"one primitive following the kernel's dispatch: CTE (computes float32 in bfloat16; "
        "jax_nkilib.qkv_projection in float32 off Neuron unless asked), TKG (S <= {TKG_MAX_SEQ} and B*S <= "
        f"{TKG_MAX_TOKENS} without RoPE; returns fused_hidden with fused_residual_add; lax.map under vmap), fused "
        "KV-cache write (CTE with k_cache, v_cache, k_scale, v_scale; caches aliased); FP8 STATIC/ROW; MX "
        f"(MX_CONTIGUOUS, CTE only). Neuron: H % {PARTITIONS} == 0, H <= {CTE_MAX_HIDDEN}, I <= {CTE_MAX_WIDTH}",
    },
)

qkv = make_kernel(QKV_SPEC, vjp=differentiable_vjp)
