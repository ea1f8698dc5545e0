"""``pad`` (catalog row 83, docs-only): pad the last one to three axes of a tensor, as ``torch.nn.functional.pad``.

Sources: the NKI Library API reference (aws-neuron-sdk ``nki/library/api/pad.rst``, nki-library 2.32:
``pad(x_ref, padding, mode='replicate', value=0)``) and, for the exact semantics, the 2.32 kernel source
``experimental/pad/pad.py`` and ``pad_modes.py`` (the public code index; absent from tag 2.29 and the snapshot's main).

``pad(x_ref [..., spatial], padding, mode='replicate', value=0) -> out`` in ``x_ref``'s dtype. ``padding`` is in
PyTorch's innermost-first order: ``(w_before, w_after[, h_before, h_after[, d_before, d_after]])`` pads the last
``len(padding) // 2`` (1 to 3) axes; every axis before them is a batch axis. Each output element is
``x[map(i)]`` with a per-axis index map, or the fill value:

* ``"constant"``: ``value`` (rounded to the dtype) outside the input;
* ``"replicate"``: the nearest edge element (NumPy's ``"edge"``);
* ``"reflect"``: mirrored without repeating the edge (NumPy's ``"reflect"``); needs size >= 2 and pads < size;
* ``"circular"``: wrapped around (NumPy's ``"wrap"``); needs pads <= size.

Pads are non-negative here (the kernel computes its output shape by adding them; cropping is not documented).

Reverse mode: JAX math (the reference's VJP): for ``"constant"`` the cotangent's interior slice, for the other modes
that slice plus the padded cotangents added back onto the input elements they copy. ``value`` is static.

Neuron: the kernel tiles the spatial axes for its SBUF itself (and asserts that its tiles fit). vmap merges the
mapped axis into the first batch axis (one kernel call); an input with no batch axis runs under ``lax.map``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param

PAD_MODES = ("constant", "replicate", "reflect", "circular")
NUMPY_MODES = {"constant": "constant", "replicate": "edge", "reflect": "reflect", "circular": "wrap"}
MAX_SPATIAL = 3


def _normalize_padding(value, where: str) -> tuple[int, ...]:
    """``padding`` as a tuple of 2, 4 or 6 non-negative Python ints."""
    expected = "a tuple of 2, 4 or 6 non-negative ints (innermost axis first: w_before, w_after, h_before, ...)"
    if value is None:
        raise TypeError(f"{where} is required: {expected}")
    if not isinstance(value, (tuple, list)) or not all(
        isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in value
    ):
        raise TypeError(f"{where} must be {expected}; got {value!r}")
    padding = tuple(int(v) for v in value)
    if len(padding) not in (2, 4, 6) or min(padding) < 0:
        raise ValueError(f"{where} must be {expected}; got {padding}")
    return padding


def pad_widths(shape: tuple[int, ...], padding: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    """Per-axis ``(before, after)`` widths (NumPy's ``pad_width``) for PyTorch-order ``padding``."""
    widths = [(0, 0)] * len(shape)
    for i in range(len(padding) // 2):
        widths[len(shape) - 1 - i] = (padding[2 * i], padding[2 * i + 1])
    return tuple(widths)


def reference_pad(x_ref, *, padding, mode="replicate", value=0.0):
    """JAX reference of ``pad``: ``jnp.pad`` with the mode's NumPy name."""
    widths = pad_widths(x_ref.shape, padding)
    if mode == "constant":
        return (jnp.pad(x_ref, widths, mode="constant", constant_values=jnp.asarray(value, x_ref.dtype)),)
    return (jnp.pad(x_ref, widths, mode=NUMPY_MODES[mode]),)


def _check_pad(call: CallInfo) -> None:
    shape, padding, mode = call.avals["x_ref"].shape, call.params["padding"], call.params["mode"]
    spatial = len(padding) // 2
    if len(shape) < spatial:
        raise ValueError(
            f"{call.function}: argument `x_ref` must have at least {spatial} axes for a padding of {len(padding)} "
            f"values (one before/after pair per trailing axis); got shape {tuple(shape)}"
        )
    for axis, (before, after) in enumerate(pad_widths(shape, padding)):
        size, padded = shape[axis], before + after > 0
        if mode == "reflect" and padded and not (size >= 2 and max(before, after) < size):
            raise ValueError(
                f"{call.function}: mode 'reflect' needs axis {axis} of `x_ref` to have size >= 2 and pads < its size; "
                f"got size {size} and pads ({before}, {after})"
            )
        if mode == "circular" and max(before, after) > size:
            raise ValueError(
                f"{call.function}: mode 'circular' needs pads <= the size of axis {axis} of `x_ref`; got size "
                f"{size} and pads ({before}, {after})"
            )
        if mode == "replicate" and padded and size == 0:
            raise ValueError(f"{call.function}: mode 'replicate' cannot pad axis {axis} of `x_ref`, which is empty")


def _has_batch_axis(call: CallInfo) -> bool:
    return call.avals["x_ref"].ndim > len(call.params["padding"]) // 2


def _pad_output(call: CallInfo):
    x = call.avals["x_ref"]
    shape = tuple(
        size + before + after for size, (before, after) in zip(x.shape, pad_widths(x.shape, call.params["padding"]))
    )
    return (("out", shape, x.dtype),)


PAD_SPEC = KernelSpec(
    name="pad",
    entry_point="nkilib.experimental.pad.pad:pad",
    operands=(Operand.of("x_ref", "..., W", doc="any batch axes, then 1 to 3 spatial axes (padding's length / 2)"),),
    params=(
        Param(
            "padding",
            None,
            tuple,
            "PyTorch order, innermost first: (w_before, w_after[, h_before, h_after[, d_before, d_after]])",
            required=True,
            normalizer=_normalize_padding,
        ),
        Param("mode", "replicate", PAD_MODES, "constant, replicate (edge), reflect or circular (wrap)"),
        Param("value", 0.0, float, "the fill value of mode 'constant' (ignored by the other modes)"),
    ),
    outputs=(),
    output_avals=_pad_output,
    reference=reference_pad,
    check=_check_pad,
    # the vmapped axis joins the first batch axis (axis 0 when x_ref has axes before the padded ones)
    fold_plans=(FoldPlan(axes={"x_ref": 0}, outputs={"out": 0}, when=_has_batch_axis),),
    family="elementwise",
    catalog="row 83",
    support={
        "idiomatic": "pad",
        "vjp": "JAX (the reference's: a slice for 'constant', plus the copied edges' sums for the other modes)",
        "notes": "docs-only kernel (2.32); torch.nn.functional.pad semantics, 1-3 trailing axes, non-negative "
        "pads; vmap folds into the first batch axis (lax.map when there is none)",
    },
)


pad = make_kernel(PAD_SPEC, reference_vjp)
