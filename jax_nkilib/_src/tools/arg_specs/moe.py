"""Arg specs of ``jax_nkilib.moe``: a prefill call (``moe_cte`` on Neuron, ``blockwise_mm_bwd`` in reverse mode) and
a decode call (``moe_tkg``); and of ``jax_nkilib.moe_block`` (one ``moe_block_tkg`` for a decode call at LNC 2)."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)


def _moe(tokens, hidden, inter, experts, dtype=jnp.float32):
    """``x [tokens, hidden]``, router logits ``[tokens, experts]``, ``w_gate_up [E, H, 2, I]``, ``w_down [E, I, H]``."""
    return lambda rng: (
        normal(rng, (tokens, hidden), dtype),
        normal(rng, (tokens, experts), dtype),
        normal(rng, (experts, hidden, 2, inter), dtype, hidden**-0.5),
        normal(rng, (experts, inter, hidden), dtype, inter**-0.5),
    )


def _block(tokens, hidden, inter, experts, dtype=jnp.float32):
    """moe_block's ``x [tokens, hidden]``, ``norm_weight [hidden]``, ``w_router [hidden, E]`` and the experts."""

    def build(rng):
        x, _, w_gate_up, w_down = _moe(tokens, hidden, inter, experts, dtype)(rng)
        return x, normal(rng, (hidden,), dtype, 0.2) + 1, normal(rng, (hidden, experts), dtype), w_gate_up, w_down

    return build


_OPERANDS = ("x", "routing", "w_gate_up", "w_down")
_BLOCK = ("x", "norm_weight", "w_router", "w_gate_up", "w_down")

register(
    ArgSpec(
        "moe",
        jax_nkilib.moe,
        _OPERANDS,
        _moe(16, 32, 16, 8),
        kwargs={"top_k": 2, "normalize": True},
        kernels=("moe_cte",),
        only_kernels=False,
        grad=_OPERANDS,
        sharding=Sharding(_DATA, (P("data"), P("data"), P(), P()), P("data")),
        neuron=_moe(512, 512, 256, 8, jnp.bfloat16),
        bad=BadInput("w_down", drop_last_axis, "w_down"),
    ),
    ArgSpec(
        "moe.decode",
        jax_nkilib.moe,
        _OPERANDS,
        _moe(4, 32, 16, 8),
        kwargs={"top_k": 2},
        kernels=("moe_tkg",),
        only_kernels=False,
        grad=("x", "w_gate_up", "w_down"),
        neuron=_moe(4, 512, 256, 8, jnp.bfloat16),
        bad=BadInput("routing", drop_last_axis, "router logits"),
    ),
    ArgSpec(
        "moe_block",
        jax_nkilib.moe_block,
        _BLOCK,
        _block(8, 32, 16, 8),
        kwargs={"top_k": 2, "normalize": True},
        kernels=("moe_block_tkg",),
        only_kernels=False,
        grad=_BLOCK,
        sharding=Sharding(_DATA, (P("data"), P(), P(), P(), P()), (P("data"), P("data"))),
        neuron=_block(4, 512, 256, 8, jnp.bfloat16),
        neuron_lnc=2,
        bad=BadInput("w_router", drop_last_axis, "w_router"),
    ),
)
