"""The Neuron lowering rule: one ``AwsNeuronCustomNativeKernel`` custom call per kernel call.

A call that exceeds a kernel limit which splitting fixes becomes several kernel calls over slices (see
:mod:`planning`). When a limit is not met
otherwise (head size, dtype, LNC divisibility, ...) the policy decides: ``"fallback"`` lowers the JAX reference
instead and warns once per call site naming the limit; ``"error"`` raises :class:`NeuronUnsupportedError`.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable

from jax import export, lax
from jax.interpreters import mlir

from ..framework import compat, config
from ..framework.spec import CallInfo, KernelSpec
from ..framework.validation import check_call, output_avals
from .compiled import CompiledKernel, NeuronOutputMismatchError, mismatched_outputs
from .compilers import active_compiler
from .planning import NeuronPlan, operand_axes, output_axes, piece_call, plan_neuron_call

CUSTOM_CALL_TARGET = "AwsNeuronCustomNativeKernel"
# For jax.export(..., platforms=[..., "neuron"], disabled_checks=EXPORT_DISABLED_CHECKS): the kernel calls are custom
# calls without JAX's compatibility guarantee (their config names a kernel artifact on this machine), so an exported
# Neuron module is for this machine and SDK, not for long-term storage.
EXPORT_DISABLED_CHECKS = (export.DisabledSafetyCheck.custom_call(CUSTOM_CALL_TARGET),)


class NeuronUnsupportedError(ValueError):
    """A kernel call does not meet the NKI kernel's limits and ``on_unsupported="error"`` is in force."""


class NeuronFallbackWarning(UserWarning):
    """A kernel call lowers to the JAX reference on Neuron because a kernel limit is not met."""


_warned: set[tuple[str, str, tuple[str, ...]]] = set()
_warned_lock = threading.Lock()


def _split_lowering(spec: KernelSpec, primitive, plan: NeuronPlan, call: CallInfo, present, params):
    """A function computing the call as ``plan.pieces`` kernel calls over equal slices along ``plan.dim``."""
    width = call.dims[plan.dim] // plan.pieces
    axes = operand_axes(spec, plan.dim, call)
    out_axes = output_axes(spec, call, piece_call(spec, call, plan.dim, width))

    def split(*values):
        pieces = []
        for start in range(0, call.dims[plan.dim], width):
            sliced = [
                lax.slice_in_dim(value, start, start + width, axis=axes[name]) if name in axes else value
                for name, value in zip(present, values)
            ]
            pieces.append(primitive.bind(*sliced, present=present, **params))
        return [lax.concatenate([outs[i] for outs in pieces], axis) for i, axis in enumerate(out_axes)]

    return split


def warn_once(name: str, site: str, unmet: list[str]) -> None:
    """Warn (once per ``name``, call site and reasons) that the call of ``name`` at ``site`` lowers to the JAX
    reference on Neuron because of ``unmet``."""
    key = (name, site, tuple(unmet))
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    filename, _, line = site.rpartition(":")
    message = (
        f"{name} at {site} lowers to the JAX reference on Neuron, not the NKI kernel: "
        f"{'; '.join(unmet)}. Use jax_nkilib.config(on_unsupported='error') to make this an error."
    )
    if line.isdigit():
        warnings.warn_explicit(message, NeuronFallbackWarning, filename, int(line))
    else:
        warnings.warn(message, NeuronFallbackWarning, stacklevel=3)


def emit_custom_call(ctx, operands, compiled: CompiledKernel, kernel: str = "the kernel"):
    """Emit the custom call for ``compiled`` (operands in the kernel's order), after checking its outputs against
    abstract evaluation."""
    mismatches = mismatched_outputs(compiled.output_specs, ctx.avals_out)
    if mismatches:
        raise NeuronOutputMismatchError(
            f"{kernel} compiled to outputs that abstract evaluation does not expect: {'; '.join(mismatches)}"
        )
    return compat.custom_call(
        CUSTOM_CALL_TARGET,
        result_types=[compat.ir_type(ctx, aval) for aval in ctx.avals_out],
        operands=[operands[index] for index in compiled.operand_order],
        backend_config=compiled.backend_config,
        operand_output_aliases=dict(compiled.aliases),
        frontend_attributes={"has_collectives": "1"} if compiled.has_collectives else None,
        tuple_result=compiled.tuple_result,
    )


def _with_replica_groups(spec: KernelSpec, ctx, call: CallInfo) -> CallInfo:
    """``call`` with each replica-group param (mesh axis names) replaced by the rank lists the kernel expects."""
    axis_params = [param.name for param in spec.params if param.kind == "axis"]
    if not axis_params:
        return call
    params = dict(call.params)
    for name in axis_params:
        if params[name] is None:  # an optional replica group left out: the kernel issues no collective
            continue
        groups = compat.replica_groups(ctx, params[name])
        if groups is None:
            raise ValueError(
                f"{spec.public_name}: `{name}`={params[name]} must name axes of the jax.shard_map that "
                "encloses the call; the Neuron kernel needs them as rank lists"
            )
        params[name] = groups
    return dataclasses.replace(call, params=params)


def neuron_lowering_rule(spec: KernelSpec, reference_rule: Callable) -> Callable:
    """The lowering rule registered as the primitive's default (and for ``neuron`` when that platform is known)."""

    def rule(ctx, *operands, present, **params):
        avals = {name: aval for name, aval in zip(present, ctx.avals_in)}
        call = check_call(spec, avals, params)
        plan = plan_neuron_call(spec, call)
        if plan.kind == "split":
            split = _split_lowering(spec, ctx.primitive, plan, call, present, params)
            return mlir.lower_fun(split, multiple_results=True)(ctx, *operands)
        if plan.kind == "fallback":
            unmet = list(plan.unmet)
            if config.current_on_unsupported() == "error":
                raise NeuronUnsupportedError(
                    f"{spec.public_name} cannot run as the NKI kernel on Neuron: {'; '.join(unmet)}"
                )
            warn_once(spec.public_name, compat.call_site(ctx.traceback), unmet)
            return reference_rule(ctx, *operands, present=present, **params)
        compiled = active_compiler().compile(spec, _with_replica_groups(spec, ctx, call), output_avals(spec, call))
        return emit_custom_call(ctx, operands, compiled, spec.public_name)

    return rule
