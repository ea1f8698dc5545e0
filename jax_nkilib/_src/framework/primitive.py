"""The primitive factory: one :class:`KernelSpec` in, one JAX primitive and its public function out.

For a spec, :func:`make_kernel` creates a multiple-results ``jax.extend.core.Primitive`` and registers

* abstract evaluation (validation + output shapes from the spec's layouts),
* the eager implementation (``apply_primitive``),
* the JAX reference lowering for ``cpu``, ``cuda``, ``rocm`` and ``tpu``,
* the Neuron custom call as the default lowering (and for ``neuron`` when that platform is already known),
* the batching rule (fold plans, then ``lax.map``),

and returns a :class:`Kernel`: the public layer-1 function. When the spec defines a VJP, the public function is a
``jax.custom_vjp`` over the primitive. Its forward names what it saves for remat policies
(``jax_nkilib.checkpoint_policies``), whatever the rule: the operands it is given are ``checkpoint_name``-d
``"<kernel>.<operand>"`` and the outputs of its calls of the kernel ``"<kernel>.<output>"`` (statistics included), and
the named outputs are also the ones it returns, so the rest of the program uses the values a policy saves.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import batching as jax_batching
from jax.interpreters import mlir

from . import batching, checkpoint_policies, compat, registry, runtime_checks
from .spec import FP8_DTYPES, KernelSpec
from .validation import check_call, check_derived, normalize_params, output_avals, output_names, split_arguments

REFERENCE_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")

# The Neuron lowering sits in the layer above the framework (``jax_nkilib._src.neuron``), which registers its rule
# builder here when it is imported (``jax_nkilib._src`` imports it first): builder(spec, reference_rule) -> rule.
_neuron_rule_builder: Callable | None = None


def register_neuron_lowering(builder: Callable) -> None:
    """Set the builder of every kernel's Neuron lowering rule (called once, by ``jax_nkilib._src.neuron``)."""
    global _neuron_rule_builder
    _neuron_rule_builder = builder


# A VJP rule is either a backward function
#     rule(kernel, operands, params, outputs, cotangents) -> {operand name: cotangent or None}
# whose forward saves the operands and outputs, or a Vjp(forward, backward) pair for kernels whose reverse mode needs
# a different forward (e.g. one that also returns softmax statistics):
#     forward(kernel, operands, params) -> (outputs, residuals)
#     backward(kernel, residuals, params, cotangents) -> {operand name: cotangent or None}
# Operands, outputs and cotangents are in the kernel's layouts. A missing or None cotangent means zero (integer
# operands always get None). The framework names the residuals: a forward gets its operands already named, and its
# ``kernel.call`` returns named outputs, so a forward saves only those (anything else it saved would have no name).


def zero_cotangents(kernel, operands, params, outs, cotangents):
    """A VJP rule for kernels whose outputs carry no derivative (indices, or quantized values: piecewise constant in
    every float input): no operand gets a cotangent, so reverse mode gives zero gradients."""
    return {}


def reference_vjp(kernel, operands, params, outs, cotangents):
    """A VJP rule for kernels with no backward kernel: differentiate the JAX reference in the floating operands that
    are not FP8 (FP8 data, like integer operands, gets no cotangent)."""
    names = [
        name
        for name, value in operands.items()
        if value is not None and jnp.issubdtype(value.dtype, jnp.floating) and value.dtype not in FP8_DTYPES
    ]
    return pull_back(lambda named: kernel.reference(named, params), operands, names, cotangents)


def pull_back(fn: Callable, operands: Mapping[str, Any], names, cotangents) -> dict[str, Any]:
    """Cotangents of ``operands[name]`` for ``name`` in ``names`` through ``fn(operands) -> tuple of outputs``, for
    the outputs' ``cotangents`` (``None`` means zero; each is cast to its output's dtype)."""

    def differentiable(*values):
        return fn(dict(operands, **dict(zip(names, values))))

    primal, pullback = jax.vjp(differentiable, *(operands[name] for name in names))
    wanted = tuple(jnp.zeros_like(p) if c is None else c.astype(p.dtype) for c, p in zip(cotangents, primal))
    return dict(zip(names, pullback(wanted)))


@dataclasses.dataclass(frozen=True)
class Vjp:
    forward: Callable
    backward: Callable


def _saving_operands_and_outputs(rule: Callable) -> Vjp:
    def forward(kernel, operands, params):
        outs = kernel.call(operands, params)
        return outs, (operands, outs)

    def backward(kernel, residuals, params, cotangents):
        operands, outs = residuals
        return rule(kernel, operands, params, outs, cotangents)

    return Vjp(forward, backward)


def _present(operands: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the operands given (absent optional operands are ``None``)."""
    return tuple(name for name, value in operands.items() if value is not None)


def _docstring(spec: KernelSpec) -> str:
    """The public function's docstring, from its spec: tensors with their layouts, flags with their defaults."""
    tensors = "\n".join(f"  {op.name}: {op.layout_text}{' (optional)' if op.optional else ''}" for op in spec.operands)
    flags = "\n".join(f"  {param.name}={param.default!r}" for param in spec.params if param.to_kernel)
    where = f" (nkilib_catalog.md {spec.catalog})" if spec.catalog else ""
    return (
        f"The NKI Library kernel ``{spec.name}``{where}: tensors positional in the kernel's order, flags by "
        f"keyword; returns the kernel's output(s).\n\nTensors:\n{tensors}\n\nFlags:\n{flags or '  none'}\n"
    )


class Kernel:
    """A layer-1 kernel function: ``kernel(*tensors, **flags)`` returns the kernel's output(s)."""

    def __init__(self, spec: KernelSpec, vjp: Callable | Vjp | None = None):
        self.spec = spec
        self.vjp = vjp if vjp is None or isinstance(vjp, Vjp) else _saving_operands_and_outputs(vjp)
        batching.check_fold_plans(spec)
        self.primitive = Primitive(spec.name)
        self.primitive.multiple_results = True
        self._register()
        self.__name__ = spec.name
        self.__qualname__ = spec.name
        self.__module__ = "jax_nkilib.nki"
        self.__doc__ = _docstring(spec)

    # ----------------------------------------------------------------------------------------------- public call
    def __call__(self, *args, **kwargs):
        operands, raw_params, derived = split_arguments(self.spec, args, kwargs)
        outs = self.call(operands, normalize_params(self.spec, raw_params), derived=derived)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def params(self, **flags) -> dict[str, Any]:
        """Normalized params for ``flags`` (defaults filled, LNC resolved), for layer-2 ops calling :meth:`call`."""
        return normalize_params(self.spec, flags)

    def unmet_neuron_limits(self, operands: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
        """The Neuron limits a call with these operands (by name, ``None`` for absent ones; only their shapes and
        dtypes are read) and normalized params would not meet: for layer-2 ops choosing between a kernel and
        another route before calling it."""
        avals = {
            name: None if value is None else jax.ShapeDtypeStruct(jnp.shape(value), jnp.result_type(value))
            for name, value in operands.items()
        }
        limits = self.spec.neuron_limits
        return [] if limits is None else limits(check_call(self.spec, avals, params))

    def call(
        self,
        operands: Mapping[str, Any],
        params: Mapping[str, Any],
        derived: Mapping[str, Any] | None = None,
        *,
        name_outputs: bool = False,
    ) -> tuple:
        """Call with operands by name (``None`` for absent optional ones) and normalized params (the spec's
        ``prepare`` hook, if any, first). ``derived`` holds shape-derived config fields the caller gave, checked
        against the shapes. ``name_outputs``: return the outputs ``checkpoint_name``-d ``"<kernel>.<output>"`` (what
        a VJP forward's ``kernel.call`` does)."""
        if self.spec.prepare is not None:
            operands, params = self.spec.prepare(self.spec.public_name, dict(operands), dict(params))
        operands = {name: (None if value is None else jnp.asarray(value)) for name, value in operands.items()}
        call = check_call(self.spec, operands, params)
        if derived:
            check_derived(self.spec, call, derived)
        if self.spec.runtime_checks is not None and runtime_checks.enabled():
            self.spec.runtime_checks(call, operands)
        outs = self.bind(operands, params) if self.vjp is None else self._differentiable(operands, params)
        names = output_names(self.spec, call)
        if self.spec.nondifferentiable_outputs:
            outs = tuple(
                jax.lax.stop_gradient(out) if name in self.spec.nondifferentiable_outputs else out
                for out, name in zip(outs, names)
            )
        if name_outputs:  # last, so that the named values are the ones returned
            operand_names = [op.name for op in self.spec.operands]
            outs = checkpoint_policies.name_outputs(self.spec.name, dict(zip(names, outs)), operand_names)
        return outs

    def bind(self, operands: Mapping[str, Any], params: Mapping[str, Any]) -> tuple:
        present = _present(operands)
        values = compat.align_varying([operands[name] for name in present])
        return tuple(self.primitive.bind(*values, present=present, **params))

    def _differentiable(self, operands: Mapping[str, Any], params: Mapping[str, Any]) -> tuple:
        present = _present(operands)
        rule, kernel_name = self.vjp, self.spec.name

        def as_operands(values):
            named = dict.fromkeys(operands)
            named.update(zip(present, values))
            return named

        @jax.custom_vjp
        def kernel_call(*values):
            return self.bind(as_operands(values), params)

        def forward(*values):
            # The rule's forward calls kernel.call (itself a custom_vjp), not bind, so that differentiating the
            # forward (higher order) goes through this rule again. It gets named operands and a kernel whose call
            # names its outputs: every residual is named, and the outputs it returns are the named ones.
            return rule.forward(
                _NamingOutputs(self), checkpoint_policies.name_operands(kernel_name, as_operands(values)), params
            )

        def backward(residuals, cotangents):
            grads = rule.backward(self, residuals, params, tuple(cotangents))
            # inside shard_map, an operand replicated over a mesh axis gets the sum of its per-shard cotangents
            return tuple(
                None
                if grads.get(name) is None
                else compat.sum_over_extra_varying(grads[name], operands[name]).astype(operands[name].dtype)
                for name in present
            )

        kernel_call.defvjp(forward, backward)
        return tuple(kernel_call(*(operands[name] for name in present)))

    def reference(self, operands: Mapping[str, Any], params: Mapping[str, Any]) -> tuple:
        """The JAX reference on operands by name (for VJP rules)."""
        spec = self.spec
        static = {param.name: params[param.name] for param in spec.params}
        if spec.reference_takes_lnc:
            static["lnc"] = params["lnc"]
        return tuple(spec.reference(**{op.name: operands.get(op.name) for op in spec.operands}, **static))

    # ------------------------------------------------------------------------------------------- registrations
    def _reference(self, *values, present, **params):
        return self.reference(dict(zip(present, values)), params)

    def _abstract_eval(self, *avals, present, **params):
        call = check_call(self.spec, dict(zip(present, avals)), params)
        return [compat.typed_like(out, avals) for out in output_avals(self.spec, call)]

    def _batch(self, args, batch_dims, *, present, **params):
        size = batching.axis_size(args, batch_dims)
        avals = {name: batching.unbatched_aval(x, d) for name, x, d in zip(present, args, batch_dims)}
        call = check_call(self.spec, avals, params)
        bind = lambda values: self.primitive.bind(*values, present=present, **params)  # noqa: E731
        plan = batching.choose_plan(self.spec, present, batch_dims, call)
        if plan is not None:
            axes, out_axes = batching.fold_axes(self.spec, plan, call, present, output_names(self.spec, call))
            return batching.fold(axes, out_axes, bind, args, batch_dims, present, size)
        return batching.map_fallback(bind, args, batch_dims)

    def _register(self) -> None:
        prim = self.primitive
        prim.def_impl(functools.partial(compat.apply_primitive, prim))
        prim.def_abstract_eval(self._abstract_eval)
        reference_rule = mlir.lower_fun(self._reference, multiple_results=True)
        for platform in REFERENCE_PLATFORMS:
            mlir.register_lowering(prim, reference_rule, platform=platform)
        # Cacheable like any lowering: everything the rule reads (LNC, target, policy, dry run) is in the params or
        # the jit key. (An uncacheable rule breaks multi-platform jax.export; the price is that a fallback warning
        # names the first of several identical call sites in one module.)
        if _neuron_rule_builder is None:  # a packaging bug: jax_nkilib._src imports the neuron layer first
            raise RuntimeError("jax_nkilib._src.neuron must be imported before any kernel is made")
        neuron_rule = _neuron_rule_builder(self.spec, reference_rule)
        mlir.register_lowering(prim, neuron_rule)
        if compat.is_known_platform("neuron"):
            mlir.register_lowering(prim, neuron_rule, platform="neuron")
        jax_batching.primitive_batchers[prim] = self._batch
        registry.register(self)

    def __repr__(self) -> str:
        return f"<jax_nkilib kernel {self.spec.name} ({self.spec.entry_point})>"


class _NamingOutputs:
    """The kernel as a VJP forward sees it: ``call`` returns the outputs named ``"<kernel>.<output>"``."""

    def __init__(self, kernel: Kernel):
        self._kernel = kernel

    def __getattr__(self, attribute: str):
        return getattr(self._kernel, attribute)

    def call(self, operands, params, derived=None) -> tuple:
        return self._kernel.call(operands, params, derived, name_outputs=True)


def make_kernel(spec: KernelSpec, vjp: Callable | Vjp | None = None) -> Kernel:
    """Create the primitive and public function for ``spec`` (see the module docstring)."""
    return Kernel(spec, vjp)
