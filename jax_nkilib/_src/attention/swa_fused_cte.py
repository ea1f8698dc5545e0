"""``swa_fused_cte`` (catalog row 48, experimental; semantics of its torch reference): one GPT-OSS sliding-window
attention layer for prefill — QKV projection, RoPE, attention over a paged KV cache holding the prior tokens, and the
output projection — that also writes the active tokens' K/V into the cache.

Layouts: ``hidden_states [B, S, H]``; ``qkv_weight [H, I]``, ``I = (num_q_heads + 2 * num_kv_heads) * d_head``,
columns ``[Q | K | V]`` (head-major); ``op_weight [num_q_heads * d_head, H]``; ``k_cache, v_cache [num_blocks,
num_kv_heads, block_size, d_head]`` (FP8: ``k_cache`` packed ``[num_blocks, num_kv_heads, block_size // 2, d_head,
2]``, tokens ``2i`` and ``2i + 1`` in the trailing axis; ``v_cache`` unpacked); ``block_tables [B, max_blocks]``
int32; ``cos_cache, sin_cache [B, S, d_head]``; ``sink [B, num_q_heads]``; ``prior_tokens [1, 1]`` int32 (runtime);
``qkv_bias [1, I]``; ``op_bias [1, H]``; ``k_scale, v_scale [128, 1]`` float32 (FP8 only; element 0 is used).
Returns ``(out [B, S, H], k_cache, v_cache)``; the caches are updated in place on Neuron (aliased outputs).

Semantics, with ``P = prior_tokens`` and ``n0 = ceil(P / block_size)``: ``qkv = hidden @ qkv_weight + qkv_bias``;
half-split RoPE (``x * cos + rotate_half(x) * sin``) on q and k, then ``q *= scale``. Active token ``s`` goes to
physical block ``block_tables[b, n0 + s // block_size]``, slot ``s % block_size`` (K after RoPE, V plain); prior
token ``p < P`` is read from block ``block_tables[b, p // block_size]``, slot ``p % block_size``. Query ``s`` (position
``P + s``) attends to the prior and active keys at positions ``[P + s - sliding_window + 1, P + s]``; query head
``h`` reads KV head ``h // (num_q_heads / num_kv_heads)``; ``sink[b, h]`` is one more softmax-denominator logit.
``out = attn @ op_weight + op_bias`` with ``attn [B, S, num_q_heads * d_head]`` (head-major).

FP8 caches: the prior is dequantized (``x * scale``); attention uses the fresh, unquantized active K/V (as the
reference does); the active tokens are written as ``clip(x / scale, -m, m)`` cast to the cache dtype, ``m = 448`` for
float8_e4m3fn and 240 otherwise (also for e5m2, as the kernel clamps). Every other cache byte is unchanged.

Precision: projections accumulate in float32 (float64 for float64 inputs); q, k, v are rounded to the dtype of
``hidden_states`` after RoPE (FP8 values are quantized from that rounding), as are the attention output and the
dequantized prior; softmax is float32; ``out`` has the dtype of ``hidden_states``.

The kernel reads the prior as the ``sliding_window`` tokens ending at block ``n0``: it agrees with these semantics
when ``prior_tokens`` is 0 or a multiple of ``block_size`` of at least ``sliding_window`` (a runtime value, so not
checked). Active tokens past the end of ``block_tables`` are not written.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import FP8_DTYPES, INT_DTYPES, CallInfo, KernelSpec, Operand, Param
from .attention_segmented_cte import CACHE_DTYPES
from .blockwise import attention_forward, group_queries
from .checks import head_dim_limit
from .masks import MaskRule

KERNEL_TILE = 128  # the kernel's token tile and its only sliding window


def is_fp8(dtype) -> bool:
    return jnp.dtype(dtype) in FP8_DTYPES


def kernel_fp8_clamp(dtype) -> float:
    """The kernel's quantization clamp: 448 for float8_e4m3fn, 240 for the other FP8 formats."""
    return 448.0 if jnp.dtype(dtype) == jnp.dtype(jnp.float8_e4m3fn) else 240.0


def _rope(x, cos, sin):
    """Half-split RoPE of ``x [B, S, heads, d]`` with ``cos, sin [B, S, d]``."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def _tokens(cache, physical, slot):
    """Tokens ``[B, T, kv_heads, d]`` at (physical block, slot) ``[B, T]`` of a cache (packed FP8 K: rank 5)."""
    if cache.ndim == 5:
        return cache[physical, :, slot // 2, :, slot % 2]
    return cache[physical, :, slot, :]


def _write(cache, physical, slot, values):
    """``cache`` with ``values [B, T, kv_heads, d]`` written at (physical block, slot); out-of-range blocks are
    skipped."""
    if cache.ndim == 5:
        return cache.at[physical, :, slot // 2, :, slot % 2].set(values, mode="drop")
    return cache.at[physical, :, slot, :].set(values, mode="drop")


def _to_cache(values, cache, scale, acc):
    """Values in the hidden dtype to the cache dtype (FP8: ``clip(x / scale)``)."""
    if not is_fp8(cache.dtype):
        return values.astype(cache.dtype)
    limit = kernel_fp8_clamp(cache.dtype)
    return jnp.clip(values.astype(acc) / scale, -limit, limit).astype(cache.dtype)


def _from_cache(values, scale, dtype, acc):
    return values.astype(dtype) if scale is None else (values.astype(acc) * scale).astype(dtype)


def reference_swa_fused_cte(
    hidden_states,
    qkv_weight,
    op_weight,
    k_cache,
    v_cache,
    block_tables,
    cos_cache,
    sin_cache,
    sink,
    prior_tokens,
    qkv_bias,
    op_bias,
    k_scale=None,
    v_scale=None,
    *,
    scale=1.0,
    sliding_window=128,
    block_size=128,
    num_q_heads=16,
    num_kv_heads=2,
    d_head=64,
    **unused,
):
    """JAX reference of ``swa_fused_cte``: returns ``(out, k_cache, v_cache)`` (see the module docstring)."""
    del unused
    dtype = hidden_states.dtype
    acc = jnp.promote_types(dtype, jnp.float32)
    batch, seq, _ = hidden_states.shape
    n_q, n_kv, d = num_q_heads, num_kv_heads, d_head
    # FP8 caches only (checked): per-tensor scales, element 0
    k_s, v_s = (None if s is None else s.reshape(-1)[0].astype(acc) for s in (k_scale, v_scale))

    qkv = jnp.einsum("bsh,hi->bsi", hidden_states.astype(acc), qkv_weight.astype(acc)) + qkv_bias[0].astype(acc)
    q = qkv[..., : n_q * d].reshape(batch, seq, n_q, d)
    k = qkv[..., n_q * d : (n_q + n_kv) * d].reshape(batch, seq, n_kv, d)
    v = qkv[..., (n_q + n_kv) * d :].reshape(batch, seq, n_kv, d).astype(dtype)
    cos, sin = cos_cache.astype(acc), sin_cache.astype(acc)
    q = (_rope(q, cos, sin) * scale).astype(dtype)
    k = _rope(k, cos, sin).astype(dtype)

    # the active tokens into the cache, from logical block ceil(prior / block_size) on
    n_blocks, max_blocks = v_cache.shape[0], block_tables.shape[1]
    prior = prior_tokens.reshape(()).astype(jnp.int32)
    first_block = (prior + block_size - 1) // block_size
    positions = jnp.arange(seq)
    physical = jnp.take(block_tables, first_block + positions // block_size, axis=1, mode="fill", fill_value=n_blocks)
    slot = jnp.broadcast_to(positions % block_size, physical.shape)
    k_cache = _write(k_cache, physical, slot, _to_cache(k, k_cache, k_s, acc))
    v_cache = _write(v_cache, physical, slot, _to_cache(v, v_cache, v_s, acc))

    # the prior tokens the window can reach: the last (sliding_window - 1) before the active ones
    capacity = max_blocks * block_size
    n_prior = min(sliding_window - 1, capacity)
    keys, values = k.astype(dtype), v
    rule = MaskRule(n_queries=seq, n_active=seq, causal=True, window=sliding_window)
    if n_prior:
        start = jnp.clip(prior - n_prior, 0, capacity - n_prior)
        logical = start + jnp.arange(n_prior)
        prior_physical = jnp.broadcast_to(block_tables[:, logical // block_size], (batch, n_prior))
        prior_slot = jnp.broadcast_to(logical % block_size, (batch, n_prior))
        k_prior = _from_cache(_tokens(k_cache, prior_physical, prior_slot), k_s, dtype, acc)
        v_prior = _from_cache(_tokens(v_cache, prior_physical, prior_slot), v_s, dtype, acc)
        keys, values = jnp.concatenate([k_prior, keys], 1), jnp.concatenate([v_prior, values], 1)
        # prior slot j holds position start + j, i.e. j - (prior - start) relative to the first active token
        rule = MaskRule(
            n_queries=seq, n_active=seq, n_prior=n_prior, prior_used=prior - start, causal=True, window=sliding_window
        )

    rows = batch * n_kv  # engine rows: (sequence, kv head); query head h belongs to kv head h // (n_q / n_kv)
    as_rows = lambda x: jnp.swapaxes(x, 1, 2).reshape(rows, x.shape[1], d)  # noqa: E731  [B,T,kv,d] -> [B*kv,T,d]
    queries = group_queries(jnp.swapaxes(q, 1, 2).reshape(batch * n_q, seq, d), rows)
    sinks = group_queries(sink.reshape(batch * n_q, 1), rows)
    attn, _, _ = attention_forward(queries, as_rows(keys), as_rows(values), rule, 1.0, sinks)
    attn = jnp.swapaxes(attn.astype(dtype).reshape(batch, n_q, seq, d), 1, 2).reshape(batch, seq, n_q * d)
    out = jnp.einsum("bsq,qh->bsh", attn.astype(acc), op_weight.astype(acc)) + op_bias[0].astype(acc)
    return out.astype(dtype), k_cache, v_cache


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    for name in ("sliding_window", "block_size", "num_q_heads", "num_kv_heads", "d_head"):
        if p[name] <= 0:
            raise ValueError(f"{function}: `{name}` must be positive; got {p[name]}")
    for name, dim, what in (
        ("num_kv_heads", "kv_heads", "the caches' head axis"),
        ("d_head", "d", "the caches' last axis"),
        ("block_size", "block", "v_cache's block axis"),
        ("num_q_heads", "NQ", "sink's second axis"),
    ):
        if p[name] != dims[dim]:
            raise ValueError(f"{function}: {name}={p[name]} does not match {what} ({dims[dim]})")
    n_q, n_kv, d = p["num_q_heads"], p["num_kv_heads"], p["d_head"]
    if n_q % n_kv:
        raise ValueError(f"{function}: num_q_heads={n_q} must be a multiple of num_kv_heads={n_kv}")
    if d % 2:
        raise ValueError(f"{function}: d_head={d} must be even (half-split RoPE)")
    if dims["I"] != (n_q + 2 * n_kv) * d:
        raise ValueError(
            f"{function}: qkv_weight has {dims['I']} columns; it must have (num_q_heads + 2 * "
            f"num_kv_heads) * d_head = {(n_q + 2 * n_kv) * d}"
        )
    if dims["QD"] != n_q * d:
        raise ValueError(f"{function}: op_weight has {dims['QD']} rows; it must have num_q_heads * d_head = {n_q * d}")
    active_blocks = -(-dims["S"] // p["block_size"])
    if active_blocks > dims["max_blocks"]:
        raise ValueError(
            f"{function}: block_tables has {dims['max_blocks']} blocks per sequence; the {dims['S']} "
            f"active tokens need {active_blocks} of block_size={p['block_size']}"
        )
    dtype = avals["hidden_states"].dtype
    for name in ("qkv_weight", "op_weight", "k_cache", "v_cache"):
        if not is_fp8(avals[name].dtype) and avals[name].dtype != dtype:
            raise TypeError(
                f"{function}: `{name}` must have the dtype of hidden_states ({dtype}) or, for a cache, "
                f"an FP8 dtype; got {avals[name].dtype}"
            )
    packed = avals["k_cache"].ndim == 5
    if packed != is_fp8(avals["k_cache"].dtype):
        raise TypeError(
            f"{function}: `k_cache` must be FP8 exactly when packed [n_blocks, kv_heads, block/2, d, 2]; "
            f"got dtype {avals['k_cache'].dtype} with shape {tuple(avals['k_cache'].shape)}"
        )
    for cache, scale in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        fp8, given = is_fp8(avals[cache].dtype), avals.get(scale) is not None
        if fp8 != given:
            need = "is required for" if fp8 else "is only accepted with"
            raise ValueError(f"{function}: `{scale}` {need} an FP8 {cache}; {cache} has dtype {avals[cache].dtype}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, p, lnc = call.dims, call.params, call.lnc
    unmet = head_dim_limit(call)
    if not unmet and 2 * dims["d"] > KERNEL_TILE:
        unmet.append(f"d_head={dims['d']} exceeds 64 (the kernel stacks two heads on 128 partitions)")
    if dims["S"] % KERNEL_TILE:
        unmet.append(f"S={dims['S']} must be a multiple of 128")
    if dims["H"] % KERNEL_TILE and dims["H"] % dims["d"]:
        unmet.append(f"H={dims['H']} must be a multiple of 128 or of d_head={dims['d']}")
    if KERNEL_TILE % p["block_size"]:
        unmet.append(f"block_size={p['block_size']} must divide 128")
    if p["sliding_window"] != KERNEL_TILE:
        unmet.append(f"sliding_window={p['sliding_window']} must be 128")
    k_fp8, v_fp8 = (is_fp8(call.avals[name].dtype) for name in ("k_cache", "v_cache"))
    if k_fp8 != v_fp8:
        unmet.append("FP8 caches need both k_cache and v_cache in FP8")
    if p["num_q_heads"] % (2 * lnc):  # the kernel splits the heads over the (at most 2) logical cores
        unmet.append(f"num_q_heads={p['num_q_heads']} / LNC={lnc} must be even (heads are processed in pairs)")
    elif lnc == 2 and p["num_kv_heads"] > 1 and p["num_kv_heads"] % 2:
        unmet.append(f"num_kv_heads={p['num_kv_heads']} must be 1 or a multiple of LNC=2")
    return unmet


def _mac_count(call: CallInfo) -> int:
    dims, p = call.dims, call.params
    tokens = dims["B"] * dims["S"]
    attention = 2 * tokens * p["num_q_heads"] * min(p["sliding_window"], KERNEL_TILE * 2) * dims["d"]
    return tokens * dims["H"] * (dims["I"] + dims["QD"]) + attention


SWA_FUSED_CTE_SPEC = KernelSpec(
    name="swa_fused_cte",
    entry_point="nkilib.experimental.attention.swa_fused_cte:swa_fused_cte",
    operands=(
        Operand.of("hidden_states", "B, S, H"),
        Operand.of("qkv_weight", "H, I"),
        Operand.of("op_weight", "QD, H"),
        Operand.of("k_cache", "n_blocks, kv_heads, block, d", "n_blocks, kv_heads, block/2, d, 2", dtypes=CACHE_DTYPES),
        Operand.of("v_cache", "n_blocks, kv_heads, block, d", dtypes=CACHE_DTYPES),
        Operand.of("block_tables", "B, max_blocks", dtypes=INT_DTYPES),
        Operand.of("cos_cache", "B, S, d"),
        Operand.of("sin_cache", "B, S, d"),
        Operand.of("sink", "B, NQ"),
        Operand.of("prior_tokens", "1, 1", dtypes=INT_DTYPES),
        Operand.of("qkv_bias", "1, I"),
        Operand.of("op_bias", "1, H"),
        Operand.of("k_scale", "128, 1", dtypes=(jnp.float32,), optional=True),
        Operand.of("v_scale", "128, 1", dtypes=(jnp.float32,), optional=True),
    ),
    params=(
        Param("scale", 1.0, float),
        Param("sliding_window", 128, int),
        Param("block_size", 128, int),
        Param("num_q_heads", 16, int),
        Param("num_kv_heads", 2, int),
        Param("d_head", 64, int),
    ),
    outputs=(),
    output_avals=lambda call: [
        ("out", call.shape("B, S, H"), call.avals["hidden_states"].dtype),
        *((name, call.avals[name].shape, call.avals[name].dtype) for name in ("k_cache", "v_cache")),
    ],  # the caches, updated
    reference=reference_swa_fused_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    aliases={"k_cache": "k_cache", "v_cache": "v_cache"},
    mac_count=_mac_count,
    family="attention",
    catalog="row 48",
    nondifferentiable_outputs=("k_cache", "v_cache"),
    support={
        "idiomatic": "",
        "vjp": "JAX (differentiates the reference; out only, the updated caches carry no gradient)",
        "notes": "fused QKV + RoPE + sliding-window paged attention + output projection; caches updated in "
        f"place (aliased); FP8 caches (packed K); kernel: S % {KERNEL_TILE} == 0, sliding_window == {KERNEL_TILE}, "
        f"d_head <= {KERNEL_TILE // 2}, LNC <= 2, prior_tokens 0 or a block-aligned count >= 128",
    },
)

swa_fused_cte = make_kernel(SWA_FUSED_CTE_SPEC, vjp=reference_vjp)
