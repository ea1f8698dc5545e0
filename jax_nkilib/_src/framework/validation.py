"""Trace-time validation of a kernel call: arguments to operands and params, shapes against layouts, dtypes.

Every error is a ``TypeError`` (wrong kind of value or dtype) or ``ValueError`` (wrong shape or value) whose message
names the function, the argument, the expected layout or values, and what was given.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from . import compat, config, views
from .layout import LayoutMismatch, bind_layouts
from .spec import FOLLOW_LNC, CallInfo, KernelSpec, switch_key


def split_arguments(spec: KernelSpec, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """Map a public call's arguments to ``(operands, raw params, derived)`` by the kernel's names; ``derived``
    holds the shape-derived config fields given (see ``KernelSpec.derived_params``)."""
    function = spec.public_name
    operand_names = [operand.name for operand in spec.operands]
    param_names = [param.name for param in spec.params]
    derived_names = dict(spec.derived_params)
    derived: dict[str, Any] = {}
    if len(args) > len(operand_names):
        raise TypeError(f"{function} takes {len(operand_names)} tensor arguments ({', '.join(operand_names)}) "
                        f"positionally; got {len(args)}. Pass static flags ({', '.join(param_names)}) by keyword.")
    operands: dict[str, Any] = dict(zip(operand_names, args))
    params: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in operand_names:
            if key in operands:
                raise TypeError(f"{function} got multiple values for argument `{key}`")
            operands[key] = value
        elif key in param_names:
            params[key] = value
        elif key in derived_names:
            derived[key] = value
        else:
            raise TypeError(f"{function} got an unexpected keyword argument `{key}`; tensor arguments are "
                            f"{', '.join(operand_names)} and static flags are {', '.join(param_names)}")
    for operand in spec.operands:
        value = operands.get(operand.name)
        if value is None:
            if not operand.optional:
                raise TypeError(f"{function}: missing required tensor argument `{operand.name}` "
                                f"with layout {operand.layout_text}")
            operands[operand.name] = None
        elif not (hasattr(value, "shape") and hasattr(value, "dtype")):
            raise TypeError(f"{function}: argument `{operand.name}` must be an array with layout "
                            f"{operand.layout_text}; got {type(value).__name__}")
    return {operand.name: operands[operand.name] for operand in spec.operands}, params, derived


def check_derived(spec: KernelSpec, call: CallInfo, derived: Mapping[str, Any]) -> None:
    """Shape-derived config fields, when given, must equal the dimension the operands bound."""
    for name, dim in spec.derived_params:
        expected, what = (dim(call), name) if callable(dim) else (call.dims.get(dim), dim)
        if name in derived and derived[name] is not None and derived[name] != expected:
            raise ValueError(f"{call.function}: `{name}`={derived[name]!r} does not match the operands, whose {what} "
                             f"is {expected}")


def normalize_params(spec: KernelSpec, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Fill defaults (a required param left out is a ``TypeError``), check types, resolve LNC-following flags, add
    the LNC degree as ``lnc``, the Neuron platform target as ``target`` and the kernel-layout view ``layout=()``
    (see :mod:`views`)."""
    lnc = config.current_lnc()
    params: dict[str, Any] = {}
    for param in spec.params:
        value = raw.get(param.name, param.default)
        if value is FOLLOW_LNC or (value is None and param.default is FOLLOW_LNC):
            params[param.name] = lnc > 1
        elif value is None and param.required:
            raise TypeError(f"{spec.public_name}: missing required parameter `{param.name}`"
                            + (f" ({param.doc})" if param.doc else ""))
        else:
            params[param.name] = param.normalize(value, spec.public_name)
    params["lnc"] = lnc
    params["target"] = config.current_target()
    params["layout"] = ()
    return spec.resolve_params(params) if spec.resolve_params is not None else params


def check_call(spec: KernelSpec, avals: Mapping[str, Any], params: Mapping[str, Any]) -> CallInfo:
    """Validate dtypes, layouts and the spec's semantic checks; return the bound :class:`CallInfo`.

    ``avals`` may be given through the layout view in ``params["layout"]``; the returned call describes the
    kernel layout.
    """
    function = spec.public_name
    view = params.get("layout", ())
    avals = {name: None if aval is None else views.kernel_aval(aval, views.permutation_of(view, name))
             for name, aval in avals.items()}
    present = [(operand, avals[operand.name]) for operand in spec.operands if avals.get(operand.name) is not None]
    for operand, aval in present:
        dtype = np.dtype(aval.dtype)
        if dtype not in operand.dtypes:
            allowed = ", ".join(str(d) for d in operand.dtypes)
            raise TypeError(f"{function}: argument `{operand.name}` must have dtype in ({allowed}); got {dtype} "
                            f"(layout {operand.layout_text}, shape {tuple(aval.shape)})")
    try:
        layouts = [(operand.name, tuple(aval.shape), operand.layouts_for(params)) for operand, aval in present]
    except ValueError as err:
        raise ValueError(f"{function}: {err}") from None
    try:
        dims, _ = bind_layouts(layouts)
    except LayoutMismatch as err:
        switch = spec.operand(err.operand).switch
        selected = f" (the layout for {switch[0]}={switch_key(switch[0], params)})" if switch else ""
        raise ValueError(f"{function}: argument `{err.operand}` {err.reason}{selected}") from None
    for name, size in dims.items():
        if size == 0:
            raise ValueError(f"{function}: dimension {name} is 0; every dimension of a kernel call must be positive")
    call = CallInfo(function, dict(avals), dims, dict(params))
    if spec.check is not None:
        spec.check(call)
    return call


def outputs_of(spec: KernelSpec, call: CallInfo):
    """The outputs this call produces (some exist only for some flags or optional operands)."""
    return spec.present_outputs(call.params, [name for name, aval in call.avals.items() if aval is not None])


def layout_of(spec: KernelSpec, name: str, call: CallInfo):
    """The kernel layout of operand or output ``name`` in this call (``None`` for an absent operand)."""
    for operand in spec.operands:
        if operand.name == name:
            aval = call.avals.get(name)
            if aval is None:
                return None
            return next(layout for layout in operand.layouts_for(call.params) if layout.rank == aval.ndim)
    output = next(output for output in spec.outputs if output.name == name)
    return layout_of(spec, output.like, call) if output.like else output.layout_for(call.params)


def output_avals(spec: KernelSpec, call: CallInfo) -> list:
    """The present outputs' abstract values, in the call's layout view."""
    view = call.params.get("layout", ())
    outs = []
    for output in outputs_of(spec, call):
        if output.like is not None:
            shape = tuple(call.avals[output.like].shape)
        else:  # output dimensions come from the operands' dimensions or from static int params
            sizes = {**{k: v for k, v in call.params.items() if isinstance(v, int)}, **call.dims}
            shape = tuple(dim.expected(sizes) for dim in output.layout_for(call.params).dims)
        if callable(output.dtype_of):
            dtype = np.dtype(output.dtype_of(call.params))
        elif call.avals.get(output.dtype_of) is not None:
            dtype = call.avals[output.dtype_of].dtype
        else:  # a dtype param, or a fixed dtype name
            dtype = call.params[output.dtype_of] if output.dtype_of in call.params else np.dtype(output.dtype_of)
        aval = compat.ShapedArray(shape, dtype)
        outs.append(views.given_aval(aval, views.permutation_of(view, output.name)))
    return outs


# ---- static values of idiomatic ops
# Values that shape the computation (a softmax scale, a window length) are static: checked here at trace time, with a
# message naming the function and the argument. Each helper returns the value as a plain Python number.

INT32_MAX = 2**31 - 1


def require_static(value: Any, function: str, name: str, expected: str) -> None:
    """``TypeError`` when ``value`` is a traced JAX value (a static argument cannot change at run time)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{function}: `{name}` is static and must be {expected}; got a traced value {value!r}. "
                        "Pass a Python value (under jax.jit: close over it or list it in static_argnames)")


def static_float(value: Any, function: str, name: str, *, finite: bool = True) -> float:
    """``value`` as a Python float: a real number (not a bool, not traced) that is finite unless ``finite=False``."""
    expected = "a finite real number" if finite else "a real number"
    require_static(value, function, name, expected)
    if isinstance(value, (bool, np.bool_)) or not _is_real_scalar(value):
        raise TypeError(f"{function}: `{name}` must be {expected}; got {value!r} of type {type(value).__name__}")
    result = float(value)
    if finite and not np.isfinite(result):
        raise ValueError(f"{function}: `{name}` must be {expected}; got {result!r}")
    return result


def static_int(value: Any, function: str, name: str, *, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """``value`` as a Python int in ``[minimum, maximum]`` (by default a non-negative int that fits int32): an int
    (not a bool, not a float, not traced)."""
    expected = f"an int in [{minimum}, {maximum}]"
    require_static(value, function, name, expected)
    if isinstance(value, (bool, np.bool_)) or not _is_int_scalar(value):
        raise TypeError(f"{function}: `{name}` must be {expected}; got {value!r} of type {type(value).__name__}")
    result = int(value)
    if not minimum <= result <= maximum:
        raise ValueError(f"{function}: `{name}` must be {expected}; got {result}")
    return result


def _is_real_scalar(value: Any) -> bool:
    if isinstance(value, (int, float, np.integer, np.floating)):
        return True
    dtype = getattr(value, "dtype", None)  # a concrete 0-d array
    return (dtype is not None and np.ndim(value) == 0
            and (jnp.issubdtype(dtype, jnp.integer) or jnp.issubdtype(dtype, jnp.floating)))


def _is_int_scalar(value: Any) -> bool:
    if isinstance(value, (int, np.integer)):
        return True
    dtype = getattr(value, "dtype", None)
    return dtype is not None and np.ndim(value) == 0 and jnp.issubdtype(dtype, jnp.integer)
