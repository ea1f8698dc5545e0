"""Arg specs of the scan kernels (``cumsum``, ``linear_scan``, ``selective_scan``) and of ``jax_nkilib.cumsum``."""

from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register, uniform

_DATA = (("data", 8),)

register(
    ArgSpec(
        "cumsum",
        nki.cumsum,
        ("x",),
        lambda rng: (normal(rng, (8, 3, 37)),),
        kernels=("cumsum",),
        grad=("x",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("x", lambda x: x[0, 0], "layout"),
    ),
    ArgSpec(
        "jax_nkilib.cumsum",
        jax_nkilib.cumsum,
        ("x",),
        lambda rng: (normal(rng, (8, 21, 5)),),
        kwargs={"axis": 1},
        kernels=("cumsum",),
        only_kernels=False,
        grad=("x",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("axis", lambda axis: 3, "axis"),
    ),
)


def _selective_scan_args(rng, batch=8, channels=5, length=19, states=3):
    """Mamba-like values: positive small time steps, negative A, a small initial state."""
    return (
        normal(rng, (batch, channels, length)),
        uniform(rng, (batch, channels, length), 0.01, 0.3),
        uniform(rng, (channels, states), -1.0, -0.1),
        normal(rng, (batch, states, length)),
        normal(rng, (batch, states, length)),
        normal(rng, (channels,)),
        normal(rng, (batch, channels, states), scale=0.1),
    )


register(
    ArgSpec(
        "linear_scan",
        nki.linear_scan,
        ("decay", "data", "initial"),
        lambda rng: (uniform(rng, (8, 3, 37), 0.5, 1.0), normal(rng, (8, 3, 37)), normal(rng, (8, 3, 1))),
        kernels=("linear_scan",),
        grad=("decay", "data", "initial"),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P("data"), P("data")), (P("data"), P("data"))),
        bad=BadInput("initial", lambda initial: initial[..., 0], "[..., P, 1]"),
    ),
    ArgSpec(
        "selective_scan",
        nki.selective_scan,
        ("x", "dt", "A", "B", "C", "D", "initial_state"),
        _selective_scan_args,
        kernels=("selective_scan",),
        grad=("x", "dt", "A", "B", "C", "D", "initial_state"),
        sharding=Sharding(
            _DATA, (P("data"), P("data"), P(), P("data"), P("data"), P(), P("data")), (P("data"), P("data"))
        ),
        bad=BadInput("B", lambda B: B[:, :, :-1], "layout"),
    ),
)


def _ssd_args(rng, batch=8, heads=3, length=20, headdim=5, dstate=4):
    """Mamba-2-like values: positive small time steps, negative A, a small initial state."""
    return (
        normal(rng, (batch, heads, length, headdim)),
        uniform(rng, (batch, heads, length), 0.01, 0.3),
        uniform(rng, (heads,), -1.0, -0.1),
        normal(rng, (batch, length, dstate)),
        normal(rng, (batch, length, dstate)),
        normal(rng, (heads,)),
        normal(rng, (batch, heads, dstate, headdim), scale=0.1),
    )


register(
    ArgSpec(
        "ssd",
        nki.ssd,
        ("x", "dt", "A", "B", "C", "D", "initial_state"),
        _ssd_args,
        kwargs={"chunk_size": 8},
        positional=5,
        kernels=("ssd",),
        grad=("x", "dt", "A", "B", "C", "D", "initial_state"),
        sharding=Sharding(
            _DATA, (P("data"), P("data"), P(), P("data"), P("data"), P(), P("data")), (P("data"), P("data"))
        ),
        neuron=lambda rng: _ssd_args(rng, batch=2, length=32),
        bad=BadInput("chunk_size", lambda chunk_size: 0, "positive"),
    ),
)
