"""The math of ``attention_block_tkg`` (catalog 1.20) as one JAX pipeline built from the references of the kernels
the NKI Library block calls, so that the block computes what they compute:

1. ``qkv`` (TKG path for ``B * S_tkg <= 128``, else CTE): optional RMSNorm of ``X`` over ``H`` (``eps`` default
   ``1e-3``, the block kernel's), ``t = X W_qkv (+ bias_qkv)`` ``[B, S_tkg, d (q + 2)]`` rounded to ``X``'s dtype
   (``STATIC``: FP8 weights and input, dequantized per Q/K/V segment, as ``qkv`` computes it);
2. split heads: ``Q [d, B, q, S_tkg]``, ``K [d, B, 1, S_tkg]``, ``V [B, S_tkg, d]``;
3. optional per-head RMSNorm of Q and K over ``d`` (float32, ``x * rsqrt(mean(x^2) + eps) * w``, rounded), then
   ``RoPE`` (``reference_rope`` on ``[d, B, n, S]`` with ``cos, sin [d/2, B, S_tkg]``), then the optional post-RoPE
   RMSNorm;
4. FP8 KV (``k_scale`` and ``v_scale`` given): ``K, V <- fp8_e4m3(clip(x * scale[0, 0], -240, 240))`` (multiplied,
   not divided: the kernel's ``_quantize_to_fp8``; attention then reads the scaled values, there is no dequant);
5. ``Q <- round(Q * softmax_scale)`` (default ``1/sqrt(d)``), then ``reference_attention_tkg`` over the cache with
   the mask (the active tokens are the last ``S_tkg`` of the ``S_ctx`` slots, as in ``attention_tkg``);
   with ``KVDP > 1`` Q heads are all-gathered over the replica group and each rank attends its batch slice, then
   the outputs are all-gathered over the batch and each rank keeps its own heads;
6. cache update (``update_cache``): row ``b``'s ``S_tkg`` new tokens go to positions ``idx[b] + s`` (flat caches)
   or flat pool slots ``idx[b] + s`` (block pools); positions outside the cache (``uint32`` max, negative) are
   skipped;
7. optional ``output_projection_tkg`` (``[B * S_tkg, H]``, or its ``TRANSPOSE_OUT`` layout; ``STATIC``: FP8 weights
   and attention, per-tensor scales, as that kernel computes it).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..attention.attention_tkg import reference_attention_tkg
from ..framework import compat
from ..framework.common_types import NormType
from ..framework.mesh_axes import lax_axis
from ..framework.spec import accumulation_dtype
from ..projection.output_projection_tkg import reference_output_projection_tkg
from ..projection.qkv_reference import reference_qkv, uses_tkg
from ..rope.rope import reference_rope

FP8_KV_DTYPE = jnp.dtype(jnp.float8_e4m3)  # nl.float8_e4m3: Trainium's E4M3, largest finite 240
FP8_KV_MAX = 240.0
DEFAULT_X_EPS = 1e-3  # the block kernel's default when rmsnorm_X_eps is None


def head_rms_norm(x, eps: float, gamma, io):
    """RMSNorm over the head dim (axis 0) of ``x [d, ...]`` in float32: ``x * rsqrt(mean(x^2) + eps) (* gamma)``."""
    acc = accumulation_dtype(io)
    xw = x.astype(acc)
    y = xw * lax.rsqrt(jnp.mean(xw * xw, axis=0, keepdims=True) + eps)
    if gamma is not None:
        y = y * gamma.reshape((-1,) + (1,) * (x.ndim - 1)).astype(acc)
    return y.astype(io)


def _qk_processing(head, cos, sin, gammas, params, io):
    """Pre-RoPE norm, RoPE, post-RoPE norm of ``head [d, B, n, S]``; ``gammas`` = (pre, post)."""
    if params["rmsnorm_QK_pre_rope_enabled"]:
        head = head_rms_norm(head, params["rmsnorm_QK_pre_rope_eps"], gammas[0], io)
    if cos is not None:
        head = reference_rope(head, cos, sin, contiguous_layout=params["rope_contiguous_layout"])[0]
    if params["rmsnorm_QK_post_rope_enabled"]:
        head = head_rms_norm(head, params["rmsnorm_QK_post_rope_eps"], gammas[1], io)
    return head


def quantize_kv(x, scale):
    """``fp8_e4m3(clip(x * scale[0, 0], -240, 240))``."""
    acc = accumulation_dtype(x.dtype)
    scaled = x.astype(acc) * scale.reshape(-1)[0].astype(acc)
    return compat.astype_float8(jnp.clip(scaled, -FP8_KV_MAX, FP8_KV_MAX), FP8_KV_DTYPE)


def project_qkv(X, gamma, W_qkv, bias, w_scale, in_scale, params, q_heads: int, d: int):
    """Steps 1-4: ``Q [d, B, q, S]``, ``K [d, B, S]``, ``V [B, S, d]`` (K, V in FP8 when quantized)."""
    batch, seq, _ = X.shape
    norm = params["rmsnorm_X_enabled"]
    eps = DEFAULT_X_EPS if params["rmsnorm_X_eps"] is None else params["rmsnorm_X_eps"]
    (t,) = reference_qkv(
        X,
        W_qkv,
        bias,
        qkv_w_scale=w_scale,
        qkv_in_scale=in_scale,
        gamma_norm_weights=gamma if norm else None,
        tkg=uses_tkg(batch, seq, False),
        quantization_type=params["quantization_type_qkv"],
        fused_norm_type=NormType.RMS_NORM if norm else NormType.NO_NORM,
        norm_eps=eps,
        hidden_actual=params["X_hidden_dim_actual"],
        d_head=d,
        num_q_heads=q_heads,
        num_kv_heads=1,
    )
    heads = t.astype(X.dtype).reshape(batch, seq, q_heads + 2, d)
    qk = jnp.transpose(heads[:, :, : q_heads + 1], (3, 0, 2, 1))  # [d, B, q + 1, S]
    return qk, heads[:, :, q_heads + 1]


def write_tokens(cache, new, positions, capacity: int, transposed: bool):
    """``cache`` with row ``b``'s tokens ``new [B, S, d]`` at ``positions [B, S]`` of a flat cache ``[B, cap, d]``
    (``transposed``: ``[B, d, cap]``); positions outside ``[0, cap)`` are dropped."""
    batch = new.shape[0]
    pos = jnp.where(positions < capacity, positions, capacity)
    rows = jnp.broadcast_to(jnp.arange(batch)[:, None], pos.shape)
    new = new.astype(cache.dtype)
    if transposed:  # element-wise into [B, d, cap] (no transpose of the cache, so a donated cache stays in place)
        dims = jnp.arange(new.shape[-1])[None, None, :]
        return cache.at[rows[..., None], dims, pos[..., None]].set(new, mode="drop")
    return cache.at[rows, pos].set(new, mode="drop")


def update_positions(index, seq: int, capacity: int):
    """``[B, S]`` int32 target positions ``index[b] + s``; a start outside ``[0, capacity)`` (uint32 max = skip,
    negative int32) gives ``capacity`` (dropped)."""
    start = index.reshape(-1).astype(jnp.uint32)  # negative int32 -> huge: skipped like uint32 max
    valid = start < jnp.uint32(capacity)
    start = jnp.where(valid, start, jnp.uint32(capacity)).astype(jnp.int32)
    return jnp.where(valid[:, None], start[:, None] + jnp.arange(seq)[None, :], capacity)


def update_caches(K_cache, V_cache, K_new, V_new, index, *, transposed: bool, block: bool):
    """Step 6 with ``K_new, V_new [B, S, d]``."""
    seq, d = K_new.shape[1], K_new.shape[2]
    if block:
        slots = K_cache.shape[0] * K_cache.shape[1]
        pos = update_positions(index, seq, slots).reshape(-1)
        pools = []
        for pool, new in ((K_cache, K_new), (V_cache, V_new)):
            flat = pool.reshape(slots, d).at[pos].set(new.reshape(-1, d).astype(pool.dtype), mode="drop")
            pools.append(flat.reshape(pool.shape))
        return tuple(pools)
    capacity = V_cache.shape[1]
    pos = update_positions(index, seq, capacity)
    return (
        write_tokens(K_cache, K_new, pos, capacity, transposed),
        write_tokens(V_cache, V_new, pos, capacity, False),
    )


def after(dependency, *values):
    """``values`` unchanged, made to depend on ``dependency``: a select on a condition that is always false but that
    XLA cannot fold. The attention (``dependency``) reads the caches; when the cache update waits for it, XLA updates
    donated caches in place instead of copying them (it copies a buffer that is read and scattered into in one
    program unless every read comes first by data dependency)."""
    total = jnp.sum(dependency.astype(jnp.float32))
    never = jnp.isnan(total) & ~jnp.isnan(total)
    return tuple(jnp.where(never, jnp.zeros_like(value), value) for value in values)


def _gather_queries(Q, axes, kvdp: int, b_attn: int):
    """``Q [B, q, S, d]`` of this rank -> ``[B_attn, KVDP * q, S, d]``: every rank's heads (rank-major) for this
    rank's batch slice."""
    gathered = lax.all_gather(Q, axes, axis=1, tiled=True)  # [B, KVDP * q, S, d]
    return lax.dynamic_slice_in_dim(gathered, lax.axis_index(axes) * b_attn, b_attn, axis=0)


def _gather_outputs(out, axes, q_heads: int):
    """``[B_attn, KVDP * q, d, S]`` -> ``[B, q, d, S]``: every rank's batch slice, this rank's heads."""
    gathered = lax.all_gather(out, axes, axis=0, tiled=True)
    return lax.dynamic_slice_in_dim(gathered, lax.axis_index(axes) * q_heads, q_heads, axis=1)


def reference_attention_block_tkg(
    X,
    rmsnorm_X_gamma=None,
    W_qkv=None,
    bias_qkv=None,
    weight_dequant_scale_qkv=None,
    input_dequant_scale_qkv=None,
    rmsnorm_QK_pre_rope_W_Q=None,
    rmsnorm_QK_pre_rope_W_K=None,
    cos=None,
    sin=None,
    rmsnorm_QK_post_rope_W_Q=None,
    rmsnorm_QK_post_rope_W_K=None,
    active_blocks_table=None,
    K_cache=None,
    V_cache=None,
    attention_mask=None,
    sink=None,
    kv_cache_update_idx=None,
    W_out=None,
    bias_out=None,
    weight_dequant_scale_out=None,
    input_dequant_scale_out=None,
    k_scale=None,
    v_scale=None,
    *,
    lnc=1,
    **params,
):
    """JAX reference of ``attention_block_tkg``: ``(out, K_out, V_out)`` (see the module docstring)."""
    io = X.dtype
    batch, seq, _ = X.shape
    d = V_cache.shape[-1]
    q_heads = W_qkv.shape[1] // d - 2
    block = active_blocks_table is not None
    scales_qkv = (weight_dequant_scale_qkv, input_dequant_scale_qkv)
    qk, V = project_qkv(X, rmsnorm_X_gamma, W_qkv, bias_qkv, *scales_qkv, params, q_heads, d)
    gammas_q = (rmsnorm_QK_pre_rope_W_Q, rmsnorm_QK_post_rope_W_Q)
    gammas_k = (rmsnorm_QK_pre_rope_W_K, rmsnorm_QK_post_rope_W_K)
    Q = _qk_processing(qk[:, :, :q_heads], cos, sin, gammas_q, params, io)  # [d, B, q, S]
    K = _qk_processing(qk[:, :, q_heads:], cos, sin, gammas_k, params, io)[:, :, 0]  # [d, B, S]
    K_new, V_new = jnp.transpose(K, (1, 2, 0)), V  # [B, S, d] each
    if k_scale is not None:
        K_new, V_new = quantize_kv(K_new, k_scale), quantize_kv(V_new, v_scale)
    scale = params["softmax_scale"] if params["softmax_scale"] is not None else d**-0.5
    acc = accumulation_dtype(io)
    Q = (jnp.transpose(Q, (1, 2, 3, 0)).astype(acc) * scale).astype(io)  # [B, q, S, d]
    kvdp = params["KVDP"]
    b_attn = batch // kvdp
    if kvdp > 1:
        axes = lax_axis(params["KVDP_replica_group"])
        Q = _gather_queries(Q, axes, kvdp, b_attn)
        rows = lax.axis_index(axes) * b_attn
        K_new, V_new = (lax.dynamic_slice_in_dim(x, rows, b_attn, axis=0) for x in (K_new, V_new))
    transposed = params["K_cache_transposed"]
    if block:
        k_prior, v_prior = K_cache.astype(io), V_cache.astype(io)
        s_ctx = active_blocks_table.shape[1] * K_cache.shape[1]
    else:
        k_prior, v_prior = K_cache.astype(io)[:, None], V_cache.astype(io)[:, None]
        s_ctx = attention_mask.shape[0]
    (attn,) = reference_attention_tkg(
        Q,
        K_new.astype(io)[:, None],
        V_new.astype(io)[:, None],
        k_prior,
        v_prior,
        attention_mask,
        sink=sink,
        active_blocks_table=active_blocks_table,
        lnc=lnc,
        curr_sprior=s_ctx,
        block_len=K_cache.shape[1] if block else 0,
        tp_k_prior=not transposed,
        strided_mm1=not block,
        use_pos_id=False,
        fuse_rope=False,
        enable_fa_s_prior_tiling=params["enable_fa_s_prior_tiling"],
    )  # [B_attn, q * KVDP, d, S]
    if kvdp > 1:
        attn = _gather_outputs(attn, axes, q_heads)
    if params["update_cache"]:
        K_new, V_new = after(attn, K_new, V_new)
        K_out, V_out = update_caches(
            K_cache, V_cache, K_new, V_new, kv_cache_update_idx, transposed=transposed, block=block
        )
    else:
        K_out, V_out = jnp.transpose(K_new, (2, 0, 1)), V_new[:, None]
    if W_out is None:
        return attn, K_out, V_out
    (out,) = reference_output_projection_tkg(
        jnp.transpose(attn, (2, 0, 1, 3)),
        W_out,
        bias_out,
        weight_dequant_scale_out,
        input_dequant_scale_out,
        quantization_type=params["quantization_type_out"],
        TRANSPOSE_OUT=params["transposed_out"],
        lnc=lnc,
    )
    return out, K_out, V_out
