"""The transposed output that ``rmsnorm_tkg`` and ``layernorm_tkg`` (catalog 1.19) share: its order, shape, fold plan
and checks.

Layouts: ``input [B, S, H]`` (H % 128 == 0), ``gamma [1, H]``, ``beta [1, H]``; output ``out [128, B*S, H/128]`` in
``input``'s dtype. The kernels also take the input already in SBUF as ``[128, B*S, H/128]``; a JAX array is always in
HBM, so that variant does not apply here.

Output order. Row ``t`` (of ``B*S``, batch-major) of the normalized ``y [B*S, H]`` is cut into ``n`` shards of
``H/128/n`` column tiles; shard ``k`` (columns ``k*128*H2 .. (k+1)*128*H2``, ``H2 = H/128/n``) goes to
``out[p, t, k*H2 + j] = y[t, k*128*H2 + p*H2 + j]``. ``n`` is the LNC degree (``jax_nkilib.config(lnc=...)``), or 1
for rmsnorm_tkg with ``hidden_dim_tp`` or ``single_core_forced``; ``hidden_dim_tp`` instead gives ``out[p, t, j] =
y[t, j*128 + p]``. (With ``H/128`` not divisible by ``n`` the last shard takes the remainder, as the kernel's loader.)
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..framework.hardware import PARTITIONS
from ..framework.spec import CallInfo, FoldPlan, accumulation_dtype


def shard_widths(h1: int, n: int) -> list[int]:
    """Column tiles per shard: ``h1 // n`` each, the last shard taking the remainder."""
    base = h1 // n
    return [base] * (n - 1) + [h1 - base * (n - 1)]


def rows_from_tiles(tiles, n: int, hidden_dim_tp: bool = False):
    """``[T, 128, H/128]`` (the output with its first two axes swapped) to rows ``[T, H]``: the inverse order of
    the module docstring."""
    t, p, h1 = tiles.shape
    if hidden_dim_tp:
        return jnp.swapaxes(tiles, 1, 2).reshape(t, p * h1)
    if n == 1:
        return tiles.reshape(t, p * h1)
    if h1 % n == 0:
        return jnp.swapaxes(tiles.reshape(t, p, n, h1 // n), 1, 2).reshape(t, p * h1)
    pieces, start = [], 0
    for width in shard_widths(h1, n):
        pieces.append(tiles[:, :, start : start + width].reshape(t, p * width))
        start += width
    return jnp.concatenate(pieces, axis=1)


def tiles_from_rows(rows, n: int, hidden_dim_tp: bool = False):
    """Inverse of :func:`rows_from_tiles`: ``[T, H]`` to ``[T, 128, H/128]``."""
    t, h = rows.shape
    if hidden_dim_tp:
        return jnp.swapaxes(rows.reshape(t, h // PARTITIONS, PARTITIONS), 1, 2)
    if n == 1:
        return rows.reshape(t, PARTITIONS, h // PARTITIONS)
    if (h // PARTITIONS) % n == 0:
        return jnp.swapaxes(rows.reshape(t, n, PARTITIONS, h // PARTITIONS // n), 1, 2).reshape(
            t, PARTITIONS, h // PARTITIONS
        )
    pieces, start = [], 0
    for width in shard_widths(h // PARTITIONS, n):
        pieces.append(rows[:, start * PARTITIONS : (start + width) * PARTITIONS].reshape(t, PARTITIONS, width))
        start += width
    return jnp.concatenate(pieces, axis=2)


def to_kernel_order(y, n: int, hidden_dim_tp: bool = False):
    """Rows ``[T, H]`` -> the kernel output ``[128, T, H/128]``."""
    return jnp.swapaxes(tiles_from_rows(y, n, hidden_dim_tp), 0, 1)


def from_kernel_order(out, n: int, hidden_dim_tp: bool = False):
    """The kernel output ``[128, T, H/128]`` -> rows ``[T, H]``, by one transpose (with reshapes, which move no data)
    where the shards are equal."""
    p, t, h1 = out.shape
    if hidden_dim_tp:  # out[p, t, j] = y[t, j*128 + p]
        return jnp.transpose(out, (1, 2, 0)).reshape(t, p * h1)
    if n > 1 and h1 % n == 0:  # out[p, t, k*H2 + j] = y[t, k*128*H2 + p*H2 + j]
        return jnp.transpose(out.reshape(p, t, n, h1 // n), (1, 2, 0, 3)).reshape(t, p * h1)
    return rows_from_tiles(jnp.swapaxes(out, 0, 1), n, hidden_dim_tp)


def token_rows(x):
    """``x [B, S, H]`` (or any ``[..., H]``) as rows ``[B*S, H]``, batch-major."""
    return x.reshape(-1, x.shape[-1])


def cotangent_rows(g, n, hidden_dim_tp=False):
    """An output cotangent ``[128, B*S, H/128]`` as rows ``[B*S, H]`` in the accumulation dtype."""
    return from_kernel_order(g, n, hidden_dim_tp).astype(accumulation_dtype(g.dtype))


def check_hidden(call: CallInfo) -> None:
    h = call.dims["H"]
    if h % PARTITIONS:
        raise ValueError(
            f"{call.function}: `input` [B, S, H] needs H % 128 == 0 (the output is [128, B*S, H/128]); got H={h}"
        )


def shard_limits(call: CallInfo, n: int) -> list[str]:
    h1 = call.dims["H"] // PARTITIONS
    if n > 1 and h1 % n:
        return [f"H/128={h1} must be divisible by the {n} H shards at LNC={call.lnc}"]
    return []


def tkg_outputs(call: CallInfo):
    """``out [128, B * S, H / 128]`` in the input's dtype."""
    dims = call.dims
    return [("out", (128, dims["B"] * dims["S"], dims["H"] // 128), call.avals["input"].dtype)]


TKG_FOLD_PLANS = (FoldPlan({"input": "B", "gamma": None, "beta": None}, outputs={"out": 1}),)


# The KernelSpec fields both TKG norm kernels share: the transposed output, its fold plan, the split along B, the
# LNC-dependent output order, the catalog entry.
TKG_SPEC_FIELDS = dict(
    reference_takes_lnc=True,
    outputs=(),
    output_avals=tkg_outputs,
    fold_plans=TKG_FOLD_PLANS,
    neuron_split_dims=("B",),
    family="norm",
    catalog="1.19",
)


def elements(call: CallInfo) -> int:
    """The number of input elements (for the MAC-count estimates)."""
    return math.prod(call.avals["input"].shape)
