"""The math of the ``qkv`` kernel (both its device paths) as one JAX reference.

With ``x [B, S, H]``, ``W [H, I]``, ``I = (nq + 2 nkv) d``, columns ``[Q heads | K heads | V heads]``:

1. fused residual add: ``x = x + mlp_prev + attention_prev`` (the TKG path also returns this sum, ``fused_hidden``);
2. norm over ``H``: RMS ``x * gamma / sqrt(sum(x^2) / hidden_actual + eps)`` (``RMS_NORM_SKIP_GAMMA``: no gamma);
   Layer ``(x - mean) / sqrt(var + eps) * gamma + beta`` (mean and variance over all ``H``);
3. ``t = x @ W + bias``; FP8 ``STATIC``: ``t = fp8(clip(x / in_scale, ±m)) @ W * (w_scale[seg] * in_scale) + bias``
   with ``seg`` the Q/K/V segment of the column and ``m`` the largest finite value of the weights' format; FP8
   ``ROW``: ``t = x @ W * w_scale[0, col] + bias``; ``MX``: ``t = mx(x) @ W + bias`` with ``W`` decoded from its x4
   words and e8m0 scales and ``mx(x)`` the MXFP8 (e4m3fn) round trip of ``x`` in blocks of 32 consecutive ``H`` per
   token (``quant.mx.mx_round_trip``: the OCP emax 8 of the nkilib ``quantize_mx_golden`` the CTE goldens use; newer
   compilers' alternative emax 7 would differ), the gradient passed straight through;
4. fused RoPE on the Q and K heads, ``X = [X1 | X2]`` (halves): ``[X1 * cos[:d/2] - X2 * sin[:d/2], X2 * cos[d/2:] +
   X1 * sin[:d/2]]`` — the kernel reads ``cos`` full width and only the first half of ``sin`` (tables built by
   repeating the half-width frequencies, as HuggingFace does, give the usual rotation);
5. output ``t`` as ``BSD [B, S, I]``, ``NBSd [I/d, B, S, d]`` or ``NBdS [I/d, B, d, S]``; or, with the fused KV-cache
   write, ``q = t[..., :nq d]`` and the caches with ``clip(k / k_scale, fp8_min, fp8_max)`` (and ``v``) cast to
   ``kv_dtype`` at token ``s``'s position ``s`` (flat cache ``[B, max_S, nkv d]``) or at flat slot
   ``slot_mapping[b, s]`` of a block cache ``[num_blocks, block_size, nkv d]`` (slots outside the cache are skipped).

Precision: accumulation in float32 (float64 for float64 inputs). Stored values are rounded to the path's buffer
dtype after the residual add, the norm, the projection (+ bias; quantized: the raw product, then the dequantized sum)
and every RoPE product and sum. The CTE path's buffers are bfloat16 for float32 inputs (the kernel computes float32
inputs in bfloat16), and ``STATIC`` without cache gives bfloat16 output there; the TKG path keeps the input dtype.
``float32_compute="float32"`` (jax_nkilib's own param, never passed to the kernel) keeps float32 buffers on the CTE
path too: float32 math, what ``jax_nkilib.qkv_projection`` computes off Neuron unless bfloat16 is asked for.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework import compat
from ..framework.common_types import NormType, QKVOutputLayout, QuantizationType
from ..framework.precision import reference_compute_dtype
from ..framework.spec import accumulation_dtype
from ..norm.fused_norm import fused_norm
from ..quant import mx
from ..quant.fp8 import fp8_max as format_max
from .matmul_numerics import contract, first_element, mx_activation, mx_weight, quantize, rounded

TKG_MAX_SEQ = 96  # qkv runs qkv_tkg when S <= 96, B * S <= 128 and there is no fused RoPE, else qkv_cte
TKG_MAX_TOKENS = 128


def uses_tkg(batch: int, seq: int, fused_rope: bool) -> bool:
    """The kernel's dispatch rule: does ``qkv`` run its TKG (decode) path for these shapes?"""
    return not fused_rope and seq <= TKG_MAX_SEQ and batch * seq <= TKG_MAX_TOKENS


buffer_dtype = reference_compute_dtype  # the dtype of the kernel's SBUF buffers (bfloat16 on the CTE path for float32)


def head_dim(d_head, num_q_heads, num_kv_heads, width: int):
    """``d_head``, or ``I / (nq + 2 nkv)`` when only the head counts are given (as the kernel infers it)."""
    if d_head is not None:
        return d_head
    if num_q_heads is not None and num_kv_heads is not None:
        return width // (num_q_heads + 2 * num_kv_heads)
    return None


def _rope(t, cos, sin, heads: int, d: int, store, acc):
    """RoPE on the first ``heads`` heads of ``t [B, S, I]`` with the kernel's per-operation rounding."""
    batch, seq, width = t.shape
    half = d // 2
    rotated = t[..., : heads * d].reshape(batch, seq, heads, d)
    c = rounded(cos.astype(acc), store, acc)[:, :, None, :]
    s = rounded(sin[..., :half].astype(acc), store, acc)[:, :, None, :]
    x1, x2 = rotated[..., :half], rotated[..., half:]
    swapped = jnp.concatenate([-rounded(x2 * s, store, acc), rounded(x1 * s, store, acc)], axis=-1)
    out = rounded(rounded(rotated * c, store, acc) + swapped, store, acc)
    return jnp.concatenate([out.reshape(batch, seq, heads * d), t[..., heads * d :]], axis=-1)


def unswizzle_4h(x):
    """``is_h_dim_4h_transposed``: ``H`` stored as ``[4, H/4]`` (stored ``[j * H/4 + r]`` = logical ``[4r + j]``)."""
    return jnp.swapaxes(x.reshape(*x.shape[:-1], 4, x.shape[-1] // 4), -1, -2).reshape(x.shape)


def _project(x, w, bias, quantization_type, w_scale, in_scale, seg, store, io, tkg, acc):
    """``t`` of step 3 (rounded to ``store``; quantized: see the module docstring)."""
    b = None if bias is None else bias[0].astype(acc)
    if quantization_type in (QuantizationType.NONE, QuantizationType.MX):
        if quantization_type == QuantizationType.MX:
            x, w = mx_activation(x), mx_weight(w, w_scale, mx.ELEMENT_DTYPE)
        t = contract("bsh,hi->bsi", x, rounded(w.astype(acc), store, acc), acc)
        return rounded(t if b is None else t + b, store, acc)
    if quantization_type == QuantizationType.STATIC:
        in_s = first_element(in_scale, acc)
        scaled = x * (1.0 / in_s)
        if tkg:  # the TKG path writes the scaled input back to its buffer before the clamp
            scaled = rounded(scaled, io, acc)
        t = rounded(contract("bsh,hi->bsi", quantize(scaled, w.dtype, format_max(w.dtype)), w, acc), store, acc)
        scale = jnp.concatenate([jnp.full((n,), w_scale[0, i].astype(acc) * in_s, acc) for i, n in enumerate(seg)])
    else:  # ROW
        t = rounded(contract("bsh,hi->bsi", x, w, acc), store, acc)
        scale = w_scale[0].astype(acc)
    t = rounded(t * scale, store, acc)
    return t if b is None else rounded(t + b, store, acc)


def write_cache(cache, values, slot_mapping):
    """``cache`` with ``values [B, S, KV]`` at positions ``s`` (flat) or at flat slots ``slot_mapping`` (block)."""
    batch, seq, width = values.shape
    if slot_mapping is None:
        return cache.at[:, :seq, :].set(values)
    total = cache.shape[0] * cache.shape[1]
    slots = slot_mapping.reshape(-1).astype(jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < total), slots, total)  # skipped, never wrapped
    flat = cache.reshape(total, width).at[slots].set(values.reshape(-1, width), mode="drop")
    return flat.reshape(cache.shape)


def quantize_kv(values, scale, kv_dtype, bounds, acc):
    low, high = bounds
    return compat.astype_float8(jnp.clip(values * (1.0 / first_element(scale, acc)), low, high), kv_dtype)


def kv_bounds(kv_dtype, fp8_max_value, fp8_min_value):
    """The clamp of the KV quantization: the given bounds, else ``±`` the largest finite value of ``kv_dtype``."""
    top = format_max(kv_dtype)
    high = top if fp8_max_value is None else fp8_max_value
    return (-high if fp8_min_value is None else fp8_min_value), high


def reference_qkv(
    input,
    fused_qkv_weights,
    bias=None,
    qkv_w_scale=None,
    qkv_in_scale=None,
    mlp_prev=None,
    attention_prev=None,
    gamma_norm_weights=None,
    layer_norm_bias=None,
    cos_cache=None,
    sin_cache=None,
    k_cache=None,
    v_cache=None,
    k_scale=None,
    v_scale=None,
    slot_mapping=None,
    *,
    tkg=False,
    output_layout=QKVOutputLayout.BSD,
    quantization_type=QuantizationType.NONE,
    fused_residual_add=False,
    fused_norm_type=NormType.NO_NORM,
    norm_eps=1e-6,
    hidden_actual=None,
    fused_rope=False,
    d_head=None,
    num_q_heads=None,
    num_kv_heads=None,
    fp8_max=None,
    fp8_min=None,
    kv_dtype=None,
    use_block_kv=False,
    block_size=None,
    is_h_dim_4h_transposed=False,
    float32_compute="bfloat16",
    **unused,
):
    """JAX reference of ``qkv`` on the path ``tkg`` selects; returns the kernel's outputs (module docstring)."""
    del unused, block_size  # block_size equals the cache's block axis (checked)
    io = jnp.dtype(input.dtype)
    acc = accumulation_dtype(io)
    store = buffer_dtype(io, tkg, float32_compute)
    width = fused_qkv_weights.shape[1]
    d = head_dim(d_head, num_q_heads, num_kv_heads, width)
    x = input.astype(acc)
    if is_h_dim_4h_transposed:
        x = unswizzle_4h(x)
    fused_hidden = None
    if fused_residual_add:
        x = x + mlp_prev.astype(acc) + attention_prev.astype(acc)
        fused_hidden = x.astype(io)
    x = rounded(x, store, acc)
    if fused_norm_type != NormType.NO_NORM:
        x = rounded(
            fused_norm(x, fused_norm_type, gamma_norm_weights, layer_norm_bias, norm_eps, hidden_actual), store, acc
        )
    seg = None
    if quantization_type == QuantizationType.STATIC:
        seg = (num_q_heads * d, num_kv_heads * d, num_kv_heads * d)
    out_store = jnp.dtype(jnp.bfloat16) if quantization_type == QuantizationType.STATIC and not tkg else store
    t = _project(x, fused_qkv_weights, bias, quantization_type, qkv_w_scale, qkv_in_scale, seg, out_store, io, tkg, acc)
    if fused_rope:
        t = _rope(t, cos_cache, sin_cache, num_q_heads + num_kv_heads, d, out_store, acc)
    if k_scale is not None:  # the fused KV-cache write
        q_dim, kv_dim = num_q_heads * d, num_kv_heads * d
        kv = jnp.dtype(io if kv_dtype is None else kv_dtype)
        bounds = kv_bounds(kv, fp8_max, fp8_min)
        slots = slot_mapping if use_block_kv else None
        k_new = quantize_kv(t[..., q_dim : q_dim + kv_dim], k_scale, kv, bounds, acc)
        v_new = quantize_kv(t[..., q_dim + kv_dim :], v_scale, kv, bounds, acc)
        return t[..., :q_dim].astype(io), write_cache(k_cache, k_new, slots), write_cache(v_cache, v_new, slots)
    out_dtype = out_store if not tkg and quantization_type == QuantizationType.STATIC else io
    out = t.astype(out_dtype)
    if output_layout != QKVOutputLayout.BSD:
        batch, seq, _ = out.shape
        heads = out.reshape(batch, seq, width // d, d)
        out = jnp.transpose(heads, (2, 0, 1, 3) if output_layout == QKVOutputLayout.NBSd else (2, 0, 3, 1))
    return (out,) if fused_hidden is None or not tkg else (out, fused_hidden)
