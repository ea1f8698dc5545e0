"""``router_topk`` (catalog row 17, section 1.17): the MoE router, logits then top-K expert selection.

Source: nki-library ``src/nkilib_src/nkilib/core/router_topk/router_topk.py`` (its torch reference
``router_topk_torch.py`` and ``test/integration/nkilib/core/router_topk``). A destination-passing subkernel: the
device adapter ``jax_nkilib_kernels/routing.py`` allocates its outputs and returns them.

Layouts: ``x [H, T]`` (``x_hbm_layout=0``) or ``[T, H]`` (``x_hbm_layout=1``), ``w [H, E]``, ``w_bias [1, E]`` or
``[E]`` (optional). Outputs, in the kernel's order:

* ``router_logits [T, E]`` in ``x``'s dtype: ``l = x^T w + w_bias`` (float32 accumulation);
* ``expert_index [T, K]`` uint32: the K selected experts, by descending score;
* ``expert_affinities [T, E]`` in ``x``'s dtype;
* ``expert_affinities_topk [T, K]`` float32, only with ``return_eager_affi`` (the selected experts' affinities).

Math (all in float32, float64 for float64 inputs; ``act`` is ``act_fn``: SOFTMAX over the last axis or SIGMOID):

* ``router_pre_norm=True``: ``a = act(l)`` over all E experts; ``expert_index = top_k(a)``. With
  ``norm_topk_prob=False`` **``expert_affinities = a``, the full activation, nothing scattered**; with
  ``norm_topk_prob=True`` ``expert_affinities`` holds ``a_i / sum_topk(a)`` at the selected experts, 0 elsewhere.
* ``router_pre_norm=False``: ``expert_index = top_k(l)`` and ``expert_affinities`` holds ``act(l_topk)`` (softmax
  over the K selected logits, or their sigmoid) at the selected experts, 0 elsewhere. **``norm_topk_prob`` is
  ignored** on this path (the kernel enables its normalisation only after a pre-top-K activation).

The bias is part of the logits: it moves the selection, the affinities and ``router_logits``. Ties between scores
are broken towards the lower expert index here; the kernel's ``max8``/``find_index8`` order on ties is not
documented. ``x_sb_layout``, ``use_column_tiling``, ``use_indirect_dma_scatter``, ``use_PE_broadcast_w_bias`` and
``shard_on_tokens`` only change how the kernel runs. ``skip_store_router_logits=True`` is refused by the kernel and
``skip_store_expert_index=True`` leaves ``expert_index`` unwritten: both raise here. ``return_eager_affi`` needs
``T <= 128`` (the kernel's ``[T, K]`` layout) and a path that computes the top-K affinities
(``router_pre_norm=False`` or ``norm_topk_prob=True``).

Reverse mode: JAX math through this reference (differentiable in ``x``, ``w``, ``w_bias`` through the logits and the
affinities; ``expert_index`` carries no gradient).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.common_types import RouterActFnType
from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import NEURON_FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype

MAX_K = 8  # the kernel's max8 instruction
MAX_EXPERTS = 512  # gemm moving free size
MIN_EXPERTS = 8  # nisa.max8 reads 8 to 16384 values per partition (token)
MAX_TOKENS = 2048  # the kernel's intended range (docstring); longer calls are split along T
SUPPORTED_ACTIVATIONS = (RouterActFnType.SOFTMAX, RouterActFnType.SIGMOID)


def activate(values, act_fn: RouterActFnType):
    """The router activation over the last axis: softmax, or the elementwise sigmoid."""
    if act_fn == RouterActFnType.SOFTMAX:
        return jax.nn.softmax(values, axis=-1)
    return jax.nn.sigmoid(values)


def scatter_topk(values, index, experts: int):
    """``[T, E]`` zeros with ``values [T, K]`` at the columns ``index [T, K]``."""
    rows = jnp.arange(values.shape[0])[:, None]
    return jnp.zeros((values.shape[0], experts), values.dtype).at[rows, index].set(values)


def router_logits_wide(x, w, w_bias, x_hbm_layout: int):
    """``x^T w + w_bias`` as ``[T, E]`` in the accumulation dtype."""
    wide = accumulation_dtype(x.dtype)
    spec = "ht,he->te" if x_hbm_layout == 0 else "th,he->te"
    logits = jnp.einsum(spec, x, w, preferred_element_type=wide, precision=jax.lax.Precision.HIGHEST)
    if w_bias is not None:
        logits = logits + w_bias.reshape(1, -1).astype(wide)
    return logits


def route(logits, act_fn, k: int, router_pre_norm: bool, norm_topk_prob: bool):
    """``(expert_index [T, K], expert_affinities [T, E], top-K affinities [T, K] or None)`` from wide logits."""
    experts = logits.shape[-1]
    if router_pre_norm:
        full = activate(logits, act_fn)
        top, index = jax.lax.top_k(full, k)
        if not norm_topk_prob:
            return index, full, None
        weights = top / jnp.sum(top, axis=-1, keepdims=True)
    else:
        top, index = jax.lax.top_k(logits, k)
        weights = activate(top, act_fn)
    return index, scatter_topk(weights, index, experts), weights


def _differentiable_outputs(x, w, w_bias, params):
    """``(router_logits, expert_affinities[, expert_affinities_topk])`` and ``expert_index``."""
    logits = router_logits_wide(x, w, w_bias, params["x_hbm_layout"])
    index, affinities, weights = route(
        logits, params["act_fn"], params["k"], params["router_pre_norm"], params["norm_topk_prob"]
    )
    outs = (logits.astype(x.dtype), affinities.astype(x.dtype))
    if params["return_eager_affi"]:
        outs += (weights.astype(accumulation_dtype(x.dtype)),)
    return outs, index


def reference_router_topk(x, w, w_bias=None, **params):
    """JAX reference: ``(router_logits, expert_index, expert_affinities[, expert_affinities_topk])``."""
    outs, index = _differentiable_outputs(x, w, w_bias, params)
    return (outs[0], index.astype(jnp.uint32)) + outs[1:]


def _router_topk_vjp(kernel, operands, params, outs, cotangents):
    """Pull back through the logits, the activation and the scatter (``expert_index`` has none)."""
    names = [name for name in ("x", "w", "w_bias") if operands[name] is not None]
    wanted = (cotangents[0], cotangents[2]) + tuple(cotangents[3:])
    return pull_back(
        lambda named: _differentiable_outputs(named["x"], named["w"], named["w_bias"], params)[0],
        operands,
        names,
        wanted,
    )


def _tokens(call: CallInfo) -> int:
    return call.dims["T"]


def _check(call: CallInfo) -> None:
    p, function, dims = call.params, call.function, call.dims
    if p["act_fn"] not in SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{function}: act_fn must be SOFTMAX or SIGMOID (the kernel's two); got {p['act_fn'].name}")
    if np.dtype(call.avals["x"].dtype) != np.dtype(call.avals["w"].dtype):
        raise TypeError(
            f"{function}: `x` and `w` must have the same dtype (the kernel asserts it); got "
            f"{call.avals['x'].dtype} and {call.avals['w'].dtype}"
        )
    if not 1 <= p["k"] <= dims["E"]:
        raise ValueError(f"{function}: parameter `k` must be in [1, E={dims['E']}]; got {p['k']}")
    if p["skip_store_router_logits"]:
        raise ValueError(f"{function}: skip_store_router_logits=True is refused by the kernel (NCC_IGCA090)")
    if p["skip_store_expert_index"]:
        raise ValueError(
            f"{function}: skip_store_expert_index=True leaves the `expert_index` output unwritten; it is not "
            "supported (the output would be undefined)"
        )
    if p["return_eager_affi"]:
        if p["router_pre_norm"] and not p["norm_topk_prob"]:
            raise ValueError(
                f"{function}: return_eager_affi needs router_pre_norm=False or norm_topk_prob=True (with "
                "router_pre_norm=True and norm_topk_prob=False the kernel never computes the top-K affinities)"
            )
        if dims["T"] > PARTITIONS:
            raise ValueError(
                f"{function}: return_eager_affi needs T <= {PARTITIONS} (its output is [T, K] only then); "
                f"got T={dims['T']}"
            )


def _neuron_limits(call: CallInfo) -> list[str]:
    p, dims, unmet = call.params, call.dims, []
    t = dims["T"]
    if p["k"] > MAX_K:
        unmet.append(f"k={p['k']} must be <= {MAX_K}")
    if not MIN_EXPERTS <= dims["E"] <= MAX_EXPERTS:
        unmet.append(f"E={dims['E']} must be in [{MIN_EXPERTS}, {MAX_EXPERTS}]")
    if dims["H"] % PARTITIONS:
        unmet.append(f"H={dims['H']} must be a multiple of {PARTITIONS}")
    if t > MAX_TOKENS:
        unmet.append(f"T={t} must be <= {MAX_TOKENS}")
    if np.dtype(call.avals["x"].dtype) not in NEURON_FLOAT_DTYPES:
        unmet.append(f"dtype {call.avals['x'].dtype} is not a Neuron dtype")
    if p["act_fn"] == RouterActFnType.SIGMOID and not p["router_pre_norm"] and not p["use_indirect_dma_scatter"]:
        unmet.append("SIGMOID with router_pre_norm=False needs use_indirect_dma_scatter=True")
    local = t // 2 if p["shard_on_tokens"] else t
    if p["use_indirect_dma_scatter"] and local > PARTITIONS and local % PARTITIONS:
        unmet.append(f"use_indirect_dma_scatter needs T per core ({local}) <= 128 or a multiple of 128")
    if p["shard_on_tokens"] and (call.lnc < 2 or t % 2):
        unmet.append(f"shard_on_tokens needs LNC=2 and an even T; got LNC={call.lnc}, T={t}")
    return unmet


def _outputs(call: CallInfo):
    """``router_logits [T, E]``, ``expert_index [T, K]`` uint32, ``expert_affinities [T, E]`` (x's dtype), and
    ``expert_affinities_topk [T, K]`` (float32; float64 for float64 x) with ``return_eager_affi``."""
    t, e, k, dtype = call.dims["T"], call.dims["E"], call.params["k"], call.avals["x"].dtype
    outs = [
        ("router_logits", (t, e), dtype),
        ("expert_index", (t, k), jnp.uint32),
        ("expert_affinities", (t, e), dtype),
    ]
    if call.params["return_eager_affi"]:
        outs.append(("expert_affinities_topk", (t, k), accumulation_dtype(dtype)))
    return outs


ROUTER_TOPK_SPEC = KernelSpec(
    name="router_topk",
    entry_point="jax_nkilib_kernels.routing:router_topk",
    operands=(
        Operand.switched("x", "x_hbm_layout", {0: "H, T", 1: "T, H"}, doc="tokens' hidden states"),
        Operand.of("w", "H, E", doc="router weights"),
        Operand.of("w_bias", "1, E", "E", optional=True, doc="router bias, added to the logits"),
    ),
    params=(
        Param("act_fn", None, RouterActFnType, "SOFTMAX or SIGMOID", required=True),
        Param("k", None, int, "experts selected per token (the kernel: <= 8)", required=True),
        Param("x_hbm_layout", None, (0, 1), "0: x is [H, T]; 1: x is [T, H]", required=True),
        Param("x_sb_layout", None, (0, 1, 2), "SBUF layout of an SBUF x (no effect on an HBM x)", required=True),
        Param("router_pre_norm", True, bool, "activation before top-K (else after, on the K logits)"),
        Param("norm_topk_prob", False, bool, "L1-normalise the top-K affinities (router_pre_norm only)"),
        Param("use_column_tiling", False, bool, "PE-array column tiling for small T (no numeric effect)"),
        Param("use_indirect_dma_scatter", False, bool, "indirect-DMA scatter (no numeric effect)"),
        Param("return_eager_affi", False, bool, "also return the top-K affinities [T, K] float32"),
        Param("use_PE_broadcast_w_bias", False, bool, "broadcast the bias on the tensor engine (no numeric effect)"),
        Param("shard_on_tokens", False, bool, "LNC=2: split T over the two cores (no numeric effect)"),
        Param("skip_store_expert_index", False, bool, "not supported: expert_index would be unwritten"),
        Param("skip_store_router_logits", False, bool, "refused by the kernel"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_router_topk,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {"x": "T", "w": None, "w_bias": None},
            outputs={"router_logits": 0, "expert_index": 0, "expert_affinities": 0, "expert_affinities_topk": 0},
            when=lambda call: not call.params["return_eager_affi"],
        ),
    ),
    neuron_split_dims=("T",),
    mac_count=lambda call: call.dims["T"] * call.dims["H"] * call.dims["E"],
    nondifferentiable_outputs=("expert_index",),
    family="moe",
    catalog="1.17",
    support={
        "idiomatic": "router",
        "vjp": "JAX (through the reference's logits, activation and scatter; no backward kernel)",
        "notes": f"k <= {MAX_K}, {MIN_EXPERTS} <= E <= {MAX_EXPERTS}, H % 128 == 0 on Neuron "
        f"(T > {MAX_TOKENS} split along T); "
        "router_pre_norm without norm_topk_prob returns the full activation; norm_topk_prob is ignored without "
        "router_pre_norm; SBUF x / SBUF outputs n/a; device adapter jax_nkilib_kernels/routing.py",
    },
)

router_topk = make_kernel(ROUTER_TOPK_SPEC, _router_topk_vjp)
