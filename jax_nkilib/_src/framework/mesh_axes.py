"""The ``axis_name`` argument of the shard_map building blocks (ring attention, collective matmuls)."""

from __future__ import annotations

from .compat import bound_axis_size


def bound_axis(where: str, axis_name, hint: str = "") -> tuple[tuple[str, ...], int]:
    """``(axis names, ring size)`` for a mesh axis name or a tuple of names bound by the enclosing
    ``jax.shard_map``; ``TypeError`` for anything else, ``ValueError`` when the axis is not bound here."""
    names = (axis_name,) if isinstance(axis_name, str) else axis_name
    if not (isinstance(names, tuple) and names and all(isinstance(name, str) for name in names)):
        raise TypeError(f"{where}: `axis_name` must be a mesh axis name or a non-empty tuple of names; got "
                        f"{axis_name!r}")
    size = bound_axis_size(names)
    if size is None:
        raise ValueError(f"{where}: mesh axis {axis_name!r} is not bound here; call {where} inside jax.shard_map "
                         f"over a mesh with that axis{hint}")
    return names, size
