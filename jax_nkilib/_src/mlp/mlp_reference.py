"""The MLP kernel's math, written once: the reference (with the kernel's roundings and FP8 activation quantization)
and the smooth function whose VJP is the backward (no roundings; quantization is the identity) are two
instantiations of :func:`mlp_forward`.

Rounding points of the reference, in the path's compute dtype ``c`` (``c`` = the hidden dtype, except that the CTE
path computes float32 inputs in bfloat16, as the kernel's ``compute_data_type`` does; ``float32_compute="float32"``,
jax_nkilib's own param that the kernel never sees, keeps float32 there): the fused-add sum, the
normalized input, CTE's float weights and biases as loaded, the gate/up product, and the down projection after its
dequantization and bias. Everything else (statistics, matmul accumulation, dequantization, bias, clamps,
activation, product) is float32 (float64 for float64 inputs). MX (:func:`_mlp_mx`) adds MXFP8 round trips of the
gate/up input and of the intermediate, in the kernel's layouts. STATIC_MX (CTE) is STATIC on unswizzled weights
(:func:`unswizzle_static_mx_gate_up`, :func:`unswizzle_static_mx_down`) whose raw projections are rounded to bfloat16
(the kernel's PSUM accumulation dtype for STATIC_MX) before the dequantization.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..framework.activations import SWISH_BETA, activation, clamp  # noqa: F401  (re-exported)
from ..framework.common_types import NormType, QuantizationType
from ..framework.precision import reference_compute_dtype
from ..norm.fused_norm import fused_norm
from ..quant import mx
from ..quant.fp8 import ROW_SCALE_FLOOR, fp8_max, saturate

TKG_TOKEN_THRESHOLD = 96  # TKG_BS_SEQLEN_THRESHOLD: B*S at or below it runs the token-generation path
QUANT_BOUND = fp8_max(jnp.float8_e4m3)  # 240: the kernel clips activations to the Trainium2 E4M3 range
STATIC_TYPES = (QuantizationType.STATIC, QuantizationType.STATIC_MX)
FP8_TYPES = (QuantizationType.ROW,) + STATIC_TYPES  # float8 weights with float32 dequantization scales
STATIC_MX_TILE = 512  # STATIC_MX swizzles H and I in tiles of 512


def is_tkg(tokens: int, force_cte_mode: bool) -> bool:
    """The kernel's dispatch: token generation (TKG) when ``B*S <= 96`` unless ``force_cte_mode``."""
    return tokens <= TKG_TOKEN_THRESHOLD and not force_cte_mode


compute_dtype = reference_compute_dtype  # the dtype intermediates are stored in (bfloat16 on the CTE path for float32)


def _row0(scale, acc):
    """Row 0 of a ``[128, n]`` scale (the 128 rows are the kernel's per-partition copies of one vector)."""
    return scale[0].astype(acc)


def unswizzle_down(down, lnc: int):
    """``use_tkg_down_proj_optimized_layout``: the given ``[I, H]`` tensor holds ``W`` as ``[I, lnc, H/(128 lnc),
    128]`` of ``W``'s ``[I, lnc, 128, H/(128 lnc)]``; this returns ``W``."""
    inter, hidden = down.shape
    return down.reshape(inter, lnc, hidden // 128 // lnc, 128).transpose(0, 1, 3, 2).reshape(inter, hidden)


def unswizzle_static_mx_gate_up(w):
    """``W [H, I]`` of STATIC_MX gate/up weights. The kernel takes ``W.reshape(2, H/512, 128, 2, I/512, 128, 4)
    .transpose(2, 1, 4, 6, 5, 0, 3).reshape(H, I)``: row ``h = a H/2 + 256 t + 2 p + b`` and column
    ``i = 512 k + 4 r + j`` of ``W`` sit at index ``(p, t, k, j, r, a, b)`` of the given array viewed as
    ``[128, H/512, I/512, 4, 128, 2, 2]``. Needs ``H % 512 == I % 512 == 0``."""
    hidden, inter = w.shape
    t, k = hidden // STATIC_MX_TILE, inter // STATIC_MX_TILE
    return w.reshape(128, t, k, 4, 128, 2, 2).transpose(5, 1, 0, 6, 2, 4, 3).reshape(hidden, inter)


def unswizzle_static_mx_down(w):
    """``W [I, H]`` of STATIC_MX down weights. The kernel takes ``W.reshape(I/512, 128, 4, H).transpose(1, 0, 3, 2)
    .reshape(I, H)``: row ``i = 512 k + 4 q + j`` of ``W`` sits at ``(q, k, h, j)`` of the given array viewed as
    ``[128, I/512, H, 4]``. Needs ``I % 512 == 0``."""
    inter, hidden = w.shape
    return w.reshape(128, inter // STATIC_MX_TILE, hidden, 4).transpose(1, 0, 3, 2).reshape(inter, hidden)


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
    c = compute_dtype(hidden.dtype, tkg, p.get("float32_compute", "bfloat16"))
    quant = p["quantization_type"]
    quantize_acts = quant in FP8_TYPES and not tkg and not exact
    if quant == QuantizationType.STATIC_MX:
        ops = dict(
            ops,
            down_proj_weights_tensor=unswizzle_static_mx_down(ops["down_proj_weights_tensor"]),
            **{
                name: unswizzle_static_mx_gate_up(ops[name])
                for name in ("gate_proj_weights_tensor", "up_proj_weights_tensor")
                if ops.get(name) is not None and not (p["skip_gate_proj"] and name.startswith("gate"))
            },
        )

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
        n = rounded(
            fused_norm(
                x,
                p["normalization_type"],
                ops.get("normalization_weights_tensor"),
                ops.get("normalization_bias_tensor"),
                p["eps"],
            )
        )

    def project(inp, in_dequant, weight, scale, bias):
        w = weight.astype(acc) if quant != QuantizationType.NONE else loaded(weight)
        out = jnp.einsum("bsh,hi->bsi", inp, w, preferred_element_type=acc)
        if quant == QuantizationType.STATIC_MX:  # STATIC_MX accumulates in a bfloat16 PSUM
            out = rounded(out, jnp.bfloat16)
        if quant in FP8_TYPES:
            out = out * _row0(scale, acc) * in_dequant
        if bias is not None:
            out = out + loaded(bias).reshape(-1)
        return out

    inp, in_dequant = n, 1.0
    if quant == QuantizationType.MX:
        return _mlp_mx(ops, p, n, project, rounded, exact), add_out
    if quantize_acts:
        inp, in_dequant = quantize_activation(
            n,
            quant,
            ops["up_proj_weights_tensor"].dtype,
            ops.get("gate_up_in_scale"),
            p["quant_clipping_bound"],
            rounded,
        )
    up = clamp(
        project(inp, in_dequant, ops["up_proj_weights_tensor"], ops.get("up_w_scale"), ops.get("up_proj_bias_tensor")),
        p["up_clamp_upper_limit"],
        p["up_clamp_lower_limit"],
    )
    if p["skip_gate_proj"]:
        inter = activation(up, p["activation_fn"])
    else:
        gate = clamp(
            project(
                inp,
                in_dequant,
                ops["gate_proj_weights_tensor"],
                ops.get("gate_w_scale"),
                ops.get("gate_proj_bias_tensor"),
            ),
            p["gate_clamp_upper_limit"],
            p["gate_clamp_lower_limit"],
        )
        inter = activation(gate, p["activation_fn"]) * up
    inter = rounded(inter)

    down = ops["down_proj_weights_tensor"]
    if p["use_tkg_down_proj_optimized_layout"]:
        down = unswizzle_down(down, lnc)
    inter_dequant = 1.0
    if quantize_acts:
        inter, inter_dequant = quantize_activation(
            inter, quant, down.dtype, ops.get("down_in_scale"), p["quant_clipping_bound"], rounded
        )
    out = rounded(project(inter, inter_dequant, down, ops.get("down_w_scale"), ops.get("down_proj_bias_tensor")))
    return out, add_out


# ------------------------------------------------------------------------------------------- MX (TKG) weights
MX_TILE = 512  # contraction elements per x4 tile: 128 partitions x 4 lanes
MX_ACT_DTYPE = jnp.float8_e4m3fn  # nisa.quantize_mx output (float8_e4m3fn_x4), OCP scale rule


def mx_inter_index(inter: int):
    """numpy int ``[P_I, ceil(I/512), 4]`` (``P_I = min(128, I/4)``): the intermediate index held by partition ``q``,
    tile ``k``, lane ``j`` of the MX TKG layout, ``512 k + j R_k + q`` with ``R_k`` = the tile's size / 4, or -1
    for the zero rows of a partial last tile (``q >= R_k``). Needs ``I % 32 == 0``."""
    rows = min(128, inter // 4)
    index = np.full((rows, -(-inter // MX_TILE), 4), -1, np.int64)
    for k in range(index.shape[1]):
        r = min(MX_TILE, inter - MX_TILE * k) // 4
        index[:r, k, :] = MX_TILE * k + np.arange(4)[None, :] * r + np.arange(r)[:, None]
    return index


def decode_mx_gate_up(words, scales, fmt):
    """``W [H, I]`` of MX gate/up weights: x4 words ``[128, H/512, I]`` (lane ``j`` of ``[p, t, i]`` is
    ``W[j H/4 + 128 t + p, i]``) with uint8 scales ``[16, H/512, I]``."""
    values = mx.decode_x4_weight(words, scales, fmt)  # [128, H/512, I, 4]
    return jnp.transpose(values, (3, 1, 0, 2)).reshape(-1, values.shape[2])


def decode_mx_down(words, scales, fmt, inter: int):
    """``W [I, H]`` of MX down weights: x4 words ``[P_I, ceil(I/512), H]`` (lane ``j`` of ``[q, k, h]`` is row
    :func:`mx_inter_index` ``[q, k, j]``) with uint8 scales ``[P_I/8, ceil(I/512), H]``."""
    values = mx.decode_x4_weight(words, scales, fmt)  # [P_I, nI, H, 4]
    index = mx_inter_index(inter)
    valid = index >= 0
    return jnp.transpose(values, (0, 1, 3, 2))[valid][np.argsort(index[valid])]


def mx_quantize_hidden(x):
    """MXFP8 round trip of the gate/up input ``x [..., H]`` as the kernel quantizes it: element ``h = j H/4 + 128 t
    + p`` sits at partition ``p``, tile ``t``, lane ``j``; one scale per 8 partitions x 4 lanes of one token."""
    *lead, hidden = x.shape
    tiles = x.reshape(-1, 4, hidden // MX_TILE, 128).transpose(3, 2, 0, 1)  # [128, H/512, T, 4]
    flat = tiles.reshape(128, -1)
    out = mx.dequantize_mx(*mx.quantize_mx(flat, MX_ACT_DTYPE)).reshape(tiles.shape)
    return out.transpose(2, 3, 1, 0).reshape(*lead, hidden).astype(x.dtype)


def mx_quantize_inter(v):
    """MXFP8 round trip of the intermediate ``v [..., I]`` in the down projection's layout (:func:`mx_inter_index`):
    one scale per 8 partitions x 4 lanes of one tile and token; padding rows are zeros."""
    *lead, inter = v.shape
    index = mx_inter_index(inter)
    rows = v.reshape(-1, inter)
    padded = jnp.concatenate([rows, jnp.zeros_like(rows[:, :1])], axis=-1)  # index -1 reads the zero column
    tiles = jnp.transpose(padded[:, index], (1, 2, 0, 3))  # [P_I, nI, T, 4]
    out = mx.dequantize_mx(*mx.quantize_mx(tiles.reshape(index.shape[0], -1), MX_ACT_DTYPE)).reshape(tiles.shape)
    valid = index >= 0
    flat = jnp.transpose(out, (2, 0, 1, 3))[:, valid]  # [T, I] in index order
    return flat[:, np.argsort(index[valid])].reshape(*lead, inter).astype(v.dtype)


def _mlp_mx(ops, p, n, project, rounded, exact: bool):
    """The MX TKG datapath after the norm: MXFP8 round trips of the gate/up input and of the intermediate (skipped
    when ``exact``), matmuls with the decoded MX weights, no weight-scale multiply (the scales are in the decode)."""
    fmt = p["mx_weight_dtype"]
    gate_up = {
        name: decode_mx_gate_up(ops[f"{name}_proj_weights_tensor"], ops[f"{name}_w_scale"], fmt)
        for name in (("up",) if p["skip_gate_proj"] else ("gate", "up"))
    }
    down = ops["down_proj_weights_tensor"]
    inter_size = gate_up["up"].shape[1]
    down = decode_mx_down(down, ops["down_w_scale"], fmt, inter_size)
    inp = n if exact else mx_quantize_hidden(n)
    bias = {
        name: None
        if ops.get(f"{name}_proj_bias_tensor") is None
        else mx_bias_vector(ops[f"{name}_proj_bias_tensor"], inter_size)
        for name in gate_up
    }
    up = clamp(project(inp, 1.0, gate_up["up"], None, bias["up"]), p["up_clamp_upper_limit"], p["up_clamp_lower_limit"])
    if p["skip_gate_proj"]:
        inter = activation(up, p["activation_fn"])
    else:
        gate = clamp(
            project(inp, 1.0, gate_up["gate"], None, bias["gate"]),
            p["gate_clamp_upper_limit"],
            p["gate_clamp_lower_limit"],
        )
        inter = activation(gate, p["activation_fn"]) * up
    inter = rounded(inter)
    if not exact:
        inter = mx_quantize_inter(inter)
    return rounded(project(inter, 1.0, down, None, ops.get("down_proj_bias_tensor")))


def mx_bias_vector(bias, inter: int):
    """``[I]`` of an MX gate/up bias ``[P_I, ceil(I/512), 4]`` (entry ``[q, k, j]`` is :func:`mx_inter_index`
    ``[q, k, j]``; the padding entries are ignored)."""
    index = mx_inter_index(inter)
    valid = index >= 0
    return bias[valid][np.argsort(index[valid])]
