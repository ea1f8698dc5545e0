"""The NKI Library's HBM collective kernels (catalog row 59, ``experimental/collectives/collectives.py``, docs-only).

Called inside ``jax.shard_map``: ``replica_group`` names the mesh axes whose devices form each rank list (a name
or a tuple of names; on Neuron it becomes the kernel's ``ReplicaGroup`` of global ranks, the devices' positions in
the mesh's flattened order). With ``G`` ranks per group, on each rank ``r`` (``x_s`` is rank ``s``'s ``input``):

* ``all_reduce_hbm_kernel(input, replica_group) -> out``: ``sum_s x_s``, same shape and dtype (any rank 1-4).
* ``all_gather_hbm_kernel(input [H, W], replica_group, num_ranks) -> out [num_ranks * H, W]``: the ranks' inputs
  concatenated along dim 0 in group order (``num_ranks = G``).
* ``reduce_scatter_hbm_kernel(input [H, W], replica_group, num_ranks) -> out [H / num_ranks, W]``: block ``r`` (of
  ``num_ranks`` along dim 0) of ``sum_s x_s``.
* ``all_to_all_hbm_kernel(input, replica_group) -> out``: dim 0 cut in ``G`` blocks, block ``s`` of the output is
  block ``r`` of ``x_s`` (rank 1-4, dim 0 divisible by ``G``).
* ``rank_id_kernel(in_tensor [R, H, W]) -> out [H, W]``: ``in_tensor[rank]``, ``rank`` = this device's global rank
  (``ncc.rank_id()``). ``dma_copy_rank_id_kernel(in_tensor, rank_id_lookup [1, R] int32)`` reads
  ``in_tensor[rank_id_lookup[0, rank]]``. Both need ``jax.shard_map`` over every axis of the mesh (the rank is the
  position among all of its devices); an index outside ``[0, R)`` is clamped (undefined on the device).

Dtypes: floating inputs (float32, bfloat16, float16; float64 runs the reference only); outputs in the input dtype.
Sharding types: every operand is marked varying over the communicating axes (over every mesh axis for the rank
kernels) before the call, and every output varies over them, whether or not its values are equal across ranks (an
all-reduced ``out`` is): give ``out_specs`` that split over those axes, or sum/slice as the program needs.

Autodiff (JAX rules that bind these kernels, so reverse mode on Neuron runs collective kernels too): the VJP of
all_reduce is all_reduce, all_gather and reduce_scatter are each other's transpose, all_to_all is its own; the
rank kernels scatter the cotangent back to row ``rank`` (a replicated ``in_tensor`` gets the sum over ranks).
``rank_id_lookup`` is an integer table: no gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from jax import lax

from ..framework import compat
from ..framework.mesh_axes import bound_axis_size, lax_axis
from ..framework.primitive import Kernel, Vjp, make_kernel, reference_vjp
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Output, Param, Prepare

ANY_RANK = ("d0", "d0, d1", "d0, d1, d2", "d0, d1, d2, d3")
LIBRARY_MODULE = "nkilib.experimental.collectives.collectives"


def mesh_axes(function: str) -> tuple[str, ...]:
    """Every axis of the mesh of the enclosing ``jax.shard_map``, which must be manual over all of them."""
    mesh = jax.sharding.get_abstract_mesh()
    names = tuple(getattr(mesh, "axis_names", ()) or ())
    manual = set(getattr(mesh, "manual_axes", ()) or ())
    if not names or set(names) - manual:
        raise ValueError(
            f"{function}: the rank is this device's position among all devices of the mesh: call it "
            f"inside jax.shard_map over every mesh axis (mesh axes {names}, manual {tuple(manual)})"
        )
    return names


def global_rank(function: str):
    """This device's global rank: its position in the mesh's flattened device order (``ncc.rank_id()``)."""
    return lax.axis_index(lax_axis(mesh_axes(function)))


def marking_varying(axes: Callable[[str, Mapping, Mapping], tuple[str, ...]]) -> Prepare:
    """The ``prepare`` hook of a kernel whose operands take part in a collective over ``axes(function, params,
    operands)``: they are marked varying over those mesh axes before the call, so the outputs' sharding types say
    that they vary over them."""

    def prepare(function, operands, params):
        names = axes(function, params, operands)
        if names:
            varying = lax.axis_index(lax_axis(names))  # a value varying over exactly these axes
            operands = {
                name: None if value is None else compat.varying_like(jnp.asarray(value), varying)
                for name, value in operands.items()
            }
        return operands, params

    return prepare


def require_replica_group(function: str, params: Mapping) -> tuple[str, ...]:
    """The ``replica_group`` axes, which every collective kernel call must name."""
    if params["replica_group"] is None:
        raise ValueError(
            f"{function}: `replica_group` is required: the mesh axis name(s) whose devices form each "
            "rank list (inside jax.shard_map)"
        )
    return params["replica_group"]


def replica_group_axes(function: str, params: Mapping, operands: Mapping) -> tuple[str, ...]:
    return require_replica_group(function, params)


def every_mesh_axis(function: str, params: Mapping, operands: Mapping) -> tuple[str, ...]:
    return mesh_axes(function)


def _like_input(call: CallInfo):
    return [("out", call.avals["input"].shape, call.avals["input"].dtype)]


# ------------------------------------------------------------------------------------------------------ references
def reference_all_reduce(input, *, replica_group):
    return (lax.psum(input, lax_axis(replica_group)),)


def reference_all_gather(input, *, replica_group, num_ranks):
    return (lax.all_gather(input, lax_axis(replica_group), axis=0, tiled=True),)


def reference_reduce_scatter(input, *, replica_group, num_ranks):
    return (lax.psum_scatter(input, lax_axis(replica_group), scatter_dimension=0, tiled=True),)


def reference_all_to_all(input, *, replica_group):
    return (lax.all_to_all(input, lax_axis(replica_group), 0, 0, tiled=True),)


def reference_rank_id(in_tensor):
    return (lax.dynamic_index_in_dim(in_tensor, global_rank("rank_id_kernel"), keepdims=False),)


def reference_dma_copy_rank_id(in_tensor, rank_id_lookup):
    row = lax.dynamic_index_in_dim(rank_id_lookup[0], global_rank("dma_copy_rank_id_kernel"), keepdims=False)
    return (lax.dynamic_index_in_dim(in_tensor, row, keepdims=False),)


# ---------------------------------------------------------------------------------------------------------- checks
def check_group(call: CallInfo, with_num_ranks: bool = False) -> int:
    """The group size; ``num_ranks``, when the kernel takes it, must equal it."""
    p, function = call.params, call.function
    size = bound_axis_size(require_replica_group(function, p))
    if with_num_ranks:
        if p["num_ranks"] is None or p["num_ranks"] <= 0:
            raise ValueError(f"{function}: `num_ranks` is required and must be positive; got {p['num_ranks']!r}")
        if size is not None and size != p["num_ranks"]:
            raise ValueError(
                f"{function}: num_ranks={p['num_ranks']} but the replica group {p['replica_group']} has {size} ranks"
            )
    return size


def _check_reduce_scatter(call: CallInfo) -> None:
    check_group(call, with_num_ranks=True)
    rows = call.dims["H"]
    if rows % call.params["num_ranks"]:
        raise ValueError(
            f"{call.function}: input [H, W] has H={rows} rows, which do not split into "
            f"num_ranks={call.params['num_ranks']} equal blocks"
        )


def _check_all_to_all(call: CallInfo) -> None:
    size = check_group(call)
    rows = call.dims["d0"]
    if size is not None and rows % size:
        raise ValueError(
            f"{call.function}: input dim 0 ({rows}) does not split into one block per rank of the "
            f"replica group ({size} ranks)"
        )


def _check_rank_table(call: CallInfo) -> None:
    ranks = bound_axis_size(mesh_axes(call.function))
    if call.avals.get("rank_id_lookup") is not None and call.dims["R_lookup"] < ranks:
        raise ValueError(
            f"{call.function}: rank_id_lookup [1, R] needs an entry for each of the {ranks} ranks; "
            f"got R={call.dims['R_lookup']}"
        )


# ------------------------------------------------------------------------------------------------------------- VJPs
def transpose_vjp(transpose: Callable[[], Kernel]) -> Vjp:
    """The VJP of a linear collective: its cotangent goes through the transposed kernel (same params)."""

    def forward(kernel, operands, params):
        return kernel.call(operands, params), None

    def backward(kernel, residuals, params, cotangents):
        return {"input": transpose().call({"input": cotangents[0]}, params)[0]}

    return Vjp(forward, backward)


def _group_kernel(
    name: str,
    operands,
    params,
    output_avals,
    reference,
    check,
    fold_plans,
    notes: str,
    transpose: Callable[[], Kernel],
    notes_extra: str = "",
) -> Kernel:
    spec = KernelSpec(
        name=name,
        entry_point=f"{LIBRARY_MODULE}:{name}",
        operands=operands,
        params=params,
        outputs=(),
        output_avals=output_avals,
        prepare=marking_varying(replica_group_axes),
        reference=reference,
        check=check,
        fold_plans=fold_plans,
        has_collectives=True,
        family="collectives",
        catalog="row 59",
        support={
            "vjp": "JAX rule binding " + notes,
            "shard_map": "inside jax.shard_map only: replica_group names the mesh axes of each rank list",
            "notes": "docs-only kernel (2.30+); the rank lists reach it as an nki.collectives.ReplicaGroup"
            + notes_extra,
        },
    )
    return make_kernel(spec, transpose_vjp(transpose))


GROUP = Param("replica_group", None, "axis", "mesh axis name(s) of each rank list", required=True)
NUM_RANKS = Param("num_ranks", None, int, "ranks per group (the replica group's size)", required=True)

all_reduce_hbm_kernel = _group_kernel(
    "all_reduce_hbm_kernel",
    (Operand.of("input", *ANY_RANK),),
    (GROUP,),
    _like_input,
    reference_all_reduce,
    check_group,
    (FoldPlan({"input": "d0"}, outputs={"out": 0}),),
    "all_reduce_hbm_kernel (its own transpose)",
    lambda: all_reduce_hbm_kernel,
)

all_gather_hbm_kernel = _group_kernel(
    "all_gather_hbm_kernel",
    (Operand.of("input", "H, W"),),
    (GROUP, NUM_RANKS),
    lambda call: [("out", (call.params["num_ranks"] * call.dims["H"], call.dims["W"]), call.avals["input"].dtype)],
    reference_all_gather,
    lambda call: check_group(call, with_num_ranks=True),
    (FoldPlan({"input": "W"}, outputs={"out": 1}),),
    "reduce_scatter_hbm_kernel",
    lambda: reduce_scatter_hbm_kernel,
)

reduce_scatter_hbm_kernel = _group_kernel(
    "reduce_scatter_hbm_kernel",
    (Operand.of("input", "H, W"),),
    (GROUP, NUM_RANKS),
    lambda call: [("out", (call.dims["H"] // call.params["num_ranks"], call.dims["W"]), call.avals["input"].dtype)],
    reference_reduce_scatter,
    _check_reduce_scatter,
    (FoldPlan({"input": "W"}, outputs={"out": 1}),),
    "all_gather_hbm_kernel",
    lambda: all_gather_hbm_kernel,
)

all_to_all_hbm_kernel = _group_kernel(
    "all_to_all_hbm_kernel",
    (Operand.of("input", *ANY_RANK),),
    (GROUP,),
    _like_input,
    reference_all_to_all,
    _check_all_to_all,
    (FoldPlan({"input": "d1"}, outputs={"out": 1}, when=lambda call: call.avals["input"].ndim > 1),),
    "all_to_all_hbm_kernel (its own inverse)",
    lambda: all_to_all_hbm_kernel,
    "; the library tests it with 4 ranks at LNC2 or 8 at LNC1 (its mesh algorithm)",
)


def _rank_kernel(name: str, operands, reference, fold_plans, notes: str) -> Kernel:
    spec = KernelSpec(
        name=name,
        entry_point=f"{LIBRARY_MODULE}:{name}",
        operands=operands,
        params=(),
        outputs=(Output.of("out", "H, W", "in_tensor"),),
        prepare=marking_varying(every_mesh_axis),
        reference=reference,
        check=_check_rank_table,
        fold_plans=fold_plans,
        has_collectives=True,
        family="collectives",
        catalog="row 59",
        support={
            "vjp": "JAX (the cotangent goes back to row `rank` of in_tensor)",
            "shard_map": "inside jax.shard_map over every mesh axis (the rank is the global device position)",
            "notes": notes,
        },
    )
    return make_kernel(spec, reference_vjp)


rank_id_kernel = _rank_kernel(
    "rank_id_kernel",
    (Operand.of("in_tensor", "R, H, W"),),
    reference_rank_id,
    (FoldPlan({"in_tensor": "H"}, outputs=("H",)),),
    "docs-only kernel (2.30+): out = in_tensor[ncc.rank_id()]; has_collectives assumed",
)

dma_copy_rank_id_kernel = _rank_kernel(
    "dma_copy_rank_id_kernel",
    (Operand.of("in_tensor", "R, H, W"), Operand.of("rank_id_lookup", "1, R_lookup", dtypes=INT_DTYPES)),
    reference_dma_copy_rank_id,
    (FoldPlan({"in_tensor": "H", "rank_id_lookup": None}, outputs=("H",)),),
    "docs-only kernel (2.30+): out = in_tensor[rank_id_lookup[0, ncc.rank_id()]]; has_collectives assumed",
)
