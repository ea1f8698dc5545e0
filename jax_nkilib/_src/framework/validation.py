"""Trace-time validation of a kernel call: arguments to operands and params, shapes against layouts, dtypes.

Every error is a ``TypeError`` (wrong kind of value or dtype) or ``ValueError`` (wrong shape or value) whose message
names the function, the argument, the expected layout or values, and what was given.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from . import compat, config
from .arguments import array_argument, is_array
from .layout import Layout, LayoutMismatch, bind_layouts
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
        raise TypeError(
            f"{function} takes {len(operand_names)} tensor arguments ({', '.join(operand_names)}) "
            f"positionally; got {len(args)}. Pass static flags ({', '.join(param_names)}) by keyword."
        )
    operands: dict[str, Any] = dict(zip(operand_names, args))
    params: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in operand_names:
            if key in operands:
                raise TypeError(f"{function} got multiple values for argument `{key}`")
            operands[key] = value
        elif key in param_names or key in spec.keywords:
            name = spec.keywords.get(key, key)
            if name in params:
                keyword = next(k for k, v in spec.keywords.items() if v == name)
                raise TypeError(f"{function}: give `{keyword}` or `{name}`, not both")
            params[name] = value
        elif key in derived_names:
            derived[key] = value
        else:
            raise TypeError(
                f"{function} got an unexpected keyword argument `{key}`; tensor arguments are "
                f"{', '.join(operand_names)} and static flags are {', '.join(param_names)}"
            )
    for operand in spec.operands:
        value = operands.get(operand.name)
        if value is None:
            if not operand.optional:
                raise TypeError(
                    f"{function}: missing required tensor argument `{operand.name}` with layout {operand.layout_text}"
                )
            operands[operand.name] = None
        elif not is_array(value):
            raise TypeError(
                f"{function}: argument `{operand.name}` must be an array with layout "
                f"{operand.layout_text}; got {type(value).__name__}"
            )
    return {operand.name: operands[operand.name] for operand in spec.operands}, params, derived


def check_derived(spec: KernelSpec, call: CallInfo, derived: Mapping[str, Any]) -> None:
    """Shape-derived config fields, when given, must equal the dimension the operands bound."""
    for name, dim in spec.derived_params:
        expected, what = (dim(call), name) if callable(dim) else (call.dims.get(dim), dim)
        if name in derived and derived[name] is not None and derived[name] != expected:
            raise ValueError(
                f"{call.function}: `{name}`={derived[name]!r} does not match the operands, whose {what} is {expected}"
            )


def normalize_params(spec: KernelSpec, raw: Mapping[str, Any]) -> dict[str, Any]:
    """Fill defaults (a required param left out is a ``TypeError``), check types, resolve LNC-following flags, add
    the LNC degree as ``lnc`` and the Neuron platform target as ``target``."""
    lnc = config.current_lnc()
    params: dict[str, Any] = {}
    for param in spec.params:
        value = raw.get(param.name, param.default)
        if value is FOLLOW_LNC or (value is None and param.default is FOLLOW_LNC):
            params[param.name] = lnc > 1
        elif value is None and param.required:
            raise TypeError(
                f"{spec.public_name}: missing required parameter `{param.name}`"
                + (f" ({param.doc})" if param.doc else "")
            )
        else:
            params[param.name] = param.normalize(value, spec.public_name)
    params["lnc"] = lnc
    params["target"] = config.current_target()
    return spec.resolve_params(params) if spec.resolve_params is not None else params


def check_call(spec: KernelSpec, avals: Mapping[str, Any], params: Mapping[str, Any]) -> CallInfo:
    """Validate dtypes, layouts and the spec's semantic checks; return the bound :class:`CallInfo`."""
    function = spec.public_name
    present = [(operand, avals[operand.name]) for operand in spec.operands if avals.get(operand.name) is not None]
    for operand, aval in present:
        dtype = np.dtype(aval.dtype)
        if dtype not in operand.dtypes:
            allowed = ", ".join(str(d) for d in operand.dtypes)
            raise TypeError(
                f"{function}: argument `{operand.name}` must have dtype in ({allowed}); got {dtype} "
                f"(layout {operand.layout_text}, shape {tuple(aval.shape)})"
            )
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


def kernel_outputs(spec: KernelSpec, call: CallInfo) -> tuple[tuple[str, Any], ...]:
    """The outputs this call produces, ``(name, abstract value)`` in the kernel's order and layout: the spec's
    plain outputs, or what its ``output_avals`` hook computes."""
    if spec.output_avals is not None:
        produced = spec.output_avals(call)
    else:
        operands = {operand.name for operand in spec.operands}
        produced = [
            (
                output.name,
                call.shape(output.layout),
                call.avals[output.dtype_of].dtype if output.dtype_of in operands else output.dtype_of,
            )
            for output in spec.outputs
        ]
    return tuple(
        (name, compat.ShapedArray(tuple(int(size) for size in shape), np.dtype(dtype)))
        for name, shape, dtype in produced
    )


def output_names(spec: KernelSpec, call: CallInfo) -> tuple[str, ...]:
    """The names of the outputs this call produces, in the kernel's order."""
    return tuple(name for name, _ in kernel_outputs(spec, call))


def operand_layout(spec: KernelSpec, name: str, call: CallInfo):
    """The kernel layout of operand ``name`` in this call (``None`` when it is absent)."""
    aval = call.avals.get(name)
    if aval is None:
        return None
    return next(layout for layout in spec.operand(name).layouts_for(call.params) if layout.fits(aval.ndim))


def output_avals(spec: KernelSpec, call: CallInfo) -> list:
    """The present outputs' abstract values."""
    return [aval for _, aval in kernel_outputs(spec, call)]


# ---- array arguments of idiomatic ops
# An idiomatic op declares its operands' JAX layouts in the kernels' layout grammar (a leading ``...`` for any
# leading batch axes) and checks them in one call, which binds the named dimensions across the operands.


def check_operand_layouts(
    where: str,
    layouts: Mapping[str, str | tuple[str, ...]],
    /,
    *,
    dtypes: str | None | Mapping[str, str | None] = "kernel",
    positive: tuple[str, ...] = (),
    known: Mapping[str, int] | None = None,
    **operands,
) -> dict[str, int]:
    """Check an idiomatic op's array operands against their layouts and return the bound dimension sizes.

    ``layouts`` maps each operand name to a layout (``"..., H"``) or a tuple of accepted layouts of different ranks;
    ``operands`` gives the values by the same names, in argument order (``None``: an absent optional operand,
    skipped). Each present value must be an array (``TypeError``, see :func:`~.arguments.array_argument`; ``dtypes``
    is its dtype rule, one for all or one per operand name), then the shapes must match the layouts, binding named
    dimensions in argument order after those ``known`` gives (sizes the op already knows, e.g. from static arguments);
    the dimensions named in ``positive`` must be >= 1. A mismatch is a ``ValueError``
    "``where: `name` must have layout [..., H]...; got shape (...)``".
    """
    present = {name: value for name, value in operands.items() if value is not None}
    shapes = []
    for name, value in present.items():
        texts = layouts[name]
        parsed = tuple(Layout.parse(text) for text in ((texts,) if isinstance(texts, str) else texts))
        rule = dtypes.get(name, "kernel") if isinstance(dtypes, Mapping) else dtypes
        layout = " or ".join(str(option) for option in parsed)
        shapes.append((name, tuple(array_argument(where, name, value, layout=layout, dtypes=rule).shape), parsed))
    try:
        dims, chosen = bind_layouts(shapes, known)
    except LayoutMismatch as err:
        raise ValueError(f"{where}: `{err.operand}` {err.reason}") from None
    for dim in positive:
        if dims.get(dim) != 0:
            continue
        for name, shape, _ in shapes:
            if any(token.name == dim for token in chosen[name].dims):
                raise ValueError(
                    f"{where}: `{name}` must have layout {chosen[name]} with {dim} >= 1; got shape {shape}"
                )
    return dims


# ---- static values of idiomatic ops
# The scalars, flags and bounds that shape an idiomatic op's computation are static: Python values, known when the
# op is traced. A traced value (an argument of a jitted function) is refused with the advice to make it static, and
# a bad value (NaN, a negative eps, reversed bounds) is a ValueError naming the op and the argument. Array values
# that may legitimately be traced (a quantization scale) are checked when they are concrete (see `concrete`).

INT32_MAX = 2**31 - 1


def require(condition: bool, where: str, message: str) -> None:
    """Raise ``ValueError("{where}: {message}")`` unless ``condition`` (a trace-time check)."""
    if not condition:
        raise ValueError(f"{where}: {message}")


def require_static(where: str, name: str, value, expected: str) -> None:
    """Refuse a traced value: ``value`` must be known at trace time (``expected`` says what it should be)."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(
            f"{where}: `{name}` must be static ({expected}), not a traced value; under jax.jit pass it as "
            f"a static argument (static_argnames / static_argnums) or close over it"
        )


def _describe(value) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{type(value).__name__} {value.dtype} {tuple(value.shape)}"
    text = repr(value)
    return f"{text} of type {type(value).__name__}" if len(text) <= 60 else type(value).__name__


def static_float(where: str, name: str, value, *, minimum: float | None = None, exclusive: bool = False) -> float:
    """``value`` as a finite Python float: a number (or a concrete one-element float/int array), not traced, not
    NaN or infinite, and ``>= minimum`` (``> minimum`` when ``exclusive``) when ``minimum`` is given."""
    bound = "" if minimum is None else f" {'>' if exclusive else '>='} {minimum:g}"
    expected = f"a finite Python float{bound}"
    require_static(where, name, value, expected)
    number = None
    if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_)):
        number = float(value)
    elif (
        hasattr(value, "shape")
        and hasattr(value, "dtype")
        and np.size(value) == 1
        and (np.issubdtype(value.dtype, np.floating) or np.issubdtype(value.dtype, np.integer))
    ):
        number = float(np.asarray(value, np.float64).reshape(()))
    if number is None:
        raise TypeError(f"{where}: `{name}` must be {expected}; got {_describe(value)}")
    if not math.isfinite(number) or (minimum is not None and (number < minimum or exclusive and number == minimum)):
        raise ValueError(f"{where}: `{name}` must be {expected}; got {number!r}")
    return number


def static_int(where: str, name: str, value, *, minimum: int = 0, maximum: int = INT32_MAX) -> int:
    """``value`` as a Python int in ``[minimum, maximum]`` (by default a non-negative int that fits int32): an int
    (or a concrete integer 0-d array), not a bool, not a float, not traced."""
    expected = f"an int in [{minimum}, {maximum}]"
    require_static(where, name, value, expected)
    integer = None
    if isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_)):
        integer = int(value)
    elif (
        hasattr(value, "shape")
        and hasattr(value, "dtype")
        and np.ndim(value) == 0
        and np.issubdtype(value.dtype, np.integer)
    ):
        integer = int(np.asarray(value))
    if integer is None:
        raise TypeError(f"{where}: `{name}` must be {expected}; got {_describe(value)}")
    if not minimum <= integer <= maximum:
        raise ValueError(f"{where}: `{name}` must be {expected}; got {integer}")
    return integer


def static_bool(where: str, name: str, value) -> bool:
    """``value`` as a Python bool (``bool`` or ``np.bool_``, not traced)."""
    require_static(where, name, value, "a Python bool")
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: `{name}` must be a Python bool; got {_describe(value)}")
    return bool(value)


def static_bounds(where: str, name: str, value) -> tuple[float | None, float | None]:
    """``(lower, upper)`` bounds: a 2-tuple of Python floats or ``None`` (that side open); +-inf are allowed, NaN
    is not, and ``lower <= upper``."""
    expected = "a (lower, upper) tuple of Python floats or None"
    require_static(where, name, value, expected)
    if not (isinstance(value, tuple) and len(value) == 2):
        raise TypeError(f"{where}: `{name}` must be {expected}; got {_describe(value)}")
    bounds = []
    for side, bound in zip(("lower", "upper"), value):
        require_static(where, f"{name}[{side}]", bound, "a Python float or None")
        if bound is None:
            bounds.append(None)
            continue
        if not isinstance(bound, (int, float, np.integer, np.floating)) or isinstance(bound, (bool, np.bool_)):
            raise TypeError(f"{where}: `{name}` must be {expected}; its {side} bound is {_describe(bound)}")
        if math.isnan(bound):
            raise ValueError(f"{where}: `{name}` must be {expected}; its {side} bound is NaN")
        bounds.append(float(bound))
    lower, upper = bounds
    if lower is not None and upper is not None and lower > upper:
        raise ValueError(f"{where}: `{name}` = ({lower!r}, {upper!r}) has lower > upper; bounds are (lower, upper)")
    return lower, upper


def concrete(value):
    """``value`` as a float64 NumPy array when it is known at trace time (a Python number, a NumPy array or a
    concrete JAX array), else ``None`` (a traced value, checked by nobody at trace time)."""
    if isinstance(value, jax.core.Tracer) or value is None:
        return None
    try:
        return np.asarray(value, np.float64)
    except (TypeError, ValueError):
        return None


def check_positive_finite(where: str, name: str, value, what: str = "a scale") -> None:
    """When ``value`` is concrete, every element must be finite and > 0 (``ValueError``); a traced value passes
    (the op documents what a non-positive or non-finite one does)."""
    known = concrete(value)
    if known is not None and not bool(np.all(np.isfinite(known) & (known > 0))):
        bad = float(known[~(np.isfinite(known) & (known > 0))].reshape(-1)[0])
        raise ValueError(f"{where}: `{name}` ({what}) must be finite and > 0; got {bad!r}")
