"""Sequence layouts for context parallelism: which global tokens each shard of a ring holds.

A global sequence of ``S = n * L`` tokens is split over ``n`` shards of ``L`` local tokens. Local token ``i`` of shard
``r`` has global position:

* ``"contiguous"``: ``r * L + i`` (shard ``r`` holds tokens ``[r L, (r+1) L)``);
* ``"striped"``: ``i * n + r`` (token ``t`` lives on shard ``t % n`` at local index ``t // n``);
* ``"zigzag"``: the sequence is cut into ``2n`` chunks of ``c = L / 2``; shard ``r`` holds chunk ``r`` then chunk
  ``2n - 1 - r``, so local token ``i`` is at ``r c + i`` for ``i < c`` and at ``(2n - 1 - r) c + (i - c)`` after.

Within a shard positions rise with the local index in every layout, so a causal mask between a shard's own queries
and keys is the plain ``key index <= query index`` mask. With causal attention, striped and zigzag give every shard the
same amount of unmasked work; contiguous does not (shard ``n - 1`` sees every key, shard 0 only its own).

``to_ring_layout`` permutes a *global* array's sequence axis so that an ordinary contiguous sharding of the result
(``PartitionSpec`` on that axis) gives each shard its layout's tokens in local order; ``from_ring_layout`` undoes it.
Both are a static gather along the sequence axis; they keep the dtype and an explicit sharding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework import compat
from ..framework.arguments import array_argument

LAYOUTS = ("contiguous", "striped", "zigzag")


def check_layout(layout, where: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"{where}: `layout` must be one of {LAYOUTS}; got {layout!r}")


def check_local_length(layout: str, local_len: int, where: str, what: str = "the local sequence length") -> None:
    """``ValueError`` unless ``local_len`` tokens per shard suit ``layout`` (zigzag needs two equal chunks)."""
    if layout == "zigzag" and local_len % 2:
        raise ValueError(
            f"{where}: the zigzag layout needs an even number of tokens per shard (two chunks of L/2); "
            f"got {what} {local_len}"
        )


def _check_axis_size(axis_size, where: str) -> int:
    if isinstance(axis_size, bool) or not isinstance(axis_size, (int, np.integer)) or axis_size < 1:
        raise ValueError(f"{where}: `axis_size` must be a positive int; got {axis_size!r}")
    return int(axis_size)


def token_positions(layout: str, axis_size: int, rank, local_len: int):
    """Global positions (int32 ``[local_len]``) of the tokens shard ``rank`` holds; ``rank`` may be traced."""
    where = "token_positions"
    check_layout(layout, where)
    n = _check_axis_size(axis_size, where)
    if isinstance(local_len, bool) or not isinstance(local_len, (int, np.integer)) or local_len < 1:
        raise ValueError(f"{where}: `local_len` must be a positive int; got {local_len!r}")
    check_local_length(layout, int(local_len), where, "local_len")
    if isinstance(rank, (int, np.integer)) and not 0 <= rank < n:
        raise ValueError(f"{where}: `rank` must be in [0, {n}); got {rank}")
    rank = jnp.asarray(rank, jnp.int32)
    i = jnp.arange(local_len, dtype=jnp.int32)
    if layout == "contiguous":
        return rank * local_len + i
    if layout == "striped":
        return i * n + rank
    chunk = local_len // 2
    return jnp.where(i < chunk, rank * chunk + i, (2 * n - 1 - rank) * chunk + i - chunk)


def _permutation(layout: str, axis_size: int, length: int, where: str) -> np.ndarray:
    """``perm`` with ``ring[p] = global[perm[p]]``: the concatenated token positions of shards 0 .. n-1."""
    check_layout(layout, where)
    n = _check_axis_size(axis_size, where)
    if length % n:
        raise ValueError(f"{where}: the sequence length {length} must be a multiple of axis_size={n}")
    local_len = length // n
    check_local_length(layout, local_len, where, f"{length} / axis_size={n} =")
    i = np.arange(local_len)
    shards = []
    for rank in range(n):
        if layout == "contiguous":
            shards.append(rank * local_len + i)
        elif layout == "striped":
            shards.append(i * n + rank)
        else:
            chunk = local_len // 2
            shards.append(np.where(i < chunk, rank * chunk + i, (2 * n - 1 - rank) * chunk + i - chunk))
    return np.concatenate(shards)


def _seq_axis(x, seq_axis, where: str) -> int:
    x = array_argument(where, "x", x, dtypes=None)
    if isinstance(seq_axis, bool) or not isinstance(seq_axis, (int, np.integer)) or not -x.ndim <= seq_axis < x.ndim:
        raise ValueError(f"{where}: `seq_axis` must be an axis of x (rank {x.ndim}); got {seq_axis!r}")
    return int(seq_axis) % x.ndim


def _gather(x, perm: np.ndarray, axis: int, layout: str):
    """``x`` indexed by the static ``perm`` along ``axis``, keeping an explicit sharding if ``x`` has one."""
    if layout == "contiguous":  # the identity
        return x
    if not compat.scatter_add_has_sharding_rule():
        return _permute(x, perm, axis)
    return _take(x, perm, axis)


def _permute(x, perm: np.ndarray, axis: int):
    """:func:`_take` whose reverse mode gathers with the inverse permutation instead of scattering (JAX 0.7 cannot
    transpose the gather of an unsharded array into a sharded cotangent)."""

    @jax.custom_vjp
    def permute(value):
        return _take(value, perm, axis)

    def backward(_, cotangent):
        return (_permute(cotangent, np.argsort(perm), axis),)

    permute.defvjp(lambda value: (permute(value), None), backward)
    return permute(x)


def _take(x, perm: np.ndarray, axis: int):
    index = (slice(None),) * axis + (perm,)
    sharding = getattr(jax.typeof(x), "sharding", None)
    if sharding is not None and any(entry is not None for entry in getattr(sharding, "spec", ())):
        return x.at[index].get(out_sharding=sharding)  # explicit mesh axes: say where the result lives
    return x[index]


def to_ring_layout(x, *, layout: str, axis_size: int, seq_axis: int = 1):
    """``x`` with its (global) sequence axis reordered so that shard ``r`` of a contiguous split holds
    ``x``'s tokens at ``token_positions(layout, axis_size, r, S / axis_size)``."""
    where = "to_ring_layout"
    axis = _seq_axis(x, seq_axis, where)
    perm = _permutation(layout, axis_size, x.shape[axis], where)
    return _gather(jnp.asarray(x), perm, axis, layout)


def from_ring_layout(x, *, layout: str, axis_size: int, seq_axis: int = 1):
    """Inverse of :func:`to_ring_layout`: the sequence axis back in global token order."""
    where = "from_ring_layout"
    axis = _seq_axis(x, seq_axis, where)
    perm = _permutation(layout, axis_size, x.shape[axis], where)
    return _gather(jnp.asarray(x), np.argsort(perm), axis, layout)
