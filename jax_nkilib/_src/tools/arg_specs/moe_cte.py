"""Arg specs of the blockwise MoE kernels: ``moe_cte`` (each bf16 implementation and ``shard_on_block_mx``),
``blockwise_mm_bwd`` and ``blockwise_mm_baseline_shard_hidden``. The routing operands are built here in NumPy, in the
kernels' layout (expert ``e``'s tokens in consecutive blocks, padding slots and trailing blocks on the padding token
``T``)."""

import math

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register

_DATA = (("data", 8),)


def routing(rng, tokens, top_k, experts, block):
    """``(affinities [(T+1)*E, 1], token_position_to_id [N*B], block_to_expert [N, 1], conditions [N+1])``."""
    index = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)])
    weights = rng.uniform(0.2, 1.0, (tokens, top_k))
    singles = min(tokens * top_k, experts - 1)
    n_blocks = singles + math.ceil((tokens * top_k - singles) / block)
    affinities = np.zeros((tokens + 1, experts))
    slots, owners = [], []
    for e in range(experts):
        mine = [t for t in range(tokens) if e in index[t]]
        for t in mine:
            affinities[t, e] = weights[t, list(index[t]).index(e)]
        for start in range(0, len(mine), block):
            chunk = mine[start : start + block]
            slots += chunk + [tokens] * (block - len(chunk))
            owners.append(e)
    used = len(owners)
    slots += [tokens] * block * (n_blocks - used)
    owners += [experts - 1] * (n_blocks - used)
    conditions = (np.arange(n_blocks + 1) < used).astype(np.int32)
    return (
        jnp.asarray(affinities.reshape(-1, 1), jnp.float32),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(owners, jnp.int32).reshape(-1, 1),
        jnp.asarray(conditions),
    )


def _moe(tokens, hidden, inter, experts, top_k, block, *, conditions=False, bias=False, scale=0.3):
    """``moe_cte``'s operands: hidden states with a zero padding row, weights, routing (conditions, biases)."""

    def build(rng):
        x = normal(rng, (tokens + 1, hidden))
        x = x.at[tokens].set(0.0)
        gate_up, down = normal(rng, (experts, hidden, 2, inter), scale=scale), normal(rng, (experts, inter, hidden))
        affinities, slots, owners, used = routing(rng, tokens, top_k, experts, block)
        operands = (x, affinities, gate_up, down * scale, slots, owners)
        if conditions:
            operands += (used,)
        if bias:
            operands += (normal(rng, (experts, 2, inter), scale=0.1), normal(rng, (experts, hidden), scale=0.1))
        return operands

    return build


def _moe_mxfp4(tokens, hidden, inter, experts, top_k, block, dtype=jnp.float32, bias=False, conditions=False):
    """``moe_cte`` operands for the MX implementations: MXFP4 uint16 words ``[E, 128, 2, H/512, I]`` /
    ``[E, min(128, I/4), ceil(I/512), H]`` (any nibble is an e2m1 code) and uint8 scales near 2**-6 (biases
    ``[E, P_I, 2, N_I, 4]``, ``[E, H]``) after the routing operands (and ``conditions``)."""
    p_i, n_i = min(128, inter // 4), -(-inter // 512)

    def build(rng):
        x = normal(rng, (tokens + 1, hidden), dtype).at[tokens].set(0)
        affinities, slots, owners, used = routing(rng, tokens, top_k, experts, block)
        words = lambda shape: jnp.asarray(rng.integers(0, 2**16, shape), jnp.uint16)  # noqa: E731
        scales = lambda shape: jnp.asarray(rng.integers(118, 124, shape), jnp.uint8)  # noqa: E731
        operands = (x, affinities.astype(dtype), words((experts, 128, 2, hidden // 512, inter)))
        operands += (words((experts, p_i, n_i, hidden)), slots, owners)
        if conditions:
            operands += (used,)
        if bias:
            operands += (normal(rng, (experts, p_i, 2, n_i, 4), dtype, 0.1), normal(rng, (experts, hidden), dtype, 0.1))
        return operands + (scales((experts, 16, 2, hidden // 512, inter)), scales((experts, p_i // 8, n_i, hidden)))

    return build


def _checkpoints(tokens, hidden, inter, experts, top_k, block):
    """``blockwise_mm_bwd``'s operands: the forward's, random checkpoints and an output cotangent."""
    forward = _moe(tokens, hidden, inter, experts, top_k, block)

    def build(rng):
        x, affinities, gate_up, down, slots, owners = forward(rng)
        n_blocks = owners.shape[0]
        gate_up_t = normal(rng, (n_blocks, 2, inter, block))
        down_act = normal(rng, (n_blocks, block, hidden))
        return x, affinities, gate_up, down, gate_up_t, down_act, slots, owners, normal(rng, (tokens + 1, hidden))

    return build


def _with_buffers(build_moe, inter, block):
    """``build_moe``'s operands and zero checkpoint buffers ``[N, 2, I, B]``, ``[N, B, H]``."""

    def build(rng):
        operands = build_moe(rng)
        n_blocks, hidden = operands[5].shape[0], operands[0].shape[1]
        zeros = lambda *shape: jnp.zeros(shape, jnp.float32)  # noqa: E731
        return operands + (zeros(n_blocks, 2, inter, block), zeros(n_blocks, block, hidden))

    return build


_MOE = (
    "hidden_states",
    "expert_affinities_masked",
    "gate_up_proj_weight",
    "down_proj_weight",
    "token_position_to_id",
    "block_to_expert",
)
_GRAD = _MOE[:4]
_FLOATS = _MOE[:4]


def _replicated(n):
    return Sharding(_DATA, (P(),) * n, P())


def _shorter(x):
    return x[:-1]


register(
    ArgSpec(
        "moe_cte.shard_on_i",
        nki.moe_cte,
        _MOE,
        _moe(11, 16, 8, 4, 2, 4),
        kwargs={"block_size": 4, "implementation": "shard_on_i"},
        kernels=("moe_cte",),
        grad=_GRAD,
        batch=_FLOATS,
        sharding=_replicated(6),
        bad=BadInput("expert_affinities_masked", _shorter, "expert_affinities_masked"),
        neuron=_moe(255, 512, 16, 2, 1, 256),
        neuron_kwargs={"block_size": 256, "implementation": "shard_on_i"},
        notes="reverse mode binds blockwise_mm_bwd on the checkpoints of a checkpoint_activation forward",
    ),
    ArgSpec(
        "moe_cte.shard_on_block",
        nki.moe_cte,
        _MOE,
        _moe(9, 16, 8, 8, 3, 2),
        kwargs={
            "block_size": 2,
            "spec": nki.MoECTESpec(nki.MoECTEImplementation.shard_on_block),
            "expert_affinities_scaling_mode": "PRE_SCALE",
        },
        kernels=("moe_cte",),
        grad=_GRAD,
        sharding=_replicated(6),
        bad=BadInput("block_to_expert", lambda b: b[:, 0], "block_to_expert"),
        neuron=_moe(128, 64, 16, 2, 2, 128),
        neuron_kwargs={"block_size": 128, "implementation": "shard_on_block"},
        neuron_lnc=2,
        notes="the accumulating output [T+1, 2, H] of the kernel's two per-core slots",
    ),
    ArgSpec(
        "moe_cte.shard_on_i_hybrid",
        nki.moe_cte,
        _MOE + ("conditions", "gate_and_up_proj_bias", "down_proj_bias"),
        _moe(10, 16, 8, 4, 2, 4, conditions=True, bias=True),
        kwargs={"block_size": 4, "implementation": "shard_on_i_hybrid", "activation_function": "Swish"},
        positional=6,
        kernels=("moe_cte",),
        grad=_GRAD + ("gate_and_up_proj_bias", "down_proj_bias"),
        batch=_FLOATS,
        sharding=_replicated(9),
        bad=BadInput("conditions", _shorter, "conditions"),
        neuron=_moe(255, 512, 16, 2, 1, 256, conditions=True, bias=True),
        neuron_kwargs={"block_size": 256, "implementation": "shard_on_i_hybrid"},
        neuron_lnc=2,
    ),
    ArgSpec(
        "moe_cte.shard_on_i_dropping",
        nki.moe_cte,
        _MOE,
        _moe(7, 16, 8, 4, 1, 4),
        kwargs={"block_size": 4, "implementation": "shard_on_i_dropping"},
        kernels=("moe_cte",),
        grad=_GRAD,
        grad_output=lambda out: out[0],
        batch=_FLOATS,
        sharding=Sharding(_DATA, (P(),) * 6, (P(), P(), P())),
        bad=BadInput("token_position_to_id", _shorter, "token_position_to_id"),
        neuron=_moe(255, 512, 16, 2, 1, 256),
        neuron_kwargs={"block_size": 256, "implementation": "shard_on_i_dropping"},
    ),
    ArgSpec(
        "moe_cte.shard_on_block_mx",
        nki.moe_cte,
        _MOE + ("gate_and_up_proj_bias", "down_proj_bias", "gate_up_proj_scale", "down_proj_scale"),
        _moe_mxfp4(5, 512, 32, 2, 2, 4, bias=True),
        kwargs={"block_size": 4, "implementation": "shard_on_block_mx", "activation_function": "Swish"},
        positional=6,
        kernels=(),
        only_kernels=False,
        grad=("hidden_states", "expert_affinities_masked", "gate_and_up_proj_bias", "down_proj_bias"),
        check_grads=False,
        batch=("hidden_states", "expert_affinities_masked"),
        sharding=_replicated(10),
        bad=BadInput("down_proj_scale", lambda s: s.astype(jnp.float32), "down_proj_scale"),
        neuron=_moe_mxfp4(128, 512, 64, 2, 2, 128, jnp.bfloat16, bias=True),
        neuron_kwargs={"block_size": 128, "implementation": "shard_on_block_mx"},
        neuron_lnc=2,
        neuron_fallback="trn3",
        notes="MXFP4 weights; the kernel is Trainium3's, so under the default trn2 target the reference runs "
        "(tests/moe/test_moe_cte_mx.py lowers it for trn3 at LNC 2); the VJP is straight-through the MXFP8 round "
        "trips, so no numerical gradient check",
    ),
    ArgSpec(
        "moe_cte.shard_on_i_mx",
        nki.moe_cte,
        _MOE + ("gate_up_proj_scale", "down_proj_scale"),
        _moe_mxfp4(5, 512, 32, 2, 1, 4),
        kwargs={"block_size": 4, "implementation": "shard_on_i_mx", "is_tensor_update_accumulating": False},
        positional=6,
        kernels=(),
        only_kernels=False,
        grad=("hidden_states", "expert_affinities_masked"),
        check_grads=False,
        batch=("hidden_states", "expert_affinities_masked"),
        sharding=_replicated(8),
        bad=BadInput("expert_affinities_scaling_mode", lambda _: "PRE_SCALE", "expert_affinities_scaling_mode"),
        neuron=_moe_mxfp4(200, 512, 1024, 2, 1, 256, jnp.bfloat16),
        neuron_kwargs={"block_size": 256, "implementation": "shard_on_i_mx"},
        neuron_lnc=2,
        neuron_fallback="trn3",
        notes="top-1, overwriting output; the library dispatcher has no shard_on_i_mx branch, so the adapter calls "
        "blockwise_mm_shard_intermediate_mx itself; trn3 only (tests/moe/test_moe_cte_mx.py lowers it for trn3)",
    ),
    ArgSpec(
        "moe_cte.shard_on_i_mx_hybrid",
        nki.moe_cte,
        _MOE + ("conditions", "gate_up_proj_scale", "down_proj_scale"),
        _moe_mxfp4(6, 512, 32, 2, 2, 4, conditions=True),
        kwargs={"block_size": 4, "implementation": "shard_on_i_mx_hybrid", "num_static_block": 1},
        positional=6,
        kernels=(),
        only_kernels=False,
        grad=("hidden_states", "expert_affinities_masked"),
        check_grads=False,
        batch=("hidden_states", "expert_affinities_masked"),
        sharding=_replicated(9),
        bad=BadInput("conditions", _shorter, "conditions"),
        neuron=_moe_mxfp4(200, 512, 1024, 2, 1, 256, jnp.bfloat16, conditions=True),
        neuron_kwargs={"block_size": 256, "implementation": "shard_on_i_mx_hybrid"},
        neuron_lnc=2,
        neuron_fallback="trn3",
        notes="through blockwise_mm_shard_intermediate_mx_hybrid (no dispatcher branch); trn3 only",
    ),
    ArgSpec(
        "moe_cte.gelu_falls_back",
        nki.moe_cte,
        _MOE,
        _moe(6, 16, 8, 4, 2, 4),
        kwargs={"block_size": 4, "implementation": "shard_on_i", "activation_function": "GELU"},
        kernels=(),
        only_kernels=False,
        batch=_FLOATS,
        neuron=_moe(255, 512, 16, 2, 1, 256),
        neuron_kwargs={"block_size": 256, "implementation": "shard_on_i", "activation_function": "GELU"},
        neuron_fallback="activation_function SiLU or Swish",
        notes="the kernels compute SiLU and Swish only: other activations run the reference on Neuron",
    ),
    ArgSpec(
        "blockwise_mm_bwd",
        nki.blockwise_mm_bwd,
        (
            "hidden_states",
            "expert_affinities_masked",
            "gate_up_proj_weight",
            "down_proj_weight",
            "gate_up_proj_act_checkpoint_T",
            "down_proj_act_checkpoint",
            "token_position_to_id",
            "block_to_expert",
            "output_hidden_states_grad",
        ),
        _checkpoints(9, 16, 8, 4, 2, 4),
        kwargs={"block_size": 4, "bias": True, "clamp_limits": nki.ClampLimits(non_linear_clamp_upper_limit=1.0)},
        kernels=("blockwise_mm_bwd",),
        batch=("hidden_states", "gate_up_proj_act_checkpoint_T", "output_hidden_states_grad"),
        sharding=Sharding(_DATA, (P(),) * 9, (P(),) * 6),
        bad=BadInput("gate_up_proj_act_checkpoint_T", lambda c: c[:, :1], "gate_up_proj_act_checkpoint_T"),
        neuron=_checkpoints(127, 64, 32, 2, 1, 128),
        neuron_kwargs={"block_size": 128, "bias": True},
        notes="a backward kernel: not differentiated itself",
    ),
    ArgSpec(
        "blockwise_mm_baseline_shard_hidden",
        nki.blockwise_mm_baseline_shard_hidden,
        _MOE,
        _moe(11, 16, 8, 4, 2, 4),
        kwargs={"block_size": 4},
        kernels=("blockwise_mm_baseline_shard_hidden",),
        grad=_GRAD,
        batch=_FLOATS,
        sharding=_replicated(6),
        bad=BadInput("down_proj_weight", lambda d: d[:, :-1], "down_proj_weight"),
        neuron=_moe(11, 16, 16, 4, 2, 4),
        neuron_lnc=2,
    ),
    ArgSpec(
        "blockwise_mm_baseline_shard_hidden.checkpoints",
        nki.blockwise_mm_baseline_shard_hidden,
        _MOE + ("gate_up_activations_T", "down_activations"),
        _with_buffers(_moe(11, 16, 16, 4, 2, 4), 16, 4),
        kwargs={"block_size": 4, "expert_affinities_scaling_mode": "PRE_SCALE"},
        kernels=("blockwise_mm_baseline_shard_hidden",),
        grad=_GRAD,
        grad_output=lambda out: out[0],
        batch=_FLOATS,
        sharding=Sharding(_DATA, (P(),) * 8, (P(), P(), P())),
        bad=BadInput("down_activations", lambda d: d[:, :-1], "down_activations"),
        notes="the checkpoint buffers are filled (and aliased on Neuron)",
    ),
)
