"""``transformer_tkg`` (catalog row 25, section 1.21): a Llama-3 decode step (token generation) over ``num_layers``
layers in one kernel. Source: ``nkilib/experimental/transformer/transformer_tkg.py`` (a plain function, identical on
nki-library ``main`` and ``2.29_release``), its torch reference ``transformer_tkg_torch.py`` and its test
``test/integration/nkilib/experimental/transformer/test_transformer_tkg.py``.

Per layer ``l`` (one tensor-parallel rank: ``q`` query heads, one KV head)::

    a = attention_block_tkg(x)        # RMSNorm(gamma_qkv) -> x W_qkv -> halves RoPE on q, k -> q / sqrt(d)
                                      # -> attention_tkg over the cache -> W_out
    x = x + all_reduce(a)             # over replica_groups (skipped without them)
    m = mlp(x)                        # RMSNorm(gamma_mlp) -> silu(x W_gate) * (x W_up) -> W_down (FP8 ROW optional)
    x = x + all_reduce(m)

The attention block runs with the flags the kernel fixes: ``K_cache_transposed=True``, ``rope_contiguous_layout=True``,
no QK norms, no biases, ``softmax_scale=None`` (``1/sqrt(d)``), ``attention_mask=mask_cache``, ``update_cache =
position_ids is not None``. Attention (``attention_tkg``'s semantics) sees the first ``S_ctx`` cache slots, whose
last ``S`` are the active tokens; afterwards the new ``k`` (after RoPE) and ``v`` of row ``b`` are written at slots
``position_ids[b, 0] + s`` of that layer's caches, by ``attention_block_tkg``'s own write rule: a row starting
outside ``[0, S_max)`` (the library's ``uint32`` max "skip" value, or a negative int32) is not written, and of a row
that starts inside but runs past ``S_max`` only the slots that fit are (the device leaves that case undefined: the
kernel bounds-checks block caches only).

Layouts (JAX operands stacked on a leading layer axis ``L``; ``I = (q + 2) d`` with columns ``[Q heads | K | V]``):
``X [B, S, H]``; ``W_qkvs [L, H, I]``; ``W_outs [L, q d, H]``; ``W_gates, W_ups [L, H, F]``; ``W_downs [L, F, H]``;
``W_gamma_qkvs, W_gamma_mlps [L, 1, H]``; ``K_caches [L, B, d, S_max]`` (transposed K) and ``V_caches [L, B, S_max,
d]``, or both with the library test's unit KV-head axis (``[L, B, 1, d, S_max]``, ``[L, B, 1, S_max, d]``);
``RoPE_cos, RoPE_sin [d/2, B, S]``; ``mask_cache [S_ctx, B, q, S]`` (nonzero = attend); ``mask_active [B, q, S, S]``
(optional, **unused**: the kernel never reads it); ``position_ids [B, 1]`` int32/uint32 (optional);
``W_gate_scales, W_up_scales [L, 128, F]``, ``W_down_scales [L, 128, H]`` float32 (optional, all or none: FP8 ROW
MLP weights). Returns ``(out [B, S, H], K_caches, V_caches)``: the library returns ``out`` only and updates the
caches in place; the binding returns the updated caches too, aliased to the inputs on Neuron.

Dtype policy: ``W_qkvs``, ``W_outs`` and the caches have ``X``'s dtype; MLP weights ``X``'s dtype or FP8 (with
scales). Each sub-step rounds where the kernel it calls does (the references of ``rmsnorm_tkg``, ``RoPE``,
``attention_tkg``, ``output_projection_tkg`` and ``mlp``); the all-reduce and residual adds are in ``X``'s dtype.
``clamp_bound`` reaches the MLP's ``quant_clipping_bound``, which only the CTE path (``B S > 96``) uses.

Per-layer lists. The library takes Python lists of tensors (``W_qkvs: List[nl.ndarray]``). Top-level list
arguments cannot go through NKI's framework path: NKI's ``CompileKernel`` standalone runner reads a list argument
as per-rank inputs (``world_size`` = the longest list, ``nki/framework/compiled.py``), and the library's own test
passes every layer's tensor as a separate argument to a wrapper that builds the lists inside the traced kernel
(``transformer_tkg_tp4_4layer_wrapper``). JAX operands are stacked ``[L, ...]`` (one array per weight kind: a
pytree of per-layer params stacks with ``jnp.stack``, and ``lax.scan`` over layers uses the same layout); the
device adapter (``jax_nkilib_kernels/transformer_tkg.py``) builds the lists inside its ``@nki.jit`` function, as the
library's test wrapper does, from per-layer views ``W[l]`` of the stacked HBM tensors. NKI documents
``tensor.ap(pattern, offset)`` as addressing the underlying storage from its start (``nki.language`` API text), and
the library's KV-cache update writes through ``K_cache.ap(..., offset=b * d * S_max, scalar_offset=...)``: on a
view of layer ``l > 0`` that offset would land in layer 0's cache. So the Neuron lowering runs the kernel only for
``num_layers == 1`` (one fused call per layer; the layer-0 view starts at storage offset 0) and falls back to the
reference otherwise, until a Trainium run shows that views keep their offset.

Refused, with a ``ValueError``: ``sbuf_residual_and_cc=True`` (the library's SBUF path passes
``attention_mask=mask``, an undefined name: it cannot trace). Not expressible with stacked operands: FP8 scales on
some layers only (the library test quantizes the middle layers): call per group of layers instead.

Reverse mode differentiates this reference in ``X`` and the float weights (no backward kernel); the caches carry
no gradient.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..attention.attention_tkg import MASK_DTYPES
from ..collectives.hbm_collectives import marking_varying
from ..framework.common_types import ActFnType, NormType, QuantizationType
from ..framework.hardware import PARTITIONS
from ..framework.mesh_axes import lax_axis
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, CallInfo, KernelSpec, Operand, Param, accumulation_dtype
from ..mlp.mlp import MLP_SPEC
from ..mlp.mlp_reference import mlp_forward
from ..quant.fp8 import FP8_WEIGHT_DTYPES
from .attention_block_tkg import attention_block_tkg
from .attention_block_tkg_math import reference_attention_block_tkg, update_caches

POSITION_DTYPES = INT_DTYPES + (jnp.dtype(jnp.uint32),)
MAX_TOKENS = 8  # attention_block_tkg: S_tkg <= 8 (catalog 1.20)
_MLP_DEFAULTS = {param.name: param.default for param in MLP_SPEC.params}
_SCALES = ("W_gate_scales", "W_up_scales", "W_down_scales")


# ------------------------------------------------------------------------------------------------- reference
def _attention_block(x, gamma, w_qkv, w_out, cos, sin, k_cache, v_cache, mask, eps):
    """``attention_block_tkg`` with transformer_tkg's flags (RMSNorm, contiguous RoPE, transposed K cache, output
    projection, no cache update): ``(out [B, S, H], k [B, S, d], v [B, S, d])``."""
    out, k, v = reference_attention_block_tkg(
        x,
        rmsnorm_X_gamma=gamma,
        W_qkv=w_qkv,
        cos=cos,
        sin=sin,
        K_cache=k_cache,
        V_cache=v_cache,
        attention_mask=mask,
        W_out=w_out,
        **attention_block_tkg.params(
            rmsnorm_X_enabled=True, rmsnorm_X_eps=eps, K_cache_transposed=True, rope_contiguous_layout=True
        ),
    )  # out [B * S, H], k [d, B, S], v [B, 1, S, d]
    return out.reshape(x.shape), jnp.transpose(k, (1, 2, 0)), v[:, 0]


def _mlp_block(x, gamma, gate, up, down, scales, eps, clamp_bound):
    """``mlp`` with transformer_tkg's flags (RMSNorm, SiLU, FP8 ROW when scales are given), in ``x``'s dtype."""
    quantized = scales[0] is not None
    params = dict(
        _MLP_DEFAULTS,
        normalization_type=NormType.RMS_NORM,
        activation_fn=ActFnType.SiLU,
        quantization_type=QuantizationType.ROW if quantized else QuantizationType.NONE,
        quant_clipping_bound=clamp_bound,
        output_dtype=x.dtype,
        eps=eps,
        use_tkg_down_proj_column_tiling=False,
    )
    ops = dict(
        hidden_tensor=x,
        gate_proj_weights_tensor=gate,
        up_proj_weights_tensor=up,
        down_proj_weights_tensor=down,
        normalization_weights_tensor=gamma,
        gate_w_scale=scales[0],
        up_w_scale=scales[1],
        down_w_scale=scales[2],
    )
    out, _ = mlp_forward(ops, params, exact=False)
    return out.astype(x.dtype)


def _residual(x, update, replica_groups):
    """``x + all_reduce(update)`` in ``x``'s dtype (the all-reduce sums over the replica group's mesh axes)."""
    if replica_groups:
        update = lax.psum(update, lax_axis(replica_groups))
    acc = accumulation_dtype(x.dtype)
    return (x.astype(acc) + update.astype(acc)).astype(x.dtype)


def reference_transformer_tkg(
    X,
    W_qkvs,
    W_outs,
    W_gates,
    W_ups,
    W_downs,
    W_gamma_qkvs,
    W_gamma_mlps,
    K_caches,
    V_caches,
    RoPE_cos,
    RoPE_sin,
    mask_cache,
    mask_active=None,
    position_ids=None,
    W_gate_scales=None,
    W_up_scales=None,
    W_down_scales=None,
    *,
    num_layers=None,
    eps=1e-6,
    replica_groups=None,
    sbuf_residual_and_cc=False,
    clamp_bound=0.0,
):
    """JAX reference of ``transformer_tkg``: ``(out, K_caches, V_caches)`` (see the module docstring), one
    ``lax.scan`` step per layer."""
    del mask_active, sbuf_residual_and_cc  # never read by the kernel; refused by the checks
    layers, head_axis = num_layers or W_qkvs.shape[0], K_caches.ndim == 5  # [L, B, 1, ...]: one KV head axis
    k_all, v_all = (c[:, :, 0] if head_axis else c for c in (K_caches, V_caches))
    stacked = (W_qkvs, W_outs, W_gates, W_ups, W_downs, W_gamma_qkvs, W_gamma_mlps, k_all, v_all)
    scales = (W_gate_scales, W_up_scales, W_down_scales)

    def layer(current, weights):
        w_qkv, w_out, gate, up, down, gamma_qkv, gamma_mlp, k_cache, v_cache, layer_scales = weights
        attn, k, v = _attention_block(
            current, gamma_qkv, w_qkv, w_out, RoPE_cos, RoPE_sin, k_cache, v_cache, mask_cache, eps
        )
        current = _residual(current, attn, replica_groups)
        mlp_out = _mlp_block(current, gamma_mlp, gate, up, down, layer_scales, eps, clamp_bound)
        current = _residual(current, mlp_out, replica_groups)
        if position_ids is not None:  # attention_block_tkg's own write (update_cache, kv_cache_update_idx)
            k_cache, v_cache = update_caches(k_cache, v_cache, k, v, position_ids[:, 0], transposed=True, block=False)
        return current, (k_cache, v_cache)

    weights = tuple(t[:layers] for t in stacked) + (tuple(None if t is None else t[:layers] for t in scales),)
    out, (k_new, v_new) = lax.scan(layer, X, weights)
    k_all, v_all = k_all.at[:layers].set(k_new), v_all.at[:layers].set(v_new)
    if head_axis:
        k_all, v_all = k_all[:, :, None], v_all[:, :, None]
    return out, k_all, v_all


# ---------------------------------------------------------------------------------------------------- checks
def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    if p["sbuf_residual_and_cc"]:
        raise ValueError(
            f"{function}: sbuf_residual_and_cc=True cannot run: the library's SBUF path passes "
            "attention_mask=mask, a name it never defines (nki-library main and 2.29); use the HBM path (False)"
        )
    d, q = dims["d"], dims["q"]
    if dims["I"] != (q + 2) * d:
        raise ValueError(
            f"{function}: W_qkvs [L, H, I] needs I = (q + 2) * d = {(q + 2) * d} columns [Q heads | K | V] for "
            f"q={q} heads (mask_cache's third axis) and one KV head of d={d}; got I={dims['I']}"
        )
    if dims["QD"] != q * d:
        raise ValueError(f"{function}: W_outs [L, q*d, H] needs q*d = {q * d} rows; got {dims['QD']}")
    if d % 2 or dims["half"] * 2 != d:
        raise ValueError(
            f"{function}: RoPE_cos/RoPE_sin [d/2, B, S] need d/2 = {d / 2} rows for an even head dim d={d}; "
            f"got {dims['half']}"
        )
    if not dims["S"] <= dims["S_ctx"] <= dims["S_max"]:
        raise ValueError(
            f"{function}: mask_cache [S_ctx, B, q, S] needs S <= S_ctx <= S_max (the cache length); got S="
            f"{dims['S']}, S_ctx={dims['S_ctx']}, S_max={dims['S_max']}"
        )
    layers = p["num_layers"]
    if layers is not None and not 1 <= layers <= dims["L"]:
        raise ValueError(f"{function}: num_layers={layers} must be in [1, L={dims['L']}] (the stacked layer axis)")
    if avals["K_caches"].ndim != avals["V_caches"].ndim:
        raise ValueError(
            f"{function}: K_caches and V_caches must both have the KV-head axis ([L, B, 1, ...]) or both not; got "
            f"shapes {tuple(avals['K_caches'].shape)} and {tuple(avals['V_caches'].shape)}"
        )
    given = [name for name in _SCALES if avals.get(name) is not None]
    if given and len(given) != len(_SCALES):
        raise ValueError(f"{function}: give all of {', '.join(_SCALES)} (FP8 ROW MLP) or none; got only {given}")
    dtype = avals["X"].dtype
    for name in ("W_qkvs", "W_outs", "K_caches", "V_caches"):
        if avals[name].dtype != dtype:
            raise TypeError(f"{function}: `{name}` must have X's dtype {dtype}; got {avals[name].dtype}")
    for name in ("W_gates", "W_ups", "W_downs"):
        weight = avals[name].dtype
        if weight in FP8_WEIGHT_DTYPES and not given:
            raise ValueError(f"{function}: FP8 `{name}` needs W_gate_scales, W_up_scales and W_down_scales")
        if weight not in FP8_WEIGHT_DTYPES and weight != dtype:
            raise TypeError(f"{function}: `{name}` must have X's dtype {dtype} or an FP8 dtype; got {weight}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, p, lnc = call.dims, call.params, call.lnc
    unmet = []
    if dims["H"] % PARTITIONS or (dims["H"] // PARTITIONS) % lnc:
        unmet.append(f"H={dims['H']} must be a multiple of 128 * LNC={PARTITIONS * lnc}")
    if dims["B"] * dims["S"] * dims["q"] > PARTITIONS:
        unmet.append(f"B * S * q = {dims['B'] * dims['S'] * dims['q']} must be <= 128")
    if dims["S"] > MAX_TOKENS:
        unmet.append(f"S={dims['S']} new tokens exceed {MAX_TOKENS}")
    if dims["d"] > PARTITIONS:
        unmet.append(f"d={dims['d']} exceeds 128")
    if dims["F"] % PARTITIONS:
        unmet.append(f"the MLP width F={dims['F']} must be a multiple of 128")
    if lnc > 2:
        unmet.append(f"LNC={lnc}: the kernel runs on 1 or 2 logical cores")
    if (p["num_layers"] or dims["L"]) > 1:
        unmet.append(
            "num_layers > 1: the per-layer lists are views of the stacked operands, and the library's cache "
            "update addresses them with storage offsets (.ap) that a view of layer > 0 does not shift: the kernel "
            "runs one layer per call (num_layers=1)"
        )
    return unmet


def _mac_count(call: CallInfo) -> int:
    dims = call.dims
    tokens, layers = dims["B"] * dims["S"], call.params["num_layers"] or dims["L"]
    projections = dims["H"] * (dims["I"] + dims["QD"] + 3 * dims["F"])
    return layers * tokens * (projections + 2 * dims["q"] * dims["S_ctx"] * dims["d"])


def _replica_axes(function, params, operands):
    return params["replica_groups"] or ()


_MLP_WEIGHT_DTYPES = FLOAT_DTYPES + FP8_WEIGHT_DTYPES
_F32 = (jnp.float32,)

TRANSFORMER_TKG_SPEC = KernelSpec(
    name="transformer_tkg",
    entry_point="jax_nkilib_kernels.transformer_tkg:transformer_tkg",
    operands=(
        Operand.of("X", "B, S, H", doc="hidden states of the new tokens"),
        Operand.of("W_qkvs", "L, H, I", doc="per layer [H, (q + 2) d]: [Q heads | K | V]"),
        Operand.of("W_outs", "L, QD, H", doc="per layer [q d, H]"),
        Operand.of("W_gates", "L, H, F", dtypes=_MLP_WEIGHT_DTYPES),
        Operand.of("W_ups", "L, H, F", dtypes=_MLP_WEIGHT_DTYPES),
        Operand.of("W_downs", "L, F, H", dtypes=_MLP_WEIGHT_DTYPES),
        Operand.of("W_gamma_qkvs", "L, 1, H", doc="attention RMSNorm gamma"),
        Operand.of("W_gamma_mlps", "L, 1, H", doc="MLP RMSNorm gamma"),
        Operand.of("K_caches", "L, B, d, S_max", "L, B, 1, d, S_max", doc="transposed K cache (one KV head)"),
        Operand.of("V_caches", "L, B, S_max, d", "L, B, 1, S_max, d", doc="V cache (one KV head)"),
        Operand.of("RoPE_cos", "half, B, S"),
        Operand.of("RoPE_sin", "half, B, S"),
        Operand.of(
            "mask_cache",
            "S_ctx, B, q, S",
            dtypes=MASK_DTYPES,
            doc="nonzero = attend; the last S slots are the active tokens",
        ),
        Operand.of("mask_active", "B, q, S, S", dtypes=MASK_DTYPES, optional=True, doc="unused by the kernel"),
        Operand.of("position_ids", "B, 1", dtypes=POSITION_DTYPES, optional=True, doc="cache write slot per row"),
        Operand.of("W_gate_scales", "L, 128, F", dtypes=_F32, optional=True, doc="FP8 ROW dequantization scales"),
        Operand.of("W_up_scales", "L, 128, F", dtypes=_F32, optional=True),
        Operand.of("W_down_scales", "L, 128, H", dtypes=_F32, optional=True),
    ),
    params=(
        Param("num_layers", None, int, "layers to run (default L, the stacked axis)"),
        Param("eps", 1e-6, float, "RMSNorm epsilon (both norms)"),
        Param("replica_groups", None, "axis", "mesh axis name(s) the two all-reduces per layer sum over"),
        Param("sbuf_residual_and_cc", False, bool, "the library's SBUF path; refused (it cannot trace)"),
        Param("clamp_bound", 0.0, float, "the MLP's quant_clipping_bound (CTE path only)"),
    ),
    outputs=(),
    output_avals=lambda call: [
        ("out", call.avals["X"].shape, call.avals["X"].dtype),
        *((name, call.avals[name].shape, call.avals[name].dtype) for name in ("K_caches", "V_caches")),
    ],
    prepare=marking_varying(_replica_axes),
    reference=reference_transformer_tkg,
    check=_check,
    neuron_limits=_neuron_limits,
    aliases={"K_caches": "K_caches", "V_caches": "V_caches"},
    has_collectives=True,
    mac_count=_mac_count,
    family="transformer",
    catalog="row 25",
    nondifferentiable_outputs=("K_caches", "V_caches"),
    support={
        "idiomatic": "",
        "vjp": "JAX (differentiates the reference in X and the float weights; the updated caches carry no gradient)",
        "shard_map": "inside jax.shard_map when replica_groups names the tensor-parallel mesh axes (two "
        "all-reduces per layer)",
        "notes": "per-layer lists as operands stacked [L, ...]; caches updated in place (aliased); FP8 ROW MLP; "
        "sbuf_residual_and_cc refused (the library's SBUF path references an undefined mask); kernel: one layer "
        f"per call, H % (128 LNC) == 0, B*S*q <= 128, S <= {MAX_TOKENS}, F % 128 == 0; "
        "device adapter jax_nkilib_kernels/transformer_tkg.py",
    },
)

transformer_tkg = make_kernel(TRANSFORMER_TKG_SPEC, vjp=reference_vjp)
