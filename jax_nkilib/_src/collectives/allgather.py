"""The NKI Library's all-gather kernels (``experimental/collectives``, catalog section 1.26, rows 33-35), called
inside ``jax.shard_map``: ``replica_groups`` names the mesh axis (or axes) whose ranks gather, and ``tp_degree``
must equal its size.

* ``fine_grained_allgather(lhs [m, K])`` -> ``[tp_degree, m, K]``: ``result[r]`` is rank ``r``'s ``lhs``.
* ``allgather_compute_matmul(lhs [m, K], rhs [K, N])`` (FGCC) -> ``[tp_degree, m, N]``: ``result[r] =
  lhs_r @ rhs`` (this rank's ``rhs`` columns), accumulated in float32, in ``lhs``'s dtype.
* ``allgather_sb2sb(inp [H, W])`` -> ``[H, tp_degree, W]`` and ``allgather_sb2sb_tiled(inp [M, K])`` ->
  ``[M, tp_degree, K]``: ``out[:, r]`` is rank ``r``'s ``inp``.

Output layouts. The gathered axis is returned split as ``(tp_degree, local)``, rank-major. The kernels' own
results are row-major views of these: fine_grained_allgather and FGCC return ``[RANK_N, ...]`` with a middle that
depends on the communication path (SBUF path ``[RANK_N, LNC, CHANNELS, m / (LNC * CHANNELS), ·]``, HBM path
``[RANK_N, CHANNELS, LNC, ...]``; both place rank ``r``'s rows ``r * m ...`` in order, so every path is the same
``[tp_degree, m, ·]`` memory); the sb2sb kernels return ``[H, W * tp_degree]``. The device adapters reshape to
these layouts (free); ``reshape(-1, K)`` or ``reshape(H, -1)`` gives the kernels' flat results, which are what
their torch references return (``cat(all_gather(lhs), dim=0)`` for rows 33-34).

Replica groups. sb2sb takes the groups as rank lists (from the axis names). fine_grained_allgather and FGCC build
their own: ``num_groups`` groups of ``tp_degree`` consecutive ranks, ``[[g * tp_degree + i for i in ...]]``; the
Neuron kernel runs only when the named axis groups exactly those ranks (it is the mesh's minor-most axis or axes),
and ``num_groups`` must be the number of groups the mesh forms (mesh size / tp_degree).

Communication path (fine_grained_allgather, FGCC; Neuron kernel only, no effect on results): with LNC=2 the rows
are also split over ``CHANNELS`` (2 for tp_degree 4-32, 4 for 64-128 on trn2). ``lhs`` circulates in SBUF when
``force_hbm_cc`` is false and twice its (padded) size fits the 24 MiB SBUF budget (FGCC: minus the double-buffered
``rhs`` blocks, and ``rhs`` stays in SBUF when twice its size fits 16 MiB); otherwise it circulates in HBM.
:func:`communication_path` computes the choice.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from ..framework.hardware import GEMM_STATIONARY_MAX, PARTITIONS, SBUF_PARTITION_BYTES
from ..framework.mesh_axes import bound_axis_size, lax_axis
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Output, Param
from .ring import gather_matmul as gather_matmul_ring

SUPPORTED_TP_DEGREES = (4, 8, 16, 32, 64, 128)  # fine_grained_allgather / FGCC (even tp_degree is asserted)
SBUF_BUDGET_BYTES = 24 << 20  # fine_grained_allgather / FGCC double-buffered operands
FGCC_RHS_SBUF_BYTES = 16 << 20
GEMM_MOVING_MAX = 512  # nl.tile_size.gemm_moving_fmax: FGCC's N tile


# --------------------------------------------------------------------------------------------------- references
def reference_fine_grained_allgather(lhs, *, tp_degree, num_groups, force_hbm_cc=False, replica_groups):
    """``[tp_degree, m, K]``: every rank's ``lhs`` in rank order (inside ``shard_map``)."""
    del tp_degree, num_groups, force_hbm_cc  # checked against the mesh; the path does not change the result
    return (lax.all_gather(lhs, lax_axis(replica_groups), axis=0),)


def reference_allgather_compute_matmul(lhs, rhs, *, tp_degree, num_groups, force_hbm_cc=False, replica_groups):
    """``[tp_degree, m, N]``: ``all_gather(lhs) @ rhs`` by a ppermute ring, float32 accumulation, lhs dtype (the ring
    of ``jax_nkilib.all_gather_matmul``, whose forward is this kernel)."""
    del num_groups, force_hbm_cc
    out = gather_matmul_ring(lhs, rhs, replica_groups, 0)
    return (out.reshape(tp_degree, lhs.shape[0], rhs.shape[1]),)


def reference_allgather_sb2sb(inp, *, replica_groups, tp_degree):
    """``[H, tp_degree, W]``: every rank's ``inp`` along the last axis, in rank order."""
    del tp_degree
    return (lax.all_gather(inp, lax_axis(replica_groups), axis=1),)


# --------------------------------------------------------------------------------------------- mesh and limits
def _mesh_axes(names: tuple[str, ...]):
    """``(axis names, sizes)`` of the enclosing mesh when it has every axis of ``names``, else ``None``."""
    mesh = jax.sharding.get_abstract_mesh()
    axis_names = tuple(getattr(mesh, "axis_names", ()) or ())
    if not axis_names or any(name not in axis_names for name in names):
        return None
    return axis_names, tuple(int(size) for size in mesh.axis_sizes)


def axis_rank_groups(names: tuple[str, ...]) -> list[list[int]] | None:
    """Rank lists of the groups along mesh axes ``names`` (ranks in the mesh's flattened order, as the Neuron
    lowering passes them to kernels); ``None`` when the enclosing mesh is unknown."""
    found = _mesh_axes(names)
    if found is None:
        return None
    axis_names, sizes = found
    ranks = np.arange(math.prod(sizes)).reshape(sizes)
    moved = np.moveaxis(ranks, [axis_names.index(name) for name in names], range(-len(names), 0))
    return moved.reshape(-1, math.prod(sizes[axis_names.index(name)] for name in names)).tolist()


def kernel_rank_groups(tp_degree: int, num_groups: int) -> list[list[int]]:
    """The groups fine_grained_allgather and FGCC generate: ``num_groups`` runs of ``tp_degree`` ranks."""
    return [[group * tp_degree + i for i in range(tp_degree)] for group in range(num_groups)]


def _check_group(call: CallInfo) -> None:
    p, function = call.params, call.function
    if p["replica_groups"] is None:
        raise ValueError(f"{function}: `replica_groups` is required: the mesh axis name(s) of the ranks that gather")
    if p["tp_degree"] is None or p["tp_degree"] <= 0:
        raise ValueError(f"{function}: `tp_degree` is required: a positive int, the number of ranks that gather")
    size = bound_axis_size(p["replica_groups"])
    if size is not None and size != p["tp_degree"]:
        raise ValueError(
            f"{function}: tp_degree={p['tp_degree']} but the replica group {p['replica_groups']} has {size} ranks"
        )


def _check_ring(call: CallInfo) -> None:
    _check_group(call)
    p, function = call.params, call.function
    if p["num_groups"] is None or p["num_groups"] <= 0:
        raise ValueError(f"{function}: `num_groups` is required: a positive int, the number of replica groups")
    groups = axis_rank_groups(p["replica_groups"])
    if groups is not None and len(groups) != p["num_groups"]:
        raise ValueError(
            f"{function}: num_groups={p['num_groups']} but the mesh forms {len(groups)} groups of "
            f"{p['tp_degree']} ranks along {p['replica_groups']}"
        )


def channels(tp_degree: int, lnc: int) -> int:
    """Communication channels of fine_grained_allgather / FGCC: 1 with LNC=1; with LNC=2 (trn2) 2 for tp_degree
    4-32 and 4 for 64-128."""
    if lnc != 2:
        return 1
    return {4: 2, 8: 2, 16: 2, 32: 2, 64: 4, 128: 4}.get(tp_degree, 1)


def _itemsize(call: CallInfo, name: str) -> int:
    return np.dtype(call.avals[name].dtype).itemsize


def communication_path(call: CallInfo) -> str:
    """``"sbuf"`` or ``"hbm"``: where fine_grained_allgather / FGCC circulate ``lhs`` for this call (the kernels'
    size rule; see the module docstring)."""
    m, k = call.dims["m"], call.dims["K"]
    if call.params["force_hbm_cc"]:
        return "hbm"
    size = _itemsize(call, "lhs")
    lanes = call.lnc * channels(call.params["tp_degree"], call.lnc)
    local = m // lanes
    tile_k = min(k, PARTITIONS)
    padded_k = math.ceil(k / tile_k) * tile_k
    tile_m = min(local, GEMM_STATIONARY_MAX)
    padded_m = math.ceil(local / tile_m) * tile_m
    budget = SBUF_BUDGET_BYTES
    if "N" in call.dims:  # FGCC: rhs blocks come first
        n = call.dims["N"]
        tile_n = min(n, GEMM_MOVING_MAX)
        padded_n = math.ceil(n / tile_n) * tile_n
        block_k, block_n = padded_k, padded_n
        if 2 * padded_k * padded_n * size > FGCC_RHS_SBUF_BYTES:  # rhs streams from HBM in smaller blocks
            block_n = tile_n * min(padded_n // tile_n, FGCC_RHS_SBUF_BYTES // padded_k // tile_n // size)
            block_k = tile_k * min(padded_k // tile_k, 16 // size)
        budget -= 2 * block_k * block_n * size
        lhs_bytes = padded_m * padded_k * size
    elif call.lnc == 2 and lanes > call.lnc:
        lhs_bytes = padded_k * channels(call.params["tp_degree"], call.lnc) * padded_m * size
    else:
        lhs_bytes = m * k * size
    return "sbuf" if 2 * lhs_bytes <= budget else "hbm"


def _ring_limits(call: CallInfo) -> list[str]:
    p, dims, unmet = call.params, call.dims, []
    tp, lnc = p["tp_degree"], call.lnc
    if tp not in SUPPORTED_TP_DEGREES:
        unmet.append(f"tp_degree={tp} must be one of {SUPPORTED_TP_DEGREES}")
    lanes = lnc * channels(tp, lnc)
    if dims["m"] % lanes:
        unmet.append(f"m={dims['m']} rows per rank must divide by LNC x channels = {lanes}")
    else:
        local = dims["m"] // lanes
        if local > GEMM_STATIONARY_MAX and local % GEMM_STATIONARY_MAX:
            unmet.append(f"rows per core and channel ({local}) must be <= 128 or a multiple of 128")
    if dims["K"] > PARTITIONS and dims["K"] % PARTITIONS:
        unmet.append(f"K={dims['K']} must be <= 128 or a multiple of 128")
    if "N" in dims and dims["N"] > GEMM_MOVING_MAX and dims["N"] % GEMM_MOVING_MAX:
        unmet.append(f"N={dims['N']} must be <= 512 or a multiple of 512")
    if "rhs" in call.avals and call.avals["rhs"].dtype != call.avals["lhs"].dtype:
        unmet.append(f"rhs dtype {call.avals['rhs'].dtype} must equal lhs dtype {call.avals['lhs'].dtype}")
    groups = axis_rank_groups(p["replica_groups"])
    expected = kernel_rank_groups(tp, p["num_groups"])
    if groups is not None and groups != expected:
        unmet.append(
            f"the kernel gathers over consecutive ranks {expected} but axis {p['replica_groups']} groups "
            f"ranks {groups} (make it the mesh's minor-most axis)"
        )
    return unmet


def _sb2sb_limits(rows: str, width: str, tiled: bool):
    def limits(call: CallInfo) -> list[str]:
        dims, unmet = call.dims, []
        size, tp = _itemsize(call, "inp"), call.params["tp_degree"]
        if not tiled and dims[rows] > PARTITIONS:
            unmet.append(f"{rows}={dims[rows]} must be <= 128 (SBUF partitions)")
        if tiled:
            if dims[rows] > PARTITIONS and dims[rows] % PARTITIONS:
                unmet.append(f"{rows}={dims[rows]} must be <= 128 or a multiple of 128")
            tiles = math.ceil(dims[rows] / PARTITIONS)
            if tiles > 1 and tiles % call.lnc:
                unmet.append(f"the {tiles} row tiles of 128 must divide over LNC={call.lnc}")
        per_partition = (1 + tp) * dims[width] * size
        if per_partition > SBUF_PARTITION_BYTES:
            unmet.append(
                f"{width} x (1 + tp_degree) x {size} bytes = {per_partition} bytes per SBUF partition "
                f"exceeds {SBUF_PARTITION_BYTES}"
            )
        return unmet

    return limits


# -------------------------------------------------------------------------------------------------------- specs
_SHARD_MAP = "inside jax.shard_map only: replica_groups names the mesh axes that gather (collectives)"
_RING_PARAMS = (
    Param("tp_degree", None, int),
    Param("num_groups", None, int),
    Param("force_hbm_cc", False, bool),
    Param("replica_groups", None, "axis"),
)
_RING_NOTES = (
    f"TRN2; tp_degree in {{{', '.join(map(str, SUPPORTED_TP_DEGREES))}}}; the axis must group "
    "consecutive ranks; m % (LNC x channels) == 0; "
    "output [tp_degree, m, .] for every SBUF/HBM path (the kernel's [RANK_N, ...] result, reshaped)"
)

FINE_GRAINED_ALLGATHER_SPEC = KernelSpec(
    name="fine_grained_allgather",
    entry_point="jax_nkilib_kernels.allgather:fine_grained_allgather",
    operands=(Operand.of("lhs", "m, K"),),
    params=_RING_PARAMS,
    outputs=(Output.of("result", "tp_degree, m, K", "lhs"),),
    reference=reference_fine_grained_allgather,
    check=_check_ring,
    neuron_limits=_ring_limits,
    # a vmapped axis folds into K (the gathered rows keep their rank-major order)
    fold_plans=(FoldPlan({"lhs": "K"}, outputs=("K",)),),
    has_collectives=True,
    family="collectives",
    catalog="row 33",
    support={
        "vjp": "JAX (differentiates the reference: the transpose of all_gather, a reduce-scatter)",
        "shard_map": _SHARD_MAP,
        "notes": _RING_NOTES,
    },
)

ALLGATHER_COMPUTE_MATMUL_SPEC = KernelSpec(
    name="allgather_compute_matmul",
    entry_point="jax_nkilib_kernels.allgather:allgather_compute_matmul",
    operands=(Operand.of("lhs", "m, K"), Operand.of("rhs", "K, N")),
    params=_RING_PARAMS,
    outputs=(Output.of("result", "tp_degree, m, N", "lhs"),),
    reference=reference_allgather_compute_matmul,
    check=_check_ring,
    neuron_limits=_ring_limits,
    # a vmapped rhs alone folds into N; a vmapped lhs runs under lax.map
    fold_plans=(FoldPlan({"lhs": None, "rhs": "N"}, outputs=("N",)),),
    has_collectives=True,
    mac_count=lambda call: call.params["tp_degree"] * call.dims["m"] * call.dims["K"] * call.dims["N"],
    family="collectives",
    catalog="row 34",
    support={
        "vjp": "JAX (differentiates the reference ring; jax_nkilib.all_gather_matmul, whose forward is this "
        "kernel, has its own dual-ring VJP)",
        "shard_map": _SHARD_MAP,
        "notes": _RING_NOTES + f"; N <= {GEMM_MOVING_MAX} or a multiple of {GEMM_MOVING_MAX}; float32 accumulation",
    },
)


def _sb2sb_spec(name: str, rows: str, width: str, tiled: bool, row: str) -> KernelSpec:
    return KernelSpec(
        name=name,
        entry_point=f"jax_nkilib_kernels.allgather:{name}",
        operands=(Operand.of("inp", f"{rows}, {width}"),),
        params=(Param("replica_groups", None, "axis"), Param("tp_degree", None, int)),
        outputs=(Output.of("out", f"{rows}, tp_degree, {width}", "inp"),),
        reference=reference_allgather_sb2sb,
        check=_check_group,
        neuron_limits=_sb2sb_limits(rows, width, tiled),
        fold_plans=(FoldPlan({"inp": rows}, outputs=(rows,)),),
        neuron_split_dims=(rows,),
        has_collectives=True,
        family="collectives",
        catalog=row,
        support={
            "vjp": "JAX (differentiates the reference: the transpose of all_gather, a reduce-scatter)",
            "shard_map": _SHARD_MAP,
            "notes": (
                f"TRN2; output [{rows}, tp_degree, {width}] (the kernel's [{rows}, {width} x tp] "
                "reshaped); (1 + tp_degree) x width must fit one SBUF partition; "
                + (
                    f"{rows} <= {PARTITIONS} or a multiple of {PARTITIONS}, tiles split over LNC"
                    if tiled
                    else f"{rows} > {PARTITIONS} runs as several kernel calls"
                )
            ),
        },
    )


ALLGATHER_SB2SB_SPEC = _sb2sb_spec("allgather_sb2sb", "H", "W", tiled=False, row="row 35")
ALLGATHER_SB2SB_TILED_SPEC = _sb2sb_spec("allgather_sb2sb_tiled", "M", "K", tiled=True, row="row 35")

fine_grained_allgather = make_kernel(FINE_GRAINED_ALLGATHER_SPEC, vjp=reference_vjp)
allgather_compute_matmul = make_kernel(ALLGATHER_COMPUTE_MATMUL_SPEC, vjp=reference_vjp)
allgather_sb2sb = make_kernel(ALLGATHER_SB2SB_SPEC, vjp=reference_vjp)
allgather_sb2sb_tiled = make_kernel(ALLGATHER_SB2SB_TILED_SPEC, vjp=reference_vjp)
