"""User tools: ``explain`` (every kernel call in a traced function) and ``neuron_hlo`` (what Neuron would compile)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr

from ..framework import config, registry
from ..framework.validation import check_call, output_avals
from ..neuron.planning import plan_neuron_call


@dataclasses.dataclass(frozen=True)
class KernelCallReport:
    """One kernel call found in a traced function.

    ``neuron`` is ``"kernel"`` when Neuron would run the NKI kernel in one call, ``"kernel, split into N calls
    along <dim> (<limits>)"`` when the call is split to meet a kernel limit, else ``"fallback: <limits>"`` (or
    ``"error: <limits>"`` under ``on_unsupported="error"``). ``context`` names the enclosing transformations (e.g.
    ``shard_map(mesh axes: data=8; manual: data)``). ``notes`` says how the kernel's numerics differ from the JAX
    reference's, for calls that run the kernel (e.g. float32 inputs computed in bfloat16).
    """

    kernel: str
    entry_point: str
    inputs: tuple[tuple[str, tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    params: dict
    lnc: int
    context: str
    neuron: str
    notes: tuple[str, ...] = ()

    @property
    def runs_kernel(self) -> bool:
        return self.neuron.startswith("kernel")

    def __str__(self) -> str:
        args = ", ".join(f"{name}{list(shape)}:{dtype}" for name, shape, dtype in self.inputs)
        flags = ", ".join(f"{k}={getattr(v, 'name', v)}" for k, v in self.params.items())
        where = f" in {self.context}" if self.context else ""
        notes = "".join(f"; note: {note}" for note in self.notes)
        return f"{self.kernel}({args}; {flags}) LNC={self.lnc}{where} -> Neuron: {self.neuron}{notes}"


class Explanation(tuple):
    """The kernel calls of a function, in program order. ``str()`` gives a readable listing."""

    def __str__(self) -> str:
        if not self:
            return "no jax_nkilib kernel calls"
        kernels = sum(report.runs_kernel for report in self)
        lines = [f"{len(self)} jax_nkilib kernel call(s); {kernels} would run as NKI kernels on Neuron:"]
        lines += [f"  {i}. {report}" for i, report in enumerate(self, 1)]
        return "\n".join(lines)


def _sub_jaxprs(value: Any) -> Iterator[Jaxpr]:
    if isinstance(value, ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _sub_jaxprs(item)


def _context_of(eqn, outer: str) -> str:
    if eqn.primitive.name != "shard_map":
        return outer
    mesh = eqn.params.get("mesh")
    axes = ", ".join(f"{name}={size}" for name, size in getattr(mesh, "shape", {}).items())
    manual_axes = eqn.params.get("manual_axes") or eqn.params.get("newly_manual_axes") or ()  # name by JAX version
    manual = ", ".join(sorted(str(a) for a in manual_axes)) or "none"
    here = f"shard_map(mesh axes: {axes}; manual: {manual})"
    return f"{outer} > {here}" if outer else here


def _report(kernel, eqn, context: str) -> KernelCallReport:
    spec = kernel.spec
    params = dict(eqn.params)
    present = params.pop("present")
    avals = {name: var.aval for name, var in zip(present, eqn.invars)}
    call = check_call(spec, avals, params)
    plan = plan_neuron_call(spec, call)
    neuron = plan.describe()
    if plan.kind == "fallback" and config.current_on_unsupported() == "error":
        neuron = "error: " + "; ".join(plan.unmet)
    notes = () if plan.kind == "fallback" or spec.neuron_notes is None else tuple(spec.neuron_notes(call))
    return KernelCallReport(
        kernel=spec.name,
        entry_point=spec.entry_point,
        inputs=tuple((n, tuple(a.shape), np.dtype(a.dtype).name) for n, a in call.avals.items()),
        outputs=tuple((tuple(a.shape), np.dtype(a.dtype).name) for a in output_avals(spec, call)),
        params={p.name: params[p.name] for p in spec.params},
        lnc=params["lnc"],
        context=context,
        neuron=neuron,
        notes=notes,
    )


def _walk(jaxpr: Jaxpr, context: str, reports: list) -> None:
    for eqn in jaxpr.eqns:
        kernel = registry.kernel_for_primitive(eqn.primitive)
        if kernel is not None:
            reports.append(_report(kernel, eqn, context))
            continue
        inner = _context_of(eqn, context)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                _walk(sub, inner, reports)


def explain(fn, *args, **kwargs) -> Explanation:
    """Trace ``fn(*args, **kwargs)`` and list every jax_nkilib kernel call in it.

    For each call: the kernel, its operand shapes (in the kernel's layout) and dtypes, static flags, LNC degree,
    enclosing ``shard_map``, and whether lowering for Neuron would run the NKI kernel (in one call or split) or fall
    back to the JAX reference (and why), with notes on the kernel's numerics (float32 inputs computed in bfloat16).
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    reports: list[KernelCallReport] = []
    _walk(closed.jaxpr, "", reports)
    return Explanation(reports)


def neuron_hlo(fn, *args, **kwargs) -> str:
    """The StableHLO text that the Neuron compiler would receive for ``jax.jit(fn)(*args, **kwargs)``.

    Kernel calls lower with the active compiler: the ``nki`` package, or the dry-run compiler inside
    ``jax_nkilib.neuron.dry_run()``.
    """
    traced = jax.jit(fn).trace(*args, **kwargs)
    return traced.lower(lowering_platforms=("neuron",)).as_text()
