"""Helpers for tests on the 8 CPU devices."""

import jax
from jax.sharding import NamedSharding


def mesh_1d(name: str = "data", size: int = 8):
    return jax.make_mesh((size,), (name,))


def shard(mesh, spec, *arrays):
    """Place ``arrays`` on ``mesh`` with ``spec`` (shard_map on an explicit mesh wants placed inputs)."""
    placed = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(arrays, spec))
    return placed if len(placed) > 1 else placed[0]
