"""Whether and how a kernel call can run as the NKI kernel on Neuron: its unmet limits and the resulting plan.

``plan_neuron_call`` makes the one decision that both the lowering and ``explain`` report: run the kernel, split
the call along an independent dimension into pieces that each meet every limit, or fall back to the reference.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..framework import compat, config
from ..framework.spec import FP8_DTYPES, NEURON_FLOAT_DTYPES, CallInfo, KernelSpec
from ..framework.validation import kernel_outputs, operand_layout
from .sdk import describe_versions, entry_point_missing, nki_available


def missing_from_sdk(spec: KernelSpec) -> list[str]:
    """When the real NKI compiler is in force: why the installed NKI Library cannot compile the kernel (it predates
    the kernel), naming the installed versions; empty otherwise."""
    if config.dry_run_enabled() or not nki_available():
        return []
    reason = entry_point_missing(spec.entry_point)
    return [] if reason is None else [f"{reason}; installed: {describe_versions()}"]


def unmet_neuron_limits(spec: KernelSpec, call: CallInfo) -> list[str]:
    """Every NKI-kernel limit this call does not meet (empty when the kernel can run)."""
    unmet = []
    for name, aval in call.avals.items():
        if aval is None:
            continue
        dtype = np.dtype(aval.dtype)
        if jnp.issubdtype(dtype, jnp.floating) and dtype not in NEURON_FLOAT_DTYPES + FP8_DTYPES:
            unmet.append(f"`{name}` has dtype {dtype}; Neuron kernels take float32, bfloat16, float16 or FP8")
    if spec.neuron_limits is not None:
        unmet.extend(spec.neuron_limits(call))
    return unmet + missing_from_sdk(spec)


@dataclasses.dataclass(frozen=True)
class NeuronPlan:
    """How a call lowers for Neuron: ``"kernel"`` (one call), ``"split"`` (``pieces`` calls along ``dim``), or
    ``"fallback"`` (the JAX reference, because of ``unmet``)."""

    kind: str
    unmet: tuple[str, ...] = ()
    dim: str | None = None
    pieces: int = 1

    def describe(self) -> str:
        if self.kind == "kernel":
            return "kernel"
        if self.kind == "split":
            return f"kernel, split into {self.pieces} calls along {self.dim} ({'; '.join(self.unmet)})"
        return "fallback: " + "; ".join(self.unmet)


def operand_axes(spec: KernelSpec, dim: str, call: CallInfo) -> dict[str, int]:
    """For each present operand (by name), the axis whose layout token is exactly ``dim``."""
    axes = {}
    for name, aval in call.avals.items():
        for axis, token in enumerate(() if aval is None else operand_layout(spec, name, call).dims):
            if token.binds and token.name == dim:
                axes[name] = axis
    return axes


def piece_call(spec: KernelSpec, call: CallInfo, dim: str, size: int) -> CallInfo:
    """The call on one slice of size ``size`` along ``dim``."""
    avals = dict(call.avals)
    for name, axis in operand_axes(spec, dim, call).items():
        shape = list(avals[name].shape)
        shape[axis] = size
        avals[name] = compat.ShapedArray(tuple(shape), call.avals[name].dtype)
    return CallInfo(call.function, avals, dict(call.dims, **{dim: size}), call.params)


def output_axes(spec: KernelSpec, call: CallInfo, piece: CallInfo) -> list[int] | None:
    """For each output, the axis along which the pieces' outputs concatenate in order: its one axis whose size
    differs between the whole call and a ``piece`` (``neuron_split_dims`` promises that the split dimension is that
    axis' major part). ``None`` when an output has no such axis: the call cannot be split this way."""
    axes = []
    for (_, whole), (_, part) in zip(kernel_outputs(spec, call), kernel_outputs(spec, piece)):
        changed = [axis for axis, (a, b) in enumerate(zip(whole.shape, part.shape)) if a != b]
        if len(changed) != 1 or whole.dtype != part.dtype:
            return None
        axes.append(changed[0])
    return axes


def plan_neuron_call(spec: KernelSpec, call: CallInfo) -> NeuronPlan:
    """Decide kernel, split or fallback for one call (the same decision for lowering and for ``explain``)."""
    unmet = tuple(unmet_neuron_limits(spec, call))
    if not unmet:
        return NeuronPlan("kernel")
    for dim in (dim for dim in spec.neuron_split_dims if dim in call.dims):
        size = call.dims[dim]
        for pieces in range(2, size + 1):
            piece = piece_call(spec, call, dim, size // pieces) if size % pieces == 0 else None
            if piece and not unmet_neuron_limits(spec, piece) and output_axes(spec, call, piece) is not None:
                return NeuronPlan("split", unmet, dim, pieces)
    return NeuronPlan("fallback", unmet)
