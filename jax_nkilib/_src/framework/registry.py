"""The kernels bound so far, by primitive and by name (for ``explain`` and the support matrix)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .primitive import Kernel

_by_name: dict[str, Kernel] = {}
_by_primitive: dict[object, Kernel] = {}


def register(kernel: Kernel) -> None:
    if kernel.spec.name in _by_name:
        raise ValueError(f"kernel {kernel.spec.name} is bound twice")
    _by_name[kernel.spec.name] = kernel
    _by_primitive[kernel.primitive] = kernel


def kernel_for_primitive(primitive) -> Kernel | None:
    return _by_primitive.get(primitive)


def bound_kernels() -> dict[str, Kernel]:
    return dict(_by_name)
