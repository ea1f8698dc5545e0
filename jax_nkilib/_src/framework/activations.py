"""The NKI Library kernels' activation functions (``ActFnType``) and projection clamps, shared by the MLP and MoE
references: ``nl.silu``, ``nl.gelu``, ``nl.gelu_apprx_tanh``, ``nl.gelu_apprx_sigmoid`` (the kernels' "Swish",
``x sigmoid(1.702 x)``) and ``nl.relu``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from .common_types import ActFnType

SWISH_BETA = 1.702  # ActFnType.Swish is nl.gelu_apprx_sigmoid: x * sigmoid(1.702 x)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def activation(x, fn: ActFnType):
    """The kernels' activation functions (``nl.silu``, ``nl.gelu``, ``nl.gelu_apprx_tanh``,
    ``nl.gelu_apprx_sigmoid``, ``nl.relu``)."""
    if fn == ActFnType.SiLU:
        return x * jax.nn.sigmoid(x)
    if fn == ActFnType.GELU:
        return 0.5 * x * (1.0 + lax.erf(x / math.sqrt(2.0)))
    if fn == ActFnType.GELU_Tanh_Approx:
        return 0.5 * x * (1.0 + jnp.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
    if fn == ActFnType.Swish:
        return x * jax.nn.sigmoid(SWISH_BETA * x)
    if fn == ActFnType.ReLU:
        return jnp.maximum(x, 0.0)
    raise AssertionError(fn)


def clamp(x, upper: float | None, lower: float | None):
    """``min(x, upper)`` then ``max(., lower)``, each when given (the kernels' order)."""
    if upper is not None:
        x = jnp.minimum(x, upper)
    if lower is not None:
        x = jnp.maximum(x, lower)
    return x
