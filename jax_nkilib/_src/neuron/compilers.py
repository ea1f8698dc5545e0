"""Kernel compilers: turn (spec, input avals, static params, LNC) into the config of one Neuron custom call.

* :class:`NkiCompiler` compiles the real kernel through the ``nki`` package's framework-integration API
  (``nki.framework.compiled.CompileKernel(...).build_config(...)``, probed at run time). It needs the Neuron SDK.
* :class:`DryRunCompiler` needs nothing: it emits a deterministic config with the same top-level schema
  (``func_name``, ``grid``, ``has_collectives``, ``mac_count``) and ``kernel_format: "dry-run"``, plus the entry
  point and static params. It is enabled explicitly with ``jax_nkilib.neuron.dry_run()`` and never poses as a
  compiled kernel.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import inspect
import json
import os
from typing import Any, Mapping

import numpy as np

from ..framework import config
from ..framework.spec import DTYPE_KINDS, CallInfo, KernelSpec
from ..framework.validation import outputs_of

PLATFORM_TARGET_ENV_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
DEFAULT_PLATFORM_TARGET = "trn2"

INSTALL_HINT = (
    "Lowering jax_nkilib kernels for the `neuron` platform needs the Neuron SDK's `nki` package, which is not "
    "installed. Install `nki`, `neuronx-cc`, `libneuronxla` and `jax-neuronx` from the Neuron SDK's own pip "
    "repository as described in the AWS Neuron setup guide (the packages of the same names on PyPI are empty "
    "placeholders). To inspect the lowering without the SDK, use `with jax_nkilib.neuron.dry_run(): ...`."
)


class NeuronSdkMissingError(RuntimeError):
    """Lowering for Neuron was requested but neither the ``nki`` package nor dry run is available."""


class NkiApiError(RuntimeError):
    """The installed ``nki`` package lacks a name jax_nkilib needs (the framework API is young and moves)."""


class NeuronOutputMismatchError(RuntimeError):
    """The compiled kernel's outputs differ from the shapes/dtypes that abstract evaluation promised."""


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What the custom-call emitter needs: the config string, the outputs, aliases and the collectives flag."""

    backend_config: str  # ASCII base64 of the JSON config
    output_specs: tuple[tuple[tuple[int, ...], np.dtype], ...]
    aliases: Mapping[int, int]
    has_collectives: bool

    @property
    def config(self) -> dict:
        return decode_backend_config(self.backend_config)


def decode_backend_config(backend_config: str) -> dict:
    """Inverse of the base64-JSON encoding used in the ``backend_config`` string."""
    return json.loads(base64.b64decode(backend_config.encode("ascii")).decode("utf-8"))


def _json_value(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (tuple, list)):
        return [_json_value(item) for item in value]
    if isinstance(value, np.dtype) or isinstance(value, type):
        return np.dtype(value).name
    return value


def static_kernel_kwargs(spec: KernelSpec, call: CallInfo) -> dict[str, Any]:
    """The kernel's static keyword arguments (the params, without the LNC degree the grid carries)."""
    return {param.name: call.params[param.name] for param in spec.params}


def present_operands(spec: KernelSpec, call: CallInfo) -> list[str]:
    return [operand.name for operand in spec.operands if call.avals.get(operand.name) is not None]


class DryRunCompiler:
    """Deterministic stand-in for the NKI compiler, for inspecting and testing the Neuron lowering."""

    name = "dry-run"

    def compile(self, spec: KernelSpec, call: CallInfo, output_avals) -> CompiledKernel:
        names = present_operands(spec, call)
        cfg = {
            "func_name": spec.name,
            "kernel_format": "dry-run",
            "entry_point": spec.entry_point,
            "grid": call.lnc,
            "has_collectives": spec.has_collectives,
            "mac_count": int(spec.mac_count(call)) if spec.mac_count else 0,
            "input_names": names,
            "input_specs": [[list(call.avals[n].shape), np.dtype(call.avals[n].dtype).name] for n in names],
            "output_names": [output.name for output in outputs_of(spec, call)],
            "params": {key: _json_value(value) for key, value in static_kernel_kwargs(spec, call).items()},
            "aliases": sorted([int(i), int(o)] for i, o in spec.aliases.items()),
        }
        text = json.dumps(cfg, sort_keys=True, separators=(",", ":"))
        return CompiledKernel(
            backend_config=base64.b64encode(text.encode("utf-8")).decode("ascii"),
            output_specs=tuple((tuple(aval.shape), np.dtype(aval.dtype)) for aval in output_avals),
            aliases=dict(spec.aliases),
            has_collectives=spec.has_collectives,
        )


def _import_entry_point(entry_point: str):
    """Import ``module:function``; ``nkilib.`` modules are also looked up as ``nkilib_src.nkilib.``."""
    module_name, _, attribute = entry_point.partition(":")
    candidates = [module_name]
    if module_name.startswith("nkilib."):
        candidates.append("nkilib_src." + module_name)
    errors = []
    for candidate in candidates:
        try:
            return getattr(importlib.import_module(candidate), attribute)
        except (ImportError, AttributeError) as err:
            errors.append(f"{candidate}:{attribute}: {err}")
    raise NkiApiError(f"cannot import the kernel entry point {entry_point} ({'; '.join(errors)}). The NKI Library "
                      "ships with neuronx-cc (as `nkilib`) or as the `nki-library` source tree (`nkilib_src`).")


COMMON_TYPES_MODULE = "nkilib.core.utils.common_types"


def library_enum(value: Any) -> Any:
    """``value``, or for one of jax_nkilib's copies of the NKI Library enums (``jax_nkilib.nki.NormType.RMS_NORM``)
    the library's own member of the same class and name, which the kernel compares against."""
    if not isinstance(value, enum.Enum):
        return value
    cls = _import_entry_point(f"{COMMON_TYPES_MODULE}:{type(value).__name__}")
    try:
        return cls[value.name]
    except KeyError:
        raise NkiApiError(f"the installed NKI Library's {type(value).__name__} has no member {value.name}") from None


ADAPTER_PACKAGE = "jax_nkilib_kernels."


def replica_group_arguments(spec: KernelSpec, static: Mapping[str, Any]) -> dict[str, Any]:
    """``static`` with each replica-group param (rank lists after lowering) as an ``nki.collectives.ReplicaGroup``,
    the type the NKI Library's collective kernels declare. Device adapters in ``jax_nkilib_kernels`` take the rank
    lists and build what their library call needs."""
    axis_params = [param.name for param in spec.params if param.kind == "axis" and static.get(param.name) is not None]
    if not axis_params or spec.entry_point.startswith(ADAPTER_PACKAGE):
        return dict(static)
    replica_group = _import_entry_point("nki.collectives:ReplicaGroup")
    return {**static, **{name: replica_group([list(ranks) for ranks in static[name]]) for name in axis_params}}


def device_dtypes(spec: KernelSpec, static: Mapping[str, Any]) -> dict[str, Any]:
    """``static`` with dtype params as ``nki.language`` dtypes of the same name (``"dtype-x4"`` params as the packed
    ``<name>_x4`` type, e.g. ``nl.float8_e4m3fn_x4``), the objects NKI kernels allocate with. Device adapters in
    ``jax_nkilib_kernels`` convert their own."""
    kinds = {param.name: param.kind for param in spec.params if param.kind in DTYPE_KINDS}
    present = [name for name in kinds if static.get(name) is not None]
    if not present or spec.entry_point.startswith(ADAPTER_PACKAGE):
        return dict(static)
    language = importlib.import_module("nki.language")
    converted = {}
    for name in present:
        type_name = np.dtype(static[name]).name + ("_x4" if kinds[name] == "dtype-x4" else "")
        if not hasattr(language, type_name):
            raise NkiApiError(f"nki.language has no dtype {type_name} (parameter `{name}` of {spec.name})")
        converted[name] = getattr(language, type_name)
    return {**static, **converted}


def kernel_arguments(function, tensors: Mapping[str, Any], static: Mapping[str, Any]) -> tuple[list, dict]:
    """Positional and keyword arguments for ``function``: tensors positionally while they fill the signature's
    leading parameters in order, every other tensor (after an absent optional one, or after static parameters in
    the kernel's signature, as ``k_scale`` in ``swa_fused_cte``) and every static parameter by keyword."""
    try:
        leading = list(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # no introspectable signature: only the first tensor is surely first
        leading = list(tensors)[:1]
    args, kwargs = [], dict(static)
    for index, (name, value) in enumerate(tensors.items()):
        if len(args) == index and index < len(leading) and leading[index] == name:
            args.append(value)
        else:
            kwargs[name] = value
    return args, kwargs


def _probe_compile_kernel():
    for module_name in ("nki.framework.compiled", "nki.framework"):
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, "CompileKernel"):
            return module.CompileKernel
    raise NkiApiError("the installed `nki` package has no `nki.framework.compiled.CompileKernel`; jax_nkilib needs "
                      "the framework-integration API of nki >= 0.4 (Neuron SDK 2.30+)")


class NkiCompiler:
    """Compiles the real NKI kernel for the call's shapes through ``nki``'s framework-integration API."""

    name = "nki"

    def __init__(self, target: str | None = None):
        self.target = target or os.environ.get(PLATFORM_TARGET_ENV_VAR, DEFAULT_PLATFORM_TARGET)

    def compile(self, spec: KernelSpec, call: CallInfo, output_avals) -> CompiledKernel:
        import jax

        compile_kernel = _probe_compile_kernel()
        function = _import_entry_point(spec.entry_point)
        tensors = {n: jax.ShapeDtypeStruct(call.avals[n].shape, call.avals[n].dtype)
                   for n in present_operands(spec, call)}
        kernel = compile_kernel(function, lnc=call.lnc, target=self.target)
        build_config = getattr(kernel, "build_config", None)
        if build_config is None:
            raise NkiApiError("nki's CompileKernel object has no `build_config`; this nki version is not supported")
        static = {name: library_enum(value) for name, value in static_kernel_kwargs(spec, call).items()}
        static = device_dtypes(spec, replica_group_arguments(spec, static))
        args, kwargs = kernel_arguments(function, tensors, static)
        framework_config = build_config(*args, **kwargs)
        missing = [attr for attr in ("backend_config_b64", "output_specs", "operand_output_aliases",
                                     "has_collectives") if not hasattr(framework_config, attr)]
        if missing:
            raise NkiApiError(f"nki's FrameworkConfig lacks {', '.join(missing)}; this nki version is not supported")
        return CompiledKernel(
            backend_config=framework_config.backend_config_b64,
            output_specs=tuple((tuple(s.shape), np.dtype(s.dtype)) for s in framework_config.output_specs),
            aliases=dict(framework_config.operand_output_aliases or {}),
            has_collectives=bool(framework_config.has_collectives),
        )


def nki_available() -> bool:
    try:
        importlib.import_module("nki")
    except ImportError:
        return False
    return True


def active_compiler():
    """The compiler in force: dry run if enabled, else the ``nki`` compiler, else an installation error."""
    if config.dry_run_enabled():
        return DryRunCompiler()
    if nki_available():
        return NkiCompiler()
    raise NeuronSdkMissingError(INSTALL_HINT)
