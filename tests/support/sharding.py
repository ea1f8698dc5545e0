"""Helpers for tests on the 8 CPU devices."""

import jax
from jax.sharding import NamedSharding


def mesh_1d(name: str = "data", size: int = 8):
    return jax.make_mesh((size,), (name,))


def shard(mesh, spec, *arrays):
    """Place ``arrays`` on ``mesh`` with ``spec`` (shard_map on an explicit mesh wants placed inputs)."""
    placed = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, spec))
    return placed if len(placed) > 1 else placed[0]


def place(mesh, specs, *arrays) -> tuple:
    """:func:`shard`, always as a tuple."""
    return tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, specs))


def run_sharded(fn, mesh, in_specs, out_specs, *args):
    """``fn`` jitted inside ``jax.shard_map`` on ``args`` placed with ``in_specs``."""
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    return jax.jit(body)(*place(mesh, in_specs, *args))
