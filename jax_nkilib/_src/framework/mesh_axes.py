"""Mesh axes given by name: the ``axis_name`` of the shard_map building blocks (ring attention, collective matmuls)
and the replica groups of the collective kernels (``replica_groups=("tp",)``), checked and converted in one place."""

from __future__ import annotations

import jax


def lax_axis(names: tuple[str, ...]):
    """The axis-name argument of ``lax`` collectives for mesh axes ``names`` (one name, or a tuple of several)."""
    return names if len(names) > 1 else names[0]


def bound_axis_size(names: tuple[str, ...]) -> int | None:
    """The size of the named (mesh) axes in the current trace, or ``None`` when one is not bound here."""
    try:
        return int(jax.lax.axis_size(lax_axis(names)))
    except (NameError, ValueError, KeyError):
        return None


def _bound(where: str, value, argument: str, hint: str) -> tuple[tuple[str, ...], int]:
    names = (value,) if isinstance(value, str) else value
    if not (isinstance(names, tuple) and names and all(isinstance(name, str) for name in names)):
        raise TypeError(f"{where}: `{argument}` must be a mesh axis name or a non-empty tuple of names; got {value!r}")
    size = bound_axis_size(names)
    if size is None:
        shown = repr(value) if isinstance(value, str) else str(names)
        raise ValueError(
            f"{where}: mesh axis {shown} is not bound here (`{argument}`); call {where} inside "
            f"jax.shard_map over a mesh with that axis{hint}"
        )
    return names, size


def axis_names(where: str, value, argument: str = "axis_name", hint: str = "") -> tuple[str, ...]:
    """``value`` (a mesh axis name or a non-empty tuple of names) as a tuple of names bound by the enclosing
    ``jax.shard_map``; ``TypeError`` for anything else, ``ValueError`` when an axis is not bound here."""
    return _bound(where, value, argument, hint)[0]


def bound_axis(where: str, axis_name, hint: str = "") -> tuple[tuple[str, ...], int]:
    """``(axis names, ring size)`` for the ``axis_name`` argument (see :func:`axis_names`)."""
    return _bound(where, axis_name, "axis_name", hint)
