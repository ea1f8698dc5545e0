"""The all-to-all(-v) metadata builders of MoE dispatch (catalog rows 75-76, docs-only): per destination rank, how
many rows to send and at which displacement, from the router's ``expert_index [T, K]`` (int32).

Sources: the NKI Library API reference (aws-neuron-sdk ``nki/library/api/build-all2all-dispatch-metadata.rst``,
``build-all-to-all-v-metadata.rst``, nki-library 2.32) and, for the exact semantics, the kernel sources
``experimental/moe_block/build_all2all_dispatch_metadata.py`` and ``experimental/subkernels/
build_all_to_all_v_metadata.py`` with their torch references (read in the public code index).

Expert ``e`` lives on rank ``e // (E / R)`` (``R`` destination ranks, ``E / R`` experts each, rounded down); an
expert id outside ``[0, R * (E // R))`` belongs to no rank and is not counted.

* ``build_all_to_all_v_metadata(expert_index, replica_group_size=R, E) -> [3, R] uint32``: row 0 the number of
  ``(token, k)`` pairs routed to each rank (no deduplication, in rows), row 1 its exclusive cumulative sum, row 2
  zeros (the receive counts, filled by the collective's runtime). ``recv_counts_known`` / ``has_rdispls`` must stay
  ``False`` (the kernel asserts it; ``has_rdispls=True`` would add a fourth row). ``E % R == 0``.
* ``build_all2all_dispatch_metadata(expert_index, num_experts, num_elements_per_token, replica_group_size=R)
  -> [4, R] float32`` (the kernel's dtype; its torch reference returns uint32 of the same values): row 0 the
  number of tokens sent to each rank, a token counted once however many of its ``K`` experts the rank holds,
  times ``num_elements_per_token``; row 1 its exclusive cumulative sum; rows 2-3 zeros.

Neither is differentiable (integer routing in, counts out).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.hardware import PARTITIONS, SBUF_PARTITION_BYTES
from ..framework.primitive import make_kernel
from ..framework.spec import INT_DTYPES, CallInfo, KernelSpec, Operand, Param


def exclusive_cumsum(counts):
    return jnp.cumsum(counts) - counts


def routed_to_rank(expert_index, num_experts: int, ranks: int):
    """``[T, K, R]`` booleans: ``expert_index[t, k]`` is one of rank ``r``'s ``num_experts // ranks`` experts."""
    per_rank = num_experts // ranks
    lower = jnp.arange(ranks, dtype=jnp.int32) * per_rank
    e = expert_index[..., None]
    return (e >= lower) & (e < lower + per_rank)


# ------------------------------------------------------------------------------------------------------ references
def reference_build_all_to_all_v_metadata(
    expert_index, *, replica_group_size, E, recv_counts_known=False, has_rdispls=False
):
    counts = jnp.sum(routed_to_rank(expert_index, E, replica_group_size), axis=(0, 1), dtype=jnp.int32)
    return (jnp.stack([counts, exclusive_cumsum(counts), jnp.zeros_like(counts)]).astype(jnp.uint32),)


def reference_build_all2all_dispatch_metadata(expert_index, *, num_experts, num_elements_per_token, replica_group_size):
    sends = jnp.any(routed_to_rank(expert_index, num_experts, replica_group_size), axis=1)  # [T, R], deduplicated
    counts = jnp.sum(sends, axis=0, dtype=jnp.int32) * num_elements_per_token
    zeros = jnp.zeros_like(counts)
    return (jnp.stack([counts, exclusive_cumsum(counts), zeros, zeros]).astype(jnp.float32),)


# ---------------------------------------------------------------------------------------------------------- checks
def _positive(call: CallInfo, *names: str) -> None:
    for name in names:
        if call.params[name] <= 0:
            raise ValueError(f"{call.function}: parameter `{name}` must be positive; got {call.params[name]}")


def _check_a2av_metadata(call: CallInfo) -> None:
    _positive(call, "replica_group_size", "E")
    p = call.params
    if p["E"] % p["replica_group_size"]:
        raise ValueError(
            f"{call.function}: E={p['E']} experts must split evenly over replica_group_size="
            f"{p['replica_group_size']} ranks (the kernel asserts E % replica_group_size == 0)"
        )
    for flag in ("recv_counts_known", "has_rdispls"):
        if p[flag]:
            raise ValueError(f"{call.function}: parameter `{flag}`=True is not supported by the kernel (it asserts)")


def _a2av_metadata_limits(call: CallInfo) -> list[str]:
    p, unmet = call.params, []
    experts, ranks = p["E"], p["replica_group_size"]
    tile = min(experts, PARTITIONS)
    if experts > PARTITIONS and experts % PARTITIONS:
        unmet.append(f"E={experts} must be <= {PARTITIONS} or a multiple of {PARTITIONS}")
    if tile % (experts // ranks):
        unmet.append(f"E/replica_group_size={experts // ranks} experts per rank must divide {tile}")
    if call.dims["T"] * call.dims["K"] * 4 > SBUF_PARTITION_BYTES:
        unmet.append(f"SBUF: T*K={call.dims['T'] * call.dims['K']} float32 routing entries per partition")
    return unmet


def _check_dispatch_metadata(call: CallInfo) -> None:
    _positive(call, "num_experts", "num_elements_per_token", "replica_group_size")
    p = call.params
    if p["num_experts"] < p["replica_group_size"]:
        raise ValueError(
            f"{call.function}: num_experts={p['num_experts']} gives no expert to each of the "
            f"replica_group_size={p['replica_group_size']} ranks"
        )


def _dispatch_metadata_limits(call: CallInfo) -> list[str]:
    unmet = []
    if call.dims["T"] > PARTITIONS:
        unmet.append(f"T={call.dims['T']} tokens must be <= {PARTITIONS}")
    if call.params["replica_group_size"] > PARTITIONS:
        unmet.append(f"replica_group_size={call.params['replica_group_size']} must be <= {PARTITIONS}")
    return unmet


# ----------------------------------------------------------------------------------------------------------- specs
EXPERT_INDEX = Operand.of("expert_index", "T, K", dtypes=INT_DTYPES, doc="top-K expert ids per token")

BUILD_ALL_TO_ALL_V_METADATA_SPEC = KernelSpec(
    name="build_all_to_all_v_metadata",
    entry_point="nkilib.experimental.subkernels.build_all_to_all_v_metadata:build_all_to_all_v_metadata",
    operands=(EXPERT_INDEX,),
    params=(
        Param("replica_group_size", None, int, "destination ranks (R)", required=True),
        Param("E", None, int, "global experts", required=True),
        Param("recv_counts_known", False, bool, "not supported by the kernel (must be False)"),
        Param("has_rdispls", False, bool, "not supported by the kernel (must be False)"),
    ),
    outputs=(),
    output_avals=lambda call: [("metadata", (3, call.params["replica_group_size"]), jnp.uint32)],
    reference=reference_build_all_to_all_v_metadata,
    check=_check_a2av_metadata,
    neuron_limits=_a2av_metadata_limits,
    family="moe",
    catalog="row 76",
    support={
        "vjp": "none (integer routing in, counts out)",
        "notes": "docs-only kernel (2.32); [3, R] uint32: send counts (rows, no dedup), displacements, zeros",
    },
)

BUILD_ALL2ALL_DISPATCH_METADATA_SPEC = KernelSpec(
    name="build_all2all_dispatch_metadata",
    entry_point="nkilib.experimental.moe_block.build_all2all_dispatch_metadata:build_all2all_dispatch_metadata",
    operands=(EXPERT_INDEX,),
    params=(
        Param("num_experts", None, int, "global experts", required=True),
        Param("num_elements_per_token", None, int, "elements per token row (e.g. H_CONCAT)", required=True),
        Param("replica_group_size", None, int, "destination ranks (R)", required=True),
    ),
    outputs=(),
    output_avals=lambda call: [("metadata", (4, call.params["replica_group_size"]), jnp.float32)],
    reference=reference_build_all2all_dispatch_metadata,
    check=_check_dispatch_metadata,
    neuron_limits=_dispatch_metadata_limits,
    family="moe",
    catalog="row 75",
    nondifferentiable_outputs=("metadata",),
    support={
        "vjp": "none (integer routing in, counts out)",
        "notes": "docs-only kernel (2.32); [4, R] float32 (integer values): deduplicated token counts x "
        "num_elements_per_token, displacements, zeros; T <= 128, R <= 128",
    },
)

build_all_to_all_v_metadata = make_kernel(BUILD_ALL_TO_ALL_V_METADATA_SPEC)
build_all2all_dispatch_metadata = make_kernel(BUILD_ALL2ALL_DISPATCH_METADATA_SPEC)
