"""Arg specs of the MLP kernels (``mlp``, ``mlp_forward_mxfp8_nki``, ``mlp_backward_mxfp8_nki``) and of
``jax_nkilib.mlp``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)


def _mlp(b, s, h, i, dtype=jnp.float32, gamma=False):
    """mlp's ``hidden [B, S, H]``, gate / up ``[H, I]``, down ``[I, H]`` (and an RMS-norm ``gamma [1, H]``)."""

    def build(rng):
        weights = (normal(rng, (h, i), dtype, 0.2), normal(rng, (h, i), dtype, 0.2), normal(rng, (i, h), dtype, 0.2))
        out = (normal(rng, (b, s, h), dtype), *weights)
        return out + (normal(rng, (1, h), dtype, 0.5) + 1,) if gamma else out

    return build


def _mxfp8(s, h, i, dtype=jnp.bfloat16):
    """mlp_forward_mxfp8_nki's ``hidden [S, H]``, ``gate_up_weights [2I, H]``, ``down_weights [H, I]``."""
    return lambda rng: (
        normal(rng, (s, h), dtype),
        normal(rng, (2 * i, h), dtype, h**-0.5),
        normal(rng, (h, i), dtype, i**-0.5),
    )


def _mxfp8_backward(s, h, i, dtype=jnp.bfloat16):
    """mlp_backward_mxfp8_nki's ``output_grad [S, H]``, ``hidden_states``, ``down_proj_weight``,
    ``gate_up_weights`` (the checkpoints recomputed)."""

    def build(rng):
        x, gate_up, down = _mxfp8(s, h, i, dtype)(rng)
        return normal(rng, (s, h), dtype), x, down, gate_up

    return build


def _op(b, s, h, i):
    return lambda rng: (
        normal(rng, (b, s, h)),
        normal(rng, (h, i), scale=0.25),
        normal(rng, (h, i), scale=0.25),
        normal(rng, (i, h), scale=0.25),
    )


_MLP = ("hidden_tensor", "gate_proj_weights_tensor", "up_proj_weights_tensor", "down_proj_weights_tensor")
_BACKWARD = ("output_grad", "hidden_states", "down_proj_weight", "gate_up_weights")

register(
    ArgSpec(
        "mlp",
        nki.mlp,
        _MLP,
        _mlp(8, 2, 16, 12),
        kernels=("mlp",),
        grad=_MLP,
        sharding=Sharding(_DATA, (P("data"), P(), P(), P()), P("data")),
        neuron=_mlp(2, 4, 256, 128, jnp.bfloat16),
        bad=BadInput("down_proj_weights_tensor", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "mlp.rms_norm_cte",
        nki.mlp,
        _MLP + ("normalization_weights_tensor",),
        _mlp(2, 3, 16, 12, gamma=True),
        kwargs=dict(normalization_type="RMS_NORM", force_cte_mode=True),
        kernels=("mlp",),
        grad=_MLP + ("normalization_weights_tensor",),
        neuron=_mlp(2, 128, 256, 128, jnp.bfloat16, gamma=True),
        bad=BadInput("normalization_weights_tensor", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "mlp_forward_mxfp8_nki",
        nki.mlp_forward_mxfp8_nki,
        ("hidden", "gate_up_weights", "down_weights"),
        _mxfp8(64, 128, 64),
        kwargs={"save_gate_act": True},
        kernels=("mlp_forward_mxfp8_nki",),
        grad=("hidden", "gate_up_weights", "down_weights"),
        check_grads=False,
        sharding=Sharding(_DATA, (P("data"), P(), P()), (P("data"), P("data"))),
        neuron=_mxfp8(256, 256, 128),
        neuron_kwargs={"save_gate_act": True, "run_with_lnc2": False},
        bad=BadInput("down_weights", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "mlp_backward_mxfp8_nki",
        nki.mlp_backward_mxfp8_nki,
        _BACKWARD,
        _mxfp8_backward(64, 128, 32),
        kernels=("mlp_backward_mxfp8_nki",),
        batch=("output_grad", "hidden_states"),
        neuron=_mxfp8_backward(256, 256, 128),
        neuron_kwargs={"run_with_lnc2": False},
        bad=BadInput("gate_up_weights", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "mlp_op",
        jax_nkilib.mlp,
        ("x", "w_gate", "w_up", "w_down"),
        _op(8, 3, 32, 24),
        kernels=("mlp",),
        only_kernels=False,
        grad=("x", "w_gate", "w_up", "w_down"),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P()), P("data")),
        neuron=lambda rng: tuple(a.astype(jnp.bfloat16) for a in _op(2, 4, 256, 128)(rng)),
        bad=BadInput("w_down", drop_last_axis, "w_down"),
    ),
)
