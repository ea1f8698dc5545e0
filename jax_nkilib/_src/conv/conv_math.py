"""What the dense NKI convolution kernels (``conv1d``, ``conv3d``, ``conv3d_temporal_unroll``) share: channels-first
inputs, filters ``[K..., Cin, Cout]``, a float32 PSUM sum, then ``round(acc + bias)`` and an activation applied to
that rounded sum (bias and activation) or to the sum (activation only), ``round`` being the cast to the input dtype.
Activations are the kernels' ``get_nl_act_fn_from_type``: SiLU, GELU, GELU_Tanh_Approx and Swish (ReLU is not)."""

from __future__ import annotations

import numpy as np
from jax import lax

from ..framework.activations import activation
from ..framework.common_types import ActFnType
from ..framework.spec import CallInfo, accumulation_dtype, enum_member

KERNEL_ACTIVATIONS = (ActFnType.SiLU, ActFnType.GELU, ActFnType.GELU_Tanh_Approx, ActFnType.Swish)


def output_size(size: int, taps: int, stride: int, pad_low: int, pad_high: int, dilation: int) -> int:
    """``(size + pad_low + pad_high - dilation (taps - 1) - 1) // stride + 1``."""
    return (size + pad_low + pad_high - dilation * (taps - 1) - 1) // stride + 1


def kernel_activation(value, where: str):
    """``activation_fn``: ``None`` or one of :data:`KERNEL_ACTIVATIONS` (a member or its name)."""
    if value is None:
        return None
    member = enum_member(ActFnType, value, where)
    if member not in KERNEL_ACTIVATIONS:
        names = ", ".join(m.name for m in KERNEL_ACTIVATIONS)
        raise ValueError(f"{where} must be None or one of {names} (the kernel's activations); got {member.name}")
    return member


def int_tuple(value, where: str, length: int, minimum: int | None = None) -> tuple[int, ...]:
    """A tuple of ``length`` Python ints, each ``>= minimum`` (when given)."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) != length
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(f"{where} must be a tuple of {length} Python ints; got {value!r}")
    if minimum is not None and min(value) < minimum:
        raise ValueError(f"{where} must have every entry >= {minimum}; got {tuple(value)}")
    return tuple(int(v) for v in value)


def cross_correlation(x, filters, *, strides, pads, dilations):
    """``acc [B, Cout, out...]`` in the accumulation dtype from ``x [B, Cin, spatial...]`` and ``filters [K...,
    Cin, Cout]``; ``pads`` one ``(low, high)`` pair per spatial axis."""
    wide = accumulation_dtype(x.dtype)
    letters = "DHW"[3 - (x.ndim - 2) :]  # spatial axes (1-D: "W"; 3-D: "DHW")
    return lax.conv_general_dilated(
        x.astype(wide),
        filters.astype(wide),
        window_strides=tuple(strides),
        padding=tuple(pads),
        rhs_dilation=tuple(dilations),
        dimension_numbers=("NC" + letters, letters + "IO", "NC" + letters),
        precision=lax.Precision.HIGHEST,
        preferred_element_type=wide,
    )


def bias_then_activation(acc, bias, activation_fn, dtype):
    """The kernels' epilogue on ``acc [B, Cout, ...]`` (wide): ``round(acc + bias)``, then the activation on that
    (or on ``acc`` without a bias), rounded to ``dtype``."""
    wide = acc.dtype
    if bias is not None:
        acc = (acc + bias.astype(wide).reshape((1, -1) + (1,) * (acc.ndim - 2))).astype(dtype).astype(wide)
    if activation_fn is not None:
        acc = activation(acc, activation_fn)
    return acc.astype(dtype)


def check_one_dtype(call: CallInfo) -> None:
    """The kernels assert that ``x_in``, ``filters`` and ``bias`` share one dtype."""
    dtypes = {name: str(aval.dtype) for name, aval in call.avals.items() if aval is not None}
    if len(set(dtypes.values())) > 1:
        raise TypeError(
            f"{call.function}: x_in, filters and bias must share one dtype (the kernel asserts it); got {dtypes}"
        )
