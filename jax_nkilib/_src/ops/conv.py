"""``jax_nkilib.conv``: ``lax.conv_general_dilated`` with the NKI convolution kernels where one computes the call.

Semantics are exactly ``lax.conv_general_dilated``'s (same arguments, same output layout). Routes:

* a 1-D convolution (``feature_group_count = batch_group_count = 1``, no ``lhs_dilation``, non-negative padding) is
  the ``conv1d`` kernel on ``x [B, Cin, L]``, ``filters [K, Cin, Cout]`` (a transpose of each operand and of the
  output unless the layouts already are the kernel's);
* a depthwise 1-D convolution (``feature_group_count = Cin`` = the output features, one input feature per filter,
  no dilation) is ``depthwise_conv1d_implicit_gemm`` on ``[N, C, 1, W]`` / ``[C, 1, 1, S]``;
* a 3-D convolution (one group, no ``lhs_dilation``, non-negative padding) is ``conv3d_temporal_unroll`` where
  the library's ``should_use_temporal_unroll`` says it pays, else ``conv3d``, on ``x [B, Cin, D, H, W]``,
  ``filters [Kd, Kh, Kw, Cin, Cout]``;
* anything else, including 2-D convolutions and 3-D transposed convolutions (``lhs_dilation``;
  ``conv3d_transpose`` is not bound), runs ``lax.conv_general_dilated``; lowering that for Neuron warns with a
  ``NeuronFallbackWarning`` naming why (an error under ``config(on_unsupported="error")``).

The kernels accumulate in float32 whatever ``precision`` asks (float64 for float64 off Neuron) and return the
operands' dtype, so a ``preferred_element_type`` other than that dtype, or operands of two dtypes, take the ``lax``
route. Reverse mode: JAX's own convolution gradients on every route (the kernels have no backward kernel).
Under explicit shardings the batch axis splits freely; every other axis must be replicated.
"""

from __future__ import annotations

import numpy as np
from jax import lax

from ..conv.conv1d import conv1d as conv1d_kernel
from ..conv.conv3d import conv3d as conv3d_kernel
from ..conv.conv3d import conv3d_temporal_unroll as temporal_unroll_kernel
from ..conv.conv3d import should_use_temporal_unroll
from ..conv.depthwise_conv1d import depthwise_conv1d_implicit_gemm as depthwise_kernel
from ..framework.arguments import array_argument
from ..framework.spec import FLOAT_DTYPES
from ..neuron.reference_only import reference_only
from ..sharding import auto

WHERE = "jax_nkilib.conv"
BATCH = "n"

CONV_SHARDING = auto.register_rule(
    auto.ShardingRule(WHERE, free={BATCH: "batch"}, note="features, spatial axes and the filters are replicated")
)


def _tuple(value, count: int, default: int, name: str) -> tuple[int, ...]:
    if value is None:
        return (default,) * count
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,) * count
    value = tuple(value)
    if len(value) != count or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{WHERE}: `{name}` must be a sequence of {count} ints (one per spatial axis); got {value!r}")
    return tuple(int(v) for v in value)


def _explicit_padding(padding, lhs_spatial, rhs_spatial, strides, rhs_dilation) -> tuple[tuple[int, int], ...]:
    """``padding`` as one ``(low, high)`` pair per spatial axis, resolving ``"SAME"``/``"VALID"`` as ``lax`` does."""
    if isinstance(padding, str):
        dilated = [(k - 1) * d + 1 for k, d in zip(rhs_spatial, rhs_dilation)]
        return tuple((int(low), int(high)) for low, high in lax.padtype_to_pads(lhs_spatial, dilated, strides, padding))
    pairs = tuple(tuple(pair) for pair in padding)
    if len(pairs) != len(lhs_spatial) or any(len(pair) != 2 for pair in pairs):
        raise TypeError(f"{WHERE}: `padding` must be a string or one (low, high) pair per spatial axis; got {padding}")
    return tuple((int(low), int(high)) for low, high in pairs)


def _route(lhs, rhs, dn, strides, pads, lhs_dilation, rhs_dilation, groups, batch_groups, preferred):
    """``"conv1d"``, ``"depthwise"``, ``"conv3d"``, or the reasons no kernel computes the call."""
    reasons = []
    spatial = len(dn.lhs_spec) - 2
    if spatial not in (1, 3):
        reasons.append(f"a {spatial}-D convolution (the kernels are 1-D and 3-D)")
    if lhs.dtype != rhs.dtype or np.dtype(lhs.dtype) not in FLOAT_DTYPES:
        reasons.append(f"operands of dtypes {lhs.dtype} and {rhs.dtype} (the kernels take one float dtype)")
    if preferred is not None and np.dtype(preferred) != np.dtype(lhs.dtype):
        reasons.append(f"preferred_element_type={np.dtype(preferred)} (the kernels return the operands' dtype)")
    if any(d != 1 for d in lhs_dilation):
        reasons.append(f"lhs_dilation={lhs_dilation} (no bound kernel dilates the input)")
    if any(p < 0 for pair in pads for p in pair):
        reasons.append(f"negative padding {pads} (the kernels pad with zeros only)")
    if batch_groups != 1:
        reasons.append(f"batch_group_count={batch_groups}")
    in_features = lhs.shape[dn.lhs_spec[1]]
    out_features, filter_in = rhs.shape[dn.rhs_spec[0]], rhs.shape[dn.rhs_spec[1]]
    if groups == 1:
        return reasons or ("conv1d" if spatial == 1 else "conv3d")
    if spatial == 3:
        return reasons + [f"feature_group_count={groups} in a 3-D convolution (conv3d has one group)"]
    if not (groups == in_features == out_features and filter_in == 1):
        reasons.append(
            f"feature_group_count={groups} that is not depthwise with one filter per channel (the kernels cover 1 "
            f"group and Cin groups with Cout = Cin; got Cin={in_features}, Cout={out_features})"
        )
    if any(d != 1 for d in rhs_dilation):
        reasons.append(f"rhs_dilation={rhs_dilation} in a depthwise convolution (its kernel has no dilation)")
    return reasons or "depthwise"


def _conv1d(lhs, rhs, dn, strides, pads, rhs_dilation):
    x = lhs.transpose(dn.lhs_spec)  # [B, Cin, L]
    filters = rhs.transpose(dn.rhs_spec[2], dn.rhs_spec[1], dn.rhs_spec[0])  # [K, Cin, Cout]
    y = conv1d_kernel(x, filters, stride=strides[0], padding=pads[0], dilation=rhs_dilation[0])
    return y.transpose(np.argsort(dn.out_spec))


def _depthwise(lhs, rhs, dn, strides, pads):
    x = lhs.transpose(dn.lhs_spec)[:, :, None, :]  # [N, C, 1, W]
    filters = rhs.transpose(dn.rhs_spec)[:, :, None, :]  # [C, 1, 1, S]
    y = depthwise_kernel(x, filters, padding=((0, 0), pads[0]), stride=(1, strides[0]), feature_group_count=x.shape[1])[
        :, :, 0, :
    ]
    return y.transpose(np.argsort(dn.out_spec))


def _conv3d(lhs, rhs, dn, strides, pads, rhs_dilation):
    x = lhs.transpose(dn.lhs_spec)  # [B, Cin, D, H, W]
    filters = rhs.transpose(*dn.rhs_spec[2:], dn.rhs_spec[1], dn.rhs_spec[0])  # [Kd, Kh, Kw, Cin, Cout]
    padding = tuple(p for pair in pads for p in pair)
    out_spatial = [
        (size + low + high - dil * (taps - 1) - 1) // stride + 1
        for size, taps, (low, high), dil, stride in zip(x.shape[2:], filters.shape[:3], pads, rhs_dilation, strides)
    ]
    unroll = should_use_temporal_unroll(filters.shape[4], out_spatial[0], x.shape[1], filters.shape[0], out_spatial[2])
    kernel = temporal_unroll_kernel if unroll else conv3d_kernel
    y = kernel(x, filters, stride=strides, padding=padding, dilation=rhs_dilation)
    return y.transpose(np.argsort(dn.out_spec))


def conv(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision=None,
    preferred_element_type=None,
):
    """General dilated convolution with ``lax.conv_general_dilated``'s arguments and semantics.

    1-D convolutions (plain or depthwise) and 3-D convolutions run the NKI ``conv1d`` /
    ``depthwise_conv1d_implicit_gemm`` / ``conv3d`` (or ``conv3d_temporal_unroll``) kernels with float32
    accumulation (``precision`` has no further effect there); every other case runs ``lax.conv_general_dilated``
    and warns on Neuron (see the module docstring). Differentiable (JAX's conv gradients).
    """
    lhs = array_argument(WHERE, "lhs", lhs, dtypes=None)
    rhs = array_argument(WHERE, "rhs", rhs, dtypes=None)
    if lhs.ndim < 3 or lhs.ndim != rhs.ndim:
        raise ValueError(
            f"{WHERE}: `lhs` and `rhs` must have the same rank, at least 3 (batch, feature, spatial...); got shapes "
            f"{lhs.shape} and {rhs.shape}"
        )
    dn = lax.conv_dimension_numbers(lhs.shape, rhs.shape, dimension_numbers)
    spatial = lhs.ndim - 2
    strides = _tuple(window_strides, spatial, 1, "window_strides")
    lhs_dilation = _tuple(lhs_dilation, spatial, 1, "lhs_dilation")
    rhs_dilation = _tuple(rhs_dilation, spatial, 1, "rhs_dilation")
    lhs_spatial = [lhs.shape[a] for a in dn.lhs_spec[2:]]
    rhs_spatial = [rhs.shape[a] for a in dn.rhs_spec[2:]]
    pads = _explicit_padding(padding, lhs_spatial, rhs_spatial, strides, rhs_dilation)
    arguments = (strides, pads, lhs_dilation, rhs_dilation, dimension_numbers, feature_group_count, batch_group_count)
    batch_dims = "".join(BATCH if axis == dn.lhs_spec[0] else "_" for axis in range(lhs.ndim))
    out_dims = "".join(BATCH if axis == dn.out_spec[0] else "_" for axis in range(lhs.ndim))
    sharded = auto.plan(
        CONV_SHARDING,
        [auto.ShardedArgument("lhs", lhs, batch_dims), auto.ShardedArgument("rhs", rhs, "_" * rhs.ndim)],
    )
    if sharded:

        def local(lhs, rhs, axes):
            del axes
            return conv(lhs, rhs, *arguments, precision=precision, preferred_element_type=preferred_element_type)

        return sharded.run(local, out_dims)
    route = _route(
        lhs, rhs, dn, strides, pads, lhs_dilation, rhs_dilation, feature_group_count, batch_group_count,
        preferred_element_type,
    )  # fmt: skip
    if route == "conv1d":
        return _conv1d(lhs, rhs, dn, strides, pads, rhs_dilation)
    if route == "depthwise":
        return _depthwise(lhs, rhs, dn, strides, pads)
    if route == "conv3d":
        return _conv3d(lhs, rhs, dn, strides, pads, rhs_dilation)
    out = lax.conv_general_dilated(
        lhs,
        rhs,
        strides,
        pads,
        lhs_dilation,
        rhs_dilation,
        dimension_numbers,
        feature_group_count,
        batch_group_count,
        precision=precision,
        preferred_element_type=preferred_element_type,
    )
    return reference_only(out, op=WHERE, reasons=tuple(route))
