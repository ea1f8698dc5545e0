"""``jax_nkilib.moe``: a dropless mixture-of-experts layer in JAX layouts, with expert and tensor parallelism."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..framework.arguments import array_argument
from ..framework.config import current_lnc
from ..framework.validation import check_operand_layouts, static_bool, static_int
from ..moe.a2av import permute_a2av, unpermute_a2av
from ..moe.blockwise_routing import blockwise_routing
from ..moe.dispatch_metadata import build_all_to_all_v_metadata
from ..moe.grouped_experts import ExpertWeights, routed_experts
from ..moe.moe_block_tkg import moe_block_tkg
from ..moe.moe_cte import moe_cte
from ..moe.moe_tkg import moe_tkg
from ..sharding import auto
from .mlp import ACTIVATIONS
from .norm import rms_norm
from .routing import router

_WHERE = "jax_nkilib.moe"
DECODE_TOKENS = 128  # up to this many tokens (per device) moe runs on moe_tkg, above on moe_cte
PREFILL_BLOCK = 256  # moe_cte's block size (shard_on_i: a multiple of 256)

MOE_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.moe",
        free=auto.LEADING,
        collective={
            "e": (
                "experts",
                "expert parallelism: tokens split over the same mesh axis are dispatched to the devices owning "
                "their experts and combined back by all-to-alls (on Neuron the permute_a2av / unpermute_a2av "
                "kernels); tokens replicated over it are computed by each device for its own experts, then one "
                "all-reduce (psum)",
            ),
            "i": ("intermediate", "tensor parallelism: local expert MLPs + one all-reduce (psum) of the output"),
        },
        shared={"e": "".join(auto.LEADING)},
        note="router logits and top-k selections split with the tokens; the experts' axis of the router logits "
        "never splits",
    )
)


def _routing(routing, leading: tuple[int, ...], num_experts: int, top_k, normalize: bool):
    """The checked ``(route, top_k)``: ``route`` is ``(indices [..., K] int32, weights [..., K])`` (from such a pair
    or an object with ``indices`` and ``weights``, ``jax_nkilib.Routing``; ``top_k`` None) or router logits
    ``[..., E]`` (selected by :func:`_select`)."""
    if hasattr(routing, "indices") and hasattr(routing, "weights"):
        routing = (routing.indices, routing.weights)
    if isinstance(routing, (tuple, list)):
        if len(routing) != 2:
            raise TypeError(f"{_WHERE}: `routing` must be router logits [..., num_experts] or (indices, weights)")
        if top_k is not None or normalize:
            raise ValueError(f"{_WHERE}: top_k and normalize apply to router logits, not to a given (indices, weights)")
        indices = array_argument(_WHERE, "indices", routing[0], dtypes=None)
        weights = array_argument(_WHERE, "weights", routing[1], dtypes="floating")
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(f"{_WHERE}: `indices` must be an integer array [..., top_k]; got {indices.dtype}")
        expected = "leading axes of x, top_k"
        if indices.shape[:-1] != leading or indices.ndim != len(leading) + 1:
            raise ValueError(
                f"{_WHERE}: `indices` must be [{expected}] with x's leading axes {leading}; got {indices.shape}"
            )
        if weights.shape != indices.shape:
            raise ValueError(
                f"{_WHERE}: `weights` must have the shape of `indices` {indices.shape}; got {weights.shape}"
            )
        return (indices.astype(jnp.int32), weights), None
    logits = array_argument(_WHERE, "routing", routing, dtypes="floating")
    if logits.shape != (*leading, num_experts):
        raise ValueError(
            f"{_WHERE}: `routing` (router logits) must be [leading axes of x, num_experts] = "
            f"{(*leading, num_experts)}; got "
            f"{logits.shape}"
        )
    if top_k is None:
        raise TypeError(f"{_WHERE}: router logits need top_k (the number of experts per token)")
    return logits, static_int(_WHERE, "top_k", top_k, minimum=1, maximum=num_experts)


def _select(logits, top_k: int, normalize: bool):
    """``(indices, weights)``: the ``top_k`` largest of ``softmax(logits)`` (over the last axis), divided by their
    sum with ``normalize``; computed on local shards (XLA's sharded TopK would gather every token)."""
    probabilities = jax.nn.softmax(logits.astype(jnp.promote_types(logits.dtype, jnp.float32)), axis=-1)
    weights, indices = jax.lax.top_k(probabilities, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return indices.astype(jnp.int32), weights.astype(logits.dtype)


def _expert_weights(w_gate_up, w_down, gate_up_bias, down_bias, hidden: int, dtype) -> ExpertWeights:
    """The experts' weights in the kernel layouts: ``gate_up [E, H, 2, I]`` (from a ``(w_gate, w_up)`` pair of
    ``[E, H, I]`` too), ``down [E, I, H]``, biases ``[E, 2, I]`` (or a pair of ``[E, I]``) and ``[E, H]``."""
    if isinstance(w_gate_up, (tuple, list)):
        if len(w_gate_up) != 2:
            raise TypeError(f"{_WHERE}: `w_gate_up` must be [E, H, 2, I] or a pair (w_gate, w_up), each [E, H, I]")
        gate, up = (
            array_argument(_WHERE, name, w, dtypes="floating") for name, w in zip(("w_gate", "w_up"), w_gate_up)
        )
        check_operand_layouts(
            _WHERE, dict.fromkeys(("w_gate", "w_up"), "E, H, I"), known={"H": hidden}, w_gate=gate, w_up=up
        )
        w_gate_up = jnp.stack([gate, up], axis=2)
    if isinstance(gate_up_bias, (tuple, list)):
        if len(gate_up_bias) != 2:
            raise TypeError(f"{_WHERE}: `gate_up_bias` must be [E, 2, I] or a pair (gate_bias, up_bias), each [E, I]")
        gate_up_bias = jnp.stack([jnp.asarray(b) for b in gate_up_bias], axis=1)
    dims = check_operand_layouts(
        _WHERE,
        {"w_gate_up": "E, H, 2, I", "w_down": "E, I, H", "gate_up_bias": "E, 2, I", "down_bias": "E, H"},
        dtypes=dict.fromkeys(("w_gate_up", "w_down", "gate_up_bias", "down_bias"), "floating"),
        positive=("E", "I"),
        known={"H": hidden},
        w_gate_up=w_gate_up,
        w_down=w_down,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
    )
    num_experts, inter = dims["E"], dims["I"]
    cast = lambda w, shape: jnp.zeros(shape, dtype) if w is None else jnp.asarray(w).astype(dtype)  # noqa: E731
    return ExpertWeights(
        cast(w_gate_up, None),
        cast(w_down, None),
        cast(gate_up_bias, (num_experts, 2, inter)),
        cast(down_bias, (num_experts, hidden)),
    )


def moe(
    x,
    routing,
    w_gate_up,
    w_down,
    *,
    top_k: int | None = None,
    normalize: bool = False,
    activation: str = "silu",
    gate_up_bias=None,
    down_bias=None,
):
    """A dropless mixture-of-experts layer: ``out[t] = sum_k weights[t, k] * MLP_{indices[t, k]}(x[t])`` with
    ``MLP_e(x) = (act(x W_gate[e] + b_gate[e]) * (x W_up[e] + b_up[e])) W_down[e] + b_down[e]``.

    Args:
      x: ``[..., hidden]`` tokens.
      routing: router logits ``[..., num_experts]`` (``weights`` = the ``top_k`` largest of ``softmax(logits)``,
        divided by their sum with ``normalize``: Mixtral is ``top_k=2, normalize=True``), or the routing itself as
        ``(indices, weights)`` / a ``jax_nkilib.Routing``: ``indices [..., top_k]`` int (an index outside
        ``[0, num_experts)`` selects nothing), ``weights [..., top_k]`` float.
      w_gate_up: ``[num_experts, hidden, 2, intermediate]`` (gate ``[:, :, 0]``, up ``[:, :, 1]``: the NKI
        kernels' layout) or the pair ``(w_gate, w_up)``, each ``[num_experts, hidden, intermediate]``.
      w_down: ``[num_experts, intermediate, hidden]``.
      activation: ``"silu"`` (SwiGLU), ``"gelu"``, ``"gelu_tanh"``, ``"gelu_sigmoid"`` (``x sigmoid(1.702 x)``),
        ``"relu"``.
      gate_up_bias: ``[num_experts, 2, intermediate]`` or ``(gate_bias, up_bias)`` each ``[num_experts,
        intermediate]``; down_bias: ``[num_experts, hidden]``.

    Returns ``[..., hidden]`` in ``x``'s dtype (weights and biases are cast to it). No token is dropped and there
    is no capacity factor. Differentiable in ``x``, the routing weights (or logits), the expert weights and
    biases. Matmuls accumulate in float32 (float64 for float64 inputs).

    Off Neuron the experts run as a blockwise grouped matmul over the tokens sorted by expert
    (:mod:`jax_nkilib._src.moe.grouped_experts`), never a one-hot product over all experts. Under an explicit mesh,
    the experts' axis of the weights may be split (expert parallelism: tokens split over the same mesh axis travel
    to their experts' devices and back by all-to-alls) and the intermediate axis too (tensor parallelism: one
    all-reduce).
    """
    x = array_argument(_WHERE, "x", x, dtypes="floating")
    if x.ndim < 1:
        raise ValueError(f"{_WHERE}: `x` must be [..., hidden]; got a scalar")
    hidden = x.shape[-1]
    normalize = static_bool(_WHERE, "normalize", normalize)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_WHERE}: activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    weights = _expert_weights(w_gate_up, w_down, gate_up_bias, down_bias, hidden, x.dtype)
    route, top_k = _routing(routing, x.shape[:-1], weights.gate_up.shape[0], top_k, normalize)
    fn = ACTIVATIONS[activation]
    rows = auto.leading(x.ndim - 1, _WHERE)
    route_dims = rows + "_" if top_k else (rows + "_",) * 2
    sharded = auto.plan(
        MOE_SHARDING,
        [
            auto.ShardedArgument("x", x, rows + "h"),
            auto.ShardedArgument("routing", route, route_dims),
            auto.ShardedArgument("w_gate_up", weights.gate_up, "eh_i"),
            auto.ShardedArgument("w_down", weights.down, "eih"),
            auto.ShardedArgument("gate_up_bias", weights.gate_up_bias, "e_i"),
            auto.ShardedArgument("down_bias", weights.down_bias, "eh"),
        ],
    )
    if not sharded:
        return _moe_local(x, route, top_k, normalize, weights, fn, {})

    def local(x, route, gate_up, down, gate_up_bias, down_bias, axes):
        token_axes = {name for letter in rows for name in axes.get(letter, ())}
        weights = ExpertWeights(gate_up, down, gate_up_bias, down_bias)
        return _moe_local(x, route, top_k, normalize, weights, fn, axes, token_axes)

    return sharded.run(local, rows + "h")


def _moe_local(x, route, top_k, normalize, weights: ExpertWeights, fn, axes, token_axes=frozenset()):
    """The layer on local shards; ``axes`` the mesh axes splitting experts (``"e"``) and intermediate (``"i"``)."""
    leading, hidden = x.shape[:-1], x.shape[-1]
    indices, routing_weights = _select(route, top_k, normalize) if top_k else route
    x2 = x.reshape(-1, hidden)
    top_k = indices.shape[-1]
    token_of_pair = jnp.repeat(jnp.arange(x2.shape[0], dtype=jnp.int32), top_k)
    pair_weights, pair_experts = routing_weights.reshape(-1), indices.reshape(-1)
    expert_axes = tuple(axes.get("e", ()))
    reduce_over = tuple(axes.get("i", ()))
    if reduce_over:  # the intermediate is split: the partial outputs are summed, so one shard adds the down bias
        first = jax.lax.axis_index(reduce_over) == 0
        weights = weights._replace(down_bias=jnp.where(first, weights.down_bias, 0).astype(weights.down_bias.dtype))
    if not expert_axes:
        out = _experts(
            x2, indices.reshape(x2.shape[0], top_k), routing_weights.reshape(x2.shape[0], top_k), weights, fn
        )
    else:
        local_experts = weights.gate_up.shape[0]
        rank = jax.lax.axis_index(expert_axes)
        if set(expert_axes) <= set(token_axes):
            out = _dispatched_experts(x2, token_of_pair, pair_weights, pair_experts, weights, fn, expert_axes)
        elif not set(expert_axes) & set(token_axes):
            local_ids = pair_experts - rank * local_experts  # other devices' experts fall outside [0, E_local)
            out = _experts(x2, local_ids.reshape(-1, top_k), pair_weights.reshape(-1, top_k), weights, fn)
            reduce_over = expert_axes + reduce_over
        else:
            raise ValueError(
                f"{_WHERE}: the experts are split over mesh axes {expert_axes} and the tokens over "
                f"{tuple(token_axes)}; split the tokens over all of the experts' axes (all-to-all dispatch) or over "
                "none of them"
            )
    if reduce_over:
        out = jax.lax.psum(out, reduce_over)
    return out.reshape(*leading, hidden)


def _dispatched_experts(x, token_of_pair, pair_weights, pair_experts, weights: ExpertWeights, fn, expert_axes):
    """Expert parallelism with tokens split over ``expert_axes``: on Neuron the ``permute_a2av`` /
    ``unpermute_a2av`` kernels (:func:`_a2av_experts`), elsewhere XLA all-to-alls (:func:`_all_to_all_experts`)."""
    top_k = pair_experts.shape[0] // x.shape[0]

    def a2av(x, pair_weights, pair_experts, weights):
        return _a2av_experts(
            x, pair_weights.reshape(-1, top_k), pair_experts.reshape(-1, top_k), weights, fn, expert_axes
        )

    def all_to_all(x, pair_weights, pair_experts, weights):
        return _all_to_all_experts(x, token_of_pair, pair_weights, pair_experts, weights, fn, expert_axes)

    return jax.lax.platform_dependent(x, pair_weights, pair_experts, weights, neuron=a2av, default=all_to_all)


def _a2av_experts(x, routing_weights, indices, weights: ExpertWeights, fn, expert_axes):
    """The exchange by the NKI Library's all-to-all-v kernels: each routed row ``[x_t, weight, local expert]``
    (``[T*K, H+2]``) goes to its expert's rank by ``permute_a2av`` (rank ``s``'s rows land at ``s*T*K``; slots past
    the received counts are masked), runs there (weighted by its routing weight), and ``unpermute_a2av`` brings the
    results back to their ``T*K`` rows, summed over ``k``. ``build_all_to_all_v_metadata`` counts the rows per rank."""
    tokens, hidden = x.shape
    top_k = indices.shape[1]
    pairs = tokens * top_k
    local_experts = weights.gate_up.shape[0]
    ranks = jax.lax.psum(1, expert_axes)
    num_experts = ranks * local_experts
    valid = (indices >= 0) & (indices < num_experts)
    indices = jnp.where(valid, indices, 0).astype(jnp.int32)  # an invalid pair rides along with weight 0
    routing_weights = jnp.where(valid, routing_weights, 0).astype(x.dtype)
    counts = build_all_to_all_v_metadata(indices, replica_group_size=ranks, E=num_experts)[0].astype(jnp.int32)
    destination = indices.reshape(pairs) // local_experts
    to_rank = destination[:, None] == jnp.arange(ranks)[None, :]
    order = jnp.argsort(~to_rank, axis=0, stable=True)  # per destination: its rows first, in row order
    active = jnp.arange(pairs)[:, None] < counts[None, :]
    send_indices = jnp.where(active, order, pairs).astype(jnp.int32)  # then the sentinel T*K
    local_id = jax.lax.stop_gradient((indices % local_experts).astype(x.dtype))
    rows = jnp.concatenate(
        [jnp.repeat(x, top_k, axis=0), routing_weights.reshape(pairs, 1), local_id.reshape(pairs, 1)], axis=1
    )
    received, metadata = permute_a2av(rows, send_indices, counts[None], replica_group=expert_axes)
    recv_counts = (metadata[2] // (hidden + 2)).astype(jnp.int32)  # rows from each source rank
    slot = jnp.arange(ranks * pairs)
    live = (slot % pairs) < recv_counts[slot // pairs]  # the kernel leaves the other slots undefined
    received = jnp.where(live[:, None], received, 0)
    expert = jnp.where(live, received[:, hidden + 1].astype(jnp.int32), -1)
    out = _experts(received[:, :hidden], expert[:, None], received[:, hidden : hidden + 1], weights, fn)
    back = unpermute_a2av(out, send_indices, recv_counts[None], replica_group=expert_axes)
    return back.reshape(tokens, top_k, hidden).sum(axis=1)


def _all_to_all_experts(x, token_of_pair, pair_weights, pair_experts, weights: ExpertWeights, fn, expert_axes):
    """Expert parallelism with tokens split over ``expert_axes`` (``P`` devices, ``E_l`` experts each): every pair
    travels to the device owning its expert by an all-to-all (a static ``[P, M, hidden]`` buffer, ``M`` this
    device's pairs: dropless whatever the load), runs there, and comes back by a second all-to-all to be combined."""
    tokens, hidden = x.shape
    (pairs,) = token_of_pair.shape
    local_experts = weights.gate_up.shape[0]
    devices = jax.lax.psum(1, expert_axes)
    valid = (pair_experts >= 0) & (pair_experts < devices * local_experts)
    destination = jnp.where(valid, pair_experts // local_experts, devices)  # invalid pairs go nowhere
    order = jnp.argsort(destination, stable=True)
    counts = jnp.bincount(destination, length=devices + 1)
    rank = jnp.arange(pairs, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[destination[order]]
    slot = jnp.where(destination[order] < devices, destination[order] * pairs + rank, devices * pairs)
    slot_pair = jnp.full((devices * pairs,), pairs, jnp.int32).at[slot].set(order.astype(jnp.int32), mode="drop")
    empty = slot_pair == pairs
    pair = jnp.minimum(slot_pair, pairs - 1)
    send_x = jnp.where(empty[:, None], 0, x[token_of_pair[pair]]).reshape(devices, pairs, hidden)
    send_expert = jnp.where(empty, -1, pair_experts[pair] % local_experts).reshape(devices, pairs)
    recv_x = jax.lax.all_to_all(send_x, expert_axes, 0, 0)
    recv_expert = jax.lax.all_to_all(send_expert, expert_axes, 0, 0).reshape(-1)
    rows = devices * pairs
    ones = jnp.ones((rows, 1), x.dtype)
    computed = _experts(recv_x.reshape(rows, hidden), recv_expert.reshape(rows, 1), ones, weights, fn)
    back = jax.lax.all_to_all(computed.reshape(devices, pairs, hidden), expert_axes, 0, 0).reshape(rows, hidden)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    scale = jnp.where(empty, 0, pair_weights.astype(acc)[pair])
    target = jnp.where(empty, tokens, token_of_pair[pair])
    out = jnp.zeros((tokens + 1, hidden), acc).at[target].add(back.astype(acc) * scale[:, None])
    return out[:tokens].astype(x.dtype)


def _experts(x, indices, routing_weights, weights: ExpertWeights, fn):
    """``sum_k routing_weights[t, k] * MLP_{indices[t, k]}(x[t])`` for ``x [T, H]``, ``indices [T, K]``: on Neuron
    the NKI kernels (:func:`_on_kernels`), elsewhere the blockwise grouped matmul."""

    def reference(x, indices, routing_weights, weights):
        tokens, top_k = indices.shape
        token_of_pair = jnp.repeat(jnp.arange(tokens, dtype=jnp.int32), top_k)
        return routed_experts(x, token_of_pair, routing_weights.reshape(-1), indices.reshape(-1), weights, fn)

    def kernels(x, indices, routing_weights, weights):
        return _on_kernels(x, indices, routing_weights, weights, fn)

    return jax.lax.platform_dependent(x, indices, routing_weights, weights, neuron=kernels, default=reference)


def _on_kernels(x, indices, routing_weights, weights: ExpertWeights, fn):
    """The Neuron route: ``moe_tkg`` (selective, ``POST_SCALE``) for at most :data:`DECODE_TOKENS` tokens, else
    ``moe_cte`` (``shard_on_i``, blocks of :data:`PREFILL_BLOCK`, whose VJP is ``blockwise_mm_bwd``) on the routing
    operands :func:`blockwise_routing` builds. An index outside ``[0, E)`` gets weight 0 (on expert 0)."""
    tokens, hidden = x.shape
    num_experts = weights.gate_up.shape[0]
    valid = (indices >= 0) & (indices < num_experts)
    indices = jnp.where(valid, indices, 0).astype(jnp.int32)
    routing_weights = jnp.where(valid, routing_weights, 0).astype(x.dtype)
    biases = dict(
        gate_up_bias=weights.gate_up_bias,
        down_bias=weights.down_bias,
    )
    if tokens <= DECODE_TOKENS:
        affinities = (
            jnp.zeros((tokens, num_experts), x.dtype).at[jnp.arange(tokens)[:, None], indices].add(routing_weights)
        )
        return moe_tkg(
            x,
            weights.gate_up,
            weights.down,
            affinities,
            indices,
            expert_gate_up_bias=biases["gate_up_bias"],
            expert_down_bias=biases["down_bias"],
            is_all_expert=False,
            expert_affinities_scaling_mode="POST_SCALE",
            activation_fn=fn,
        )
    routing = blockwise_routing(indices, routing_weights, num_experts=num_experts, block_size=PREFILL_BLOCK)
    out = moe_cte(
        jnp.concatenate([x, jnp.zeros((1, hidden), x.dtype)]),
        routing.expert_affinities_masked,
        weights.gate_up,
        weights.down,
        routing.token_position_to_id,
        routing.block_to_expert,
        gate_and_up_proj_bias=biases["gate_up_bias"],
        down_proj_bias=biases["down_bias"],
        block_size=PREFILL_BLOCK,
        implementation="shard_on_i",
        activation_function=fn,
    )
    return out[:tokens]


MOE_BLOCK_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.moe_block",
        free=auto.LEADING,
        note="tokens shard freely; the norm, router and expert weights are replicated (for expert or tensor "
        "parallelism compose rms_norm, router and moe)",
    )
)
_BLOCK = "jax_nkilib.moe_block"


def moe_block(
    x,
    norm_weight,
    w_router,
    w_gate_up,
    w_down,
    *,
    top_k: int,
    activation: str = "softmax",
    normalize: bool = False,
    router_bias=None,
    eps: float = 1e-6,
    expert_activation: str = "silu",
):
    """A mixture-of-experts block: ``h = rms_norm(x, norm_weight, eps)``, ``r = router(h, w_router, top_k=top_k,
    activation=activation, normalize=normalize, bias=router_bias)``, ``out = moe(h, r, w_gate_up, w_down,
    activation=expert_activation)``; returns ``(out [..., hidden], r.logits [..., num_experts])`` in ``x``'s dtype.

    Layouts and semantics are those of :func:`jax_nkilib.rms_norm` (``norm_weight [hidden]``),
    :func:`jax_nkilib.router` (``w_router [hidden, num_experts]``, ``router_bias [num_experts]``, the activation
    before the top-k) and :func:`jax_nkilib.moe` (``w_gate_up [E, H, 2, I]`` or a ``(w_gate, w_up)`` pair,
    ``w_down [E, I, H]``). Differentiable like them. On Neuron a decode call (at most 128 tokens) at LNC 2 is one
    ``moe_block_tkg`` kernel (RMSNorm, router top-k and experts fused; its router matmul in ``x``'s dtype); any other
    call is the three ops' kernels (``rmsnorm_tkg``, ``router_topk``, ``moe_tkg`` or ``moe_cte``).
    """
    x = array_argument(_BLOCK, "x", x, dtypes="kernel")
    if x.ndim < 1:
        raise ValueError(f"{_BLOCK}: `x` must be [..., hidden]; got a scalar")
    check_operand_layouts(
        _BLOCK,
        {"norm_weight": "H", "w_router": "H, E", "router_bias": "E"},
        known={"H": x.shape[-1]},
        norm_weight=norm_weight,
        w_router=w_router,
        router_bias=router_bias,
    )
    if expert_activation not in ACTIVATIONS:
        raise ValueError(
            f"{_BLOCK}: expert_activation must be one of {', '.join(ACTIVATIONS)}; got {expert_activation!r}"
        )
    rows = auto.leading(x.ndim - 1, _BLOCK)
    sharded = auto.plan(
        MOE_BLOCK_SHARDING,
        [
            auto.ShardedArgument("x", x, rows + "h"),
            auto.ShardedArgument("norm_weight", norm_weight),
            auto.ShardedArgument("w_router", w_router),
            auto.ShardedArgument("w_gate_up", w_gate_up),
            auto.ShardedArgument("w_down", w_down),
            auto.ShardedArgument("router_bias", router_bias),
        ],
    )
    options = dict(
        top_k=top_k, activation=activation, normalize=normalize, eps=eps, expert_activation=expert_activation
    )
    if sharded:
        return sharded.run(
            lambda *operands, axes: moe_block(*operands[:5], router_bias=operands[5], **options),
            (rows + "h", rows + "_"),
        )
    return _moe_block_local(x, norm_weight, w_router, w_gate_up, w_down, router_bias, **options)


def _moe_block_local(x, norm_weight, w_router, w_gate_up, w_down, router_bias, **options):
    def composed(x, norm_weight, w_router, w_gate_up, w_down, router_bias):
        h = rms_norm(x, norm_weight, eps=options["eps"])
        routing = router(
            h,
            w_router,
            top_k=options["top_k"],
            activation=options["activation"],
            normalize=options["normalize"],
            bias=router_bias,
        )
        return moe(h, routing, w_gate_up, w_down, activation=options["expert_activation"]), routing.logits

    tokens = math.prod(x.shape[:-1])
    if tokens > DECODE_TOKENS or current_lnc() != 2 or isinstance(w_gate_up, (tuple, list)):
        return composed(x, norm_weight, w_router, w_gate_up, w_down, router_bias)

    def fused(x, norm_weight, w_router, w_gate_up, w_down, router_bias):
        hidden = x.shape[-1]
        out, logits = moe_block_tkg(
            x.reshape(1, tokens, hidden),
            jnp.asarray(norm_weight, x.dtype).reshape(1, hidden),
            jnp.asarray(w_router, x.dtype),
            jnp.asarray(w_gate_up, x.dtype),
            jnp.asarray(w_down, x.dtype),
            router_bias=None if router_bias is None else jnp.asarray(router_bias, x.dtype).reshape(1, -1),
            eps=options["eps"],
            top_k=options["top_k"],
            router_act_fn=options["activation"].upper(),
            router_pre_norm=True,
            norm_topk_prob=options["normalize"],
            expert_affinities_scaling_mode="POST_SCALE",
            hidden_act_fn=ACTIVATIONS[options["expert_activation"]],
            router_mm_dtype=x.dtype,
        )
        return out.reshape(x.shape), logits.reshape(*x.shape[:-1], -1)

    operands = (x, norm_weight, w_router, w_gate_up, w_down, router_bias)
    return jax.lax.platform_dependent(*operands, neuron=fused, default=composed)
