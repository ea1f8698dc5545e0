"""Arg specs of ``transformer_tkg``: a two-layer decode step sharded over the batch (no all-reduce), and the
tensor-parallel variant whose two all-reduces per layer sum over the ``tp`` mesh axis (one KV head per rank)."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register

OPERANDS = (
    "X",
    "W_qkvs",
    "W_outs",
    "W_gates",
    "W_ups",
    "W_downs",
    "W_gamma_qkvs",
    "W_gamma_mlps",
    "K_caches",
    "V_caches",
    "RoPE_cos",
    "RoPE_sin",
    "mask_cache",
    "position_ids",
)
DIFFERENTIABLE = OPERANDS[:6]  # X and the projections (tests/attention/test_transformer_tkg.py: the gammas)


def decode_step(layers, batch, hidden, d, q, inter, s_max, s_ctx, ranks=1, tokens=1):
    """Operands of one decode step: ``ranks`` tensor-parallel ranks side by side (each ``q`` query heads and one KV
    head, its weight columns/rows and cache rows contiguous), caches filled, the first ``s_ctx - tokens`` slots
    visible plus a causal active tail, new tokens written after each row's context."""

    def build(rng):
        scale = 0.5 / np.sqrt(hidden)
        x = normal(rng, (batch, tokens, hidden), scale=0.3)
        w_qkv = normal(rng, (layers, hidden, ranks * (q + 2) * d), scale=scale)
        w_out = normal(rng, (layers, ranks * q * d, hidden), scale=0.5 / np.sqrt(q * d))
        w_gate, w_up = (normal(rng, (layers, hidden, ranks * inter), scale=scale) for _ in range(2))
        w_down = normal(rng, (layers, ranks * inter, hidden), scale=0.5 / np.sqrt(inter))
        gammas = [1.0 + normal(rng, (layers, 1, hidden), scale=0.1) for _ in range(2)]
        k_cache = normal(rng, (layers, ranks * batch, d, s_max), scale=0.5)
        v_cache = normal(rng, (layers, ranks * batch, s_max, d), scale=0.5)
        angle = jnp.asarray(rng.uniform(-np.pi, np.pi, (d // 2, batch, tokens)), jnp.float32)
        visible = np.ones((s_ctx, batch, ranks * q, tokens), np.int32)
        visible[s_ctx - tokens :] = np.tril(np.ones((tokens, tokens), np.int32))[:, None, None, :].transpose(1, 2, 3, 0)
        positions = jnp.asarray((s_ctx - tokens + np.arange(batch) % (s_max - s_ctx + 1))[:, None], jnp.int32)
        return (
            x,
            w_qkv,
            w_out,
            w_gate,
            w_up,
            w_down,
            *gammas,
            k_cache,
            v_cache,
            jnp.cos(angle),
            jnp.sin(angle),
            jnp.asarray(visible),
            positions,
        )

    return build


_DATA = (("data", 8),)
_BY_BATCH = Sharding(
    _DATA,
    (P("data"),) + (P(),) * 7 + (P(None, "data"),) * 2 + (P(None, "data"),) * 2 + (P(None, "data"), P("data")),
    (P("data"), P(None, "data"), P(None, "data")),
)
_TP = (("tp", 8),)
_TENSOR_PARALLEL = Sharding(
    _TP,
    (P(), P(None, None, "tp"), P(None, "tp"), P(None, None, "tp"), P(None, None, "tp"), P(None, "tp"), P(), P())
    + (P(None, "tp"),) * 2
    + (P(), P(), P(None, None, "tp"), P()),
    (P("tp"), P(None, "tp"), P(None, "tp")),  # out per rank: every rank holds the all-reduced result
    collective=True,
)

register(
    ArgSpec(
        "transformer_tkg",
        nki.transformer_tkg,
        OPERANDS,
        decode_step(2, 8, 32, 4, 2, 24, 6, 4),
        positional=13,
        kernels=("transformer_tkg",),
        grad=DIFFERENTIABLE,
        grad_output=lambda out: out[0],
        batch=("X", "W_qkvs", "K_caches"),
        sharding=_BY_BATCH,
        neuron=decode_step(1, 2, 128, 16, 2, 128, 8, 6),
        bad=BadInput("W_outs", lambda w: w[:, :-1], "W_outs"),
    ),
    ArgSpec(
        "transformer_tkg.tensor_parallel",
        nki.transformer_tkg,
        OPERANDS,
        decode_step(2, 2, 32, 4, 1, 8, 6, 4, ranks=8),
        positional=13,
        kwargs={"replica_groups": "tp"},
        kernels=("transformer_tkg",),
        grad=DIFFERENTIABLE,
        grad_output=lambda out: out[0],
        batch=("X",),
        sharding=_TENSOR_PARALLEL,
        neuron=decode_step(1, 2, 128, 16, 1, 128, 8, 6, ranks=8),
        bad=BadInput("W_outs", lambda w: w[:, :-8], "W_outs"),
    ),
)
