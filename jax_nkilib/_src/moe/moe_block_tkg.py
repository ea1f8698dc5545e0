"""``moe_block_tkg`` (catalog 1.12; nki-library ``core/moe_block/moe_block_tkg.py``, torch ref
``moe_block_tkg_torch.py``): a whole token-generation MoE block in one kernel, RMSNorm -> router top-k -> experts.

Operands: ``inp [B, S, H]`` (``T = B*S`` tokens), ``gamma [1, H]``, ``router_weights [H, E]``, the expert weights,
biases and FP8 row scales of :mod:`.moe_tkg` (``E_L`` experts here), ``router_bias [1, E]``, ``rank_id [1, 1]``
(all-expert mode). Outputs ``out [T, H]`` and, unless ``skip_router_logits``, ``router_logits [T, E]``, both in
``inp``'s dtype.

Math, per token (float32, float64 for float64 inputs; ``io`` = ``inp``'s dtype):

1. ``n = io(x * gamma / sqrt(sum(x^2) / hidden_actual + eps))`` (``rmsnorm_tkg``);
2. ``logits = router_mm_dtype(n) @ router_weights + router_bias``; ``router_logits = io(logits)``; ``index`` = the
   ``top_k`` largest logits (descending);
3. affinities ``[T, E]`` (float32): ``router_pre_norm=True``: ``act(logits)`` over all ``E`` (sigmoid per logit, or
   softmax), with ``norm_topk_prob`` the top-k entries divided by their sum and the others 0; ``False``: ``act`` of
   the top-k logits alone (softmax over the k), scattered to their experts, 0 elsewhere;
4. ``out = moe_tkg(n, ..., affinities, index, rank_id, is_all_expert, mask_unselected_experts = router_pre_norm and
   not norm_topk_prob, expert_affinities_scaling_mode, activation_fn = hidden_act_fn, clamps)``.

The kernel runs only at LNC 2 (it asserts it): at LNC 1 the Neuron lowering falls back to this reference with a
``NeuronFallbackWarning`` (or raises under ``on_unsupported="error"``). Placeholders the kernel refuses are refused
here: the shared expert (``shared_expert_*`` must be None), ``hidden_act_scale_factor`` / ``hidden_act_bias``
(None), and ``residual``, which the kernel takes only with MX weights (not bound here, like the MX weights
themselves). Reverse mode differentiates this reference: the expert choice is piecewise constant, the affinities,
experts, norm and router weights carry gradients.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import ActFnType, ExpertAffinityScaleMode, RouterActFnType
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import FLOAT_DTYPES, CallInfo, KernelSpec, Operand, Param, accumulation_dtype
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


def reference_moe_block_tkg(inp, gamma, router_weights, expert_gate_up_weights, expert_down_weights, **rest):
    """JAX reference of ``moe_block_tkg``: ``(out [T, H], router_logits [T, E])`` (``(out,)`` when
    ``skip_router_logits``)."""
    p = {k: v for k, v in rest.items() if k not in _OPERAND_NAMES}
    io, acc = inp.dtype, accumulation_dtype(inp.dtype)
    normed = rms_normalized_rows(inp, gamma, p["eps"], p["hidden_actual"]).astype(io)
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
    out = moe_tkg_forward(operands, expert_params).astype(io)
    return (out,) if p["skip_router_logits"] else (out, logits.astype(io))


def _check(call: CallInfo) -> None:
    check_expert_flags(call, "hidden_act_fn")
    if mx_format(call.avals["expert_gate_up_weights"].dtype) is not None:
        raise TypeError(
            f"{call.function}: MX expert weights (x4 words) are not bound for moe_block_tkg (its MX path quantizes "
            "and routes in other layouts); use dense or FP8-row weights"
        )
    p, f, dims = call.params, call.function, call.dims
    given = [name for name in PLACEHOLDER_OPERANDS if call.avals.get(name) is not None]
    if given:
        raise ValueError(f"{f}: the shared expert is a placeholder in the kernel: `{given[0]}` must be None")
    for name in ("hidden_act_scale_factor", "hidden_act_bias"):
        if p[name] is not None:
            raise ValueError(f"{f}: `{name}` is a placeholder in the kernel and must be None; got {p[name]}")
    if call.avals.get("residual") is not None:
        raise ValueError(f"{f}: `residual` (fused residual add) is only supported with MX expert weights (not bound)")
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


def _neuron_limits(call: CallInfo) -> list[str]:
    p, dims, unmet = call.params, call.dims, []
    if call.lnc != 2:
        unmet.append(f"the kernel runs only with LNC=2; got LNC={call.lnc}")
    if jnp.dtype(call.avals["inp"].dtype) not in KERNEL_HIDDEN_DTYPES:
        unmet.append(f"the kernel takes bfloat16 or float16 inputs; got {call.avals['inp'].dtype}")
    if dims["H"] % HIDDEN_MULTIPLE:
        unmet.append(f"H % {HIDDEN_MULTIPLE} == 0 (128 partitions x 2 cores); got H={dims['H']}")
    tokens = dims["B"] * dims["S"]
    if tokens > MAX_TOKENS:
        unmet.append(f"T = B*S <= {MAX_TOKENS} without MX weights; got T={tokens}")
    if p["top_k"] > MAX_TOP_K or dims["E"] > MAX_EXPERTS:
        unmet.append(f"router top_k <= {MAX_TOP_K} and E <= {MAX_EXPERTS}; got top_k={p['top_k']}, E={dims['E']}")
    if jnp.dtype(p["router_mm_dtype"]) not in ROUTER_MM_DTYPES:
        unmet.append(f"router_mm_dtype must be bfloat16, float16 or float32; got {p['router_mm_dtype']}")
    return unmet


def _outputs(call: CallInfo):
    dims, dtype = call.dims, call.avals["inp"].dtype
    tokens = dims["B"] * dims["S"]
    out = [("out", (tokens, dims["H"]), dtype)]
    return out if call.params["skip_router_logits"] else out + [("router_logits", (tokens, dims["E"]), dtype)]


def _mac_count(call: CallInfo) -> int:
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
        Operand.of("residual", "B, S, H", optional=True, doc="MX all-expert only: must be None here"),
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
    output_avals=_outputs,
    reference=reference_moe_block_tkg,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=_mac_count,
    family="moe",
    catalog="1.12",
    support={
        "vjp": "JAX (the reference differentiated; no backward kernel)",
        "notes": "LNC=2 only (falls back at LNC 1); bf16/fp16 and FP8-row weights, selective and all-expert; "
        "MX weights, residual add and the shared expert (a placeholder in the kernel) n/a; H % 256 == 0, T <= 128",
    },
)

_OPERAND_NAMES = tuple(op.name for op in MOE_BLOCK_TKG_SPEC.operands)

moe_block_tkg = make_kernel(MOE_BLOCK_TKG_SPEC, reference_vjp)
moe_block_tkg.__doc__ += "\nSemantics (from the module documentation):\n\n" + __doc__
