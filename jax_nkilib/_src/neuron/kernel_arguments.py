"""The arguments a device kernel is compiled with: which ones, in what order, as what Python values.

A kernel receives its present tensor operands and the spec's params except jax_nkilib's own (``Param.to_kernel``),
by name, in the order of the kernel's own signature (the order NKI takes its inputs in, and so the custom call's
operand order). Absent optional operands are left to the kernel's defaults. How values are represented depends on
who receives them:

* an NKI Library function gets what it declares: enums as the library's own members (from the module that defines
  them in the installed library), dtypes as ``nki.language`` dtypes, replica groups as
  ``nki.collectives.ReplicaGroup``, tensors as placeholders with the operand's shape and dtype;
* a device adapter in ``jax_nkilib_kernels`` (our own ``@nki.jit`` wrappers) gets plain values it converts itself:
  enum member names, NumPy dtypes, rank lists, config dataclasses as the tuple of their field values, and tensors
  as placeholders in their JAX dtype (packed words stay unsigned words; the adapter views them as the x4 type).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..framework.spec import DTYPE_KINDS, CallInfo, KernelSpec, Param
from .sdk import ADAPTER_PACKAGE, NkiApiError, describe_versions, module_candidates, probe

ENUM_FALLBACK_MODULE = "nkilib.core.utils.common_types"


@dataclasses.dataclass(frozen=True)
class TensorArgument:
    """A tensor argument before it becomes the compiler's input: name, shape, JAX dtype, and the NKI dtype name a
    library kernel declares for it where JAX has none (``float8_e4m3fn_x4`` for uint32 words)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    device_dtype: str | None = None


def forwarded_params(spec: KernelSpec) -> tuple[Param, ...]:
    """The spec's params the kernel takes (all but jax_nkilib's own)."""
    return tuple(param for param in spec.params if param.to_kernel)


def is_adapter(spec: KernelSpec) -> bool:
    return spec.entry_point.startswith(ADAPTER_PACKAGE)


def call_arguments(spec: KernelSpec, call: CallInfo) -> dict[str, Any]:
    """The kernel's arguments for ``call`` by name, in the spec's order: a :class:`TensorArgument` per present
    operand, then each forwarded param's normalized value."""
    arguments: dict[str, Any] = {}
    for operand in spec.operands:
        aval = call.avals.get(operand.name)
        if aval is None:
            continue
        dtype = np.dtype(aval.dtype)
        device = None if operand.device_dtype is None or is_adapter(spec) else operand.device_dtype(call.params, dtype)
        arguments[operand.name] = TensorArgument(operand.name, tuple(aval.shape), dtype, device)
    arguments.update((param.name, call.params[param.name]) for param in forwarded_params(spec))
    return arguments


def in_signature_order(function: Callable, arguments: Mapping[str, Any], kernel: str) -> dict[str, Any]:
    """``arguments`` reordered as ``function``'s parameters; :class:`NkiApiError` naming any argument the function
    does not take and any parameter it requires that is not given (the installed library differs from the one this
    jax_nkilib release was written against)."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError) as err:
        raise NkiApiError(f"cannot read the signature of {kernel}: {err}") from None
    unknown = [name for name in arguments if name not in parameters]
    required = [
        name
        for name, p in parameters.items()
        if p.default is inspect.Parameter.empty
        and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        and name not in arguments
    ]
    if unknown or required:
        problems = ([f"takes no parameter {', '.join(f'`{n}`' for n in unknown)}"] if unknown else []) + (
            [f"requires {', '.join(f'`{n}`' for n in required)}"] if required else []
        )
        raise NkiApiError(
            f"the installed {kernel} {' and '.join(problems)}, unlike the NKI Library version jax_nkilib "
            f"binds (see the README's tested versions). Installed: {describe_versions()}"
        )
    return {name: arguments[name] for name in parameters if name in arguments}


# ------------------------------------------------------------------------------------------ values for the device
def _enum_class(function: Callable, parameter: str, name: str):
    """The installed library's enum class ``name`` that ``function`` compares ``parameter`` against: the parameter's
    annotation, else the name in the function's module (which imported it from the defining module), else
    ``common_types``."""
    annotation = inspect.signature(function).parameters[parameter].annotation
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum) and annotation.__name__ == name:
        return annotation
    namespace = getattr(inspect.unwrap(function), "__globals__", {})
    if isinstance(namespace.get(name), type) and issubclass(namespace[name], enum.Enum):
        return namespace[name]
    for module in module_candidates(ENUM_FALLBACK_MODULE):
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise NkiApiError(
        f"cannot find the installed NKI Library's enum {name} for parameter `{parameter}` of "
        f"{getattr(function, '__qualname__', function)} (neither its annotation, its module nor "
        f"{ENUM_FALLBACK_MODULE} has it). Installed: {describe_versions()}"
    )


def library_enum(function: Callable, parameter: str, value: enum.Enum):
    """The installed library's member with the name of jax_nkilib's ``value`` (its copy of a library enum)."""
    cls = _enum_class(function, parameter, type(value).__name__)
    try:
        return cls[value.name]
    except KeyError:
        raise NkiApiError(
            f"the installed NKI Library's {cls.__name__} has no member {value.name} (parameter "
            f"`{parameter}`). Installed: {describe_versions()}"
        ) from None


def nki_dtype(name: str, parameter: str):
    """``nki.language.<name>``: the dtype object NKI kernels allocate and compare with."""
    language = importlib.import_module("nki.language")
    if not hasattr(language, name):
        raise NkiApiError(
            f"nki.language has no dtype {name} (parameter `{parameter}`). Installed: {describe_versions()}"
        )
    return getattr(language, name)


def library_values(
    spec: KernelSpec, function: Callable, arguments: Mapping[str, Any], placeholder: Callable[[TensorArgument], Any]
) -> dict[str, Any]:
    """``arguments`` as the library function ``function`` takes them (see the module docstring)."""
    kinds = {param.name: param.kind for param in spec.params}
    values = {}
    for name, value in arguments.items():
        kind = kinds.get(name)
        if isinstance(value, TensorArgument):
            values[name] = placeholder(value)
        elif value is None:
            values[name] = None
        elif isinstance(value, enum.Enum):
            values[name] = library_enum(function, name, value)
        elif kind in DTYPE_KINDS:
            values[name] = nki_dtype(np.dtype(value).name + ("_x4" if kind == "dtype-x4" else ""), name)
        elif kind == "axis":
            replica_group = probe("nki.collectives", "ReplicaGroup", f"the replica group `{name}`")
            values[name] = replica_group([list(ranks) for ranks in value])
        else:
            values[name] = value
    return values


def adapter_values(arguments: Mapping[str, Any], placeholder: Callable[[TensorArgument], Any]) -> dict[str, Any]:
    """``arguments`` as a device adapter takes them (see the module docstring)."""
    values = {}
    for name, value in arguments.items():
        if isinstance(value, TensorArgument):
            values[name] = placeholder(value)
        elif isinstance(value, enum.Enum):
            values[name] = value.name
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):  # a config object: its field values
            values[name] = dataclasses.astuple(value)
        else:  # replica groups arrive as rank lists already (the lowering resolves the mesh axes)
            values[name] = value
    return values
