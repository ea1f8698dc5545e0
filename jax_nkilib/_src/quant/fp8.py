"""FP8 element formats as the NKI kernels use them, emulated exactly with JAX's FP8 types (``ml_dtypes``).

``float8_e4m3`` is the Trainium2 (non-OCP) E4M3 with largest finite 240; ``float8_e4m3fn`` the OCP E4M3 (448, no
inf); ``float8_e5m2`` has 57344. Casts round to nearest even; :func:`saturate` clips to the largest finite value
first, as the kernels' quantisation does (a plain cast would overflow to inf/NaN).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..framework import compat
from ..framework.spec import FP8_DTYPES  # noqa: F401  (the formats, re-exported for quantization code)

# the formats the kernels read FP8 weights in
FP8_WEIGHT_DTYPES = (jnp.dtype(jnp.float8_e4m3), jnp.dtype(jnp.float8_e4m3fn))

# MINVAL, the floor of the dequant scale in the library's row (dynamic) quantization: scale = max(absmax / M, 1e-6).
# The 2.29 MLP kernel's value; fp8_quantize.py imports it from core/quantization/constants.py, not available here.
ROW_SCALE_FLOOR = 1e-6


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 format."""
    return float(jnp.finfo(np.dtype(dtype)).max)


def saturate(x, dtype, bound: float | None = None):
    """``x`` clipped to ``[-bound, bound]`` (default: the format's largest finite value) and cast to ``dtype``;
    NaN stays NaN."""
    bound = fp8_max(dtype) if bound is None else bound
    return compat.astype_float8(jnp.clip(x, -bound, bound), dtype)


SCALE_BYTES = 4  # a float32 scale stored as four 1-byte elements


def scale_to_bytes(scale, dtype):
    """float32 ``scale [...]`` as ``[..., 4]`` elements of the 1-byte type ``dtype``, bit for bit (a bitcast):
    element ``j`` is byte ``j`` of the float32 in memory, i.e. bits ``8j..8j+7`` on the little-endian targets (CPU,
    Trainium), as rmsnorm_quant's ROW output stores its scale."""
    from jax import lax

    return lax.bitcast_convert_type(jnp.asarray(scale, jnp.float32), dtype)


def scale_from_bytes(data):
    """Inverse of :func:`scale_to_bytes`: float32 ``[...]`` from ``[..., 4]`` 1-byte elements (any 1-byte type)."""
    from jax import lax

    return lax.bitcast_convert_type(data, jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def fake_quantize(x, dtype, bound: float | None = None):
    """:func:`saturate` returned in ``x``'s dtype (FP8 values are exact in bfloat16, float16 and float32), with a
    straight-through gradient: the cotangent passes unchanged (no FP8 rounding of the gradient)."""
    return saturate(x, dtype, bound).astype(x.dtype)


def _fake_quantize_fwd(x, dtype, bound):
    return fake_quantize(x, dtype, bound), None


def _fake_quantize_bwd(dtype, bound, _, cotangent):
    del dtype, bound
    return (cotangent,)


fake_quantize.defvjp(_fake_quantize_fwd, _fake_quantize_bwd)
