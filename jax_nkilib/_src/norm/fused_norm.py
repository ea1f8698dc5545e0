"""The normalisation that the projection and MLP kernels fuse before their matmuls (``fused_norm_type`` /
``normalization_type``), over the last axis, computed in ``x``'s dtype:

* ``RMS_NORM``: ``x * rsqrt(sum(x^2) / n + eps) * gamma`` with ``n = hidden_actual`` (default: the last axis);
* ``RMS_NORM_SKIP_GAMMA``: the same without ``gamma``;
* ``LAYER_NORM``: ``(x - mean) * rsqrt(mean((x - mean)^2) + eps) * gamma + beta`` (two-pass, biased variance).

``gamma``/``beta`` are ``[H]`` or ``[1, H]``. (The standalone TKG norm kernels round differently; see ``tkg``.)
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..framework.common_types import NormType

NORM_NAMES = {None: NormType.NO_NORM, "rms": NormType.RMS_NORM, "layer": NormType.LAYER_NORM}


def norm_type_of(where: str, norm, has_gamma: bool = True) -> NormType:
    """The kernels' ``NormType`` for the idiomatic ops' ``norm`` argument (``None``, ``"rms"`` or ``"layer"``); an RMS
    norm without a weight is ``RMS_NORM_SKIP_GAMMA``."""
    if norm not in NORM_NAMES:
        raise ValueError(f"{where}: `norm` must be None, 'rms' or 'layer'; got {norm!r}")
    if norm == "rms" and not has_gamma:
        return NormType.RMS_NORM_SKIP_GAMMA
    return NORM_NAMES[norm]


def fused_norm(x, norm_type: NormType, gamma, beta, eps: float, hidden_actual: int | None = None):
    if norm_type == NormType.NO_NORM:
        return x
    if norm_type == NormType.LAYER_NORM:
        centered = x - jnp.mean(x, axis=-1, keepdims=True)
        y = centered * lax.rsqrt(jnp.mean(centered * centered, axis=-1, keepdims=True) + eps)
    else:
        count = x.shape[-1] if hidden_actual is None else hidden_actual
        y = x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) / count + eps)
    if gamma is not None and norm_type != NormType.RMS_NORM_SKIP_GAMMA:
        y = y * gamma.reshape(-1).astype(x.dtype)
    if beta is not None and norm_type == NormType.LAYER_NORM:
        y = y + beta.reshape(-1).astype(x.dtype)
    return y
