"""``op_census``: what a function's Neuron graph holds besides its kernel calls.

Lowered for Neuron, every jax_nkilib kernel call is one ``AwsNeuronCustomNativeKernel`` custom call; everything else
in the StableHLO module is glue that XLA runs between the kernels (layout changes, splits, broadcasts, residual
adds, fallbacks). The census counts that glue by operation name, so a model's graph economy can be measured and held
by a test. A ``reshape`` of a dense row-major array never moves data (it merges or splits contiguous axes), so
reshapes are counted but listed apart from the data-moving operations. Transposes are also judged by what their
chains do: a run of transposes and reshapes (each feeding only the next) that leaves the elements in row-major
order, such as a transpose back to the layout an op started from, or one that moves only size-1 axes, amounts to a
reshape once folded (XLA's algebraic simplifier merges consecutive transposes and drops the identities); only the
chains that do reorder count as ``moving_transposes``.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator

import jax
import numpy as np

from ..framework import config
from ..neuron.compiled import decode_backend_config
from ..neuron.lowering import CUSTOM_CALL_TARGET

STRUCTURAL = frozenset({"func.func", "func.return", "func.call", "stablehlo.return", "builtin.module"})
FREE = frozenset({"reshape", "constant"})  # no data movement: row-major reshapes and literal constants
LAYOUT = frozenset({"stablehlo.transpose", "stablehlo.reshape"})
MAX_TRACKED = 1 << 24  # elements whose positions a chain's check follows one by one


@dataclasses.dataclass(frozen=True)
class OpCensus:
    """The Neuron graph of a function: ``kernels``, the NKI kernel names (``func_name``) of its kernel calls in
    program order; ``ops``, the other StableHLO operations by name without the ``stablehlo.`` prefix (other
    dialects keep theirs; a custom call to another target is ``custom_call:<target>``), in first-seen order;
    ``moving_transposes``, how many chains of transposes and reshapes reorder the elements (the others, such as a
    transpose followed by its inverse, amount to a reshape)."""

    kernels: tuple[str, ...]
    ops: dict[str, int]
    moving_transposes: int = 0

    @property
    def glue(self) -> dict[str, int]:
        """``ops`` without the free ones (reshapes and constants): what moves or computes data between kernels."""
        return {name: count for name, count in self.ops.items() if name not in FREE}

    def __str__(self) -> str:
        others = ", ".join(f"{count} {name}" for name, count in sorted(self.ops.items())) or "none"
        return (
            f"{len(self.kernels)} kernel call(s) ({', '.join(self.kernels)}); {sum(self.ops.values())} other op(s): "
            f"{others}; {self.moving_transposes} transpose chain(s) that move data"
        )


def _operations(op) -> Iterator:
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                yield inner
                yield from _operations(inner)


def _string_attribute(op, name: str) -> str:
    attribute = op.attributes[name]
    return getattr(attribute, "value", str(attribute).strip('"'))


def _single_layout_use(op) -> bool:
    """Whether ``op``'s one result feeds exactly one operation, a transpose or reshape."""
    uses = list(op.results[0].uses)
    return len(uses) == 1 and uses[0].owner.operation.name in LAYOUT


def _chain_ending_at(op) -> list:
    """The transposes and reshapes that feed only one another up to ``op``, in program order."""
    chain = [op]
    while True:
        source = chain[0].operands[0].owner
        if not hasattr(source, "operation") or source.operation.name not in LAYOUT or not _single_layout_use(source):
            return chain
        chain.insert(0, source)


def _moves_sized_axes(transpose) -> bool:
    shape = tuple(transpose.operands[0].type.shape)
    kept = [axis for axis in (int(a) for a in transpose.attributes["permutation"]) if shape[axis] != 1]
    return kept != sorted(kept)


def _reorders(chain) -> bool:
    """Whether the chain's elements leave row-major order, worked out on the positions themselves (for arrays past
    ``MAX_TRACKED`` elements: whether any of its transposes moves an axis longer than 1)."""
    shape = tuple(chain[0].operands[0].type.shape)
    size = int(np.prod(shape, dtype=np.int64))
    if size > MAX_TRACKED:
        return any(op.operation.name == "stablehlo.transpose" and _moves_sized_axes(op) for op in chain)
    positions = np.arange(size, dtype=np.int32).reshape(shape)
    for op in chain:
        if op.operation.name == "stablehlo.transpose":
            positions = positions.transpose([int(axis) for axis in op.attributes["permutation"]])
        else:
            positions = positions.reshape(tuple(op.results[0].type.shape))
    return bool(np.any(positions.reshape(-1) != np.arange(positions.size)))


def _moving_transposes(layout_ops) -> int:
    ends = [op for op in layout_ops if not _single_layout_use(op)]
    chains = [_chain_ending_at(op) for op in ends]
    return sum(any(op.operation.name == "stablehlo.transpose" for op in chain) and _reorders(chain) for chain in chains)


def census_of_module(module) -> OpCensus:
    """The census of a lowered module (``jax.jit(f).trace(...).lower(...).compiler_ir("stablehlo")``)."""
    kernels, ops, layout_ops = [], collections.Counter(), []
    for op in _operations(module.operation):
        name = op.operation.name
        if name in STRUCTURAL:
            continue
        if name == "stablehlo.custom_call":
            target = _string_attribute(op, "call_target_name")
            if target == CUSTOM_CALL_TARGET:
                kernels.append(_kernel_name(op))
                continue
            name = f"custom_call:{target}"
        if name in LAYOUT:
            layout_ops.append(op)
        ops[name.removeprefix("stablehlo.")] += 1
    return OpCensus(tuple(kernels), dict(ops), _moving_transposes(layout_ops))


def _kernel_name(op) -> str:
    try:
        return str(decode_backend_config(_string_attribute(op, "backend_config"))["func_name"])
    except (KeyError, ValueError):  # a config that is not base64 JSON: the kernel is unnamed
        return "kernel"


def op_census(fn, *args, **kwargs) -> OpCensus:
    """Lower ``jax.jit(fn)(*args, **kwargs)`` for Neuron with the dry-run compiler and count its operations.

    The dry-run compiler emits the same kernel calls as the Neuron SDK's (one per kernel, the same operands, the
    same fallbacks), so the census needs no SDK. For a gradient graph, pass ``jax.grad(loss)``.
    """
    with config.dry_run():
        lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("neuron",))
    return census_of_module(lowered.compiler_ir("stablehlo"))
