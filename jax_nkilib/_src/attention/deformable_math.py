"""Multi-scale deformable attention math shared by the ``ms_deformable_attention`` kernels' references.

Canonical layouts: ``value [B, L, N_h, C_h]`` (levels flattened row-major, level ``l`` at rows ``start_l ..
start_l + H_l * W_l``), ``x, y [B, N_q, N_h, N_l, N_p]`` normalized sampling coordinates (``x`` along the width),
``weights [B, N_q, N_h, N_l, N_p]``. For each point, pixel coordinates are ``px = x * W_l - 0.5`` (or ``x * (W_l - 1)``
with ``align_corners``), ``py`` likewise with ``H_l``; the sample is the bilinear mix of the four corners
``(floor(px) + i, floor(py) + j)``, each weighted by ``(1 - fx or fx) * (1 - fy or fy)``. Corners outside the map
count zero (``padding_mode="zeros"``, ``grid_sample``'s) or are clamped to the edge (``"border"``). The output is
``sum_{l, p} weights * sample`` per head, ``[B, N_q, N_h * C_h]``. Arithmetic runs in the accumulation dtype of the
inputs (float32, or float64 for float64 inputs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.spec import accumulation_dtype

VALUE_LAYOUTS = ("BLNC", "BNLC")
LOCATION_LAYOUTS = ("BQHLP2", "B2QHLP")
PADDING_MODES = ("zeros", "border")


def level_starts(spatial_shapes) -> tuple[int, ...]:
    """The start row of each level in the flattened ``L`` axis: ``(0, H_0 W_0, H_0 W_0 + H_1 W_1, ...)``."""
    starts, total = [], 0
    for height, width in spatial_shapes:
        starts.append(total)
        total += height * width
    return tuple(starts)


def canonical_value(value, value_layout: str):
    """``value`` as ``[B, L, N_h, C_h]``."""
    return value if value_layout == "BLNC" else jnp.swapaxes(value, 1, 2)


def canonical_locations(sampling_locations, layout: str):
    """``(x, y)``, each ``[B, N_q, N_h, N_l, N_p]``, from either sampling-locations layout."""
    if layout == "BQHLP2":
        return sampling_locations[..., 0], sampling_locations[..., 1]
    return sampling_locations[:, 0], sampling_locations[:, 1]


def _pixel(coordinate, size: int, align_corners: bool):
    return coordinate * (size - 1) if align_corners else coordinate * size - 0.5


def _gather(value_heads, rows):
    """``value_heads [B, N_h, L, C]`` at ``rows [B, N_q, N_h, K]`` (per batch, head) -> ``[B, N_q, N_h, K, C]``."""
    batch, heads, length, channels = value_heads.shape
    base = (jnp.arange(batch)[:, None] * heads + jnp.arange(heads)[None, :]) * length  # [B, N_h]
    flat = rows + base[:, None, :, None]
    return jnp.take(value_heads.reshape(batch * heads * length, channels), flat, axis=0)


def level_corners(x, y, start: int, height: int, width: int, align_corners: bool, padding_mode: str):
    """One level's bilinear corners: ``(rows, weights)``, each ``[..., N_p, 4]`` for ``x, y [..., N_p]`` (the rows
    clamped into the level; the weights zero for corners outside it under ``"zeros"``)."""
    px, py = _pixel(x, width, align_corners), _pixel(y, height, align_corners)
    x0, y0 = jnp.floor(px), jnp.floor(py)
    fx, fy = px - x0, py - y0
    x0, y0 = x0.astype(jnp.int32), y0.astype(jnp.int32)
    rows, weights = [], []
    for dx, wx in ((0, 1 - fx), (1, fx)):
        for dy, wy in ((0, 1 - fy), (1, fy)):
            cx, cy = x0 + dx, y0 + dy
            weight = wx * wy
            if padding_mode == "zeros":
                weight = jnp.where((cx >= 0) & (cx < width) & (cy >= 0) & (cy < height), weight, 0)
            rows.append(start + jnp.clip(cy, 0, height - 1) * width + jnp.clip(cx, 0, width - 1))
            weights.append(weight)
    return jnp.stack(rows, -1), jnp.stack(weights, -1)


def deformable_attention_math(
    value, spatial_shapes, level_start_index, x, y, weights, *, align_corners=False, padding_mode="zeros"
):
    """``[B, N_q, N_h * C_h]`` in the accumulation dtype from canonical ``value [B, L, N_h, C_h]``, ``x, y,
    weights [B, N_q, N_h, N_l, N_p]`` (see the module doc): one gather of every level's corners."""
    wide = accumulation_dtype(jnp.result_type(value.dtype, x.dtype, weights.dtype))
    value_heads = jnp.swapaxes(value.astype(wide), 1, 2)  # [B, N_h, L, C]
    x, y, weights = x.astype(wide), y.astype(wide), weights.astype(wide)
    batch, queries, heads = x.shape[:3]
    rows, mix = [], []
    for level, ((height, width), start) in enumerate(zip(spatial_shapes, level_start_index)):
        level_rows, bilinear = level_corners(
            x[..., level, :], y[..., level, :], start, height, width, align_corners, padding_mode
        )
        rows.append(level_rows.reshape(batch, queries, heads, -1))
        mix.append((bilinear * weights[..., level, :, None]).reshape(batch, queries, heads, -1))
    samples = _gather(value_heads, jnp.concatenate(rows, -1))  # [B, N_q, N_h, N_l * N_p * 4, C]
    out = jnp.einsum("bqhk,bqhkc->bqhc", jnp.concatenate(mix, -1), samples, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(batch, queries, heads * value.shape[-1])
