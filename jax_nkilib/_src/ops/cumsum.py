"""``jax_nkilib.cumsum``: ``jnp.cumsum`` through the NKI ``cumsum`` kernel (see :mod:`jax_nkilib._src.scan.cumsum` for
the kernel's tiled float32 numerics).

Layout glue: the summed axis is moved last and the other axes flattened into the kernel's rows (``[rows, n]``), one
transpose each way unless the axis is already last; an axis longer than the kernel's 8192 is scanned in 8192-long
blocks plus a scan of the block totals. Under explicit shardings the other axes split freely; a split
summed axis runs the kernel on each shard and adds the totals of the shards before it (one all-gather of the
shards' last elements).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument
from ..framework.spec import FLOAT_DTYPES, dtype_value
from ..framework.validation import require_static, static_int
from ..scan.cumsum import MAX_H
from ..scan.cumsum import cumsum as cumsum_kernel
from ..sharding import auto

WHERE = "jax_nkilib.cumsum"
SUMMED = "s"  # the sharding letter of the summed axis

CUMSUM_SHARDING = auto.register_rule(
    auto.ShardingRule(
        WHERE,
        free=auto.LEADING,
        collective={
            SUMMED: (
                "summed axis",
                "each shard's prefix sums plus the totals of the shards before it (one all-gather of the "
                "shards' last elements)",
            )
        },
    )
)


def _summed_axis(x, axis) -> tuple[jax.Array, int]:
    """``x`` (flattened for ``axis=None``, as ``jnp.cumsum`` does) and the summed axis as a non-negative int."""
    if axis is None:
        return x.reshape(-1), 0
    require_static(WHERE, "axis", axis, "an int")
    if x.ndim == 0:
        raise ValueError(f"{WHERE}: `x` must have at least one axis to sum along (or pass axis=None); got a scalar")
    axis = static_int(WHERE, "axis", axis, minimum=-x.ndim, maximum=x.ndim - 1)
    return x, axis % x.ndim


def _result_dtype(x, dtype) -> np.dtype:
    result = np.dtype(x.dtype) if dtype is None else dtype_value(dtype, f"{WHERE}: `dtype`")
    if result not in FLOAT_DTYPES:
        raise TypeError(
            f"{WHERE}: the result dtype must be float32, bfloat16, float16 or float64 (the kernel sums floats in "
            f"float32); got {result}" + ("" if dtype is None else " from `dtype`") + ". Pass dtype=jnp.float32 to sum "
            "integers as floats, or use jnp.cumsum for exact integer sums."
        )
    return result


def _add_earlier_shard_totals(local, axis: int, mesh_axes: tuple[str, ...]):
    """Prefix sums of the whole axis from each shard's own: add the sum of the shards before this one."""
    totals = jax.lax.slice_in_dim(local, local.shape[axis] - 1, local.shape[axis], axis=axis)
    gathered = jax.lax.all_gather(totals, mesh_axes)  # [shards, ...totals]
    earlier = jnp.arange(gathered.shape[0]) < jax.lax.axis_index(mesh_axes)
    offset = jnp.sum(jnp.where(earlier.reshape((-1,) + (1,) * local.ndim), gathered, 0), axis=0)
    return local + offset.astype(local.dtype)


def cumsum(x, axis: int | None = -1, dtype=None):
    """Inclusive cumulative sum along ``axis``, as ``jnp.cumsum(x, axis, dtype)``.

    Args:
      x: an array; its values are cast to ``dtype`` first (as ``jnp.cumsum`` does).
      axis: the summed axis, a static int (default -1, the last); ``None`` sums the flattened array.
      dtype: the result dtype (default ``x``'s); it must be float32, bfloat16, float16 or float64.

    Returns an array of ``x``'s shape (flattened for ``axis=None``) in the result dtype. Sums run in float32
    (float64 for float64) within tiles of 2048 elements; between tiles the running sum is rounded to the result
    dtype, as the kernel does. Differentiable: the VJP is the reversed cumulative sum of the cotangent, computed by
    the same kernel. On Neuron it is the ``cumsum`` kernel on ``[rows, n]`` (rows past 2048 split into several
    calls); a summed axis longer than the kernel's 8192 is scanned in blocks of 8192 (one call), and each block
    then adds the total of the blocks before it (a second call on the block totals).
    """
    x = array_argument(WHERE, "x", x, dtypes=None)
    x, axis = _summed_axis(x, axis)
    x = x.astype(_result_dtype(x, dtype))
    auto.leading(x.ndim, WHERE)
    dims = "".join(SUMMED if i == axis else str(i) for i in range(x.ndim))
    sharded = auto.plan(CUMSUM_SHARDING, [auto.ShardedArgument("x", x, dims)])
    if sharded:

        def local(x, axes):
            summed = cumsum(x, axis)
            return _add_earlier_shard_totals(summed, axis, axes[SUMMED]) if SUMMED in axes else summed

        return sharded.run(local, dims)
    if x.size == 0:
        return x
    moved = jnp.moveaxis(x, axis, -1)
    out = _prefix_sums(moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]))
    return jnp.moveaxis(out.reshape(moved.shape), -1, axis)


def _kernel_rows(rows):
    (out,) = cumsum_kernel.call({"x": rows}, cumsum_kernel.params())
    return out


def _prefix_sums(rows):
    """Prefix sums of ``rows [R, n]`` by the kernel; rows longer than its limit ``n <= 8192`` are scanned in blocks
    of 8192 (one call on ``[R * blocks, 8192]``), then each block gets the sum of the blocks before it (a second
    call on the ``[R, blocks]`` block totals)."""
    count, length = rows.shape
    if length <= MAX_H:
        return _kernel_rows(rows)
    blocks = -(-length // MAX_H)
    padded = jnp.pad(rows, ((0, 0), (0, blocks * MAX_H - length)))  # zeros after: prefix sums unchanged
    within = _kernel_rows(padded.reshape(count * blocks, MAX_H)).reshape(count, blocks, MAX_H)
    before = _prefix_sums(within[:, :-1, -1])  # [R, blocks - 1]: the totals of blocks 0..b-1 for block b
    offsets = jnp.concatenate([jnp.zeros((count, 1), rows.dtype), before], axis=1)
    return (within + offsets[:, :, None]).reshape(count, blocks * MAX_H)[:, :length]
