"""Numerics shared by the projection kernels: accumulation and storage dtypes, static FP8 quantization, the matmul,
and the VJP rule (JAX differentiation of the reference over the floating, non-FP8 operands).

Precision (the kernels'): matmuls accumulate in float32 (float64 for float64 inputs, CPU only); every value the
kernels keep in an SBUF buffer is rounded to that buffer's dtype, which the references reproduce with
:func:`rounded`. Per-tensor scales given as ``[128, 1]`` (or ``[1, 1]``) tiles are read at element ``[0, 0]``: the
kernels apply row ``p`` of the tile to partition ``p`` of their 128-row tiles, so all rows must hold the same value
(as the NKI Library's tests provide); a differing row is a runtime value the binding cannot check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ..framework.primitive import reference_vjp
from ..framework.spec import FP8_DTYPES
from ..quant import mx
from ..quant.fp8 import fake_quantize, fp8_max


def is_fp8(dtype) -> bool:
    return np.dtype(dtype) in FP8_DTYPES


def rounded(x, dtype, acc):
    """``x`` rounded to ``dtype`` (a kernel storing it in a buffer of that dtype), kept in ``acc``."""
    return x.astype(dtype).astype(acc)


def first_element(scale, acc):
    """The scalar a ``[128, 1]`` / ``[1, 1]`` per-tensor scale tile holds (element ``[0, 0]``)."""
    return scale.reshape(-1)[0].astype(acc)


def quantize(x, fp8_dtype, bound: float | None = None):
    """``clip(x, -bound, bound)`` rounded to ``fp8_dtype`` (default bound: the format's largest finite value), kept
    in ``x``'s dtype, with a straight-through gradient (the kernels' activation quantization)."""
    return fake_quantize(x, fp8_dtype, fp8_max(fp8_dtype) if bound is None else bound)


def contract(subscripts: str, x, w, acc):
    """``einsum`` accumulated in ``acc`` at full precision (FP8 operands are exact in ``acc``)."""
    return jnp.einsum(
        subscripts, x.astype(acc), w.astype(acc), precision=lax.Precision.HIGHEST, preferred_element_type=acc
    )


# The projections' VJP rule: the reference differentiated in the floating, non-FP8 operands.
differentiable_vjp = reference_vjp


def mx_activation(x, axis: int = -1):
    """The MXFP8 (e4m3fn) round trip of ``x`` in blocks of 32 consecutive elements along ``axis`` (OCP emax 8,
    ``quant.mx.mx_round_trip``), in ``x``'s dtype; its gradient passes the quantization straight through."""
    return x + jax.lax.stop_gradient(mx.mx_round_trip(x, axis=axis).astype(x.dtype) - x)


def mx_weight(words, scales, dtype):
    """float32 ``W [K, N]`` of an x4-packed MX weight ``words [K/4, N]`` (``dtype`` elements, 4 per word) with e8m0
    ``scales [K/32, N]``: ``W[4k + j, n]`` is element ``j`` of word ``[k, n]`` times ``2**(scales[(4k + j) // 32, n]
    - 127)``."""
    lanes = mx.decode_x4_weight(words, scales, dtype)  # [K/4, N, 4]
    return jnp.swapaxes(lanes, -1, -2).reshape(4 * words.shape[0], words.shape[1])
