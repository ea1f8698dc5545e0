"""The fused RMSNorm + router top-k kernels of the expert-parallel decode path (docs-only, catalog rows 73 and 74;
NKI Library API reference 2.32 ``rmsnorm-router-topk-a2av.rst`` / ``rmsnorm-router-topk-tkg.rst``, sources
``experimental/moe_block/rmsnorm_router_topk_{a2av,tkg}.py`` of newer nki-library commits).

Both take ``hidden_states [B, S, H]``, ``gamma [1, H]``, ``router_weights [H, E]``, ``router_bias [1, E]`` and return
``(norm_output [T, H], expert_index [T, K] int32, expert_affinities [T, E] bfloat16)``, ``T = B*S``, with the math
of :mod:`.routing` in its "ACT2" form: the top-k of the logits, then the activation of those k alone (sigmoid each,
or softmax over the k), zero for the other experts.

* ``rmsnorm_router_topk_a2av``: the norm output and the router input are in the input dtype; RMSNorm over all of H.
  Both cores compute everything (any LNC); Neuron limits T <= 128, H % 128 == 0.
* ``rmsnorm_router_topk_tkg``: ``hidden_actual``; the norm output and the router input are in ``router_mm_dtype``.
  ``quantization_type=MX`` (an FP8 ``[T, H + H/4]`` packing of quantized values and scales whose layout the docs do
  not give) is not bound: only ``NONE``. Neuron limits: LNC = 2 (the kernel requires it), H % 128 == 0, T a multiple
  of 256.

The expert ids are not differentiable; the norm output and the affinities are (through the chosen logits).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.common_types import QuantizationType, RouterActFnType
from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import FLOAT_DTYPES, CallInfo, KernelSpec, Operand, Param
from .routing import rms_normalized_rows, route

MAX_TOKENS = 128  # rmsnorm_router_topk_a2av: one tile of tokens
DLOC_TOKEN_MULTIPLE = 256  # rmsnorm_router_topk_tkg (NONE): the DLoC RMSNorm's token tiling
MAX_TOP_K = 8
AFFINITY_DTYPE = jnp.bfloat16
HIDDEN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _normalize_and_route(hidden_states, gamma, router_weights, router_bias, p, *, hidden_actual, norm_dtype):
    normed = rms_normalized_rows(hidden_states, gamma, p["eps"], hidden_actual)
    router_in = normed.astype(hidden_states.dtype)
    _, index, affinities = route(
        router_in,
        router_weights,
        router_bias,
        top_k=p["top_k"],
        act_fn=p["router_act_fn"],
        pre_norm=False,
        norm_topk=False,
        mm_dtype=norm_dtype,
    )
    return normed.astype(norm_dtype), index.astype(jnp.int32), affinities.astype(AFFINITY_DTYPE)


def reference_rmsnorm_router_topk_a2av(hidden_states, gamma, router_weights, router_bias=None, **p):
    """JAX reference: ``(norm_output [T, H], expert_index [T, K], expert_affinities [T, E])``."""
    return _normalize_and_route(
        hidden_states, gamma, router_weights, router_bias, p, hidden_actual=None, norm_dtype=hidden_states.dtype
    )


def reference_rmsnorm_router_topk_tkg(hidden_states, gamma, router_weights, router_bias=None, **p):
    """JAX reference: ``(norm_output [T, H], expert_index [T, K], expert_affinities [T, E])``."""
    return _normalize_and_route(
        hidden_states,
        gamma,
        router_weights,
        router_bias,
        p,
        hidden_actual=p["hidden_actual"],
        norm_dtype=jnp.dtype(p["router_mm_dtype"]),
    )


def _check(call: CallInfo) -> None:
    p, f, dims = call.params, call.function, call.dims
    if p["router_act_fn"] not in (RouterActFnType.SIGMOID, RouterActFnType.SOFTMAX):
        raise ValueError(f"{f}: `router_act_fn` must be SIGMOID or SOFTMAX; got {p['router_act_fn'].name}")
    if not 1 <= p["top_k"] <= dims["E"]:
        raise ValueError(f"{f}: `top_k` must be in [1, E={dims['E']}]; got {p['top_k']}")
    if p.get("quantization_type", QuantizationType.NONE) != QuantizationType.NONE:
        raise ValueError(
            f"{f}: `quantization_type` NONE only: the MX output packing [T, H + H/4] is not bound (its layout is "
            f"not documented); got {p['quantization_type'].name}"
        )
    if p.get("hidden_actual") is not None and not 0 < p["hidden_actual"] <= dims["H"]:
        raise ValueError(f"{f}: `hidden_actual` must be in [1, H={dims['H']}]; got {p['hidden_actual']}")
    if "router_mm_dtype" in p and jnp.dtype(p["router_mm_dtype"]) not in FLOAT_DTYPES:
        raise TypeError(f"{f}: `router_mm_dtype` must be a float dtype; got {p['router_mm_dtype']}")


def _common_limits(call: CallInfo) -> list[str]:
    unmet, dims = [], call.dims
    if jnp.dtype(call.avals["hidden_states"].dtype) not in HIDDEN_DTYPES:
        unmet.append(f"bfloat16 or float16 hidden states; got {call.avals['hidden_states'].dtype}")
    if dims["H"] % PARTITIONS:
        unmet.append(f"H % {PARTITIONS} == 0; got H={dims['H']}")
    if call.params["top_k"] > MAX_TOP_K:
        unmet.append(f"top_k <= {MAX_TOP_K}; got {call.params['top_k']}")
    return unmet


def _a2av_limits(call: CallInfo) -> list[str]:
    tokens = call.dims["B"] * call.dims["S"]
    return _common_limits(call) + ([f"T = B*S <= {MAX_TOKENS}; got T={tokens}"] if tokens > MAX_TOKENS else [])


def _tkg_limits(call: CallInfo) -> list[str]:
    unmet, tokens = _common_limits(call), call.dims["B"] * call.dims["S"]
    if call.lnc != 2:
        unmet.append(f"the kernel runs only with LNC=2; got LNC={call.lnc}")
    if tokens % DLOC_TOKEN_MULTIPLE:
        unmet.append(f"T = B*S must be a multiple of {DLOC_TOKEN_MULTIPLE}; got T={tokens}")
    if jnp.dtype(call.params["router_mm_dtype"]) not in (*HIDDEN_DTYPES, jnp.dtype(jnp.float32)):
        unmet.append(f"router_mm_dtype bfloat16, float16 or float32; got {call.params['router_mm_dtype']}")
    return unmet


def _outputs(norm_dtype):
    def outputs(call: CallInfo):
        dims, tokens = call.dims, call.dims["B"] * call.dims["S"]
        return [
            ("norm_output", (tokens, dims["H"]), norm_dtype(call)),
            ("expert_index", (tokens, call.params["top_k"]), jnp.int32),
            ("expert_affinities", (tokens, dims["E"]), AFFINITY_DTYPE),
        ]

    return outputs


_OPERANDS = (
    Operand.of("hidden_states", "B, S, H", doc="hidden states"),
    Operand.of("gamma", "1, H", doc="RMSNorm weight"),
    Operand.of("router_weights", "H, E", doc="router"),
    Operand.of("router_bias", "1, E", optional=True, doc="router bias"),
)
_EPS_TOP_K = (Param("eps", 1e-6, float, "RMSNorm epsilon"), Param("top_k", 1, int, "experts per token"))
_ACT = Param("router_act_fn", RouterActFnType.SIGMOID, RouterActFnType, "SIGMOID or SOFTMAX (of the top-k logits)")
_COMMON = dict(
    outputs=(),
    check=_check,
    nondifferentiable_outputs=("expert_index",),
    mac_count=lambda call: call.dims["B"] * call.dims["S"] * call.dims["H"] * (call.dims["E"] + 3),
    family="moe",
    catalog="3",
)

RMSNORM_ROUTER_TOPK_A2AV_SPEC = KernelSpec(
    name="rmsnorm_router_topk_a2av",
    entry_point="nkilib.experimental.moe_block.rmsnorm_router_topk_a2av:rmsnorm_router_topk_a2av",
    operands=_OPERANDS,
    params=(*_EPS_TOP_K, _ACT),
    output_avals=_outputs(lambda call: call.avals["hidden_states"].dtype),
    reference=reference_rmsnorm_router_topk_a2av,
    neuron_limits=_a2av_limits,
    neuron_split_dims=("B",),
    support={
        "vjp": "JAX (the reference differentiated; expert ids not differentiable)",
        "notes": "docs-only (NKI Library 2.32): bound from the API reference and the newer source; falls back where "
        "the installed library lacks it; T <= 128, H % 128 == 0",
    },
    **_COMMON,
)

RMSNORM_ROUTER_TOPK_TKG_SPEC = KernelSpec(
    name="rmsnorm_router_topk_tkg",
    entry_point="nkilib.experimental.moe_block.rmsnorm_router_topk_tkg:rmsnorm_router_topk_tkg",
    operands=_OPERANDS,
    params=(
        *_EPS_TOP_K,
        Param("hidden_actual", None, int, "unpadded H for the RMSNorm mean"),
        Param("quantization_type", QuantizationType.NONE, QuantizationType, "NONE (MX not bound)"),
        Param("router_mm_dtype", jnp.bfloat16, "dtype", "dtype of the norm output and the router matmul's inputs"),
        _ACT,
    ),
    output_avals=_outputs(lambda call: call.params["router_mm_dtype"]),
    reference=reference_rmsnorm_router_topk_tkg,
    neuron_limits=_tkg_limits,
    support={
        "vjp": "JAX (the reference differentiated; expert ids not differentiable)",
        "notes": "docs-only (NKI Library 2.32): bound from the API reference and the newer source; LNC=2 only, "
        "T % 256 == 0, H % 128 == 0; quantization_type=MX (packed FP8 output) not bound",
    },
    **_COMMON,
)


def _float_outputs_vjp(kernel, operands, params, outs, cotangents):
    """The reference differentiated through ``norm_output`` and ``expert_affinities`` (the expert ids, integers,
    carry no cotangent)."""
    norm, _, affinities = cotangents
    names = [name for name, value in operands.items() if value is not None]
    floats = lambda named: (lambda out: (out[0], out[2]))(kernel.reference(named, params))  # noqa: E731
    return pull_back(floats, operands, names, (norm, affinities))


rmsnorm_router_topk_a2av = make_kernel(RMSNORM_ROUTER_TOPK_A2AV_SPEC, _float_outputs_vjp)
rmsnorm_router_topk_tkg = make_kernel(RMSNORM_ROUTER_TOPK_TKG_SPEC, _float_outputs_vjp)
for _kernel in (rmsnorm_router_topk_a2av, rmsnorm_router_topk_tkg):
    _kernel.__doc__ += "\nSemantics (from the module documentation):\n\n" + __doc__
