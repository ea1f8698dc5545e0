"""``jax_nkilib.embedding_lookup``: rows of an embedding table for integer ids of any shape, through the ``gather``
kernel forward and the ``scatter_add`` kernel in reverse mode (see :mod:`jax_nkilib._src.indexing.gather_scatter`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument
from ..framework.config import current_lnc
from ..framework.runtime_checks import check_all
from ..framework.validation import check_operand_layouts
from ..indexing.gather_scatter import gather
from ..sharding import auto

WHERE = "jax_nkilib.embedding_lookup"

EMBEDDING_SHARDING = auto.register_rule(
    auto.ShardingRule(
        WHERE,
        free={**auto.LEADING, "d": "embedding"},
        note="the vocabulary axis of `table` is not shardable (gather it first or shard the embedding axis)",
    )
)


def _checked_ids(ids, vocab: int):
    """``ids`` as an integer array; concrete ids must lie in ``[0, vocab)`` (``ValueError`` naming the first bad)."""
    ids = array_argument(WHERE, "ids", ids, layout="[...]", dtypes=None)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise TypeError(f"{WHERE}: `ids` must have an integer dtype; got {ids.dtype}")
    if not isinstance(ids, jax.core.Tracer) and ids.size:
        values = np.asarray(ids)
        bad = (values < 0) | (values >= vocab)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"{WHERE}: ids{list(first)} = {values[first]} is outside [0, vocab={vocab}) (the vocabulary axis of "
                "`table`)"
            )
    return ids


def _row_indices(ids, vocab: int):
    """``ids`` flattened and clamped to ``[0, vocab - 1]`` in their own dtype, then as int32 (the kernel's index)."""
    info = jnp.iinfo(ids.dtype)
    flat = ids.reshape(-1)
    if info.max > vocab - 1:
        flat = jnp.minimum(flat, jnp.asarray(vocab - 1, ids.dtype))
    if info.min < 0:
        flat = jnp.maximum(flat, jnp.asarray(0, ids.dtype))
    return flat.astype(jnp.int32)


def embedding_lookup(table, ids):
    """``table[ids]``: the rows of ``table [vocab, dim]`` for integer ``ids`` of any shape, ``[*ids.shape, dim]``.

    Differentiable in ``table``: its cotangent is the scatter-add of the output cotangent's rows into zeros at
    ``ids`` (repeated ids accumulate); ``ids`` get none. The output has ``table``'s dtype (float32, bfloat16, float16
    or float64); the gradient is accumulated in it too, as the kernel does.

    Out-of-range ids: concrete ids (known at trace time) outside ``[0, vocab)`` raise ``ValueError``; traced ones are
    clamped to ``[0, vocab - 1]`` (a negative id reads row 0, it does not wrap), forward and backward alike, like
    ``jnp.take(..., mode="clip")``. ``jax_nkilib.config(runtime_checks=True)`` under ``checkify`` reports them.

    On Neuron it is one ``gather`` kernel call over the flattened ids (padded with row 0 to a multiple of the LNC
    degree, the padding's rows dropped) and its VJP one ``scatter_add`` (``unique_indices=False``). Under an explicit
    mesh the ids' axes and the table's embedding axis shard with no communication (the table's vocabulary axis may
    not be sharded); a table replicated over the axes that split the ids gets the sum of the shards' gradients.
    """
    dims = check_operand_layouts(WHERE, {"table": "vocab, dim"}, table=table)
    vocab, dim = dims["vocab"], dims["dim"]
    if vocab == 0:
        raise ValueError(f"{WHERE}: `table` must have at least one row; got shape {tuple(jnp.shape(table))}")
    ids = _checked_ids(ids, vocab)
    table = jnp.asarray(table)
    lead = auto.leading(ids.ndim, WHERE, "ids")
    sharded = auto.plan(
        EMBEDDING_SHARDING, [auto.ShardedArgument("table", table, "vd"), auto.ShardedArgument("ids", ids, lead)]
    )
    if sharded:
        return sharded.run(lambda table, ids, axes: embedding_lookup(table, ids), lead + "d")
    if ids.size == 0:
        return jnp.zeros((*ids.shape, dim), table.dtype)
    check_all((ids >= 0) & (ids < vocab), f"{WHERE}: ids[{{index}}] = {{}} is outside [0, vocab={vocab})", ids)
    index = _row_indices(ids, vocab)
    count = index.shape[0]
    padding = -count % current_lnc()  # the kernel splits the rows over the logical cores
    if padding:
        index = jnp.concatenate([index, jnp.zeros((padding,), jnp.int32)])
    (rows,) = gather.call({"input": table, "index": index}, gather.params())
    return rows[:count].reshape(*ids.shape, dim)
