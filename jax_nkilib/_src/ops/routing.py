"""Routing and selection in JAX layouts: ``topk``, ``argmax`` and the mixture-of-experts ``router``.

Each works over the last axis of its input, with any leading axes (folded into the kernels' token axis). On Neuron
``topk`` is the ``topk`` kernel, ``argmax`` is ``cascaded_max`` (or ``topk`` with k=1 past its limits) and ``router``
is ``router_topk``; elsewhere the
kernels' JAX references run. The kernels' uint32 indices are returned as int32 (like ``jax.lax.top_k``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.common_types import RouterActFnType
from ..framework.spec import FLOAT_DTYPES, accumulation_dtype
from ..framework.validation import check_operand_layouts, static_bool, static_int
from ..moe.cascaded_max import cascaded_max
from ..moe.router_topk import activate, router_topk
from ..moe.topk import topk as topk_kernel
from ..sharding import auto

ACTIVATIONS = {"softmax": RouterActFnType.SOFTMAX, "sigmoid": RouterActFnType.SIGMOID}

TOPK_SHARDING = auto.register_rule(auto.ShardingRule("jax_nkilib.topk", free=auto.LEADING))
ARGMAX_SHARDING = auto.register_rule(auto.ShardingRule("jax_nkilib.argmax", free=auto.LEADING))
ROUTER_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.router",
        free=auto.LEADING,
        note="tokens shard freely; w_router, bias and selection_bias are replicated",
    )
)


class Routing(NamedTuple):
    """A router's decision for each token (the contract ``jax_nkilib.moe`` consumes).

    Attributes:
      indices: ``[..., top_k]`` int32, the selected experts by descending score.
      weights: ``[..., top_k]`` in ``x``'s dtype, the routing weight of each selected expert.
      logits: ``[..., num_experts]`` in ``x``'s dtype, ``x @ w_router + bias``.
    """

    indices: jax.Array
    weights: jax.Array
    logits: jax.Array


def _check_x(where: str, x):
    check_operand_layouts(where, {"x": "..., V"}, dtypes=None, positive=("V",), x=x)
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"{where}: `x` [..., V] must have a floating or integer dtype; got {x.dtype}")
    auto.leading(x.ndim - 1, where)
    return x


def _kernel_dtype(x) -> bool:
    """Whether the kernels take ``x``'s dtype (the other floats and integers run in XLA)."""
    return np.dtype(x.dtype) in FLOAT_DTYPES


def _rows(x):
    """``x [..., V]`` as ``[R, V]``."""
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


def topk(x, k: int):
    """The ``k`` largest values along the last axis and their indices, like ``jax.lax.top_k``.

    Args:
      x: ``[..., V]``, any float or integer dtype.
      k: a static int in ``[1, V]``.

    Returns ``(values [..., k] in x's dtype, indices [..., k] int32)``, in descending order of value (ties: the lower
    index first here; the kernel's order on ties is unspecified). Differentiable in ``x`` through the values, like
    ``jax.lax.top_k``. On Neuron a float32, bfloat16, float16 or float64 ``x`` is the ``topk`` kernel on ``x``
    reshaped to ``[B*S, V]`` (its limits, e.g. ``k < V``, apply; otherwise the reference runs with a
    ``NeuronFallbackWarning``); other dtypes run ``jax.lax.top_k`` in XLA.
    """
    where = "jax_nkilib.topk"
    x = _check_x(where, x)
    k = static_int(where, "k", k, minimum=1, maximum=x.shape[-1])
    sharded = auto.plan(TOPK_SHARDING, [auto.ShardedArgument("x", x, auto.leading(x.ndim - 1) + "_")])
    if sharded:
        dims = auto.leading(x.ndim - 1) + "_"
        return sharded.run(lambda x, axes: topk(x, k), (dims, dims))
    if x.size == 0 or not _kernel_dtype(x):
        values, indices = jax.lax.top_k(x, k)
        return values, indices.astype(jnp.int32)
    values, indices = topk_kernel.call({"inp": _rows(x)}, topk_kernel.params(k=k))
    shape = x.shape[:-1] + (k,)
    return values.reshape(shape), indices.astype(jnp.int32).reshape(shape)


def argmax(x):
    """The index of the largest value along the last axis, like ``jnp.argmax(x, axis=-1)`` (for greedy sampling).

    Args:
      x: ``[..., V]``, any float or integer dtype.

    Returns ``[...]`` int32 (not differentiable). Ties give the lowest index here (the kernels' choice on ties is
    unspecified). On Neuron a float32, bfloat16, float16 or float64 ``x`` is the ``cascaded_max`` kernel on ``x``
    reshaped to ``[B*S, V]`` where it fits (at most 128 rows per core, ``128 <= V <= 16384``), else the ``topk``
    kernel with ``k=1`` (large vocabularies, many rows); a call neither fits runs the reference with a
    ``NeuronFallbackWarning``. Other dtypes run ``jnp.argmax`` in XLA. NaN handling off the kernels is XLA's
    (``jnp.argmax``'s first NaN for ``cascaded_max``'s reference, ``jax.lax.top_k``'s order for ``topk``'s).
    """
    where = "jax_nkilib.argmax"
    x = _check_x(where, x)
    dims = auto.leading(x.ndim - 1)
    sharded = auto.plan(ARGMAX_SHARDING, [auto.ShardedArgument("x", x, dims + "_")])
    if sharded:
        return sharded.run(lambda x, axes: argmax(x), dims)
    if x.size == 0 or not _kernel_dtype(x):
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    rows = _rows(x)
    params = cascaded_max.params()
    top1 = topk_kernel.params(k=1)
    if cascaded_max.unmet_neuron_limits({"input_tensor": rows}, params) and not topk_kernel.unmet_neuron_limits(
        {"inp": rows}, top1
    ):
        _, indices = topk_kernel.call({"inp": rows}, top1)
    else:
        _, indices = cascaded_max.call({"input_tensor": rows}, params)
    return indices.astype(jnp.int32).reshape(x.shape[:-1])


def _check_router(x, w_router, bias, selection_bias, top_k, activation, normalize, activation_before_topk):
    where = "jax_nkilib.router"
    dims = check_operand_layouts(
        where,
        {"x": "..., H", "w_router": "H, E", "bias": "E", "selection_bias": "E"},
        positive=("H", "E"),
        x=x,
        w_router=w_router,
        bias=bias,
        selection_bias=selection_bias,
    )
    auto.leading(jnp.ndim(x) - 1, where)
    top_k = static_int(where, "top_k", top_k, minimum=1, maximum=dims["E"])
    if activation not in ACTIVATIONS:
        raise ValueError(f"{where}: `activation` must be one of {tuple(ACTIVATIONS)}; got {activation!r}")
    normalize = static_bool(where, "normalize", normalize)
    activation_before_topk = static_bool(where, "activation_before_topk", activation_before_topk)
    if selection_bias is not None and not activation_before_topk:
        raise ValueError(
            f"{where}: `selection_bias` is added to the activated scores of every expert, so it needs "
            "activation_before_topk=True"
        )
    return top_k, normalize, activation_before_topk


def _route_in_jax(x2, w, bias, selection_bias, top_k, act_fn, normalize, activation_before_topk):
    """The routing math in JAX (``selection_bias``, and token-free calls): ``(indices, weights wide, logits wide)``."""
    wide = accumulation_dtype(x2.dtype)
    logits = jnp.dot(x2, w, preferred_element_type=wide, precision=jax.lax.Precision.HIGHEST)
    if bias is not None:
        logits = logits + bias.astype(wide)
    if not activation_before_topk:
        top, indices = jax.lax.top_k(logits, top_k)
        return indices, activate(top, act_fn), logits
    scores = activate(logits, act_fn)
    chosen = scores if selection_bias is None else scores + selection_bias.astype(wide)
    _, indices = jax.lax.top_k(jax.lax.stop_gradient(chosen), top_k)
    weights = jnp.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return indices, weights, logits


def router(
    x,
    w_router,
    *,
    top_k: int,
    activation: str = "softmax",
    normalize: bool = False,
    bias=None,
    activation_before_topk: bool = True,
    selection_bias=None,
) -> Routing:
    """The mixture-of-experts router: logits, top-``k`` expert selection and routing weights per token.

    ``logits = x @ w_router + bias`` (float32 accumulation). Then, with ``s = activation(logits)`` over all
    ``num_experts`` experts (``softmax``, or the elementwise ``sigmoid``):

    * ``activation_before_topk=True`` (default): ``indices = top_k(s + selection_bias)``, ``weights = s[indices]``;
    * ``activation_before_topk=False``: ``indices = top_k(logits)`` and ``weights = activation(logits[indices])``:
      for softmax, a softmax over the ``top_k`` selected logits (their weights sum to 1); for sigmoid, the same as
      before top-k;
    * ``normalize=True``: ``weights /= sum(weights)`` over the ``top_k`` experts (L1; a no-op for a softmax after
      top-k).

    ``bias`` (``[num_experts]``) is part of the logits: it moves the selection, the weights and the returned
    logits (the ``router_topk`` kernel's ``w_bias``). ``selection_bias`` (``[num_experts]``, DeepSeek-V3's
    ``e_score_correction_bias``) is added to the activated scores for the selection only: it changes which experts
    are chosen, not their weights (no gradient flows into it).

    Args:
      x: ``[..., hidden]`` tokens, float32, bfloat16, float16 or float64.
      w_router: ``[hidden, num_experts]``; ``x`` and ``w_router`` are computed in their promoted dtype.
      top_k: experts per token, a static int in ``[1, num_experts]``.
      activation: ``"softmax"`` or ``"sigmoid"``.
      normalize: L1-renormalise the selected experts' weights.
      bias, selection_bias: optional ``[num_experts]`` vectors (see above).
      activation_before_topk: where the activation sits (see above).

    Returns :class:`Routing` ``(indices [..., top_k] int32, weights [..., top_k] and logits [..., num_experts]
    in x's dtype)``. Differentiable in ``x``, ``w_router`` and ``bias`` through the weights and the logits; the
    indices carry no gradient. Ties between scores pick the lower expert index here.

    Examples::

        # Mixtral: softmax, top-2, renormalised (equivalently activation_before_topk=False)
        router(x, w, top_k=2, activation="softmax", normalize=True)
        # Qwen3-MoE: softmax over all experts, top-8, renormalised when config.norm_topk_prob
        router(x, w, top_k=8, activation="softmax", normalize=config.norm_topk_prob)
        # DeepSeek-V3: sigmoid scores, the correction bias for the selection only, normalised, then scaled
        r = router(x, w, top_k=8, activation="sigmoid", normalize=True, selection_bias=e_score_correction_bias)
        weights = r.weights * routed_scaling_factor
        # (DeepSeek-V3's group-limited selection, n_group/topk_group, is not expressible here)

    On Neuron a call without ``selection_bias`` is one ``router_topk`` kernel call over the tokens (``[T, hidden]``,
    ``x_hbm_layout=1``) followed by a gather of the weights; the kernel's limits (``top_k <= 8``,
    ``8 <= num_experts <= 512``, ``hidden % 128 == 0``) otherwise make it the reference with a
    ``NeuronFallbackWarning``.
    ``selection_bias`` has no kernel: that call runs in JAX (XLA) on every platform.
    """
    top_k, normalize, activation_before_topk = _check_router(
        x, w_router, bias, selection_bias, top_k, activation, normalize, activation_before_topk
    )
    x, w_router = jnp.asarray(x), jnp.asarray(w_router)
    lead = auto.leading(x.ndim - 1)
    sharded = auto.plan(
        ROUTER_SHARDING,
        [
            auto.ShardedArgument("x", x, lead + "_"),
            auto.ShardedArgument("w_router", w_router, "__"),
            auto.ShardedArgument("bias", bias, "_"),
            auto.ShardedArgument("selection_bias", selection_bias, "_"),
        ],
    )
    options = dict(
        top_k=top_k,
        activation=activation,
        normalize=normalize,
        activation_before_topk=activation_before_topk,
    )
    if sharded:
        return sharded.run(
            lambda x, w, b, s, axes: router(x, w, bias=b, selection_bias=s, **options),
            Routing(lead + "_", lead + "_", lead + "_"),
        )
    compute = jnp.promote_types(x.dtype, w_router.dtype)
    x2, w = _rows(x).astype(compute), w_router.astype(compute)
    bias = None if bias is None else jnp.asarray(bias).astype(compute)  # the kernel's bias is in x's dtype
    act_fn = ACTIVATIONS[activation]
    experts = w.shape[-1]
    if selection_bias is not None or x2.shape[0] == 0:
        indices, weights, logits = _route_in_jax(
            x2, w, bias, selection_bias, top_k, act_fn, normalize, activation_before_topk
        )
    else:
        pre_norm = activation_before_topk or act_fn == RouterActFnType.SIGMOID  # sigmoid commutes with top-k
        params = router_topk.params(
            act_fn=act_fn,
            k=top_k,
            x_hbm_layout=1,
            x_sb_layout=0,
            router_pre_norm=pre_norm,
            norm_topk_prob=normalize and pre_norm,
        )
        logits, indices, affinities = router_topk.call({"x": x2, "w": w, "w_bias": bias}, params)
        indices = indices.astype(jnp.int32)
        weights = jnp.take_along_axis(affinities, indices, axis=-1, mode="clip")  # indices < E by construction
    lead_shape = x.shape[:-1]
    return Routing(
        indices.astype(jnp.int32).reshape(lead_shape + (top_k,)),
        weights.astype(x.dtype).reshape(lead_shape + (top_k,)),
        logits.astype(x.dtype).reshape(lead_shape + (experts,)),
    )
