"""FP8-quantized weights for the idiomatic ops (``mlp``, ``qkv_projection``, ``output_projection``).

A :class:`QuantizedWeight` stands in for a float weight ``W [in, out]`` (the ops' layout: rows are the contracted
input features, columns the output features). It holds ``data [in, out]`` in an FP8 format the kernels read
(``float8_e4m3``, the Trainium2 E4M3 with max 240, or ``float8_e4m3fn``, max 448) and float32 dequantization scales::

    mode="row":     W[i, j] ~= data[i, j] * scale[j]      scale [out]: one per output column, the max over axis 0
    mode="static":  W[i, j] ~= data[i, j] * scale         scale []: one per tensor

:func:`quantize_weight_fp8` makes one: ``scale = amax / fp8_max(dtype)`` (``amax`` the largest finite ``|W|`` of the
column, or of the tensor; 1 where it is 0) and ``data = fp8(clip(W / scale, +-fp8_max))``, rounded to nearest even.
Non-finite weights follow the quantizers' common contract (see ``jax_nkilib.quantize_fp8``): a NaN or +-inf is left
out of its scale's max, so the rest of its column (tensor) quantizes as if it were absent; it becomes NaN (NaN) or
+-fp8_max (+-inf) itself.

The kernels take the scales as ``[128, n]`` float32 tiles whose 128 rows are equal copies (one per SBUF partition):
:func:`scale_tile` is ``broadcast_to(scale.reshape(1, n), (128, n))`` with ``n = out`` (row) or ``1`` (static).

``mode="static"`` also holds ``input_scale`` (float32 ``[]``), the per-tensor scale of the *activation* this weight
multiplies: where the kernel quantizes activations (the CTE paths; the projections' STATIC paths) it computes
``fp8(clip(a / input_scale, +-bound)) @ data * (scale * input_scale)``, so ``input_scale`` should be about
``max|a| / bound`` (``bound`` 240 for e4m3). ``mode="row"`` holds ``input_scale=None`` (row-quantized activations, where
used, get their scales from the data).

The container is a pytree (``data``, ``scale``, ``input_scale`` are leaves; ``mode`` is static), so it passes through
``jit``, ``vmap`` (``in_axes=None``), ``shard_map`` and ``grad``. The ops stop the gradient at its leaves: quantized
weights get no cotangent.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import is_array
from ..framework.validation import check_positive_finite
from .fp8 import FP8_WEIGHT_DTYPES, fp8_max, saturate

MODES = ("row", "static")


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """An FP8 weight ``W [in, out] ~= data * scale`` (see the module docstring); build it with
    :func:`quantize_weight_fp8`, or directly from pre-quantized arrays (checked by the ops at trace time)."""

    data: jax.Array
    scale: jax.Array
    input_scale: jax.Array | None = None
    mode: str = "row"

    def tree_flatten(self):
        return (self.data, self.scale, self.input_scale), self.mode

    @classmethod
    def tree_unflatten(cls, mode, children):
        return cls(*children, mode=mode)

    @property
    def shape(self):
        return tuple(self.data.shape)

    def dequantize(self, dtype=jnp.float32):
        """``data * scale`` as a float ``[in, out]`` array of ``dtype``."""
        acc = jnp.promote_types(dtype, jnp.float32)
        scale = self.scale.astype(acc).reshape((1, -1) if self.mode == "row" else ())
        return (self.data.astype(acc) * scale).astype(dtype)


def _scalar(value, name: str, where: str):
    floats = hasattr(value, "dtype") and (
        jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)
    )
    if not (floats or isinstance(value, (int, float, np.integer, np.floating))) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{where}: `{name}` must be a positive float scalar; got {type(value).__name__}")
    check_positive_finite(where, name, value, "the activation's per-tensor scale")
    value = jnp.asarray(value, jnp.float32)
    if value.size != 1:
        raise ValueError(f"{where}: `{name}` must be a scalar; got shape {tuple(value.shape)}")
    return value.reshape(())


def quantize_weight_fp8(w, mode: str = "row", dtype=jnp.float8_e4m3, *, input_scale=None) -> QuantizedWeight:
    """Quantize a float weight ``w [in, out]`` to a :class:`QuantizedWeight`.

    ``mode="row"``: one scale per output column (``scale[j] = max_i |w[i, j]| / fp8_max(dtype)``).
    ``mode="static"``: one scale for the tensor, and ``input_scale`` (required, a finite scalar > 0, checked when it
    is concrete) for the activation.
    ``dtype``: ``jnp.float8_e4m3`` (default, max 240) or ``jnp.float8_e4m3fn`` (max 448).
    The max is over finite values (see the module docstring for NaN and inf); an empty ``w`` gives scales 1.
    """
    where = "jax_nkilib.quantize_weight_fp8"
    if mode not in MODES:
        raise ValueError(f"{where}: `mode` must be 'row' or 'static'; got {mode!r}")
    if np.dtype(dtype) not in FP8_WEIGHT_DTYPES:
        raise TypeError(f"{where}: `dtype` must be float8_e4m3 or float8_e4m3fn; got {np.dtype(dtype)}")
    if (
        not is_array(w)
        or not jnp.issubdtype(w.dtype, jnp.floating)
        or jnp.dtype(w.dtype) in FP8_WEIGHT_DTYPES
        or w.ndim != 2
    ):
        got = f"{w.dtype} {tuple(w.shape)}" if hasattr(w, "shape") else type(w).__name__
        raise TypeError(f"{where}: `w` must be a float (not FP8) array [in, out]; got {got}")
    if mode == "row" and input_scale is not None:
        raise ValueError(
            f"{where}: `input_scale` is for mode='static' (row-quantized activations carry their own scales)"
        )
    if mode == "static":
        if input_scale is None:
            raise ValueError(
                f"{where}: mode='static' needs `input_scale`, the activation's per-tensor scale (the "
                "kernels quantize activations as clip(a / input_scale, +-240)), e.g. max|a| / 240"
            )
        input_scale = _scalar(input_scale, "input_scale", where)
    w32 = jnp.asarray(w).astype(jnp.promote_types(w.dtype, jnp.float32))
    finite = jnp.where(jnp.isfinite(w32), jnp.abs(w32), 0)  # a NaN or inf takes no part in its scale
    amax = jnp.max(finite, axis=0 if mode == "row" else None, initial=0.0)
    scale = jnp.where(amax > 0, amax / fp8_max(dtype), 1.0).astype(jnp.float32)
    data = saturate(w32 / scale.astype(w32.dtype), dtype)
    return QuantizedWeight(data, scale, input_scale, mode)


def check_weight(where: str, name: str, w: QuantizedWeight, shape: tuple[int, int] | None = None) -> None:
    """Trace-time validation of a :class:`QuantizedWeight` argument: its mode, FP8 data ``[in, out]`` (``shape`` when
    given) and float32 scale shapes."""
    if w.mode not in MODES:
        raise ValueError(f"{where}: `{name}`.mode must be 'row' or 'static'; got {w.mode!r}")
    data = w.data
    if not hasattr(data, "dtype") or jnp.dtype(data.dtype) not in FP8_WEIGHT_DTYPES or data.ndim != 2:
        got = f"{data.dtype} {tuple(data.shape)}" if hasattr(data, "dtype") else type(data).__name__
        raise TypeError(f"{where}: `{name}`.data must be float8_e4m3 or float8_e4m3fn [in, out]; got {got}")
    if shape is not None and tuple(data.shape) != tuple(shape):
        raise ValueError(f"{where}: `{name}` must be [in, out] = {tuple(shape)}; got {tuple(data.shape)}")
    want = (data.shape[1],) if w.mode == "row" else ()
    scale = w.scale
    if not hasattr(scale, "dtype") or jnp.dtype(scale.dtype) != jnp.float32 or tuple(scale.shape) != want:
        got = f"{scale.dtype} {tuple(scale.shape)}" if hasattr(scale, "dtype") else type(scale).__name__
        raise ValueError(f"{where}: `{name}`.scale must be float32 {list(want)} for mode={w.mode!r}; got {got}")
    if w.mode == "row" and w.input_scale is not None:
        raise ValueError(f"{where}: `{name}` has mode='row' and an input_scale; only mode='static' takes one")
    if w.mode == "static":
        s = w.input_scale
        if s is None or not hasattr(s, "dtype") or jnp.dtype(s.dtype) != jnp.float32 or tuple(s.shape) != ():
            raise ValueError(
                f"{where}: `{name}` has mode='static' and needs input_scale as a float32 scalar; got {s!r}"
            )
        check_positive_finite(where, f"{name}.input_scale", s, "the activation's per-tensor scale")


def scale_tile(w: QuantizedWeight):
    """The kernels' ``[128, n]`` float32 weight-scale tile: 128 equal rows of ``scale`` (``n = out`` for row, 1 for
    static); no gradient."""
    scale = jax.lax.stop_gradient(w.scale).reshape(1, -1)
    return jnp.broadcast_to(scale, (128, scale.shape[1]))


def input_scale_tile(w: QuantizedWeight):
    """The kernels' ``[128, 1]`` float32 input-scale tile of a static weight; no gradient."""
    return jnp.broadcast_to(jax.lax.stop_gradient(w.input_scale).reshape(1, 1), (128, 1))


def fp8_data(w: QuantizedWeight):
    """The FP8 ``data [in, out]`` (no gradient)."""
    return jax.lax.stop_gradient(w.data)


__all__ = ["QuantizedWeight", "check_weight", "fp8_data", "input_scale_tile", "quantize_weight_fp8", "scale_tile"]
