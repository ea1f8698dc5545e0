"""The kernels bound so far, by primitive and by name (for ``explain``, the support matrix and the remat policies),
and the prefixes of the checkpoint names that jax_nkilib's VJPs give their residuals."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from .primitive import Kernel

_by_name: dict[str, Kernel] = {}
_by_primitive: dict[object, Kernel] = {}
# checkpoint-name prefix (a kernel's or a JAX-level op's name) -> the names of its operands
_checkpointed: dict[str, frozenset[str]] = {}


def register(kernel: Kernel) -> None:
    if kernel.spec.name in _by_name:
        raise ValueError(f"kernel {kernel.spec.name} is bound twice")
    register_checkpointed(kernel.spec.name, (op.name for op in kernel.spec.operands))
    _by_name[kernel.spec.name] = kernel
    _by_primitive[kernel.primitive] = kernel


def register_checkpointed(prefix: str, operands: Iterable[str]) -> None:
    """Declare that a VJP names its residuals ``<prefix>.<operand>`` (its inputs, ``operands``) and
    ``<prefix>.<output>`` (anything else it saves: outputs, statistics). Every kernel is declared when it is bound;
    a JAX-level op with its own ``jax.custom_vjp`` (ring attention) declares itself."""
    if prefix in _checkpointed:
        raise ValueError(f"checkpoint names {prefix}.* are declared twice")
    _checkpointed[prefix] = frozenset(operands)


def checkpointed_operands(prefix: str) -> frozenset[str] | None:
    """The operand names behind the checkpoint-name prefix ``prefix``; ``None`` if jax_nkilib does not use it."""
    return _checkpointed.get(prefix)


def kernel_for_primitive(primitive) -> Kernel | None:
    return _by_primitive.get(primitive)


def bound_kernels() -> dict[str, Kernel]:
    return dict(_by_name)
