"""Arg specs of ``dynamic_elementwise_add`` and ``pad`` (kernel-native) and of ``jax_nkilib.pad``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, integers, normal, register

_DATA = (("data", 8),)


def _addends(rng):
    """Two [256, 512] addends and a count of one 128-row tile: the second tile is left unwritten (zeros)."""
    return normal(rng, (256, 512)), normal(rng, (256, 512)), integers(1)


def _bf16_addends(rng):
    a, b, count = _addends(rng)
    return a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), count


register(
    ArgSpec(
        "dynamic_elementwise_add",
        nki.dynamic_elementwise_add,
        ("input_a", "input_b", "num_m_tiles"),
        _addends,
        kernels=("dynamic_elementwise_add",),
        grad=("input_a", "input_b"),
        sharding=Sharding(_DATA, (P(None, "data"), P(None, "data"), P()), P(None, "data")),
        bad=BadInput("input_b", lambda b: b[:, :384], "layout"),
        neuron=_bf16_addends,
    ),
    ArgSpec(
        "pad",
        nki.pad,
        ("x_ref",),
        lambda rng: (normal(rng, (8, 3, 5, 7)),),
        kwargs={"padding": (2, 1, 0, 3), "mode": "reflect"},
        kernels=("pad",),
        grad=("x_ref",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("padding", lambda padding: (1, 2, 3), "padding"),
    ),
    ArgSpec(
        "jax_nkilib.pad",
        jax_nkilib.pad,
        ("x",),
        lambda rng: (normal(rng, (8, 5, 6)),),
        kwargs={"pad_width": ((0, 0), (1, 2), (3, 0)), "mode": "constant", "constant_values": 0.5},
        kernels=("pad",),
        only_kernels=False,
        grad=("x",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("mode", lambda mode: "symmetric", "mode"),
    ),
)
