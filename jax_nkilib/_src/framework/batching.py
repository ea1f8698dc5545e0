"""Batching (vmap) of kernel primitives.

A vmapped axis is folded into one of the kernel's own axes when a :class:`FoldPlan` of the spec fits the call
(e.g. into the batch axis, or into the heads axis when the per-position tables are not batched); operands that are
not batched are broadcast along the vmapped axis only when the plan needs them to be. When no plan fits, the call
runs under ``lax.map`` over the vmapped axis with the unbatched operands closed over.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax.numpy as jnp
from jax import lax

from . import compat
from .spec import CallInfo, FoldPlan, KernelSpec
from .validation import operand_layout


def _merge_axis(x, source_axis: int | None, target_axis: int, size: int):
    """Put the vmapped axis in front of ``target_axis`` and merge the two (vmapped axis major)."""
    if source_axis is None:
        x = jnp.broadcast_to(jnp.expand_dims(x, target_axis), x.shape[:target_axis] + (size,) + x.shape[target_axis:])
    else:
        x = jnp.moveaxis(x, source_axis, target_axis)
    shape = x.shape
    return x.reshape(shape[:target_axis] + (shape[target_axis] * shape[target_axis + 1],) + shape[target_axis + 2 :])


def _split_axis(x, axis: int, size: int):
    shape = x.shape
    return x.reshape(shape[:axis] + (size, shape[axis] // size) + shape[axis + 1 :])


def plan_fits(plan: FoldPlan, present: Sequence[str], batch_dims: Sequence[int | None], call: CallInfo) -> bool:
    for name, dim in zip(present, batch_dims):
        if plan.axes.get(name) is None and dim is not None:
            return False
    return plan.when is None or plan.when(call)


def choose_plan(spec: KernelSpec, present, batch_dims, call: CallInfo) -> FoldPlan | None:
    for plan in spec.fold_plans:
        if plan_fits(plan, present, batch_dims, call):
            return plan
    return None


def _axis(spec: KernelSpec, name: str, dim: str | int, call: CallInfo) -> int:
    """The axis of operand or output ``name`` that the plan's ``dim`` names: the position of that token in the
    layout the call selects (an int is an output's axis, for outputs with no layout)."""
    if isinstance(dim, int):
        return dim
    plain = {output.name: output.layout for output in spec.outputs}
    layout = plain[name] if name in plain else operand_layout(spec, name, call)
    tokens = [] if layout is None else [token.text for token in layout.dims]
    if dim not in tokens:  # a spec bug, not a user error
        raise AssertionError(
            f"{spec.name}: a fold plan names dimension {dim} of `{name}`, whose layout in this call is {layout}"
        )
    return tokens.index(dim)


def check_fold_plans(spec: KernelSpec) -> None:
    """At kernel creation: every output dimension a fold plan names by token is a token of that plain output's
    layout (an output the ``output_avals`` hook computes has no layout: its axis must be an int), and plans that list
    output dimensions in order list one per plain output."""
    layouts = {output.name: output.layout for output in spec.outputs}
    for plan in spec.fold_plans:
        if not isinstance(plan.outputs, Mapping) and len(plan.outputs) != len(spec.outputs):
            raise AssertionError(
                f"{spec.name}: a fold plan gives {len(plan.outputs)} output dimensions in order for "
                f"{len(spec.outputs)} plain outputs (computed outputs are named: outputs={{name: axis}})"
            )
        for name, dim in plan.output_dims(spec.outputs).items():
            if isinstance(dim, int):
                continue
            layout = layouts.get(name)
            if layout is None or dim not in [token.text for token in layout.dims]:
                raise AssertionError(
                    f"{spec.name}: a fold plan names dimension {dim} of output `{name}`, which "
                    f"{'has no layout (give its axis as an int)' if layout is None else f'is {layout}'}"
                )


def fold_axes(spec: KernelSpec, plan: FoldPlan, call: CallInfo, present, produced) -> tuple[dict, list[int]]:
    """``(operand name -> axis or None, [axis of each produced output])``: where the plan merges the vmapped axis
    in the present operands and where the produced outputs carry it, resolved against this call's layouts."""
    operand_axes = {
        name: None if plan.axes.get(name) is None else _axis(spec, name, plan.axes[name], call) for name in present
    }
    dims = plan.output_dims(spec.outputs)
    return operand_axes, [_axis(spec, name, dims[name], call) for name in produced]


def fold(axes: dict, out_axes: list[int], bind: Callable, args, batch_dims, present, size: int):
    """Merge the vmapped axis into the kernel axes ``axes``, bind once, split it out of the outputs."""
    folded = []
    for name, x, dim in zip(present, args, batch_dims):
        axis = axes.get(name)
        folded.append(x if axis is None else _merge_axis(x, dim, axis, size))
    outs = bind(folded)
    return [_split_axis(out, axis, size) for out, axis in zip(outs, out_axes)], list(out_axes)


def map_fallback(bind: Callable, args, batch_dims):
    """Run the kernel once per element of the vmapped axis with ``lax.map``."""
    batched = [i for i, dim in enumerate(batch_dims) if dim is not None]
    sliced = tuple(jnp.moveaxis(args[i], batch_dims[i], 0) for i in batched)

    def one(xs):
        full = list(args)
        for i, x in zip(batched, xs):
            full[i] = x
        return tuple(bind(full))

    outs = lax.map(one, sliced)
    return list(outs), [0] * len(outs)


def axis_size(args, batch_dims) -> int:
    for x, dim in zip(args, batch_dims):
        if dim is not None:
            return x.shape[dim]
    raise ValueError("batching rule called with no batched argument")


def unbatched_aval(x, dim):
    shape = tuple(s for i, s in enumerate(x.shape) if i != dim)
    return compat.ShapedArray(shape, x.dtype)
