"""The Neuron lowering rule: one ``AwsNeuronCustomNativeKernel`` custom call per kernel call.

When a Neuron-kernel limit is not met (head size, SBUF capacity, dtype, LNC divisibility, ...) the policy decides:
``"fallback"`` lowers the JAX reference instead and warns once per call site naming the limit; ``"error"`` raises
:class:`NeuronUnsupportedError`.
"""

from __future__ import annotations

import threading
import warnings
from typing import Callable

import numpy as np
from ..framework import compat, config
from ..framework.spec import NEURON_FLOAT_DTYPES, CallInfo, KernelSpec
from ..framework.validation import check_call, output_avals
from .compilers import CompiledKernel, NeuronOutputMismatchError, active_compiler

CUSTOM_CALL_TARGET = "AwsNeuronCustomNativeKernel"


class NeuronUnsupportedError(ValueError):
    """A kernel call does not meet the NKI kernel's limits and ``on_unsupported="error"`` is in force."""


class NeuronFallbackWarning(UserWarning):
    """A kernel call lowers to the JAX reference on Neuron because a kernel limit is not met."""


_warned: set[tuple[str, str, tuple[str, ...]]] = set()
_warned_lock = threading.Lock()


def unmet_neuron_limits(spec: KernelSpec, call: CallInfo) -> list[str]:
    """Every NKI-kernel limit this call does not meet (empty when the kernel can run)."""
    unmet = []
    for name, aval in call.avals.items():
        if aval is None:
            continue
        dtype = np.dtype(aval.dtype)
        if dtype.kind == "f" and dtype not in NEURON_FLOAT_DTYPES:
            unmet.append(f"`{name}` has dtype {dtype}; Neuron kernels take float32, bfloat16 or float16")
    if spec.neuron_limits is not None:
        unmet.extend(spec.neuron_limits(call))
    return unmet


def _warn_once(spec: KernelSpec, site: str, unmet: list[str]) -> None:
    key = (spec.name, site, tuple(unmet))
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    filename, _, line = site.rpartition(":")
    message = (f"{spec.public_name} at {site} lowers to the JAX reference on Neuron, not the NKI kernel: "
               f"{'; '.join(unmet)}. Use jax_nkilib.config(on_unsupported='error') to make this an error.")
    if line.isdigit():
        warnings.warn_explicit(message, NeuronFallbackWarning, filename, int(line))
    else:
        warnings.warn(message, NeuronFallbackWarning, stacklevel=3)


def emit_custom_call(ctx, operands, compiled: CompiledKernel):
    """Emit the custom call for ``compiled``, after checking its outputs against abstract evaluation."""
    expected = [(tuple(aval.shape), np.dtype(aval.dtype)) for aval in ctx.avals_out]
    if list(compiled.output_specs) != expected:
        raise NeuronOutputMismatchError(f"the compiled kernel returns {list(compiled.output_specs)} but abstract "
                                        f"evaluation expects {expected}")
    op = compat.custom_call(
        CUSTOM_CALL_TARGET,
        result_types=[compat.ir_type(ctx, aval) for aval in ctx.avals_out],
        operands=operands,
        backend_config=compiled.backend_config,
        operand_output_aliases=dict(compiled.aliases),
        frontend_attributes={"has_collectives": "1"} if compiled.has_collectives else None,
    )
    return op.results


def neuron_lowering_rule(spec: KernelSpec, reference_rule: Callable) -> Callable:
    """The lowering rule registered as the primitive's default (and for ``neuron`` when that platform is known)."""

    def rule(ctx, *operands, present, **params):
        avals = {name: aval for name, aval in zip(present, ctx.avals_in)}
        call = check_call(spec, avals, params)
        unmet = unmet_neuron_limits(spec, call)
        if unmet:
            if config.current_on_unsupported() == "error":
                raise NeuronUnsupportedError(f"{spec.public_name} cannot run as the NKI kernel on Neuron: "
                                             f"{'; '.join(unmet)}")
            _warn_once(spec, compat.call_site(ctx.traceback), unmet)
            return reference_rule(ctx, *operands, present=present, **params)
        compiled = active_compiler().compile(spec, call, output_avals(spec, call))
        return emit_custom_call(ctx, operands, compiled)

    return rule
