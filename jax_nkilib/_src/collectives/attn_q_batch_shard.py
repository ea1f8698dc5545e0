"""``attn_q_batch_shard`` (catalog row 62, ``experimental/collectives/batch_shard.py``, docs-only): the Q projection's
move from tensor parallel to tensor + data parallel for batch-sharded attention (e.g. TP64 -> TP8DP8), inside
``jax.shard_map``.

Each rank of a group of ``G = gqa_group_size`` ranks (``replica_group``, mesh axis names) holds ``n`` query heads of
all ``B`` batches and ends with the ``G * n`` heads of the group for ``B / G`` batches:

* ``layout="NBSd"``: ``input [n, B, S, d]`` -> ``[G * n, B / G, S, d]``;
* ``layout="dBnS"`` (``n = 1``): ``input [d, B, 1, S]`` -> ``[G, d, B / G, S]`` (the gathered ranks become the head
  axis).

Semantics: ``gathered = all_gather(input)`` along dim 0 in group order, viewed as ``[G, dim0, B, ...]``; the output
is batches ``[o, o + B / G)`` of it, where ``o = iota_workers[0, rank]``: ``rank`` is ``rank_id_in[0, 0]`` when
given, else this device's global rank (its position in the mesh's flattened device order, ``ncc.rank_id()``; this
needs ``jax.shard_map`` over every mesh axis). ``iota_workers [1, R] int32`` is the kernel's rank -> batch-offset
table, ``(r % G) * (B / G)`` in the kernel's tests; offsets are clamped into ``[0, B - B / G]`` (out-of-range DMA is
undefined on the device).

``gathered_buf`` is the kernel's HBM workspace (``[G, n, B, S, d]`` / ``[G, d, B, 1, S]``, it must be a kernel
input on the device): optional here, a zero buffer is passed when it is omitted; its values never matter. The
output has the input's dtype. The kernel's ``layout`` flag is the ``AttnQBatchShardLayout`` enum (members or names);
the spec stores it as ``q_layout`` (both names are accepted).

Autodiff: JAX differentiates the reference (the all-gather transposes to a reduce-scatter over the group);
``iota_workers``, ``rank_id_in`` and ``gathered_buf`` get no gradient.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
from jax import lax

from ..framework.mesh_axes import bound_axis_size, lax_axis
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param, enum_member
from .hbm_collectives import global_rank, marking_varying, mesh_axes, require_replica_group


class AttnQBatchShardLayout(enum.Enum):
    """``NBSd``: ``[n_heads, B, S, d]``; ``dBnS``: ``[d, B, n_heads, S]`` (``n_heads = 1``)."""

    NBSd = 0
    dBnS = 1


def _layout_name(value: Any, where: str) -> str:
    """The ``AttnQBatchShardLayout`` flag (a member or a member's name) as the member's name, which the device
    adapter turns into the library's own enum."""
    return enum_member(AttnQBatchShardLayout, value, where).name


def reference_attn_q_batch_shard(
    input, iota_workers, gathered_buf=None, rank_id_in=None, *, gqa_group_size, replica_group, q_layout
):
    """JAX reference (inside ``shard_map``); see the module docstring."""
    del gathered_buf  # workspace only
    groups, per_rank = gqa_group_size, input.shape[1] // gqa_group_size
    gathered = lax.all_gather(input, lax_axis(replica_group), axis=0, tiled=True)
    grouped = gathered.reshape(groups, input.shape[0], *input.shape[1:])  # [G, dim0, B, ...]
    rank = global_rank("attn_q_batch_shard") if rank_id_in is None else rank_id_in[0, 0]
    offset = lax.dynamic_index_in_dim(iota_workers[0], rank, keepdims=False)
    rows = lax.dynamic_slice_in_dim(grouped, offset, per_rank, axis=2)
    if q_layout == "NBSd":
        return (rows.reshape(groups * input.shape[0], per_rank, *input.shape[2:]),)
    return (rows.reshape(groups, input.shape[0], per_rank, input.shape[3]),)


def _check(call: CallInfo) -> None:
    p, dims, function = call.params, call.dims, call.function
    groups = p["gqa_group_size"]
    if groups is None or groups <= 0:
        raise ValueError(f"{function}: `gqa_group_size` is required and must be positive; got {groups!r}")
    size = bound_axis_size(require_replica_group(function, p))
    if size is not None and size != groups:
        raise ValueError(
            f"{function}: gqa_group_size={groups} but the replica group {p['replica_group']} has {size} ranks"
        )
    if p["q_layout"] == "dBnS" and dims["n"] != 1:
        raise ValueError(f"{function}: layout dBnS needs one head per rank (input [d, B, 1, S]); got n={dims['n']}")
    if dims["B"] % groups:
        raise ValueError(f"{function}: the batch B={dims['B']} must split over gqa_group_size={groups} ranks")
    if call.avals.get("gathered_buf") is not None and dims["G"] != groups:
        raise ValueError(f"{function}: gathered_buf's dim 0 ({dims['G']}) must be gqa_group_size={groups}")
    if call.avals.get("gathered_buf") is not None and call.avals["gathered_buf"].dtype != call.avals["input"].dtype:
        raise TypeError(
            f"{function}: gathered_buf must have the input's dtype {call.avals['input'].dtype}; got "
            f"{call.avals['gathered_buf'].dtype}"
        )
    if call.avals.get("rank_id_in") is None:
        ranks = bound_axis_size(mesh_axes(function))
        if dims["R"] < ranks:
            raise ValueError(
                f"{function}: iota_workers [1, R] needs an entry for each of the {ranks} ranks of the "
                f"mesh (the kernel indexes it by ncc.rank_id()); got R={dims['R']}"
            )


def _communicating_axes(function: str, params: Mapping, operands: Mapping) -> tuple[str, ...]:
    """The group's axes, or every mesh axis when the rank is the global device position (no ``rank_id_in``)."""
    group = require_replica_group(function, params)
    return group if operands.get("rank_id_in") is not None else mesh_axes(function)


_marking_varying = marking_varying(_communicating_axes)


def _prepare(function, operands, params):
    """Fill an omitted ``gathered_buf`` with a zero workspace, then mark the operands varying over the
    communicating axes."""
    if operands.get("gathered_buf") is None and params["gqa_group_size"] and operands.get("input") is not None:
        # [G, n, B, S, d] (NBSd) or [G, d, B, n, S] (dBnS): the group axis before the input's
        workspace = (params["gqa_group_size"],) + jnp.shape(operands["input"])
        operands["gathered_buf"] = jnp.zeros(workspace, jnp.result_type(operands["input"]))
    return _marking_varying(function, operands, params)


def _outputs(call: CallInfo):
    """``q_out``: ``[G * n, B / G, S, d]`` (NBSd) or ``[G, d, B / G, S]`` (dBnS) in the input's dtype."""
    groups, dims = call.params["gqa_group_size"], call.dims
    if call.params["q_layout"] == "NBSd":
        shape = (groups * dims["n"], dims["B"] // groups, dims["S"], dims["d"])
    else:
        shape = (groups, dims["d"], dims["B"] // groups, dims["S"])
    return [("q_out", shape, call.avals["input"].dtype)]


INPUT_LAYOUTS = {"NBSd": "n, B, S, d", "dBnS": "d, B, n, S"}
BUFFER_LAYOUTS = {"NBSd": "G, n, B, S, d", "dBnS": "G, d, B, n, S"}

ATTN_Q_BATCH_SHARD_SPEC = KernelSpec(
    name="attn_q_batch_shard",
    entry_point="jax_nkilib_kernels.collectives:attn_q_batch_shard",
    operands=(
        Operand.switched("input", "q_layout", INPUT_LAYOUTS),
        Operand.of("iota_workers", "1, R", dtypes=INT_DTYPES),
        Operand.switched("gathered_buf", "q_layout", BUFFER_LAYOUTS, optional=True),
        Operand.of("rank_id_in", "1, 1", dtypes=INT_DTYPES, optional=True),
    ),
    params=(
        Param("gqa_group_size", None, int),
        Param("replica_group", None, "axis"),
        Param("q_layout", "NBSd", AttnQBatchShardLayout, "the kernel's `layout`", normalizer=_layout_name),
    ),
    outputs=(),
    output_avals=_outputs,
    prepare=_prepare,
    keywords={"layout": "q_layout"},
    reference=reference_attn_q_batch_shard,
    check=_check,
    # a vmapped axis folds into S (the workspace's S axis with it)
    fold_plans=(
        FoldPlan(
            {"input": "S", "gathered_buf": "S", "iota_workers": None, "rank_id_in": None},
            outputs={"q_out": 2},
            when=lambda call: call.params["q_layout"] == "NBSd",
        ),
        FoldPlan(
            {"input": "S", "gathered_buf": "S", "iota_workers": None, "rank_id_in": None},
            outputs={"q_out": 3},
            when=lambda call: call.params["q_layout"] == "dBnS",
        ),
    ),
    has_collectives=True,
    family="collectives",
    catalog="row 62",
    support={
        "vjp": "JAX (differentiates the reference: reduce-scatter of the padded cotangent)",
        "shard_map": "inside jax.shard_map only: replica_group names the mesh axes of each GQA group",
        "notes": "docs-only kernel (2.30+); NBSd or dBnS (n = 1); gathered_buf optional (zero workspace); "
        "without rank_id_in, the rank is the global device position",
    },
)


attn_q_batch_shard = make_kernel(ATTN_Q_BATCH_SHARD_SPEC, reference_vjp)
