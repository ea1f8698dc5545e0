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
from ..framework.validation import layout_of, outputs_of
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


def axes_of(spec: KernelSpec, dim: str, call: CallInfo) -> dict:
    """For each present operand (by name) and output (by index), the axis whose layout token is exactly ``dim``."""
    layouts = {name: layout_of(spec, name, call) for name, aval in call.avals.items() if aval is not None}
    layouts.update((index, layout_of(spec, output.name, call)) for index, output in enumerate(outputs_of(spec, call)))
    axes = {}
    for key, layout in layouts.items():
        for axis, token in enumerate(layout.dims):
            if token.binds and token.name == dim:
                axes[key] = axis
    return axes


def _piece_call(spec: KernelSpec, call: CallInfo, dim: str, size: int) -> CallInfo:
    avals = dict(call.avals)
    for name, axis in axes_of(spec, dim, call).items():
        if isinstance(name, str):
            shape = list(avals[name].shape)
            shape[axis] = size
            avals[name] = compat.ShapedArray(tuple(shape), call.avals[name].dtype)
    return CallInfo(call.function, avals, dict(call.dims, **{dim: size}), call.params)


def plan_neuron_call(spec: KernelSpec, call: CallInfo) -> NeuronPlan:
    """Decide kernel, split or fallback for one call (the same decision for lowering and for ``explain``)."""
    unmet = tuple(unmet_neuron_limits(spec, call))
    if not unmet:
        return NeuronPlan("kernel")
    for dim in spec.neuron_split_dims:
        size = call.dims[dim]
        for pieces in range(2, size + 1):
            if size % pieces == 0 and not unmet_neuron_limits(spec, _piece_call(spec, call, dim, size // pieces)):
                return NeuronPlan("split", unmet, dim, pieces)
    return NeuronPlan("fallback", unmet)


