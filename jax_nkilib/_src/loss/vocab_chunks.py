"""Vocabulary-chunked softmax statistics and gradients: the JAX math of the cross-entropy kernels' references.

The logits ``[N, V]`` are read in chunks of ``chunk`` columns (``lax.fori_loop``), so no float32 copy of the whole
logits, softmax or probabilities is ever materialised: only ``[N, chunk]`` working tiles and the ``[N, V]`` gradient
itself (in its output dtype). ``V`` need not be a multiple of ``chunk``: the last chunk starts at ``V - chunk``
(it overlaps the previous one) and its columns already seen are masked out of the running sums (the kernel instead
pads a short last chunk with ``-inf``; both count every column once).

Work dtype: ``float32``, or ``float64`` for ``float64`` logits (:func:`~..framework.spec.accumulation_dtype`).
16-bit logits and gradients travel through the loops as their bits (``uint16``): XLA:CPU otherwise widens a
loop-carried bfloat16 array to float32 as a whole, which is the very copy the chunking avoids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.compat import varying_like
from ..framework.spec import accumulation_dtype


def chunking(vocab: int, chunk_size: int) -> tuple[int, int]:
    """``(chunk, count)``: the chunk width actually used (at most ``vocab``) and the number of chunks."""
    chunk = max(1, min(chunk_size, vocab))
    return chunk, -(-vocab // chunk)


def _as_bits(x):
    """16-bit floats as their ``uint16`` bits (other dtypes unchanged)."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if np.dtype(x.dtype).itemsize == 2 else x


def _from_bits(x, dtype):
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != np.dtype(dtype) else x


def _chunk(bits, dtype, index, chunk: int, wide):
    """``(columns [chunk] int32, tile [N, chunk] in wide, fresh [chunk] bool)`` of chunk ``index`` of the logits
    (``bits``: see :func:`_as_bits`, of ``dtype``): ``fresh`` is false for the columns the clamped last chunk shares
    with the previous one."""
    vocab = bits.shape[1]
    start = jnp.minimum(index * chunk, vocab - chunk)
    tile = _from_bits(jax.lax.dynamic_slice_in_dim(bits, start, chunk, axis=1), dtype).astype(wide)
    columns = start + jnp.arange(chunk, dtype=jnp.int32)
    return columns, tile, columns >= index * chunk


def online_logsumexp(logits, chunk_size: int):
    """``lse [N]`` (work dtype) of ``logits [N, V]`` by the online algorithm over vocabulary chunks:
    ``m' = max(m, max(tile))``, ``d' = d exp(m - m') + sum(exp(tile - m'))``, ``lse = m + log(d)``."""
    wide = accumulation_dtype(logits.dtype)
    rows, vocab = logits.shape
    chunk, count = chunking(vocab, chunk_size)

    bits = _as_bits(logits)

    def step(index, state):
        m, d = state
        _, tile, fresh = _chunk(bits, logits.dtype, index, chunk, wide)
        tile = jnp.where(fresh[None, :], tile, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(tile, axis=1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0)  # rows of -inf so far stay at d = 0, not NaN
        d = d * jnp.exp(m - shift) + jnp.sum(jnp.exp(tile - shift[:, None]), axis=1)
        return m_new, d

    init = tuple(varying_like(x, logits) for x in (jnp.full((rows,), -jnp.inf, wide), jnp.zeros((rows,), wide)))
    m, d = jax.lax.fori_loop(0, count, step, init)
    return m + jnp.log(d)


def target_logits(logits, targets):
    """``logits[i, targets[i]]`` as ``[N]`` (work dtype)."""
    picked = jnp.take_along_axis(logits, targets.astype(jnp.int32)[:, None], axis=1, mode="clip")[:, 0]
    return picked.astype(accumulation_dtype(logits.dtype))


def chunked_softmax_gradient(logits, targets, lse, scale, chunk_size: int, out_dtype):
    """``scale * (exp(logits - lse[:, None]) - onehot(targets))`` as ``[N, V]`` in ``out_dtype``, written chunk by
    chunk (``scale``: a Python float or an ``[N]`` array of row scales)."""
    wide = accumulation_dtype(logits.dtype)
    rows, vocab = logits.shape
    chunk, count = chunking(vocab, chunk_size)
    lse = lse.astype(wide)[:, None]
    targets = targets.astype(jnp.int32)[:, None]
    scale = jnp.asarray(scale, wide)
    scale = scale[:, None] if scale.ndim else scale

    bits = _as_bits(logits)

    def step(index, grad):
        columns, tile, _ = _chunk(bits, logits.dtype, index, chunk, wide)
        onehot = (columns[None, :] == targets).astype(wide)
        tile_grad = _as_bits((scale * (jnp.exp(tile - lse) - onehot)).astype(out_dtype))
        start = jnp.minimum(index * chunk, vocab - chunk)  # the overlap is rewritten with the same values
        return jax.lax.dynamic_update_slice_in_dim(grad, tile_grad, start, axis=1)

    init = varying_like(_as_bits(jnp.zeros((rows, vocab), np.dtype(out_dtype))), logits, targets, lse, scale)
    return _from_bits(jax.lax.fori_loop(0, count, step, init), out_dtype)
