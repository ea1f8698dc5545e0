"""The ring schedule that the collective matmuls, the all-gather kernels' references and ring attention share.

The ``n`` ranks along mesh axes ``names`` (bound by the enclosing ``jax.shard_map``) form a ring; a block moves one
rank per step with ``lax.ppermute``, so visiting every rank's block costs ``n - 1`` collective-permutes and no
all-gather.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..framework import compat
from ..framework.mesh_axes import bound_axis_size, lax_axis
from ..framework.spec import accumulation_dtype


def shift(value, names: tuple[str, ...], n: int, direction: int = -1):
    """Rank ``r``'s ``value`` goes to rank ``r + direction`` (mod ``n``); the default passes it left, so rank ``r``
    receives rank ``r + 1``'s."""
    return lax.ppermute(value, lax_axis(names), [(j, (j + direction) % n) for j in range(n)])


def visit_ring(chunk, names: tuple[str, ...], n: int, step, carry):
    """``carry = step(carry, block, source)`` for the block of every rank in turn, starting with this rank's
    ``chunk`` (``source`` is the rank the block came from); ``n - 1`` collective-permutes of the block."""
    rank = lax.axis_index(lax_axis(names))
    for s in range(n):
        carry = step(carry, chunk, (rank + s) % n)
        if s < n - 1:
            chunk = shift(chunk, names, n)
    return carry


def contract_last(a, b, acc):
    """``a [..., K] @ b [K, N]`` accumulated in ``acc``."""
    return lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())), preferred_element_type=acc)


def common_dtype(x, w):
    """``x`` and ``w`` in their promoted dtype, and that dtype's accumulation dtype."""
    dtype = jnp.promote_types(x.dtype, w.dtype)
    return x.astype(dtype), w.astype(dtype), accumulation_dtype(dtype)


def gather_matmul(x, w, names: tuple[str, ...], axis: int):
    """``all_gather(x, axis, tiled=True) @ w`` by the ring: each rank multiplies the ``x`` block in hand, then passes
    it on. Output in ``x``'s dtype."""
    n = bound_axis_size(names)
    out_dtype = x.dtype
    x, w, acc = common_dtype(x, w)
    rows = x.shape[axis]
    shape = x.shape[:axis] + (n * rows,) + x.shape[axis + 1 : -1] + (w.shape[1],)
    out = compat.varying_like(jnp.zeros(shape, out_dtype), x, w)

    def step(out, block, source):
        product = contract_last(block, w, acc).astype(out_dtype)
        return lax.dynamic_update_slice_in_dim(out, product, source * rows, axis)

    return visit_ring(x, names, n, step, out)
