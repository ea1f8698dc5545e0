"""Ring attention: context-parallel attention inside ``jax.shard_map``, keys and values passed around a ring.

The sequence axis of ``q``, ``k``, ``v`` is split over ``n`` shards (mesh axis ``axis_name``) in one of the layouts
of ``layouts.py``. Shard ``r`` keeps its queries; at ring step ``t = 0 .. n-1`` it holds the keys and values of
shard ``s = (r - t) mod n`` (each step they move one shard forward with ``lax.ppermute``; the permute for step
``t + 1`` is issued before step ``t`` is computed, so communication can overlap compute) and runs the blockwise
online-softmax engine (``attention/blockwise.py``) on (its queries, those keys). Each step yields a partial
``(o_t, m_t, l_t)`` (output normalised over that step's keys, row max, row sum of ``exp(s - m_t)``); partials merge
with a stable log-sum-exp: ``m = max(m_a, m_b)``, ``l = l_a e^{m_a - m} + l_b e^{m_b - m}``,
``o = (o_a l_a e^{m_a - m} + o_b l_b e^{m_b - m}) / l``. The result is ``softmax(scale * q k^T + mask) v`` over the
whole global sequence, exactly what ``jax_nkilib.attention`` computes on the gathered sequence.

Masks. Non-causal: every step attends to all keys. Causal (``key_pos <= query_pos`` on global positions): step 0
is the shard's own keys, where positions rise with the local index, so it is the plain causal mask. For ``t >= 1``,
``s < r`` exactly when ``r >= t``, and the (query chunk, key chunk) structure is static per branch of a
``lax.cond`` on ``r >= t``; fully masked work is never computed:

* contiguous: ``s < r``: all keys visible (no mask); ``s > r``: nothing visible (skipped). Unbalanced: shard
  ``r`` does ``r`` full steps.
* striped (query ``i`` at ``i n + r``, key ``j`` at ``j n + s``): ``s < r``: ``j <= i``; ``s > r``: ``j < i``
  (a causal mask shifted by one). Every shard does a half-masked block per step; the engine skips masked blocks.
* zigzag (chunks ``r``, ``2n-1-r`` of length ``c = L/2``): ``s < r``: all queries see the first key chunk fully and
  never the second; ``s > r``: only the second query chunk sees keys, all of them. Either way ``L x c`` unmasked
  work per step on every shard.

Steps ``1 .. n-2`` run as one rolled loop (step 0 and the last step, which has no transfer after it, run outside
it), so one step's buffers are alive at a time and per-device memory stays ``O(L)``.

Reverse mode (``jax.custom_vjp``): the forward saves ``q, k, v``, the output and the row log-sum-exp
``lse = m + log l`` (residuals named ``"ring_attention.<name>"``). The backward is a ring too: ``dq``
accumulates locally; each step runs the engine's FlashAttention-2 backward with the global ``lse`` on the visiting
block. Each block's ``dk, dv`` accumulators start at home with its step-0 gradients and travel the whole ring
with the block, arriving home after the last step (``2 (n - 1)`` permutes of K and V, ``2 n`` of dK and dV; no
separate home copy is kept). The backward ring turns the other way (shard ``r`` holds block
``r + t`` at step ``t``): its transfers then differ from the forward's, so XLA cannot merge the two and keep every
forwarded K/V block alive from the forward until the backward. No collective other than ``ppermute`` is used.

Layouts: ``q [batch, L, heads, head_dim]``, ``k, v [batch, L, kv_heads, head_dim]`` per shard (``heads % kv_heads
== 0``: query head ``h`` uses kv head ``h // (heads / kv_heads)``), output like ``q``.

Dtypes (those of ``jax_nkilib.attention``): ``q``, ``k``, ``v`` share one floating dtype; scores, softmax statistics,
partial outputs, their merge and the travelling ``dk, dv`` accumulators are float32 (float64 for float64 inputs);
probabilities and score gradients are rounded to the input dtype before their matmuls; the output and the
gradients are in the inputs' dtype. Rows with no visible key give 0. NaN propagates as in ``jax_nkilib.attention``
(and ``jax.nn.dot_product_attention``): a NaN in a query row, in a key or value it sees, or from ``scale`` makes the
row (and its gradients) NaN, never 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..attention.blockwise import attention_backward, attention_forward, log_sum_exp, normalize
from ..attention.checks import check_qkv_layout
from ..attention.masks import MaskRule
from ..collectives.ring import shift
from ..framework import registry
from ..framework.checkpoint_policies import name_operands, name_outputs
from ..framework.compat import varying_like
from ..framework.mesh_axes import bound_axis, lax_axis
from ..framework.spec import accumulation_dtype
from ..framework.validation import static_float
from ..sharding import auto
from ..sharding.sequence_layouts import check_layout, check_local_length

_WHERE = "jax_nkilib.ring_attention"


@dataclasses.dataclass(frozen=True)
class _Ring:
    axis_names: tuple[str, ...]
    size: int
    causal: bool
    layout: str
    scale: float


@dataclasses.dataclass(frozen=True)
class _Piece:
    """Queries ``[q_start, q_stop)`` against keys ``[k_start, k_stop)`` (local indices) under a static rule:
    none, or causal with query index shifted by ``q_base`` (``key <= query + q_base``)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool = False
    q_base: int = 0

    def rule(self) -> MaskRule:
        return MaskRule(
            n_queries=self.q_stop - self.q_start,
            n_active=self.k_stop - self.k_start,
            causal=self.causal,
            q_base=self.q_base,
        )


def _plan(ring: _Ring, length: int, t: int) -> tuple:
    """What step ``t`` computes: ``(piece,)`` on every shard, or ``(piece when the visiting block comes from an
    earlier shard, piece otherwise)``; ``None`` is a step with nothing visible."""
    everything = _Piece(0, length, 0, length)
    if not ring.causal:
        return (everything,)
    if t == 0:
        return (_Piece(0, length, 0, length, causal=True),)
    if ring.layout == "contiguous":
        return everything, None
    if ring.layout == "striped":
        return _Piece(0, length, 0, length, causal=True), _Piece(0, length, 0, length, causal=True, q_base=-1)
    chunk = length // 2
    return _Piece(0, length, 0, chunk), _Piece(chunk, length, 0, length)


def _pad_rows(x, axis: int, before: int, after: int, value=0.0):
    if not before and not after:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (before, after)
    return jnp.pad(x, pad, constant_values=value)


def _forward_piece(piece, q, k, v, scale):
    """A step's partial ``(o, row_max, row_sum)`` over all local query rows (rows outside the piece are empty)."""
    acc, length = accumulation_dtype(q.dtype), q.shape[2]
    if piece is None:
        empty = (jnp.zeros(q.shape, acc), jnp.full(q.shape[:3], -jnp.inf, acc), jnp.zeros(q.shape[:3], acc))
        return tuple(varying_like(x, q, k, v) for x in empty)
    out, row_max, row_sum = attention_forward(
        q[:, :, piece.q_start : piece.q_stop],
        k[:, piece.k_start : piece.k_stop],
        v[:, piece.k_start : piece.k_stop],
        piece.rule(),
        scale,
    )
    before, after = piece.q_start, length - piece.q_stop
    return (
        _pad_rows(out, 2, before, after),
        _pad_rows(row_max, 2, before, after, -jnp.inf),
        _pad_rows(row_sum, 2, before, after),
    )


def _backward_piece(piece, q, k, v, out, dy, lse, scale):
    """A step's ``(dq, dk, dv)`` in the accumulation dtype, zero outside the piece."""
    acc = accumulation_dtype(q.dtype)
    if piece is None:
        zeros = (jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc))
        return tuple(varying_like(x, q, k, v, out, dy, lse) for x in zeros)
    rows, keys = slice(piece.q_start, piece.q_stop), slice(piece.k_start, piece.k_stop)
    dq, dk, dv, _ = attention_backward(
        q[:, :, rows], k[:, keys], v[:, keys], out[:, :, rows], dy[:, :, rows], lse[:, :, rows], piece.rule(), scale
    )
    q_pad, k_pad = (piece.q_start, q.shape[2] - piece.q_stop), (piece.k_start, k.shape[1] - piece.k_stop)
    return _pad_rows(dq, 2, *q_pad), _pad_rows(dk, 1, *k_pad), _pad_rows(dv, 1, *k_pad)


def _step(ring: _Ring, t, rank, compute, k, v, direction: int = 1):
    """``compute(piece, k, v)`` for step ``t``'s plan: directly, or under ``lax.cond`` on whether the visiting
    block comes from an earlier shard (``s < r``: ``r >= t`` when blocks move forward, ``s = r - t``; ``r >= n - t``
    when they move backward, ``s = r + t``)."""
    plan = _plan(ring, k.shape[1], 0 if isinstance(t, int) and t == 0 else 1)  # steps >= 1 share one plan
    if len(plan) == 1:
        return compute(plan[0], k, v)
    first, otherwise = plan
    earlier = rank >= (t if direction == 1 else ring.size - t)
    return lax.cond(earlier, functools.partial(compute, first), functools.partial(compute, otherwise), k, v)


def _shift(ring: _Ring, x, direction: int = 1):
    """``x`` of shard ``i`` to shard ``i + direction`` (mod n)."""
    return shift(x, ring.axis_names, ring.size, direction)


def _merge(state, part):
    """Combine ``(numerator, row_max, row_sum)`` with a step's ``(o, row_max, row_sum)`` (log-sum-exp stable)."""
    numerator, max_a, sum_a = state
    out_b, max_b, sum_b = part
    new_max = jnp.maximum(max_a, max_b)
    safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
    scale_a, scale_b = jnp.exp(max_a - safe_max), jnp.exp(max_b - safe_max)
    return (
        numerator * scale_a[..., None] + out_b * (sum_b * scale_b)[..., None],
        new_max,
        sum_a * scale_a + sum_b * scale_b,
    )


def _ring_steps(ring: _Ring, step, carry, blocks, shifted):
    """Run ring steps ``1 .. n-1``: ``step(t, blocks, carry) -> carry`` on the visiting ``blocks``, which
    ``shifted(blocks)`` passes on. Steps ``1 .. n-2`` are one rolled loop that issues the next transfer before its
    compute (a rolled loop keeps one step's buffers alive, not ``n``); the last step, with no transfer after it,
    runs after the loop."""
    if ring.size == 1:
        return carry

    def body(t, state):
        blocks, carry = state
        following = shifted(blocks)
        return following, step(t, blocks, carry)

    blocks, carry = lax.fori_loop(1, ring.size - 1, body, (blocks, carry))
    return step(ring.size - 1, blocks, carry)


def _ring_forward(ring: _Ring, q, k, v):
    """Engine layouts ``q [H_kv, G, L, d]``, ``k, v [H_kv, L, d]`` -> ``(out in q.dtype, lse [H_kv, G, L])``."""
    rank = lax.axis_index(lax_axis(ring.axis_names))
    compute = lambda piece, k_block, v_block: _forward_piece(piece, q, k_block, v_block, ring.scale)  # noqa: E731
    shifted = lambda blocks: tuple(_shift(ring, x) for x in blocks)  # noqa: E731
    following = shifted((k, v)) if ring.size > 1 else None  # issued before step 0's compute
    out, row_max, row_sum = _step(ring, 0, rank, compute, k, v)
    state = (out * row_sum[..., None], row_max, row_sum)

    def step(t, blocks, state):
        return _merge(state, _step(ring, t, rank, compute, *blocks))

    numerator, row_max, row_sum = _ring_steps(ring, step, state, following, shifted)
    return normalize(numerator, row_sum).astype(q.dtype), log_sum_exp(row_max, row_sum)


def _ring_backward(ring: _Ring, residuals, dy):
    q, k, v, out, lse = residuals
    rank = lax.axis_index(lax_axis(ring.axis_names))
    dy = dy.astype(q.dtype)
    compute = lambda piece, k_block, v_block: _backward_piece(  # noqa: E731
        piece, q, k_block, v_block, out, dy, lse, ring.scale
    )
    shifted = lambda blocks: tuple(_shift(ring, x, -1) for x in blocks)  # noqa: E731
    following = shifted((k, v)) if ring.size > 1 else None
    dq, dk_acc, dv_acc = _step(ring, 0, rank, compute, k, v, direction=-1)

    def step(t, blocks, state):
        dq, dk_acc, dv_acc = state
        dq_t, dk_t, dv_t = _step(ring, t, rank, compute, *blocks, direction=-1)
        # the visiting block's accumulators move on with it (after the last step: back to their owner)
        return dq + dq_t, _shift(ring, dk_acc + dk_t, -1), _shift(ring, dv_acc + dv_t, -1)

    # a block's accumulators start at home with its own step-0 gradients and travel the whole ring with it
    moving = (_shift(ring, dk_acc, -1), _shift(ring, dv_acc, -1)) if ring.size > 1 else (dk_acc, dv_acc)
    dq, dk, dv = _ring_steps(ring, step, (dq, *moving), following, shifted)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring_attention(ring: _Ring, q, k, v):
    return _ring_forward(ring, q, k, v)[0]


_NAME, _OPERANDS = "ring_attention", ("q", "k", "v")
registry.register_checkpointed(_NAME, _OPERANDS)


def _ring_attention_fwd(ring: _Ring, q, k, v):
    q, k, v = name_operands(_NAME, dict(zip(_OPERANDS, (q, k, v)))).values()
    out, lse = _ring_forward(ring, q, k, v)
    out, lse = name_outputs(_NAME, {"out": out, "lse": lse}, _OPERANDS)
    return out, (q, k, v, out, lse)


_ring_attention.defvjp(_ring_attention_fwd, _ring_backward)


def _check(q, k, v, causal, layout, scale) -> float | None:
    """Validate the arguments; returns ``scale`` as a Python float (or ``None``)."""
    check_qkv_layout(_WHERE, q, k, v, same_seq=True, kind="a per-shard array")  # self-attention, one sharded seq
    if not isinstance(causal, bool):
        raise TypeError(f"{_WHERE}: `causal` must be a bool; got {causal!r}")
    check_layout(layout, _WHERE)
    check_local_length(layout, q.shape[1], _WHERE)
    return None if scale is None else static_float(_WHERE, "scale", scale)


auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.ring_attention",
        free={},
        collective={
            "s": (
                "sequence",
                "inside jax.shard_map, over axis_name: K/V blocks travel a ppermute ring, "
                "partials merge by log-sum-exp; the backward is a ring too",
            )
        },
        note="a shard_map building block (zigzag, striped or contiguous layout); jax_nkilib.attention selects it for "
        "a sharded sequence",
    )
)


def ring_attention(q, k, v, *, axis_name, causal: bool = True, layout: str = "zigzag", scale: float | None = None):
    """Attention over a sequence sharded along mesh axis ``axis_name``; call inside ``jax.shard_map``.

    Args:
      q: this shard's queries ``[batch, L, heads, head_dim]``.
      k, v: this shard's keys and values ``[batch, L, kv_heads, head_dim]`` (``heads % kv_heads == 0``).
      axis_name: the mesh axis (a name, or a tuple of names, flattened in order) the sequence is split over.
      causal: query at global position ``p`` sees keys at positions ``<= p``.
      layout: ``"zigzag"`` (default), ``"striped"`` or ``"contiguous"``: which global positions a shard's tokens
        have (see ``layouts.py``; ``to_ring_layout`` prepares a global array for it). Zigzag needs an even ``L``.
      scale: defaults to ``1/sqrt(head_dim)``; static (a finite Python real, checked while tracing).

    Returns this shard's output ``[batch, L, heads, head_dim]`` in ``q``'s dtype: gathered and put back in global
    order it equals ``jax_nkilib.attention(q, k, v, causal=causal, scale=scale)`` on the global sequence.
    Differentiable (a ring backward); the forward uses ``2 (n - 1)`` collective permutes and nothing else.
    """
    names, size = bound_axis(_WHERE, axis_name, " (the sequence axis split over it)")
    scale = _check(q, k, v, causal, layout, scale)
    batch, length, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    ring = _Ring(names, size, causal, layout, scale)
    groups = heads // kv_heads
    # engine layouts: batch folded into the kv-head axis
    q_engine = jnp.transpose(q.reshape(batch, length, kv_heads, groups, head_dim), (0, 2, 3, 1, 4))
    q_engine = q_engine.reshape(batch * kv_heads, groups, length, head_dim)
    k_engine, v_engine = (jnp.transpose(x, (0, 2, 1, 3)).reshape(batch * kv_heads, length, head_dim) for x in (k, v))
    out = _ring_attention(ring, q_engine, k_engine, v_engine)
    out = jnp.transpose(out.reshape(batch, kv_heads, groups, length, head_dim), (0, 3, 1, 2, 4))
    return out.reshape(batch, length, heads, head_dim)
