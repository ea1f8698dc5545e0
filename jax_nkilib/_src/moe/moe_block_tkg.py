"""``moe_block_tkg`` (catalog 1.12; nki-library ``core/moe_block/moe_block_tkg.py``, torch ref
``moe_block_tkg_torch.py``): a whole token-generation MoE block in one kernel, RMSNorm -> router top-k -> experts.

Operands: ``inp [B, S, H]`` (``T = B*S`` tokens), ``gamma [1, H]``, ``router_weights [H, E]``, the expert weights,
biases and scales of :mod:`.moe_tkg` (``E_L`` experts here: dense, FP8 row, or MX x4 words), ``router_bias [1, E]``,
``rank_id [1, 1]`` (all-expert mode), ``residual [B, S, H]`` (MX all-expert mode only). Outputs ``out [T, H]``,
unless ``skip_router_logits`` ``router_logits [T, E]`` (both in ``inp``'s dtype), and with ``residual``
``residual_out [T, H] = inp + residual`` (in ``residual``'s dtype).

Math, per token (float32, float64 for float64 inputs; ``io`` = ``inp``'s dtype):

1. ``n = io(x * gamma / sqrt(sum(x^2) / hidden_actual + eps))`` (``rmsnorm_tkg``); on the MX all-expert path
   ``x = inp + residual`` and ``n = io(io(x * gamma) / sqrt(...))`` (``rmsnorm_mx_quantize_tkg``);
2. ``logits = router_mm_dtype(n) @ router_weights + router_bias``; ``router_logits = io(logits)``; ``index`` = the
   ``top_k`` largest logits (descending);
3. affinities ``[T, E]`` (float32): ``router_pre_norm=True``: ``act(logits)`` over all ``E`` (sigmoid per logit, or
   softmax), with ``norm_topk_prob`` the top-k entries divided by their sum and the others 0; ``False``: ``act`` of
   the top-k logits alone (softmax over the k), scattered to their experts, 0 elsewhere;
4. ``out = moe_tkg(n, ..., affinities, index, rank_id, is_all_expert, mask_unselected_experts = router_pre_norm and
   not norm_topk_prob, expert_affinities_scaling_mode, activation_fn = hidden_act_fn, clamps)`` (with MX weights,
   ``n`` and the intermediate take moe_tkg's MXFP8 round trips, as the torch ref composes them).

The kernel runs only at LNC 2 (it asserts it): at LNC 1 the Neuron lowering falls back to this reference with a
``NeuronFallbackWarning`` (or raises under ``on_unsupported="error"``). Placeholders the kernel refuses are refused
here: the shared expert (``shared_expert_*`` must be None) and ``hidden_act_scale_factor`` / ``hidden_act_bias``
(None); ``residual`` without MX all-expert weights is refused as the kernel refuses it. Reverse mode differentiates
this reference (straight through the MX round trips): the expert choice is piecewise constant; the affinities,
experts, norm, residual and router weights carry gradients.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import ActFnType, ExpertAffinityScaleMode, RouterActFnType
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import FLOAT_DTYPES, FP8_DTYPES, CallInfo, KernelSpec, Operand, Param, accumulation_dtype
from ..norm.rmsnorm_tkg import rms_statistics
from .moe_tkg import (
    CLAMP_PARAMS,
    EXPERT_BIASES_AND_SCALES,
    EXPERT_WEIGHT_OPERANDS,
    INDEX_DTYPES,
    KERNEL_HIDDEN_DTYPES,
    check_expert_flags,
    moe_tkg_forward,
    mx_format,
)
from .routing import rms_normalized_rows, route

HIDDEN_MULTIPLE = 256  # H % (128 * 2 cores)
MAX_TOKENS = 128
MX_TOKEN_MULTIPLE = 4  # MX all-expert: rmsnorm_mx_quantize_tkg's LNC=2 split of the rows
MAX_TOP_K = 8  # router_topk's limits
MAX_EXPERTS = 512
ROUTER_MM_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
PLACEHOLDER_OPERANDS = (
    "shared_expert_gate_w",
    "shared_expert_up_w",
    "shared_expert_down_w",
    "shared_expert_gate_bias",
    "shared_expert_up_bias",
    "shared_expert_down_bias",
)


def _normalized(inp, gamma, residual, p, mx_all_expert: bool):
    """``(normed [T, H] in io, residual_out [T, H] or None)``: RMSNorm as ``rmsnorm_tkg`` computes it, or, on the MX
    all-expert path, as ``rmsnorm_mx_quantize_tkg`` does (after the optional residual add, with ``x * gamma``
    rounded to io before the statistics multiply)."""
    io = inp.dtype
    if not mx_all_expert:
        return rms_normalized_rows(inp, gamma, p["eps"], p["hidden_actual"]).astype(io), None
    acc = accumulation_dtype(io)
    x = inp if residual is None else (inp.astype(acc) + residual.astype(acc)).astype(residual.dtype)
    rows = x.reshape(-1, x.shape[-1]).astype(acc)
    scaled = (rows * gamma.reshape(1, -1).astype(acc)).astype(io).astype(acc)
    normed = (scaled * rms_statistics(rows, p["hidden_actual"] or x.shape[-1], p["eps"])).astype(io)
    return normed, None if residual is None else x.reshape(rows.shape)


def reference_moe_block_tkg(inp, gamma, router_weights, expert_gate_up_weights, expert_down_weights, **rest):
    """JAX reference of ``moe_block_tkg``: ``(out [T, H], router_logits [T, E], residual_out [T, H])``, without
    ``router_logits`` when ``skip_router_logits`` and without ``residual_out`` when no ``residual`` is given."""
    named = dict(rest, inp=inp, gamma=gamma, router_weights=router_weights)
    named.update(expert_gate_up_weights=expert_gate_up_weights, expert_down_weights=expert_down_weights)
    return block_forward(named, {k: v for k, v in rest.items() if k not in _OPERAND_NAMES})


def block_forward(rest, p, exact: bool = False):
    """The block's outputs from operands by name ``rest`` and params ``p``; ``exact`` leaves out the MXFP8
    activation round trips of MX experts (the straight-through function the VJP differentiates)."""
    inp, gamma, router_weights = rest["inp"], rest["gamma"], rest["router_weights"]
    expert_gate_up_weights, expert_down_weights = rest["expert_gate_up_weights"], rest["expert_down_weights"]
    io, acc = inp.dtype, accumulation_dtype(inp.dtype)
    mx_all_expert = mx_format(expert_gate_up_weights.dtype) is not None and p["is_all_expert"]
    normed, residual_out = _normalized(inp, gamma, rest["residual"], p, mx_all_expert)
    logits, index, affinities = route(
        normed,
        router_weights,
        rest["router_bias"],
        top_k=p["top_k"],
        act_fn=p["router_act_fn"],
        pre_norm=p["router_pre_norm"],
        norm_topk=p["norm_topk_prob"],
        mm_dtype=p["router_mm_dtype"],
    )
    expert_params = dict(
        is_all_expert=p["is_all_expert"],
        mask_unselected_experts=p["router_pre_norm"] and not p["norm_topk_prob"],
        expert_affinities_scaling_mode=p["expert_affinities_scaling_mode"],
        activation_fn=p["hidden_act_fn"],
        **{param.name: p[param.name] for param in CLAMP_PARAMS},
    )
    operands = dict(
        hidden_input=normed,
        expert_gate_up_weights=expert_gate_up_weights,
        expert_down_weights=expert_down_weights,
        expert_affinities=affinities.astype(jnp.promote_types(acc, jnp.float32)),
        expert_index=index,
        rank_id=rest["rank_id"],
        **{op.name: rest[op.name] for op in EXPERT_BIASES_AND_SCALES},
    )
    outs = [moe_tkg_forward(operands, expert_params, exact=exact).astype(io)]
    if not p["skip_router_logits"]:
        outs.append(logits.astype(io))
    if residual_out is not None:
        outs.append(residual_out)
    return tuple(outs)


def check_block(call: CallInfo) -> None:
    check_expert_flags(call, "hidden_act_fn")
    mx = mx_format(call.avals["expert_gate_up_weights"].dtype) is not None
    p, f, dims = call.params, call.function, call.dims
    given = [name for name in PLACEHOLDER_OPERANDS if call.avals.get(name) is not None]
    if given:
        raise ValueError(f"{f}: the shared expert is a placeholder in the kernel: `{given[0]}` must be None")
    for name in ("hidden_act_scale_factor", "hidden_act_bias"):
        if p[name] is not None:
            raise ValueError(f"{f}: `{name}` is a placeholder in the kernel and must be None; got {p[name]}")
    if call.avals.get("residual") is not None and not (mx and p["is_all_expert"]):
        raise ValueError(f"{f}: `residual` (fused residual add) is only supported with MX weights in all-expert mode")
    if p["router_act_fn"] not in (RouterActFnType.SIGMOID, RouterActFnType.SOFTMAX):
        raise ValueError(f"{f}: `router_act_fn` must be SIGMOID or SOFTMAX; got {p['router_act_fn'].name}")
    if not 1 <= p["top_k"] <= dims["E"]:
        raise ValueError(f"{f}: `top_k` must be in [1, E={dims['E']}]; got {p['top_k']}")
    if p["is_all_expert"] and call.avals.get("rank_id") is None:
        raise ValueError(f"{f}: all-expert mode needs `rank_id` [1, 1] (this rank's block of E_L experts)")
    if not p["is_all_expert"] and dims["E_L"] != dims["E"]:
        raise ValueError(
            f"{f}: selective mode indexes the expert weights by the router's expert ids: E_L={dims['E_L']} "
            f"must equal the router's E={dims['E']}"
        )
    if p["hidden_actual"] is not None and not 0 < p["hidden_actual"] <= dims["H"]:
        raise ValueError(f"{f}: `hidden_actual` must be in [1, H={dims['H']}]; got {p['hidden_actual']}")
    if jnp.dtype(p["router_mm_dtype"]) not in FLOAT_DTYPES:
        raise TypeError(f"{f}: `router_mm_dtype` must be a float dtype; got {p['router_mm_dtype']}")


def block_neuron_limits(call: CallInfo) -> list[str]:
    p, dims, unmet = call.params, call.dims, []
    if call.lnc != 2:
        unmet.append(f"the kernel runs only with LNC=2; got LNC={call.lnc}")
    if jnp.dtype(call.avals["inp"].dtype) not in KERNEL_HIDDEN_DTYPES:
        unmet.append(f"the kernel takes bfloat16 or float16 inputs; got {call.avals['inp'].dtype}")
    if dims["H"] % HIDDEN_MULTIPLE:
        unmet.append(f"H % {HIDDEN_MULTIPLE} == 0 (128 partitions x 2 cores); got H={dims['H']}")
    tokens = dims["B"] * dims["S"]
    mx_all_expert = mx_format(call.avals["expert_gate_up_weights"].dtype) is not None and p["is_all_expert"]
    if mx_all_expert and tokens % MX_TOKEN_MULTIPLE:
        unmet.append(f"MX all-expert mode needs T = B*S % {MX_TOKEN_MULTIPLE} == 0; got T={tokens}")
    if not mx_all_expert and tokens > MAX_TOKENS:
        unmet.append(f"T = B*S <= {MAX_TOKENS} (except MX all-expert mode); got T={tokens}")
    if p["top_k"] > MAX_TOP_K or dims["E"] > MAX_EXPERTS:
        unmet.append(f"router top_k <= {MAX_TOP_K} and E <= {MAX_EXPERTS}; got top_k={p['top_k']}, E={dims['E']}")
    if jnp.dtype(p["router_mm_dtype"]) not in ROUTER_MM_DTYPES:
        unmet.append(f"router_mm_dtype must be bfloat16, float16 or float32; got {p['router_mm_dtype']}")
    return unmet


def block_outputs(call: CallInfo):
    dims, dtype = call.dims, call.avals["inp"].dtype
    tokens = dims["B"] * dims["S"]
    out = [("out", (tokens, dims["H"]), dtype)]
    if not call.params["skip_router_logits"]:
        out.append(("router_logits", (tokens, dims["E"]), dtype))
    if call.avals.get("residual") is not None:
        out.append(("residual_out", (tokens, dims["H"]), call.avals["residual"].dtype))
    return out


def block_mac_count(call: CallInfo) -> int:
    d = call.dims
    tokens, experts = d["B"] * d["S"], d["E_L"] if call.params["is_all_expert"] else call.params["top_k"]
    return tokens * d["H"] * (d["E"] + 3 * experts * d["I"])


MOE_BLOCK_TKG_SPEC = KernelSpec(
    name="moe_block_tkg",
    entry_point="nkilib.core.moe_block.moe_block_tkg:moe_block_tkg",
    operands=(
        Operand.of("inp", "B, S, H", doc="hidden states"),
        Operand.of("gamma", "1, H", doc="RMSNorm weight"),
        Operand.of("router_weights", "H, E", doc="router"),
        *EXPERT_WEIGHT_OPERANDS,
        Operand.of("shared_expert_gate_w", "H, I_S", optional=True, doc="placeholder: must be None"),
        Operand.of("shared_expert_up_w", "H, I_S", optional=True, doc="placeholder: must be None"),
        Operand.of("shared_expert_down_w", "I_S, H", optional=True, doc="placeholder: must be None"),
        EXPERT_BIASES_AND_SCALES[2],
        EXPERT_BIASES_AND_SCALES[3],
        Operand.of("router_bias", "1, E", optional=True, doc="router bias"),
        EXPERT_BIASES_AND_SCALES[0],
        EXPERT_BIASES_AND_SCALES[1],
        Operand.of("shared_expert_gate_bias", "1, I_S", optional=True, doc="placeholder: must be None"),
        Operand.of("shared_expert_up_bias", "1, I_S", optional=True, doc="placeholder: must be None"),
        Operand.of("shared_expert_down_bias", "1, H", optional=True, doc="placeholder: must be None"),
        Operand.of("rank_id", "1, 1", dtypes=INDEX_DTYPES, optional=True, doc="all-expert: this rank's block"),
        Operand.of("residual", "B, S, H", optional=True, doc="MX all-expert only: added to inp before the norm"),
    ),
    params=(
        Param("eps", 1e-6, float, "RMSNorm epsilon"),
        Param("top_k", 1, int, "experts per token"),
        Param("router_act_fn", RouterActFnType.SIGMOID, RouterActFnType, "SIGMOID or SOFTMAX"),
        Param("router_pre_norm", True, bool, "activation before the top-k (else on the top-k logits)"),
        Param("norm_topk_prob", False, bool, "renormalise the top-k affinities to sum to 1 (with pre-norm)"),
        Param(
            "expert_affinities_scaling_mode",
            ExpertAffinityScaleMode.NO_SCALE,
            ExpertAffinityScaleMode,
            "NO_SCALE or POST_SCALE",
        ),
        Param("hidden_act_fn", ActFnType.SiLU, ActFnType, "experts' gate activation"),
        Param("hidden_act_scale_factor", None, float, "placeholder: must be None"),
        Param("hidden_act_bias", None, float, "placeholder: must be None"),
        *CLAMP_PARAMS,
        Param("router_mm_dtype", jnp.bfloat16, "dtype", "dtype of the router matmul's inputs"),
        Param("hidden_actual", None, int, "unpadded H for the RMSNorm mean"),
        Param("skip_router_logits", False, bool, "return only out"),
        Param("is_all_expert", False, bool, "every local expert on every token"),
    ),
    outputs=(),
    output_avals=block_outputs,
    reference=reference_moe_block_tkg,
    check=check_block,
    neuron_limits=block_neuron_limits,
    mac_count=block_mac_count,
    family="moe",
    catalog="1.12",
    support={
        "idiomatic": "moe_block (decode at LNC 2)",
        "vjp": "JAX (the reference differentiated; no backward kernel)",
        "notes": "LNC=2 only (falls back at LNC 1); bf16/fp16, FP8-row and MXFP4/MXFP8 weights, selective and "
        "all-expert, MX all-expert residual add; the shared expert (a placeholder in the kernel) n/a; H % 256 == 0, "
        "T <= 128 (MX all-expert: T % 4 == 0)",
    },
)

_OPERAND_NAMES = tuple(op.name for op in MOE_BLOCK_TKG_SPEC.operands)


def block_vjp(kernel, operands, params, outs, cotangents):
    """Reverse mode of the reference, straight through the MX activation round trips (for dense weights, the
    reference itself)."""
    names = [
        name
        for name, value in operands.items()
        if value is not None and jnp.issubdtype(value.dtype, jnp.floating) and jnp.dtype(value.dtype) not in FP8_DTYPES
    ]
    return pull_back(lambda named: block_forward(named, params, exact=True), operands, names, cotangents)


moe_block_tkg = make_kernel(MOE_BLOCK_TKG_SPEC, block_vjp)
moe_block_tkg.__doc__ += "\nSemantics (from the module documentation):\n\n" + __doc__
