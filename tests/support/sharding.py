"""Helpers for tests on the 8 CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

# `jax.set_mesh` (a context manager too) is JAX >= 0.8; JAX 0.7 spells the context manager jax.sharding.use_mesh.
use_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...]):
    """``jax.make_mesh`` with explicit axes: JAX's default since 0.8 (JAX 0.7 defaulted to auto axes)."""
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


def reshard(x, sharding):
    """``jax.sharding.reshard`` (an array with no mesh onto an explicit mesh, inside ``jit``) where JAX can
    differentiate that. JAX 0.7 cannot: its transpose reshards the cotangent back to the empty mesh, which its
    abstract eval rejects (jax/_src/pjit.py ``_reshard_transpose_rule``, ``_reshard_abstract_eval``); there the
    cotangent passes through unchanged instead."""
    if _reshard_transposes_from_no_mesh():
        return jax.sharding.reshard(x, sharding)
    return _reshard_passing_cotangent(x, sharding)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _reshard_passing_cotangent(x, sharding):
    return jax.sharding.reshard(x, sharding)


_reshard_passing_cotangent.defvjp(
    lambda x, sharding: (jax.sharding.reshard(x, sharding), None), lambda _, __, ct: (ct,)
)


@functools.cache
def _reshard_transposes_from_no_mesh() -> bool:
    mesh = make_mesh((1,), ("probe",))
    sharded = NamedSharding(mesh, PartitionSpec("probe"))
    try:
        jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jax.sharding.reshard(x, sharded))))(np.ones(2, np.float32))
    except ValueError:
        return False
    return True


def mesh_1d(name: str = "data", size: int = 8):
    return make_mesh((size,), (name,))


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
