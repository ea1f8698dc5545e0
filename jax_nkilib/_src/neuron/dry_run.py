"""``DryRunCompiler``: a deterministic stand-in for the NKI compiler, for inspecting and testing the Neuron lowering.

It needs nothing from the Neuron SDK. Its config has the top-level schema of NKI's (``func_name``, ``grid``,
``has_collectives``, ``mac_count``) with ``kernel_format: "dry-run"``, plus what the kernel would be compiled with:
the entry point, the tensor inputs (name, shape, dtype; the NKI dtype of packed words), the forwarded static params
(jax_nkilib's own, ``Param.to_kernel=False``, never appear) and the aliases. It is enabled explicitly with
``jax_nkilib.neuron.dry_run()`` and never poses as a compiled kernel. It does not read the kernel's signature, so
it keeps the spec's operand order.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import numpy as np

from ..framework.spec import CallInfo, KernelSpec
from ..framework.validation import output_names
from .compiled import CompiledKernel, encode_backend_config
from .kernel_arguments import TensorArgument, call_arguments


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config object (RotationalTopkConfig)
        return {field.name: _json_value(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_json_value(item) for item in value]
    if isinstance(value, np.dtype) or isinstance(value, type):
        return np.dtype(value).name
    return value


class DryRunCompiler:
    """Deterministic stand-in for the NKI compiler (see the module docstring)."""

    name = "dry-run"

    def compile(self, spec: KernelSpec, call: CallInfo, output_avals) -> CompiledKernel:
        arguments = call_arguments(spec, call)
        tensors = [value for value in arguments.values() if isinstance(value, TensorArgument)]
        outputs = list(output_names(spec, call))
        inputs = [t.name for t in tensors]
        aliases = {inputs.index(i): outputs.index(o) for i, o in spec.aliases.items() if i in inputs and o in outputs}
        collectives = spec.has_collectives(call) if callable(spec.has_collectives) else spec.has_collectives
        cfg = {
            "func_name": spec.name,
            "kernel_format": "dry-run",
            "entry_point": spec.entry_point,
            "grid": call.lnc,
            "platform_target": call.target,
            "has_collectives": collectives,
            "mac_count": int(spec.mac_count(call)) if spec.mac_count else 0,
            "input_names": inputs,
            "input_specs": [[list(t.shape), t.device_dtype or t.dtype.name] for t in tensors],
            "output_names": outputs,
            "params": {
                name: _json_value(value) for name, value in arguments.items() if not isinstance(value, TensorArgument)
            },
            "aliases": sorted([i, o] for i, o in aliases.items()),
        }
        return CompiledKernel(
            backend_config=encode_backend_config(cfg),
            output_specs=tuple((tuple(aval.shape), np.dtype(aval.dtype).name) for aval in output_avals),
            aliases=aliases,
            has_collectives=collectives,
            operand_order=tuple(range(len(tensors))),
        )
