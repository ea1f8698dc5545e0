"""Memory-efficient attention in JAX: online-softmax forward and the matching backward, block by block.

No ``[Sq, Sk]`` score matrix is ever formed: queries and keys are processed in blocks (one ``fori_loop`` over the
(query block, key block) pairs, slicing the inputs in place and accumulating results with in-place updates), so
the working memory is ``O(block_q * block_k)`` per (kv-head, group) plus the outputs. Pairs that the causal rule
or a left or right window hides entirely are skipped when known at trace time (no runtime offsets or lengths);
packing bounds, segment ids and dense masks only narrow those, and never skip a pair.

Layouts (the engine's own, batchless: batch by ``vmap``): ``q [H_kv, G, Sq, d]`` (``G`` query heads share each KV
head: grouped-query attention), ``k, v [H_kv, Sk, d]`` (the rule's prior slots first, then its active keys);
``sink`` ``[H_kv, G, n_sinks]`` holds extra softmax logits per row (unscaled). ``bias`` (floating) and ``mask``
(boolean) broadcast to ``[H_kv, G, Sq, Sk]`` with every dim 1 or full (a lower rank gains leading 1s); they are sliced
block by block like ``q`` and ``k``, never broadcast to the full shape.

Logits, in this order: ``u = scale * q k^T``; with a soft cap ``c`` (static, > 0), ``u = c * tanh(u / c)``; then
``s = u + bias``; then ``s = -inf`` where the rule (:class:`~.masks.MaskRule`: causal, windows, packing bounds,
segment ids, prefix slots) or ``mask`` (False) forbids. ``o = softmax(s) v``, the sinks joining every row's softmax.
The backward's ``dS = P * (dP - D)`` is the gradient of ``s`` (hence of ``bias``: ``dbias`` is ``dS`` summed over
the bias's broadcast dims, 0 where masked); ``q`` and ``k`` receive ``dS * (1 - tanh^2(scale q k^T / c)) * scale``.

Precision (the NKI kernels'): scores, soft cap, bias, softmax statistics and accumulations are float32 (float64 for
float64 inputs), and so are the results (``o``, ``dq``, ``dk``, ``dv``, ``dsink``, ``dbias``); probabilities and
score gradients are rounded to the input dtype before their matmuls.

Rows with no allowed key (and no sink) have output 0, row max ``-inf`` and row sum 0, so ``lse = +inf`` and their
gradients are 0: never NaN.

NaN contract (that of ``jax.nn.dot_product_attention``): a NaN in a query row, in a key or value the row attends to
or in the row's sink (or an inf there that makes one of its scores NaN or ``+inf``) makes that row's output NaN, and
its gradients NaN; it is never turned into zeros. An empty row is recognised by its row sum being exactly 0 (a NaN
row sum is not), so this costs no extra pass over the scores. The row sums carry the NaN: XLA's vectorised max
reductions on CPU need not propagate NaN, so a NaN row's ``row_max`` may be ``-inf``. Keys the mask rule declares
invalid for every query (prior slots past a runtime prefix length: :meth:`MaskRule.key_valid`) have their keys and
values zeroed before use, so stale memory there cannot reach a result through ``0 * NaN``; a NaN in the value of a
valid key that only the causal or window mask hides from a row can still reach that row through ``0 * NaN`` in the
``P v`` product, as in ``jax.nn.dot_product_attention`` (which propagates it to every row).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..framework.compat import varying_like
from ..framework.spec import accumulation_dtype
from .masks import MaskRule

DEFAULT_BLOCK_Q = 512
DEFAULT_BLOCK_K = 512


def _pad_to(x, axis: int, block: int):
    """Pad ``axis`` with zeros to a multiple of ``block`` (no copy when it already is one)."""
    size = x.shape[axis]
    extra = -size % block
    if not extra:
        return x
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, extra)
    return jnp.pad(x, pad)


def _block_sizes(rule: MaskRule, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    return min(block_q or DEFAULT_BLOCK_Q, rule.n_queries), min(block_k or DEFAULT_BLOCK_K, rule.n_keys)


def _matmul(spec: str, a, b, acc):
    """``einsum`` of two input-dtype operands accumulated in ``acc``.

    Products of two bfloat16/float16 values are exact in float32, so casting before the contraction gives the same
    result as a low-precision matmul with float32 accumulation (which XLA:CPU does not support for every shape).
    """
    return jnp.einsum(spec, a.astype(acc), b.astype(acc))


def _scores(q_block, k_block, scale, acc):
    """``scale * q k^T`` in the accumulation dtype: [H_kv, G, bq, bk]."""
    return _matmul("hgqd,hkd->hgqk", q_block, k_block, acc) * scale


def _block(x, index, block: int, axis: int):
    return lax.dynamic_slice_in_dim(x, index * block, block, axis=axis)


def _put(x, update, index, block: int, axis: int):
    return lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), index * block, axis=axis)


def _dense_operand(x, name: str, shape: tuple, bq: int, bk: int):
    """``bias`` or ``mask`` as a rank-4 array whose every dim is 1 (broadcast) or that of ``shape``
    ``[H_kv, G, Sq, Sk]``, its full query and key dims padded (zeros: ``False`` for a mask) like ``q`` and ``k``."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if name == "mask" and x.dtype != jnp.bool_:
        raise TypeError(f"attention mask must be boolean, got {x.dtype}")
    if name == "bias" and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"attention bias must be floating-point, got {x.dtype}")
    if x.ndim > 4 or any(size not in (1, full) for size, full in zip(x.shape[::-1], shape[::-1])):
        raise ValueError(
            f"attention {name} of shape {list(x.shape)} must broadcast to [H_kv, G, Sq, Sk] = {list(shape)} "
            "with every dim 1 or full"
        )
    x = x.reshape((1,) * (4 - x.ndim) + x.shape)
    if x.shape[2] != 1:
        x = _pad_to(x, 2, bq)
    return _pad_to(x, 3, bk) if x.shape[3] != 1 else x


def _tile_starts(x, i, j, bq: int, bk: int) -> tuple:
    """Where block ``(i, j)`` of a dense operand starts (a size-1, broadcast dim always at 0)."""
    starts = 0, 0, (i * bq if x.shape[2] != 1 else 0), (j * bk if x.shape[3] != 1 else 0)
    return tuple(jnp.asarray(start, jnp.int32) for start in starts)


def _tile(x, i, j, bq: int, bk: int):
    """Block ``(i, j)`` of a dense operand: ``[H_kv or 1, G or 1, bq or 1, bk or 1]`` (broadcast dims stay 1)."""
    if x is None:
        return None
    size = x.shape[:2] + (bq if x.shape[2] != 1 else 1, bk if x.shape[3] != 1 else 1)
    return lax.dynamic_slice(x, _tile_starts(x, i, j, bq, bk), size)


def _logits(q_block, k_block, scale, acc, soft_cap, bias_tile):
    """The logits of a block pair before masking, ``soft_cap * tanh(scale q k^T / soft_cap) + bias``, and the
    ``tanh`` (``None`` without a soft cap) whose ``1 - tanh^2`` the backward needs."""
    s = _scores(q_block, k_block, scale, acc)
    capped = None
    if soft_cap is not None:
        capped = jnp.tanh(s / soft_cap)
        s = soft_cap * capped
    if bias_tile is not None:
        s = s + bias_tile.astype(acc)
    return s, capped


def _allowed(rule: MaskRule, i, j, bq: int, bk: int, mask):
    """Booleans ``[.., bq, bk]``: the rule's entries of block pair ``(i, j)``, and the dense mask's block."""
    allowed = rule.allowed(i * bq + jnp.arange(bq), j * bk + jnp.arange(bk))
    return allowed if mask is None else allowed & _tile(mask, i, j, bq, bk)


def _check_soft_cap(soft_cap):
    if soft_cap is not None and not soft_cap > 0:
        raise ValueError(f"soft_cap must be a positive number or None, got {soft_cap!r}")


def attention_forward(
    q, k, v, rule: MaskRule, scale: float, sink=None, *, bias=None, mask=None, soft_cap=None, block_q=None, block_k=None
):
    """Returns ``(o, row_max, row_sum)``: ``o [H_kv, G, Sq, d]`` in the accumulation dtype, statistics
    ``[H_kv, G, Sq]`` over the allowed keys and the sinks (``row_max`` is ``-inf`` for empty rows).

    ``bias`` (floating) and ``mask`` (boolean) broadcast to ``[H_kv, G, Sq, Sk]`` (``Sk`` counting the prior slots
    first) with every dim 1 or full; the logits are ``soft_cap * tanh(scale q k^T / soft_cap)`` (or
    ``scale q k^T``) plus ``bias``, then masked (``mask`` False or the rule forbids: not attended)."""
    _check_soft_cap(soft_cap)
    acc = accumulation_dtype(q.dtype)
    bq, bk = _block_sizes(rule, block_q, block_k)
    n_kv, groups, seq_q, d = q.shape
    bias, mask = (
        _dense_operand(x, name, (n_kv, groups, seq_q, k.shape[1]), bq, bk)
        for x, name in ((bias, "bias"), (mask, "mask"))
    )
    q, k, v = _pad_to(q, 2, bq), _pad_to(k, 1, bk), _pad_to(v, 1, bk)
    q_blocks, k_blocks, starts_row = block_pairs(rule, q.shape[2] // bq, k.shape[1] // bk, bq, bk, by="query")
    dense = tuple(x for x in (bias, mask) if x is not None)
    runtime = rule.runtime_values()

    def one_pair(t, carry):
        out_all, max_all, sum_all, row_max, row_sum, out = carry
        i, j = q_blocks[t], k_blocks[t]
        fresh = starts_row[t]  # the first key block of a query block: start its running statistics anew
        row_max = jnp.where(fresh, -jnp.inf, row_max)
        row_sum, out = jnp.where(fresh, 0.0, row_sum), jnp.where(fresh, 0.0, out)
        q_block = _block(q, i, bq, 2)
        k_block, v_block = (_only_valid_keys(rule, j, bk, _block(x, j, bk, 1)) for x in (k, v))
        logits = _logits(q_block, k_block, scale, acc, soft_cap, _tile(bias, i, j, bq, bk))[0]
        s = jnp.where(_allowed(rule, i, j, bq, bk, mask), logits, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.exp(s - safe_max[..., None])
        correction = jnp.exp(row_max - safe_max)
        row_sum = row_sum * correction + p.sum(-1)
        out = out * correction[..., None] + _matmul("hgqk,hkd->hgqd", p.astype(v.dtype), v_block, acc)
        # written at every step; the last key block of a query block leaves the final values
        return (
            _put(out_all, out, i, bq, 2),
            _put(max_all, new_max, i, bq, 2),
            _put(sum_all, row_sum, i, bq, 2),
            new_max,
            row_sum,
            out,
        )

    init = (
        jnp.zeros(q.shape, acc),
        jnp.full(q.shape[:3], -jnp.inf, acc),
        jnp.zeros(q.shape[:3], acc),
        jnp.full((n_kv, groups, bq), -jnp.inf, acc),
        jnp.zeros((n_kv, groups, bq), acc),
        jnp.zeros((n_kv, groups, bq, d), acc),
    )
    init = tuple(varying_like(x, q, k, v, *dense, *runtime) for x in init)
    out, row_max, row_sum = (
        lax.slice_in_dim(x, 0, seq_q, axis=2) for x in lax.fori_loop(0, len(q_blocks), one_pair, init)[:3]
    )
    if sink is not None:
        sink = sink.astype(acc)[:, :, None, :]  # the same logits for every row
        new_max = jnp.maximum(row_max, sink.max(-1))
        correction = jnp.exp(row_max - new_max)
        row_sum = row_sum * correction + jnp.exp(sink - new_max[..., None]).sum(-1)
        out, row_max = out * correction[..., None], new_max
    return normalize(out, row_sum), row_max, row_sum


def normalize(out, row_sum):
    """``out / row_sum`` per row; 0 for empty rows (row sum exactly 0). A NaN row sum gives NaN: never zeroed."""
    empty = row_sum == 0
    return jnp.where(empty[..., None], 0.0, out / jnp.where(empty, 1.0, row_sum)[..., None])


def log_sum_exp(row_max, row_sum):
    """``log(sum(exp(scores)))`` per row from the forward statistics (``+inf`` for empty rows, NaN for NaN rows)."""
    empty = row_sum == 0
    return jnp.where(empty, jnp.inf, row_max + jnp.log(jnp.where(empty, 1.0, row_sum)))


def _only_valid_keys(rule: MaskRule, j, bk: int, x):
    """Key block ``j`` of ``x [H_kv, bk, d]`` with the rows of keys that are invalid for every query zeroed (stale
    prefix slots: their garbage must not meet a zero probability as ``0 * NaN``). An ``O(bk d)`` select."""
    valid = rule.key_valid(j * bk + jnp.arange(bk))
    return x if valid is None else jnp.where(valid[:, None], x, jnp.zeros((), x.dtype))


def attention_backward(
    q,
    k,
    v,
    o,
    dy,
    lse,
    rule: MaskRule,
    scale: float,
    sink=None,
    *,
    bias=None,
    mask=None,
    soft_cap=None,
    return_dbias: bool = False,
    block_q=None,
    block_k=None,
):
    """Gradients ``(dq, dk, dv, dsink)`` in the accumulation dtype from the forward output ``o`` and its row
    log-sum-exp ``lse [H_kv, G, Sq]`` (FlashAttention-2: ``D = rowsum(dy * o)``, ``dS = P * (dP - D)``).

    ``bias``, ``mask`` and ``soft_cap`` must be those of the forward. With ``return_dbias`` the result is
    ``(dq, dk, dv, dsink, dbias)``: ``dbias`` (``None`` without a bias) has the bias's own shape and the
    accumulation dtype, ``dS`` (0 where masked) summed over the bias's broadcast dims. A soft cap scales the score
    gradient that reaches ``q`` and ``k`` by ``1 - tanh^2``."""
    _check_soft_cap(soft_cap)
    acc = accumulation_dtype(q.dtype)
    bq, bk = _block_sizes(rule, block_q, block_k)
    seq_q, seq_k = q.shape[2], k.shape[1]
    bias_shape = None if bias is None else jnp.shape(bias)
    bias, mask = (
        _dense_operand(x, name, q.shape[:3] + (seq_k,), bq, bk) for x, name in ((bias, "bias"), (mask, "mask"))
    )
    delta = jnp.sum(dy.astype(acc) * o.astype(acc), axis=-1)
    q, dy, lse_p, delta_p = (_pad_to(x, 2, bq) for x in (q, dy, lse.astype(acc), delta))
    k, v = _pad_to(k, 1, bk), _pad_to(v, 1, bk)
    q_blocks, k_blocks, starts_column = block_pairs(rule, q.shape[2] // bq, k.shape[1] // bk, bq, bk, by="key")
    dense = tuple(x for x in (bias, mask) if x is not None)
    inputs = (q, k, v, o, dy, lse, *dense, *rule.runtime_values())

    def one_pair(t, carry):
        dq, dk, dv, dk_block, dv_block, dbias = carry
        i, j = q_blocks[t], k_blocks[t]
        fresh = starts_column[t]  # the first query block of a key block: start its accumulators anew
        dk_block, dv_block = jnp.where(fresh, 0.0, dk_block), jnp.where(fresh, 0.0, dv_block)
        q_block, dy_block = _block(q, i, bq, 2), _block(dy, i, bq, 2)
        lse_block, delta_block = _block(lse_p, i, bq, 2), _block(delta_p, i, bq, 2)
        k_block, v_block = (_only_valid_keys(rule, j, bk, _block(x, j, bk, 1)) for x in (k, v))
        logits, capped = _logits(q_block, k_block, scale, acc, soft_cap, _tile(bias, i, j, bq, bk))
        allowed = _allowed(rule, i, j, bq, bk, mask)
        p = jnp.where(allowed, jnp.exp(logits - lse_block[..., None]), 0.0)
        dv_block = dv_block + _matmul("hgqk,hgqd->hkd", p.astype(dy.dtype), dy_block, acc)
        dp = _matmul("hgqd,hkd->hgqk", dy_block, v_block, acc)
        ds = p * (dp - delta_block[..., None])  # the gradient of the logits
        if bias is not None:  # exactly 0 where masked, as a select's gradient is (even in a NaN row)
            dbias = _add_tile(dbias, jnp.where(allowed, ds, 0.0), i, j, bq, bk)
        if capped is not None:
            ds = ds * (1.0 - capped * capped)
        ds = ds.astype(q.dtype)
        dq_block = _matmul("hgqk,hkd->hgqd", ds, k_block, acc) * scale
        dk_block = dk_block + _matmul("hgqk,hgqd->hkd", ds, q_block, acc) * scale
        # written at every step; the last query block of a key block leaves the final values
        return (
            _put(dq, _block(dq, i, bq, 2) + dq_block, i, bq, 2),
            _put(dk, dk_block, j, bk, 1),
            _put(dv, dv_block, j, bk, 1),
            dk_block,
            dv_block,
            dbias,
        )

    block_zeros = jnp.zeros((k.shape[0], bk, k.shape[2]), acc)
    dbias = jnp.zeros(() if bias is None else bias.shape, acc)  # a placeholder without a bias
    init = (jnp.zeros(q.shape, acc), jnp.zeros(k.shape, acc), jnp.zeros(v.shape, acc), block_zeros, block_zeros, dbias)
    init = tuple(varying_like(x, *inputs) for x in init)
    dq, dk, dv, _, _, dbias = lax.fori_loop(0, len(q_blocks), one_pair, init)
    dq, dk, dv = (
        lax.slice_in_dim(dq, 0, seq_q, axis=2),
        lax.slice_in_dim(dk, 0, seq_k, axis=1),
        lax.slice_in_dim(dv, 0, seq_k, axis=1),
    )
    dsink = None
    if sink is not None:
        p_sink = jnp.exp(sink.astype(acc)[:, :, None, :] - lse.astype(acc)[..., None])  # [H_kv, G, Sq, n_sinks]
        dsink = -jnp.sum(p_sink * delta[..., None], axis=2)
    if not return_dbias:
        return dq, dk, dv, dsink
    if bias is None:
        return dq, dk, dv, dsink, None
    dbias = dbias[:, :, : min(bias.shape[2], seq_q), : min(bias.shape[3], seq_k)]  # without the padding
    return dq, dk, dv, dsink, dbias.reshape(bias_shape)


def _add_tile(x, update, i, j, bq: int, bk: int):
    """``x`` plus ``update [H_kv, G, bq, bk]``, summed over ``x``'s broadcast (size-1) dims, at block ``(i, j)``."""
    update = update.sum(tuple(axis for axis in range(4) if x.shape[axis] == 1), keepdims=True)
    starts = _tile_starts(x, i, j, bq, bk)
    return lax.dynamic_update_slice(x, lax.dynamic_slice(x, starts, update.shape) + update, starts)


def block_pairs(rule: MaskRule, n_q_blocks: int, n_k_blocks: int, bq: int, bk: int, *, by: str):
    """The (query block, key block) pairs that can hold an allowed entry, as int32 arrays ``(i, j, starts)``.

    Pairs are ordered by query block (``by="query"``) or key block (``by="key"``); ``starts`` flags the first pair
    of each group. Fully masked pairs are skipped when the mask is known at trace time (causal, left and right
    windows without runtime offsets or lengths); otherwise every pair is visited.
    """
    pairs = [
        (i, j)
        for i in range(n_q_blocks)
        for j in range(n_k_blocks)
        if rule.block_may_attend(
            i * bq, min((i + 1) * bq, rule.n_queries) - 1, j * bk, min((j + 1) * bk, rule.n_keys) - 1
        )
    ]
    if not pairs:  # nothing is visible: one pair keeps the loop well-formed (its entries are all masked)
        pairs = [(0, 0)]
    if by == "key":
        pairs.sort(key=lambda pair: (pair[1], pair[0]))
    group = 0 if by == "query" else 1
    starts = [t == 0 or pairs[t][group] != pairs[t - 1][group] for t in range(len(pairs))]
    as_array = lambda values: jnp.asarray(np.asarray(values, np.int32))  # noqa: E731
    return as_array([i for i, _ in pairs]), as_array([j for _, j in pairs]), jnp.asarray(np.asarray(starts))


def group_queries(x, n_kv: int):
    """``[B, S, d]`` with ``B = n_kv * G`` (kv index ``b // G``) to the engine's ``[n_kv, G, S, d]``."""
    return x.reshape((n_kv, x.shape[0] // n_kv) + x.shape[1:])


def ungroup_queries(x):
    return x.reshape((math.prod(x.shape[:2]),) + x.shape[2:])
