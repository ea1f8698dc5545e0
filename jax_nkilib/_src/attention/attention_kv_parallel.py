"""``attention_kv_parallel_segmented_cte`` (catalog row 46, docs-only; semantics of its kernel source and torch
reference): prefill attention whose KV cache is sharded over a KV-parallel group of ranks, merged with a collective
online softmax. Called inside ``jax.shard_map``; ``replica_groups`` names the mesh axes of the group.

Layouts (per rank): ``q [QH, S, D]`` (this rank's query heads); ``k_cache [n_blocks, 1, block_size, D]``
(``fp8_packed``: ``[n_blocks, 1, block_size / 2, D, 2]``, tokens ``2i`` and ``2i + 1`` in the trailing pair) and
``v_cache [n_blocks, 1, block_size, D]``: this rank's shard, in the query dtype or FP8; ``block_tables [1,
max_blocks]`` int32 (local logical block -> cache block); ``kvp_q_offset``, ``kvp_rank_id``,
``valid_num_prior_tokens [1, 1]`` int32 (runtime); ``k_scale``/``v_scale [128, 1]`` float32. Output ``[QH, S, D]``
(``tp_out``: ``[QH, D, S]``) in ``q``'s dtype.

Semantics, on each rank of the group (``G = group_size`` ranks, in the axes' order):

1. ``q_full = all_gather(q)`` — ``[G * QH, S, D]``; every rank attends all heads to its local keys: token ``t`` of
   the local sequence is slot ``t % block_size`` of cache block ``block_tables[0, t // block_size]``, KV head 0
   (every query head reads it; the kernel passes one KV head to its segmented inner kernel).
2. Positions. Query ``i`` is at ``kvp_q_offset + i``. Contiguous sharding (``kvp_group_size = 0``): local token
   ``t`` is at ``t`` (the caller passes ``kvp_q_offset = global_q_offset - rank * local_len``). Round-robin
   (``kvp_group_size = R > 0``): rank ``r = kvp_rank_id`` holds global blocks ``r, r + R, ...``, so local token
   ``t`` is at ``((t // block_size) * R + r) * block_size + t % block_size`` and ``kvp_q_offset`` is the global
   position of query 0. A token is visible when ``key_pos <= query_pos`` and, with ``sliding_window = w > 0``,
   ``key_pos > query_pos - w``. Scores are ``scale * q k^T``; softmax statistics in float32.
3. The per-rank partial outputs and statistics travel back to the heads' owners (``all_to_all``), which merge them:
   ``out = sum_r l_r exp(m_r - M) o_r / sum_r l_r exp(m_r - M)`` — the softmax over every visible key of the group.
   Rows with no visible key give 0; a NaN partial makes the row NaN (never 0).

FP8 caches are dequantised as the reference does: ``K * k_scale[:D]`` (per head-dimension entry, the kernel's
partition axis) and ``V * v_scale[0]`` (the kernel requires one replicated value), then rounded to ``q``'s dtype.
``global_q_offset``, ``seg_size``, ``apc_mode`` and ``valid_num_prior_tokens`` choose which local blocks the kernel
reads per query segment; for inputs meeting the kernel's contract (``global_q_offset`` = the position of query 0;
in APC mode the given prior tokens are visible) those are exactly the visible tokens, which is what this computes.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..framework.mesh_axes import bound_axis_size, lax_axis
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import FP8_DTYPES, INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from .attention_segmented_cte import CACHE_DTYPES, unpack_token_pairs
from .blockwise import attention_forward, normalize
from .checks import head_dim_limit, require_cache_dtypes, require_params
from .masks import MaskRule


def local_tokens(cache, block_tables, fp8_packed: bool = False):
    """``[n_blocks, kv_heads, block, D]`` pages (or packed FP8 K pages) -> ``[max_blocks * block, D]`` local tokens
    of KV head 0, in the order of ``block_tables[0]``."""
    if fp8_packed:
        cache = unpack_token_pairs(cache)
    pages = cache[block_tables[0], 0]  # [max_blocks, block, D]
    return pages.reshape(-1, pages.shape[-1])


def merge_partials(out, row_max, row_sum):
    """Merge per-rank softmax partials along axis 0: ``out [G, ..., D]`` (normalised), statistics ``[G, ...]``."""
    top = row_max.max(axis=0)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    weight = jnp.where(row_sum == 0, 0.0, row_sum * jnp.exp(row_max - top))  # a NaN partial stays NaN
    total = weight.sum(axis=0)
    return normalize((weight[..., None] * out).sum(axis=0), total)


def reference_attention_kv_parallel_segmented_cte(
    q,
    k_cache,
    v_cache,
    block_tables,
    kvp_q_offset,
    kvp_rank_id=None,
    valid_num_prior_tokens=None,
    k_scale=None,
    v_scale=None,
    *,
    replica_groups,
    group_size,
    block_size,
    scale=1.0,
    tp_out=False,
    sliding_window=0,
    kvp_group_size=0,
    fp8_packed=False,
    **tiling,
):
    """JAX reference (inside ``shard_map`` over ``replica_groups``); see the module docstring."""
    del valid_num_prior_tokens, tiling, group_size  # tiling only (see the module docstring); group size = axis size
    axes = lax_axis(replica_groups)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    keys = local_tokens(k_cache, block_tables, fp8_packed).astype(acc)
    values = local_tokens(v_cache, block_tables).astype(acc)
    if k_scale is not None:
        keys = keys * k_scale[: keys.shape[-1], 0]
    if v_scale is not None:
        values = values * v_scale[0, 0]
    heads = q.shape[0]
    q_full = lax.all_gather(q, axes, axis=0, tiled=True)  # [G * QH, S, D]
    round_robin = dict(k_block=block_size, k_groups=kvp_group_size, k_rank=kvp_rank_id[0, 0]) if kvp_group_size else {}
    rule = MaskRule(
        n_queries=q.shape[1],
        n_active=keys.shape[0],
        q_base=kvp_q_offset[0, 0],
        causal=True,
        window=sliding_window,
        **round_robin,
    )
    out, row_max, row_sum = attention_forward(
        q_full[None], keys.astype(q.dtype)[None], values.astype(q.dtype)[None], rule, scale
    )
    # rank g's partials for the heads of rank r go to rank r: [G (heads' owner), QH, ...] -> [G (source), QH, ...]
    exchanged = [
        lax.all_to_all(x[0].reshape(-1, heads, *x.shape[2:]), axes, 0, 0, tiled=True) for x in (out, row_max, row_sum)
    ]
    merged = merge_partials(*exchanged).astype(q.dtype)
    return (jnp.swapaxes(merged, 1, 2) if tp_out else merged,)


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    require_params(call, ("group_size", "block_size", "seg_size"), positive=True)
    if p["replica_groups"] is None:
        raise ValueError(f"{function}: `replica_groups` is required: the mesh axis name(s) of the KV-parallel group")
    size = bound_axis_size(p["replica_groups"])
    if size is not None and size != p["group_size"]:
        raise ValueError(
            f"{function}: group_size={p['group_size']} but the replica group {p['replica_groups']} has {size} ranks"
        )
    if dims["kv_heads"] != 1:
        raise ValueError(
            f"{function}: the kernel reads KV head 0 only; k_cache/v_cache must have one KV head "
            f"([n_blocks, 1, block, D]); got {dims['kv_heads']}"
        )
    block = 2 * dims["half_block"] if p["fp8_packed"] else dims["block"]
    if block != p["block_size"] or dims["block"] != p["block_size"]:
        raise ValueError(
            f"{function}: block_size={p['block_size']} does not match the caches' block axis {block}"
            + (" (packed pairs x 2)" if p["fp8_packed"] else "")
        )
    if p["seg_size"] % p["block_size"]:
        raise ValueError(f"{function}: seg_size={p['seg_size']} must be a multiple of block_size={p['block_size']}")
    if p["kvp_group_size"] < 0 or p["sliding_window"] < 0:
        raise ValueError(f"{function}: kvp_group_size and sliding_window must be >= 0")
    if p["kvp_group_size"] and avals.get("kvp_rank_id") is None:
        raise ValueError(f"{function}: round-robin KV (kvp_group_size > 0) needs `kvp_rank_id` [1, 1] int32")
    if p["apc_mode"] and avals.get("valid_num_prior_tokens") is None:
        raise ValueError(f"{function}: apc_mode=True needs `valid_num_prior_tokens` [1, 1] int32")
    require_cache_dtypes(call)
    if p["fp8_packed"] and avals["k_cache"].dtype not in FP8_DTYPES:
        raise TypeError(f"{function}: fp8_packed needs an FP8 k_cache; got {avals['k_cache'].dtype}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, p, unmet = call.dims, call.params, head_dim_limit(call)
    if dims["S"] % p["seg_size"]:
        unmet.append(f"S={dims['S']} must be a multiple of seg_size={p['seg_size']}")
    if (dims["QH"] * p["group_size"]) % call.lnc:
        unmet.append(f"total heads {dims['QH']} x {p['group_size']} must divide over LNC={call.lnc}")
    return unmet


def _outputs(call: CallInfo):
    """``out [QH, S, d]`` (``[QH, d, S]`` with ``tp_out``) in q's dtype."""
    layout = "QH, d, S" if call.params["tp_out"] else "QH, S, d"
    return [("out", call.shape(layout), call.avals["q"].dtype)]


ATTENTION_KV_PARALLEL_SEGMENTED_CTE_SPEC = KernelSpec(
    name="attention_kv_parallel_segmented_cte",
    entry_point="nkilib.core.attention.attention_kv_parallel_segmented_cte:attention_kv_parallel_segmented_cte",
    operands=(
        Operand.of("q", "QH, S, d"),
        Operand.switched(
            "k_cache",
            "fp8_packed",
            {False: "n_blocks, kv_heads, block, d", True: "n_blocks, kv_heads, half_block, d, 2"},
            dtypes=CACHE_DTYPES,
        ),
        Operand.of("v_cache", "n_blocks, kv_heads, block, d", dtypes=CACHE_DTYPES),
        Operand.of("block_tables", "1, max_blocks", dtypes=INT_DTYPES),
        Operand.of("kvp_q_offset", "1, 1", dtypes=INT_DTYPES),
        Operand.of("kvp_rank_id", "1, 1", dtypes=INT_DTYPES, optional=True),
        Operand.of("valid_num_prior_tokens", "1, 1", dtypes=INT_DTYPES, optional=True),
        Operand.of("k_scale", "128, 1", dtypes=(jnp.float32,), optional=True),
        Operand.of("v_scale", "128, 1", dtypes=(jnp.float32,), optional=True),
    ),
    params=(
        Param("replica_groups", None, "axis", required=True),
        *(Param(name, None, int, required=True) for name in ("group_size", "block_size", "seg_size")),
        Param("scale", 1.0, float),
        Param("global_q_offset", 0, int),
        Param("tp_out", False, bool),
        Param("sliding_window", 0, int),
        Param("kvp_group_size", 0, int),
        Param("apc_mode", False, bool),
        Param("fp8_packed", False, bool),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_attention_kv_parallel_segmented_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    # a vmapped axis folds into this rank's query heads (the gathered heads keep the rank-major order)
    fold_plans=(
        FoldPlan(
            {
                "q": "QH",
                "k_cache": None,
                "v_cache": None,
                "block_tables": None,
                "kvp_q_offset": None,
                "kvp_rank_id": None,
                "valid_num_prior_tokens": None,
                "k_scale": None,
                "v_scale": None,
            },
            outputs={"out": 0},
        ),
    ),
    has_collectives=True,
    mac_count=lambda call: (
        2
        * call.dims["QH"]
        * call.params["group_size"]
        * call.dims["S"]
        * call.dims["max_blocks"]
        * call.params["block_size"]
        * call.dims["d"]
    ),
    family="attention",
    catalog="row 46",
    support={
        "vjp": "JAX (differentiates the reference, collectives included; no backward kernel)",
        "shard_map": "inside jax.shard_map only: replica_groups names the KV-parallel mesh axes (collectives)",
        "notes": "contiguous or round-robin KV shards, FP8 (packed) caches; one KV head",
    },
)

attention_kv_parallel_segmented_cte = make_kernel(ATTENTION_KV_PARALLEL_SEGMENTED_CTE_SPEC, vjp=reference_vjp)
