"""``attention_block_tkg`` (catalog row 24, section 1.20): the NKI Library's fused decode attention block
(``nkilib/experimental/transformer/attention_block_tkg.py``, identical on ``main`` and ``2.29_release``; torch
reference ``attention_block_tkg_torch.py``), one KV head per call (GQA group of ``q`` query heads).

Math (see :mod:`.attention_block_tkg_math`): RMSNorm(X) -> QKV projection -> optional Q/K RMSNorm before and after
RoPE -> optional FP8 K/V -> attention over the KV cache with the mask -> optional cache update -> optional output
projection. Every dtype is ``X``'s (accumulation and softmax in float32).

Tensors: ``X, W_qkv, K_cache, V_cache, attention_mask`` positional (the kernel's required tensors, in its order), the
optional ones by keyword. Flags by keyword with the kernel's names; where the kernel has no default the default here
is the feature switched off (``rmsnorm_*_enabled=False``, ``update_cache=False``, ``QuantizationType.NONE``...).

Layouts (``B`` batch, ``S`` = S_tkg new tokens, ``H`` hidden, ``d`` head dim, ``q`` query heads, ``I = d (q + 2)``;
with ``KVDP > 1`` ``B_attn = B / KVDP`` and ``q_attn = q * KVDP``, else ``B_attn = B`` and ``q_attn = q``):

* ``X [B, S, H]``; ``rmsnorm_X_gamma [1, H]`` (needed with ``rmsnorm_X_enabled``);
* ``W_qkv [H, I]`` (columns: ``q`` Q heads, then K, then V, ``d`` each), ``bias_qkv [1, I]``;
* ``rmsnorm_QK_{pre,post}_rope_W_{Q,K} [1, d]`` (optional gammas of the per-head norms over ``d``);
* ``cos, sin [d/2, B, S]`` (both or neither: no RoPE); ``rope_contiguous_layout``: pairs ``(i, i + d/2)``, else
  ``(2i, 2i + 1)``;
* caches: flat ``K_cache [B_attn, S_max, d]`` (``K_cache_transposed``: ``[B_attn, d, S_max]``), ``V_cache [B_attn,
  S_max, d]``; block pools ``K_cache, V_cache [n_pool, block_len, d]`` with ``active_blocks_table [B_attn,
  n_blocks]`` (int32/uint32; ``S_ctx = n_blocks * block_len``; ``K_cache_transposed=False``). Caches have ``X``'s
  dtype, or ``float8_e4m3`` with ``k_scale``/``v_scale [1 or 128, 1]`` (element ``[0, 0]`` is used);
* ``attention_mask [S_ctx, B_attn, q_attn, S]`` (nonzero = attend; the last ``S`` of the ``S_ctx`` slots are the
  new tokens, whatever the cache holds there; a block-cache mask is in ``attention_tkg``'s LNC-dependent block
  order, see ``gen_mask_tkg``); ``sink [q_attn, 1]``;
* ``kv_cache_update_idx [B_attn, 1]`` int32/uint32 (with ``update_cache``): row ``b`` writes its ``S`` tokens at
  positions (flat) or flat pool slots (block) ``idx[b] + s``; ``uint32`` max (any start outside the cache) skips
  the row. On Neuron only block caches skip (``oob_mode.skip``); a flat cache's out-of-range write is undefined;
* ``W_out [q d, H]``, ``bias_out [1, H]`` (optional output projection).

Outputs ``(out, K_out, V_out)``: ``out [B, q, d, S]`` without ``W_out``; ``[B * S, H]`` with it (row ``b * S +
s``); ``transposed_out``: ``[128, LNC, H / LNC / 128, B * S]`` (``output_projection_tkg``'s ``TRANSPOSE_OUT``).
``update_cache=True``: the updated caches, **aliased to ``K_cache``/``V_cache``** in the Neuron custom call (donate
them to update in place); else the new ``K [d, B_attn, S]`` and ``V [B_attn, 1, S, d]`` (FP8 when quantized).

``KVDP > 1`` (inside ``jax.shard_map``; ``KVDP_replica_group`` names the mesh axes, ``KVDP`` ranks): every rank has
all ``B`` rows of ``X`` and its own ``q`` heads; its caches, mask, table and indices hold its ``B_attn`` rows (rank
``r``: rows ``r B_attn ...``). Q heads are all-gathered (rank-major), each rank attends its rows with K/V from its
own projection, the outputs are all-gathered over rows and each rank keeps its heads.

Quantization: ``quantization_type_qkv=STATIC`` takes an FP8 ``W_qkv`` with ``weight_dequant_scale_qkv [1 or 128, 3]``
(one float32 scale per Q/K/V segment, as ``qkv`` takes it: the block hands it to ``qkv``; the block's docstring says
``[128, 1]``) and ``input_dequant_scale_qkv [1 or 128, 1]``; ``quantization_type_out=STATIC`` an FP8 ``W_out`` with
``weight_dequant_scale_out``, ``input_dequant_scale_out [128, 1]`` (``output_projection_tkg``'s). Their math is that
of ``qkv`` and ``output_projection_tkg``.

Not bound: ``ROW``/MX quantization (refused), ``out_in_sb=True`` and ``sbm`` (SBUF; refused/dropped),
``skip_attention=True`` (a debug path whose output layout differs; refused), 4-D caches with a unit head axis (give
the 3-D view). Reverse mode differentiates the reference (no backward kernel).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..attention.attention_tkg import MASK_DTYPES, SPRIOR_TILE
from ..attention.checks import head_dim_limit
from ..attention.gen_mask_tkg import resized_block_len
from ..framework.common_types import QuantizationType
from ..framework.hardware import PARTITIONS
from ..framework.mesh_axes import bound_axis_size
from ..framework.platform import before_trn2
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, CallInfo, KernelSpec, Operand, Param
from ..quant.fp8 import FP8_WEIGHT_DTYPES
from .attention_block_tkg_math import FP8_KV_DTYPE, reference_attention_block_tkg

MAX_S_TKG = 8  # the kernel's documented limit on new tokens per call
INDEX_DTYPES = (jnp.uint32,) + INT_DTYPES
CACHE_DTYPES = FLOAT_DTYPES + (FP8_KV_DTYPE,)
WEIGHT_DTYPES = FLOAT_DTYPES + FP8_WEIGHT_DTYPES


def _fail(call: CallInfo, message: str, error=ValueError):
    raise error(f"{call.function}: {message}")


def _check_present_with_flag(call: CallInfo, names, flag: str, required: tuple[str, ...] = ()) -> None:
    present = {name for name in names if call.avals.get(name) is not None}
    if present and not call.params[flag]:
        _fail(call, f"{', '.join(sorted(present))} given but {flag}=False (the kernel would ignore it)")
    for name in required:
        if call.params[flag] and name not in present:
            _fail(call, f"{flag}=True needs `{name}`")


def _check_heads(call: CallInfo) -> tuple[int, int]:
    dims = call.dims
    d, width = dims["d"], dims["I"]
    if d % 2:
        _fail(call, f"the head dim d (last axis of V_cache) must be even; got d={d}")
    if width % d or width // d < 3:
        _fail(call, f"W_qkv [H, I] must pack (q + 2) heads of d={d} (q >= 1); got I={width}")
    return width // d - 2, d


def _check_kvdp(call: CallInfo, q_heads: int) -> int:
    p, dims = call.params, call.dims
    kvdp = p["KVDP"]
    if kvdp < 1:
        _fail(call, f"KVDP must be >= 1; got {kvdp}")
    if kvdp > 1:
        if p["KVDP_replica_group"] is None:
            _fail(call, "KVDP > 1 needs `KVDP_replica_group`: the mesh axis name(s) of the KV data-parallel ranks")
        size = bound_axis_size(p["KVDP_replica_group"])
        if size is not None and size != kvdp:
            _fail(call, f"KVDP={kvdp} but the replica group {p['KVDP_replica_group']} has {size} ranks")
    elif p["KVDP_replica_group"] is not None:
        _fail(call, "KVDP_replica_group is only used with KVDP > 1")
    if dims["B"] % kvdp:
        _fail(call, f"B={dims['B']} must be divisible by KVDP={kvdp}")
    expected = {"B_attn": dims["B"] // kvdp, "q_attn": q_heads * kvdp}
    got = {"B_attn": dims["Ba"], "q_attn": dims["Hq"]}
    if got != expected:
        _fail(
            call,
            f"attention_mask must be [S_ctx, B_attn={expected['B_attn']}, q_attn={expected['q_attn']}, S] "
            f"(B / KVDP rows, q * KVDP heads); got {tuple(call.avals['attention_mask'].shape)}",
        )
    return kvdp


def _check_cache(call: CallInfo) -> None:
    avals, dims, p = call.avals, call.dims, call.params
    block = avals.get("active_blocks_table") is not None
    s_ctx, seq = dims["S_ctx"], dims["S"]
    if block:
        if p["K_cache_transposed"]:
            _fail(call, "a block KV cache (active_blocks_table given) needs K_cache_transposed=False")
        if s_ctx != dims["n_blocks"] * dims["Sc"]:
            _fail(
                call,
                f"with a block KV cache the mask covers n_blocks * block_len = {dims['n_blocks'] * dims['Sc']} "
                f"slots; got attention_mask S_ctx={s_ctx}",
            )
        resized_block_len(
            s_ctx,
            dims["Sc"],
            lnc=call.lnc,
            bs=dims["Ba"],
            q_head=dims["Hq"],
            s_active=seq,
            enable_fa_s_prior_tiling=p["enable_fa_s_prior_tiling"],
            fuse_rope=False,
            function=call.function,
        )
    else:
        if dims["Bc"] != dims["Ba"]:
            _fail(call, f"a flat cache holds B_attn={dims['Ba']} rows; got K_cache/V_cache with {dims['Bc']}")
        if not seq <= s_ctx <= dims["Sc"]:
            _fail(call, f"need S <= S_ctx <= S_max; got S={seq}, S_ctx={s_ctx}, S_max={dims['Sc']}")
    io = jnp.dtype(avals["X"].dtype)
    cache_dtypes = {jnp.dtype(avals[name].dtype) for name in ("K_cache", "V_cache")}
    quantized = avals.get("k_scale") is not None
    if quantized != (avals.get("v_scale") is not None):
        _fail(call, "give both k_scale and v_scale (FP8 KV cache) or neither")
    if quantized and cache_dtypes != {FP8_KV_DTYPE}:
        _fail(call, f"k_scale/v_scale quantize K/V to float8_e4m3: the caches must be float8_e4m3; got {cache_dtypes}")
    if not quantized and cache_dtypes != {io}:
        _fail(
            call,
            f"K_cache and V_cache must have X's dtype {io} (FP8 caches need k_scale/v_scale); got {cache_dtypes}",
            TypeError,
        )
    for name in ("k_scale", "v_scale"):
        if quantized and dims[name[0] + "s"] not in (1, PARTITIONS):
            _fail(call, f"`{name}` must be [1, 1] or [{PARTITIONS}, 1]; got {tuple(avals[name].shape)}")


def _check_projection(call: CallInfo, weight: str, flag: str, scales: tuple[str, str]) -> None:
    """``NONE``: ``weight`` in X's dtype, no scales; ``STATIC``: FP8 ``weight`` and both float32 scales."""
    avals, qtype = call.avals, call.params[flag]
    io = jnp.dtype(avals["X"].dtype)
    given = [name for name in scales if avals.get(name) is not None]
    if qtype not in (QuantizationType.NONE, QuantizationType.STATIC):
        _fail(call, f"{flag}={qtype.name} is not bound in jax_nkilib (NONE or STATIC)")
    if avals.get(weight) is None:
        if given:
            _fail(call, f"{', '.join(given)} given without `{weight}`")
        return
    dtype = jnp.dtype(avals[weight].dtype)
    if qtype == QuantizationType.NONE:
        if dtype != io:
            _fail(call, f"`{weight}` must have X's dtype {io} with {flag}=NONE; got {dtype}", TypeError)
        if given:
            _fail(call, f"{', '.join(given)}: dequantization scales need {flag}=STATIC")
        return
    if dtype not in FP8_WEIGHT_DTYPES:
        _fail(call, f"{flag}=STATIC needs an FP8 `{weight}` (float8_e4m3 or float8_e4m3fn); got {dtype}", TypeError)
    for name in scales:
        if avals.get(name) is None:
            _fail(call, f"{flag}=STATIC needs `{name}`")
        if jnp.dtype(avals[name].dtype) != jnp.float32:
            _fail(call, f"`{name}` must be float32; got {avals[name].dtype}", TypeError)


def _check(call: CallInfo) -> None:
    avals, p, dims = call.avals, call.params, call.dims
    q_heads, d = _check_heads(call)
    _check_kvdp(call, q_heads)
    _check_cache(call)
    _check_projection(call, "W_qkv", "quantization_type_qkv", ("weight_dequant_scale_qkv", "input_dequant_scale_qkv"))
    _check_projection(call, "W_out", "quantization_type_out", ("weight_dequant_scale_out", "input_dequant_scale_out"))
    if p["out_in_sb"]:
        _fail(call, "out_in_sb=True leaves the output in SBUF, which a JAX call cannot do")
    if p["skip_attention"]:
        _fail(call, "skip_attention=True (the kernel's debug path) is not bound")
    _check_present_with_flag(call, ("rmsnorm_X_gamma",), "rmsnorm_X_enabled", ("rmsnorm_X_gamma",))
    _check_present_with_flag(
        call, ("rmsnorm_QK_pre_rope_W_Q", "rmsnorm_QK_pre_rope_W_K"), "rmsnorm_QK_pre_rope_enabled"
    )
    _check_present_with_flag(
        call, ("rmsnorm_QK_post_rope_W_Q", "rmsnorm_QK_post_rope_W_K"), "rmsnorm_QK_post_rope_enabled"
    )
    _check_present_with_flag(call, ("kv_cache_update_idx",), "update_cache", ("kv_cache_update_idx",))
    if (avals.get("cos") is None) != (avals.get("sin") is None):
        _fail(call, "give both cos and sin [d/2, B, S] (RoPE) or neither")
    if p["X_hidden_dim_actual"] is not None and not 0 < p["X_hidden_dim_actual"] <= dims["H"]:
        _fail(call, f"X_hidden_dim_actual must be in [1, H={dims['H']}]; got {p['X_hidden_dim_actual']}")
    if avals.get("W_out") is None:
        if avals.get("bias_out") is not None:
            _fail(call, "bias_out needs W_out")
        if p["transposed_out"]:
            _fail(call, "transposed_out requires the output projection (W_out)")
    else:
        if dims["QD"] != q_heads * d:
            _fail(call, f"W_out must be [q * d = {q_heads * d}, H]; got {tuple(avals['W_out'].shape)}")
        if p["transposed_out"] and dims["H"] % (PARTITIONS * call.lnc):
            _fail(call, f"transposed_out needs H={dims['H']} to be a multiple of 128 * LNC = {128 * call.lnc}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, p = call.dims, call.params
    unmet = head_dim_limit(call)
    if before_trn2(call.target):
        unmet.append(f"the kernel needs NeuronCore v3 (Trainium2) or later; the platform target is {call.target}")
    if dims["H"] % PARTITIONS or dims["H"] % call.lnc:
        unmet.append(f"H={dims['H']} must be a multiple of {PARTITIONS} and of LNC={call.lnc}")
    if dims["S"] > MAX_S_TKG:
        unmet.append(f"S_tkg={dims['S']} exceeds {MAX_S_TKG}")
    if dims["Ba"] * dims["Hq"] * dims["S"] > PARTITIONS:
        unmet.append(f"B_attn * q_attn * S_tkg = {dims['Ba'] * dims['Hq'] * dims['S']} exceeds {PARTITIONS}")
    if dims["S_ctx"] % SPRIOR_TILE:
        unmet.append(f"S_ctx={dims['S_ctx']} must be a multiple of {SPRIOR_TILE}")
    if (p["rmsnorm_QK_pre_rope_enabled"] or p["rmsnorm_QK_post_rope_enabled"]) and dims["d"] != PARTITIONS:
        unmet.append(f"the Q/K RMSNorm needs d={PARTITIONS}; got d={dims['d']}")
    return unmet


def _outputs(call: CallInfo):
    """``(out, K_out, V_out)``: see the module docstring (updated caches keep the names ``K_cache``/``V_cache``)."""
    avals, dims, p = call.avals, call.dims, call.params
    io = avals["X"].dtype
    q_heads = dims["I"] // dims["d"] - 2
    batch, seq, d = dims["B"], dims["S"], dims["d"]
    if avals.get("W_out") is None:
        out = ("out", (batch, q_heads, d, seq), io)
    elif p["transposed_out"]:
        out = ("out", (PARTITIONS, call.lnc, dims["H"] // call.lnc // PARTITIONS, batch * seq), io)
    else:
        out = ("out", (batch * seq, dims["H"]), io)
    if p["update_cache"]:
        return [out, *((name, avals[name].shape, avals[name].dtype) for name in ("K_cache", "V_cache"))]
    kv = FP8_KV_DTYPE if avals.get("k_scale") is not None else io
    return [out, ("K_out", (d, dims["Ba"], seq), kv), ("V_out", (dims["Ba"], 1, seq, d), kv)]


def _mac_count(call: CallInfo) -> int:
    dims = call.dims
    tokens = dims["B"] * dims["S"]
    projections = tokens * dims["H"] * (dims["I"] + (dims.get("QD") or 0))
    return projections + 2 * dims["Ba"] * dims["Hq"] * dims["S"] * dims["S_ctx"] * dims["d"]


_OPERANDS = (  # required tensors first (positional), then the optional ones in the kernel's relative order
    Operand.of("X", "B, S, H", doc="hidden states"),
    Operand.of("W_qkv", "H, I", dtypes=WEIGHT_DTYPES, doc="[H, d (q + 2)]: Q heads, K, V"),
    Operand.switched("K_cache", "K_cache_transposed", {False: "Bc, Sc, d", True: "Bc, d, Sc"}, dtypes=CACHE_DTYPES),
    Operand.of("V_cache", "Bc, Sc, d", dtypes=CACHE_DTYPES, doc="flat [B_attn, S_max, d] or block pool"),
    Operand.of("attention_mask", "S_ctx, Ba, Hq, S", dtypes=MASK_DTYPES),
    Operand.of("rmsnorm_X_gamma", "1, H", optional=True),
    Operand.of("bias_qkv", "1, I", optional=True),
    Operand.of("weight_dequant_scale_qkv", "wq, 3", dtypes=(jnp.float32,), optional=True, doc="STATIC: Q, K, V"),
    Operand.of("input_dequant_scale_qkv", "iq, 1", dtypes=(jnp.float32,), optional=True, doc="STATIC: [0, 0]"),
    Operand.of("rmsnorm_QK_pre_rope_W_Q", "1, d", optional=True),
    Operand.of("rmsnorm_QK_pre_rope_W_K", "1, d", optional=True),
    Operand.of("cos", "d/2, B, S", optional=True),
    Operand.of("sin", "d/2, B, S", optional=True),
    Operand.of("rmsnorm_QK_post_rope_W_Q", "1, d", optional=True),
    Operand.of("rmsnorm_QK_post_rope_W_K", "1, d", optional=True),
    Operand.of("active_blocks_table", "Ba, n_blocks", dtypes=INDEX_DTYPES, optional=True),
    Operand.of("sink", "Hq, 1", optional=True),
    Operand.of("kv_cache_update_idx", "Ba, 1", dtypes=INDEX_DTYPES, optional=True),
    Operand.of("W_out", "QD, H", dtypes=WEIGHT_DTYPES, optional=True),
    Operand.of("bias_out", "1, H", optional=True),
    Operand.of("weight_dequant_scale_out", "128, 1", dtypes=(jnp.float32,), optional=True, doc="STATIC: [0, 0]"),
    Operand.of("input_dequant_scale_out", "128, 1", dtypes=(jnp.float32,), optional=True, doc="STATIC: [0, 0]"),
    Operand.of("k_scale", "ks, 1", optional=True),
    Operand.of("v_scale", "vs, 1", optional=True),
)

_PARAMS = (
    Param("X_hidden_dim_actual", None, int, "unpadded H for the RMSNorm mean (default H)"),
    Param("rmsnorm_X_enabled", False, bool, "RMSNorm of X (with rmsnorm_X_gamma) before the projection"),
    Param("rmsnorm_X_eps", None, float, "epsilon of the RMSNorm of X (None: the kernel's 1e-3)"),
    Param("quantization_type_qkv", "NONE", QuantizationType, "NONE or STATIC (FP8 W_qkv)"),
    Param("rmsnorm_QK_pre_rope_enabled", False, bool),
    Param("rmsnorm_QK_pre_rope_eps", 1e-6, float),
    Param("rope_contiguous_layout", True, bool, "RoPE pairs (i, i + d/2); False: (2i, 2i + 1)"),
    Param("rmsnorm_QK_post_rope_enabled", False, bool),
    Param("rmsnorm_QK_post_rope_eps", 1e-6, float),
    Param("K_cache_transposed", False, bool, "flat K cache [B_attn, d, S_max]"),
    Param("update_cache", False, bool, "write the new tokens into the caches and return them (aliased)"),
    Param("quantization_type_out", "NONE", QuantizationType, "NONE or STATIC (FP8 W_out)"),
    Param("transposed_out", False, bool, "output [128, LNC, H / LNC / 128, B * S] (needs W_out)"),
    Param("out_in_sb", False, bool, "must be False (SBUF output)"),
    Param("softmax_scale", None, float, "scale of the scores (None: 1/sqrt(d))"),
    Param("enable_fa_s_prior_tiling", True, bool, "flash-attention tiling of S_ctx (block-mask order)"),
    Param("skip_attention", False, bool, "must be False (debug path)"),
    Param("KVDP", 1, int, "KV data-parallel ranks (B split over them)"),
    Param("KVDP_replica_group", None, "axis", "mesh axis name(s) of the KVDP ranks"),
)

ATTENTION_BLOCK_TKG_SPEC = KernelSpec(
    name="attention_block_tkg",
    entry_point="jax_nkilib_kernels.transformer:attention_block_tkg",
    operands=_OPERANDS,
    params=_PARAMS,
    outputs=(),
    output_avals=_outputs,
    reference=reference_attention_block_tkg,
    reference_takes_lnc=True,
    check=_check,
    neuron_limits=_neuron_limits,
    aliases={"K_cache": "K_cache", "V_cache": "V_cache"},
    has_collectives=lambda call: call.params["KVDP"] > 1,
    mac_count=_mac_count,
    family="transformer",
    catalog="1.20",
    support={
        "idiomatic": "decode_block",
        "vjp": "JAX (differentiates the reference, collectives included; no backward kernel)",
        "shard_map": "per-shard; KVDP > 1 inside jax.shard_map over KVDP_replica_group (all_gather)",
        "notes": "flat, transposed and block KV caches; update_cache aliases K_cache/V_cache; FP8 (float8_e4m3) "
        "KV with k_scale/v_scale; STATIC FP8 QKV/output projections (ROW/MX refused); out_in_sb and skip_attention "
        "refused; Neuron: trn2+, S_tkg <= 8, B_attn * q_attn * S_tkg <= 128, H % 128 == 0, QK norms need d = 128; "
        "device adapter jax_nkilib_kernels/transformer.py",
    },
)

attention_block_tkg = make_kernel(ATTENTION_BLOCK_TKG_SPEC, vjp=reference_vjp)
