"""Arg specs of the prefix-sum kernel ``cumsum`` and of ``jax_nkilib.cumsum``."""

from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register

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
