"""``jax_nkilib.pad``: ``jnp.pad`` through the NKI ``pad`` kernel for the modes it has (see
:mod:`jax_nkilib._src.elementwise.pad`).

``jnp.pad``'s modes map to the kernel's: ``"constant"`` -> ``constant``, ``"edge"`` -> ``replicate``, ``"reflect"``
-> ``reflect``, ``"wrap"`` -> ``circular``. The kernel pads the last one to three axes (the others are its batch
axes), so padded axes among the last three are one kernel call with no data movement; padded axes before them are
moved last in groups of three (a transpose each way per group, one kernel call each). Under explicit shardings the
unpadded axes split freely; a padded axis must be replicated.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..elementwise.pad import MAX_SPATIAL
from ..elementwise.pad import pad as pad_kernel
from ..framework.arguments import array_argument
from ..framework.validation import require_static, static_float
from ..sharding import auto

WHERE = "jax_nkilib.pad"
KERNEL_MODES = {"constant": "constant", "edge": "replicate", "reflect": "reflect", "wrap": "circular"}

PAD_SHARDING = auto.register_rule(
    auto.ShardingRule(WHERE, free=auto.LEADING, note="padded axes are replicated; the other axes split freely")
)


def _widths(x, pad_width) -> tuple[tuple[int, int], ...]:
    """``pad_width`` broadcast to one ``(before, after)`` pair of non-negative ints per axis, as ``jnp.pad``."""
    require_static(WHERE, "pad_width", pad_width, "ints or (before, after) pairs")
    expected = "an int, a (before, after) pair, or one (before, after) pair per axis of non-negative ints"
    try:
        widths = np.asarray(pad_width)
    except (TypeError, ValueError):
        raise TypeError(f"{WHERE}: `pad_width` must be {expected}; got {pad_width!r}") from None
    if widths.dtype == np.bool_ or not np.issubdtype(widths.dtype, np.integer):
        raise TypeError(f"{WHERE}: `pad_width` must be {expected}; got {pad_width!r}")
    try:
        widths = np.broadcast_to(widths, (x.ndim, 2))
    except ValueError:
        raise ValueError(
            f"{WHERE}: `pad_width` must be {expected} for `x` of shape {x.shape}; got {pad_width!r}"
        ) from None
    if (widths < 0).any():
        raise ValueError(f"{WHERE}: `pad_width` must be non-negative; got {pad_width!r}")
    return tuple((int(before), int(after)) for before, after in widths)


def _check_mode_widths(x, widths, mode: str) -> None:
    for axis, (before, after) in enumerate(widths):
        size = x.shape[axis]
        if before + after == 0:
            continue
        if mode == "reflect" and not (size >= 2 and max(before, after) < size):
            raise ValueError(
                f"{WHERE}: mode 'reflect' pads axis {axis} (size {size}) by ({before}, {after}); the kernel needs a "
                "size >= 2 and pads smaller than the size (use jnp.pad for repeated reflections)"
            )
        if mode == "wrap" and max(before, after) > size:
            raise ValueError(
                f"{WHERE}: mode 'wrap' pads axis {axis} (size {size}) by ({before}, {after}); the kernel needs pads "
                "no larger than the size (use jnp.pad to wrap more than once)"
            )
        if mode == "edge" and size == 0:
            raise ValueError(f"{WHERE}: mode 'edge' cannot pad axis {axis} of `x`, which is empty")


def _kernel_pad(x, widths, params_for):
    """Pad ``x`` by ``widths``: one kernel call for the padded axes among the last three, then groups of three
    earlier padded axes moved last."""
    ndim = x.ndim
    padded = [axis for axis, width in enumerate(widths) if width != (0, 0)]
    trailing = [axis for axis in padded if axis >= ndim - MAX_SPATIAL]
    if trailing:  # no transpose: unpadded axes between them get zero pads
        first = min(trailing)
        padding = tuple(size for axis in reversed(range(first, ndim)) for size in widths[axis])
        (x,) = pad_kernel.call({"x_ref": x}, params_for(padding))
    earlier = [axis for axis in padded if axis < ndim - MAX_SPATIAL]
    for start in range(0, len(earlier), MAX_SPATIAL):
        group = earlier[start : start + MAX_SPATIAL]
        order = [axis for axis in range(ndim) if axis not in group] + group
        padding = tuple(size for axis in reversed(group) for size in widths[axis])
        (moved,) = pad_kernel.call({"x_ref": jnp.transpose(x, order)}, params_for(padding))
        x = jnp.transpose(moved, np.argsort(order))
    return x


def pad(x, pad_width, mode: str = "constant", constant_values=0):
    """Pad ``x`` as ``jnp.pad(x, pad_width, mode, constant_values=...)`` for the kernel's modes.

    Args:
      x: an array of float32, bfloat16, float16 or float64.
      pad_width: static non-negative ints: one ``(before, after)`` pair per axis, or one pair (or one int) for
        every axis, as in ``jnp.pad``.
      mode: ``"constant"``, ``"edge"``, ``"reflect"`` or ``"wrap"`` (other ``jnp.pad`` modes raise a
        ``ValueError``: the kernel has no such mode). ``"reflect"`` needs pads smaller than the axis and
        ``"wrap"`` pads no larger than it (the kernel's limits; ``jnp.pad`` allows more).
      constant_values: the fill of mode ``"constant"``, one static scalar (rounded to ``x``'s dtype).

    Returns the padded array in ``x``'s dtype. Differentiable in ``x``: for ``"constant"`` the VJP is the slice
    of the cotangent, for the other modes the slice plus the padded cotangents summed onto the elements they copy.
    On Neuron each group of up to three padded axes is one ``pad`` kernel call.
    """
    x = array_argument(WHERE, "x", x)
    require_static(WHERE, "mode", mode, "a mode name")
    if not isinstance(mode, str) or mode not in KERNEL_MODES:
        raise ValueError(
            f"{WHERE}: `mode` must be one of {', '.join(map(repr, KERNEL_MODES))} (the NKI pad kernel's modes); got "
            f"{mode!r}. Use jnp.pad for the others."
        )
    if np.ndim(constant_values) != 0:
        raise ValueError(
            f"{WHERE}: `constant_values` must be one scalar (the kernel fills with one value); got "
            f"shape {np.shape(constant_values)}"
        )
    value = static_float(WHERE, "constant_values", constant_values)
    widths = _widths(x, pad_width)
    _check_mode_widths(x, widths, mode)
    auto.leading(x.ndim, WHERE)
    dims = "".join("_" if width != (0, 0) else str(axis) for axis, width in enumerate(widths))
    sharded = auto.plan(PAD_SHARDING, [auto.ShardedArgument("x", x, dims)])
    if sharded:
        return sharded.run(lambda x, axes: pad(x, widths, mode, value), dims)
    if all(width == (0, 0) for width in widths):
        return x
    if x.size == 0:  # nothing to copy: no kernel call
        fill = {"constant_values": jnp.asarray(value, x.dtype)} if mode == "constant" else {}
        return jnp.pad(x, widths, mode=mode, **fill)
    return _kernel_pad(
        x, widths, lambda padding: pad_kernel.params(padding=padding, mode=KERNEL_MODES[mode], value=value)
    )
