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

Reverse mode: JAX math written from this formula (differentiable in ``x``, ``w``, ``w_bias`` through the logits and
the affinities; ``expert_index`` carries no gradient). It starts from the saved selection and, for float32/float64
inputs, the saved ``router_logits`` (no second matmul); bfloat16/float16 logits are recomputed wide instead of
differentiating their rounded copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.common_types import RouterActFnType
from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel
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
    return jnp.zeros((values.shape[0], experts), values.dtype).at[rows, index].set(values, unique_indices=True)


def router_logits_wide(x, w, w_bias, x_hbm_layout: int):
    """``x^T w + w_bias`` as ``[T, E]`` in the accumulation dtype."""
    wide = accumulation_dtype(x.dtype)
    spec = "ht,he->te" if x_hbm_layout == 0 else "th,he->te"
    logits = jnp.einsum(spec, x, w, preferred_element_type=wide, precision=jax.lax.Precision.HIGHEST)
    if w_bias is not None:
        logits = logits + w_bias.reshape(1, -1).astype(wide)
    return logits


def selected_affinities(logits, index, params):
    """``(expert_affinities [T, E], top-K affinities [T, K] or None)`` of wide ``logits`` for the selection
    ``index [T, K]`` (differentiable in ``logits``)."""
    act_fn = params["act_fn"]
    if params["router_pre_norm"]:
        full = activate(logits, act_fn)
        if not params["norm_topk_prob"]:
            return full, None
        top = jnp.take_along_axis(full, index, axis=-1)
        weights = top / jnp.sum(top, axis=-1, keepdims=True)
    else:
        weights = activate(jnp.take_along_axis(logits, index, axis=-1), act_fn)
    return scatter_topk(weights, index, logits.shape[-1]), weights


def select(logits, params):
    """``expert_index [T, K]`` int32: top-K of the activated scores (``router_pre_norm``) or of the logits."""
    scores = activate(logits, params["act_fn"]) if params["router_pre_norm"] else logits
    return jax.lax.top_k(scores, params["k"])[1]


def reference_router_topk(x, w, w_bias=None, **params):
    """JAX reference: ``(router_logits, expert_index, expert_affinities[, expert_affinities_topk])``."""
    logits = router_logits_wide(x, w, w_bias, params["x_hbm_layout"])
    index = select(logits, params)
    affinities, weights = selected_affinities(logits, index, params)
    outs = (logits.astype(x.dtype), index.astype(jnp.uint32), affinities.astype(x.dtype))
    return outs + ((weights.astype(accumulation_dtype(x.dtype)),) if params["return_eager_affi"] else ())


def _router_topk_vjp(kernel, operands, params, outs, cotangents):
    """``d logits`` through the activation, the normalisation and the scatter for the saved selection, from the
    saved ``router_logits`` for float32/float64 inputs (exact: no second matmul) and from recomputed wide logits for
    bfloat16/float16 ones (whose saved logits are rounded); then ``dx = d logits w^T``, ``dw = x^T d logits``,
    ``dw_bias = sum_T d logits``."""
    x, w, bias = operands["x"], operands["w"], operands["w_bias"]
    wide = accumulation_dtype(x.dtype)
    index = outs[1].astype(jnp.int32)
    eager = params["return_eager_affi"]

    def affinity_outputs(logits):
        affinities, weights = selected_affinities(logits, index, params)
        return (affinities.astype(x.dtype),) + ((weights.astype(wide),) if eager else ())

    if jnp.finfo(x.dtype).bits >= 32:  # router_logits hold the wide logits exactly
        logits = outs[0].astype(wide)
    else:  # rounded to 8 or 11 bits: recompute them (one matmul) rather than differentiate rounded values
        logits = router_logits_wide(x, w, bias, params["x_hbm_layout"])
    primal, pull = jax.vjp(affinity_outputs, logits)
    wanted = (cotangents[2],) + ((cotangents[3],) if eager else ())
    (d_logits,) = pull(tuple(jnp.zeros_like(p) if c is None else c.astype(p.dtype) for c, p in zip(wanted, primal)))
    if cotangents[0] is not None:
        d_logits = d_logits + cotangents[0].astype(wide)
    product = dict(preferred_element_type=wide, precision=jax.lax.Precision.HIGHEST)
    tokens_first = params["x_hbm_layout"] == 1
    d_x = jnp.einsum("te,he->th" if tokens_first else "te,he->ht", d_logits, w, **product)
    d_w = jnp.einsum("th,te->he" if tokens_first else "ht,te->he", x, d_logits, **product)
    grads = {"x": d_x, "w": d_w}
    if bias is not None:
        grads["w_bias"] = jnp.sum(d_logits, axis=0).reshape(bias.shape)
    return grads


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
        "vjp": "JAX (hand-written from the formula, from the saved selection and logits; no backward kernel)",
        "notes": f"k <= {MAX_K}, {MIN_EXPERTS} <= E <= {MAX_EXPERTS}, H % 128 == 0 on Neuron "
        f"(T > {MAX_TOKENS} split along T); "
        "router_pre_norm without norm_topk_prob returns the full activation; norm_topk_prob is ignored without "
        "router_pre_norm; SBUF x / SBUF outputs n/a; device adapter jax_nkilib_kernels/routing.py",
    },
)

router_topk = make_kernel(ROUTER_TOPK_SPEC, _router_topk_vjp)
