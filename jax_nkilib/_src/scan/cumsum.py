"""``cumsum`` (catalog row 5, section 1.5): the inclusive prefix sum along the last axis.

Source: nki-library ``src/nkilib_src/nkilib/core/cumsum/cumsum.py`` (``@nki.jit cumsum(x, axis=-1)``, the same at tag
2.29, on main and in the 2.32 API reference), its torch reference ``cumsum_torch.py`` (``torch.cumsum(x, dim=axis)``)
and its tests ``test/integration/nkilib/core/cumsum/test_cumsum.py``.

``cumsum(x [B, H] or [B, S, H], axis=-1) -> out`` of ``x``'s shape and dtype, ``out[..., i] = sum(x[..., :i+1])``.
Only the last axis is supported (the kernel asserts it): ``axis`` must be -1 or ``rank - 1``.

Numerics, as the kernel computes them: the rows are processed in tiles of 2048 columns. Inside a tile the running
sum is a float32 state (``tensor_tensor_scan`` accumulates in float32; float64 for float64 inputs off Neuron) and each
output is rounded to ``x``'s dtype; the next tile starts from the previous tile's last *output*, already rounded to
``x``'s dtype. For float32 that is a plain float32 prefix sum; for bfloat16 the carry is rounded once every 2048
columns. The library documents about 1e-2 absolute error for H > 5K (float32 accumulation).

Reverse mode: the VJP of a prefix sum is the suffix sum of the cotangent, ``dx = flip(cumsum(flip(dy)))``, computed by
this kernel again (so training on Neuron runs it in both directions).

Neuron limits (the API reference's constraints, "optimized for"): B <= 2048 (a larger B is split into several kernel
calls), S <= 10, H <= 8192; no LNC sharding (one core).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.compat import varying_like
from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype

CUMSUM_F_TILE = 2048  # columns per tensor_tensor_scan tile; the carry between tiles is rounded to x's dtype
MAX_B, MAX_S, MAX_H = 2048, 10, 8192  # the API reference's constraints


def tiled_prefix_sum(rows, dtype):
    """The kernel's prefix sum of ``rows [R, H]`` (any float dtype) as ``dtype``: wide sums inside each tile of
    :data:`CUMSUM_F_TILE` columns, the carry into the next tile rounded to ``dtype``."""
    wide = accumulation_dtype(dtype)
    count, hidden = rows.shape
    tiles = -(-hidden // CUMSUM_F_TILE)
    if tiles == 1:  # one tile: no carry
        return jnp.cumsum(rows.astype(wide), axis=-1).astype(dtype)
    padded = jnp.pad(rows.astype(wide), ((0, 0), (0, tiles * CUMSUM_F_TILE - hidden)))
    within = jnp.cumsum(padded.reshape(count, tiles, CUMSUM_F_TILE), axis=-1)  # per-tile sums from zero
    tile_lengths = jnp.minimum(hidden - jnp.arange(tiles) * CUMSUM_F_TILE, CUMSUM_F_TILE)
    tile_totals = jnp.take_along_axis(within, (tile_lengths - 1)[None, :, None], axis=-1)[..., 0]  # [R, tiles]

    def carry_step(carry, total):  # the next tile's initial value: this tile's last output, in dtype
        return (carry + total).astype(dtype).astype(wide), carry

    _, carries = jax.lax.scan(carry_step, varying_like(jnp.zeros((count,), wide), rows), tile_totals.T)  # [tiles, R]
    out = (within + carries.T[:, :, None]).astype(dtype)
    return out.reshape(count, tiles * CUMSUM_F_TILE)[:, :hidden]


def reference_cumsum(x, *, axis=-1):
    """JAX reference of ``cumsum``: the kernel's tiled prefix sum along the last axis (see the module docstring)."""
    del axis  # checked: always the last axis
    rows = x.reshape(-1, x.shape[-1])
    return (tiled_prefix_sum(rows, x.dtype).reshape(x.shape),)


def _cumsum_vjp(kernel, operands, params, outs, cotangents):
    """``dx[i] = sum_{j >= i} dy[j]``: the kernel's prefix sum of the reversed cotangent, reversed."""
    (dy,) = cotangents
    x = operands["x"]
    dy = jnp.zeros_like(x) if dy is None else dy.astype(x.dtype)
    (suffix,) = kernel.call({"x": jnp.flip(dy, axis=-1)}, params)
    return {"x": jnp.flip(suffix, axis=-1)}


def _check_cumsum(call: CallInfo) -> None:
    rank = call.avals["x"].ndim
    if call.params["axis"] not in (-1, rank - 1):
        raise ValueError(
            f"{call.function}: parameter `axis` must be -1 or {rank - 1} (the kernel sums along the last axis "
            f"only); got {call.params['axis']}. Move the axis last first (jax_nkilib.cumsum does)."
        )


def _cumsum_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    for name, limit in (("B", MAX_B), ("S", MAX_S), ("H", MAX_H)):
        if dims.get(name, 0) > limit:
            unmet.append(f"{name}={dims[name]} exceeds the kernel's documented limit {name} <= {limit}")
    return unmet


CUMSUM_SPEC = KernelSpec(
    name="cumsum",
    entry_point="nkilib.core.cumsum.cumsum:cumsum",
    operands=(Operand.of("x", "B, H", "B, S, H", doc="rows to prefix-sum along the last axis"),),
    params=(Param("axis", -1, int, "the summed axis: -1 or the last axis' index (the kernel's only choice)"),),
    outputs=(),
    output_avals=lambda call: (("out", call.avals["x"].shape, call.avals["x"].dtype),),
    reference=reference_cumsum,
    check=_check_cumsum,
    neuron_limits=_cumsum_limits,
    neuron_split_dims=("B",),
    fold_plans=(FoldPlan(axes={"x": "B"}, outputs={"out": 0}),),
    family="scan",
    catalog="1.5",
    support={
        "idiomatic": "cumsum",
        "vjp": "kernel (the suffix sum: cumsum of the reversed cotangent)",
        "notes": f"last axis only; float32 accumulation in tiles of {CUMSUM_F_TILE} columns, the carry between "
        f"tiles in x's dtype; Neuron: B <= {MAX_B} (larger B split into calls), S <= {MAX_S}, H <= {MAX_H} "
        "(jax_nkilib.cumsum scans longer axes in blocks); one core (no LNC sharding)",
    },
)


cumsum = make_kernel(CUMSUM_SPEC, _cumsum_vjp)
