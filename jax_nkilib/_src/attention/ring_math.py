"""The math the NKI ring attention kernels compute, as per-device JAX for the references (inside ``jax.shard_map``).

Sequence positions. The ``nw`` ranks of a replica group (``rank`` = position in the group: the index along the
mesh axes that name it, in their order) each hold ``S`` tokens of a global sequence of ``nw * S``:

* contiguous: token ``i`` of rank ``r`` is at position ``r * S + i``;
* striped: token ``i`` of rank ``r`` is at position ``i * nw + r``.

Attention of a rank's queries runs over the keys of every rank: the kernels pass K/V around the ring (forward) or
Q/dY/LSE around it (backward) and merge the partial results with an online softmax. That schedule does not change
the math, so these references instead **all-gather K and V** along the group, put the keys in global position
order, and run the blockwise engine (:mod:`..attention.blockwise`) with a :class:`MaskRule` giving this rank's
queries their global positions (``q_base = rank * S`` or ``rank``, ``q_stride = 1`` or ``nw``). The backward
computes this rank's query gradients and every key's contribution from this rank's queries, then
``psum_scatter``s the key/value gradients back to their owners. Per-device memory on this reference path is
``O(nw * S)`` for the gathered K/V (the kernels keep ``O(S)``); the score matrix is never formed.

Causal masking is ``key_pos <= query_pos``. Sequence packing (striped only) bounds the *local* key index of every
rank alike: key ``j`` (of any rank) is visible to query ``i`` when ``bound_min[i] <= j < bound_max[i]``; in global
positions ``p = j * nw + s`` that is ``ceil(bound_min[i]) * nw <= p < ceil(bound_max[i]) * nw``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from .blockwise import attention_backward, attention_forward, log_sum_exp
from .masks import MaskRule


def gather_in_position_order(x, axes, striped: bool):
    """This rank's ``[bs, S, d]`` -> every rank's ``[bs, nw * S, d]``, index = global position."""
    gathered = lax.all_gather(x, axes, axis=1, tiled=False)  # [bs, nw, S, d]: rank-major
    if striped:
        gathered = jnp.swapaxes(gathered, 1, 2)  # [bs, S, nw, d]: position i * nw + r
    return gathered.reshape(x.shape[0], -1, x.shape[-1])


def scatter_from_position_order(x, axes, striped: bool, nw: int):
    """Inverse of :func:`gather_in_position_order` for gradients: ``[bs, nw * S, d]`` partial sums (one per rank)
    -> this rank's ``[bs, S, d]`` total."""
    bs, total, d = x.shape
    if striped:
        x = jnp.swapaxes(x.reshape(bs, total // nw, nw, d), 1, 2).reshape(bs, total, d)  # rank-major
    return lax.psum_scatter(x, axes, scatter_dimension=1, tiled=True)


def mask_rule(seq: int, nw: int, rank, *, causal: bool, striped: bool, bound_min=None, bound_max=None):
    """The visibility of the ``nw * S`` position-ordered keys to this rank's ``S`` queries (one batch row's bounds:
    ``[S]`` local-key-index bounds, or ``None``)."""
    to_positions = lambda b: None if b is None else jnp.ceil(b.astype(jnp.float32)) * nw  # noqa: E731
    return MaskRule(
        n_queries=seq,
        n_active=nw * seq,
        q_base=rank if striped else rank * seq,
        q_stride=nw if striped else 1,
        causal=causal,
        bound_min=to_positions(bound_min),
        bound_max=to_positions(bound_max),
    )


def _per_row(fn, bounds, *arrays):
    """``fn(*rows, bound_min_row, bound_max_row)`` over the batch rows when there are bounds, else one call on
    every row at once (``[bs, ...]`` arrays; the engine takes ``[H_kv = bs, G = 1, ...]``)."""
    if bounds is None:
        return fn(*arrays, None, None)
    return jax.vmap(lambda *row: fn(*(x[None] for x in row[:-2]), row[-2], row[-1]))(*arrays, *bounds)


def ring_forward(q, k, v, *, axes, nw: int, scale: float, causal: bool, striped: bool, bounds=None):
    """Attention of this rank's queries over the whole group's keys.

    ``q, k, v [bs, S, d]`` (this rank's tokens), ``bounds`` = ``(bound_min, bound_max)`` ``[bs, S]`` or ``None``.
    Returns ``(o [bs, S, d]`` in the accumulation dtype, ``lse [bs, S])``; rows that see no key have ``o = 0`` and
    ``lse = 0`` (the kernel zeroes the LSE of fully masked rows).
    """
    seq, rank = q.shape[1], lax.axis_index(axes)
    keys, values = gather_in_position_order(k, axes, striped), gather_in_position_order(v, axes, striped)

    def attend(q_rows, k_rows, v_rows, bound_min, bound_max):
        rule = mask_rule(seq, nw, rank, causal=causal, striped=striped, bound_min=bound_min, bound_max=bound_max)
        out, row_max, row_sum = attention_forward(q_rows[:, None], k_rows, v_rows, rule, scale)
        lse = jnp.where(row_sum == 0, 0.0, log_sum_exp(row_max, row_sum))  # NaN rows keep a NaN lse
        return out[:, 0], lse[:, 0]

    out, lse = _per_row(attend, bounds, q, keys, values)
    return (out[:, 0], lse[:, 0]) if bounds is not None else (out, lse)


def ring_backward(q, k, v, o, dy, lse, *, axes, nw: int, scale: float, causal: bool, striped: bool, bounds=None):
    """Gradients ``(dq, dk, dv)`` ``[bs, S, d]`` (accumulation dtype) of this rank's tokens, from every rank's
    queries: ``q, k, v, o, dy [bs, S, d]``, ``lse [bs, S]`` from the forward (FlashAttention-2 backward with
    ``D = rowsum(dy * o)``, ``P = exp(scale * q k^T - lse)`` over the visible keys)."""
    seq, rank = q.shape[1], lax.axis_index(axes)
    keys, values = gather_in_position_order(k, axes, striped), gather_in_position_order(v, axes, striped)

    def grads(q_rows, k_rows, v_rows, o_rows, dy_rows, lse_rows, bound_min, bound_max):
        rule = mask_rule(seq, nw, rank, causal=causal, striped=striped, bound_min=bound_min, bound_max=bound_max)
        dq, dk, dv, _ = attention_backward(
            q_rows[:, None], k_rows, v_rows, o_rows[:, None], dy_rows[:, None], lse_rows[:, None], rule, scale
        )
        return dq[:, 0], dk, dv

    dq, dk_all, dv_all = _per_row(grads, bounds, q, keys, values, o, dy, lse)
    if bounds is not None:
        dq, dk_all, dv_all = dq[:, 0], dk_all[:, 0], dv_all[:, 0]
    return (
        dq,
        scatter_from_position_order(dk_all, axes, striped, nw),
        scatter_from_position_order(dv_all, axes, striped, nw),
    )


def unpermute_striped(x, axes, nw: int):
    """Striped ``[bs, S, d]`` -> this rank's contiguous chunk ``[bs, S, d]`` (``S % nw == 0``).

    Rank ``r``'s output token ``j`` is global position ``r * S + j``, held by rank ``j % nw`` at local index
    ``r * S / nw + j // nw``: every rank sends its ``c = S / nw`` tokens ``[r * c, (r + 1) * c)`` to rank ``r``
    (one ``all_to_all``) and the received pieces interleave.
    """
    bs, seq, d = x.shape
    chunks = x.reshape(bs, nw, seq // nw, d)  # chunk r goes to rank r
    received = lax.all_to_all(chunks, axes, split_axis=1, concat_axis=1, tiled=True)  # [bs, nw (source), c, d]
    return jnp.swapaxes(received, 1, 2).reshape(bs, seq, d)
