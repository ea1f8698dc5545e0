"""``attention_segmented_cte`` (catalog row 45, docs-only; semantics of its torch reference): prefill attention over
a paged (block) KV cache that already holds the prior *and* the active tokens.

Layouts: ``q [bs * num_q_heads, Sq, d]`` (``tp_q=True``) or ``[bs * num_q_heads, d, Sq]``; ``k_cache, v_cache
[num_blocks, kv_heads, block_size, d]`` (``k_pre_transposed``: ``k_cache [num_blocks * kv_heads, d, block_size]``);
``block_tables [bs, max_blocks]`` int32; ``prior_tokens [1, 1]`` int32 (runtime); ``sink [bs * num_q_heads, 1]``;
``k_scale``/``v_scale [128, 1]`` float32. Output ``[bs * num_q_heads, Sq, d]`` (``tp_out=True``: ``[.., d, Sq]``).

Semantics: query row ``r`` belongs to sequence ``r // num_q_heads`` and reads KV head
``(r % num_q_heads) * kv_heads // num_q_heads``. The sequence's tokens are its first ``(prior_tokens + Sq) /
block_size`` blocks in order (a ``-1`` entry indexes the last block, as in the reference); token ``t`` has position
``t`` and query ``i`` has position ``prior_tokens + i``. Query ``i`` sees every token at position ``<= prior_tokens
+ i`` (causal over the active segment, all prior tokens), and with ``sliding_window = w`` only positions
``> prior_tokens + i - w``. ``scale`` multiplies the scores; ``sink`` adds one logit per row; ``k_scale``/``v_scale``
multiply the cache by their first element (the reference's delayed dequantisation). Float32 softmax.

``fp8_packed``: an FP8 K cache ``[num_blocks, kv_heads, block_size / 2, d, 2]`` holding tokens ``2i`` and ``2i + 1``
of a block in its trailing pair (V stays token-major); FP8 caches are upcast and multiplied by the scales. The
KV-parallel parameters (``kvp_*``) are the inner interface that
``attention_kv_parallel_segmented_cte`` drives (bound as that kernel); here they are rejected.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    INT_DTYPES,
    CallInfo,
    FoldPlan,
    KernelSpec,
    Operand,
    Param,
)
from .blockwise import attention_forward, group_queries, ungroup_queries
from .checks import head_dim_limit, require_cache_dtypes, require_params
from .masks import MaskRule

CACHE_DTYPES = FLOAT_DTYPES + FP8_DTYPES
_KVP_DEFAULTS = {
    "kvp_group_size": 0,
    "kvp_cp_offset_int": 0,
    "kvp_seg_block_offset_int": 0,
    "kvp_prior_load_blocks": 0,
    "kvp_prior_fully_visible": False,
}


def unpack_token_pairs(cache):
    """Packed FP8 K pages ``[n, kv_heads, block / 2, d, 2]`` (tokens ``2i`` and ``2i + 1`` in the trailing pair)
    -> ``[n, kv_heads, block, d]``."""
    n, heads, half, d, _ = cache.shape
    return jnp.swapaxes(cache, 3, 4).reshape(n, heads, 2 * half, d)


def _sequence_cache(cache, block_tables, kv_heads: int):
    """[num_blocks, kv_heads, block, d] pages -> [bs * kv_heads, max_blocks * block, d] per-sequence caches."""
    pages = cache[block_tables]  # [bs, max_blocks, kv_heads, block, d]
    bs, max_blocks, _, block, d = pages.shape
    return jnp.transpose(pages, (0, 2, 1, 3, 4)).reshape(bs * kv_heads, max_blocks * block, d)


def reference_attention_segmented_cte(
    q,
    k_cache,
    v_cache,
    block_tables,
    prior_tokens,
    sink=None,
    k_scale=None,
    v_scale=None,
    *,
    block_size,
    prior_seg_size,
    scale=1.0,
    tp_q=True,
    tp_out=False,
    sliding_window=None,
    num_q_heads=1,
    k_pre_transposed=False,
    fp8_packed=False,
    **unused,
):
    """JAX reference of ``attention_segmented_cte`` (blockwise online softmax over the gathered pages)."""
    # prior_seg_size is the kernel's tiling and the kvp_* knobs are rejected by the checks; block_size and
    # num_q_heads equal what the shapes say (checked), so the values follow from the operands alone
    del prior_seg_size, block_size, num_q_heads, unused
    kv_heads = v_cache.shape[1]
    if fp8_packed:
        k_cache = unpack_token_pairs(k_cache)
    if k_pre_transposed:  # [num_blocks * kv_heads, d, block] -> [num_blocks, kv_heads, block, d]
        k_cache = jnp.swapaxes(k_cache.reshape(-1, kv_heads, *k_cache.shape[1:]), 2, 3)
    acc = jnp.promote_types(q.dtype, jnp.float32)
    keys, values = (_sequence_cache(c, block_tables, kv_heads) for c in (k_cache, v_cache))
    if k_scale is not None:
        keys = (keys.astype(acc) * k_scale.reshape(-1)[0]).astype(q.dtype)
    if v_scale is not None:
        values = (values.astype(acc) * v_scale.reshape(-1)[0]).astype(q.dtype)
    queries = q if tp_q else jnp.swapaxes(q, 1, 2)  # [bs * num_q_heads, Sq, d]
    seq_q = queries.shape[1]
    rows_kv = keys.shape[0]  # bs * kv_heads; q rows are (sequence, kv head, group) in that order
    rule = MaskRule(
        n_queries=seq_q,
        n_active=keys.shape[1],
        q_base=prior_tokens.reshape(()).astype(jnp.int32),
        causal=True,
        window=sliding_window or 0,
    )
    sink_rows = None if sink is None else group_queries(sink, rows_kv)
    out, _, _ = attention_forward(
        group_queries(queries, rows_kv), keys.astype(q.dtype), values.astype(q.dtype), rule, scale, sink_rows
    )
    out = ungroup_queries(out).astype(q.dtype)
    return (jnp.swapaxes(out, 1, 2) if tp_out else out,)


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    require_params(call, ("block_size", "prior_seg_size"), positive=False)
    if p["k_pre_transposed"] and dims["n_kv_blocks"] != dims["n_blocks"] * dims["kv_heads"]:
        raise ValueError(
            f"{function}: with k_pre_transposed, k_cache must be [num_blocks * kv_heads, d, block]; got "
            f"{dims['n_kv_blocks']} rows for {dims['n_blocks']} blocks of {dims['kv_heads']} heads"
        )
    if p["fp8_packed"] and (avals["k_cache"].dtype not in FP8_DTYPES or 2 * dims["half_block"] != dims["block"]):
        raise ValueError(
            f"{function}: fp8_packed needs an FP8 k_cache [n_blocks, kv_heads, block_size / 2, d, 2]; "
            f"got {avals['k_cache'].dtype} {tuple(avals['k_cache'].shape)}"
        )
    changed = [name for name, default in _KVP_DEFAULTS.items() if p[name] != default]
    changed += [name for name in ("kvp_q_offset", "kvp_rank_id") if avals.get(name) is not None]
    if changed:
        raise ValueError(
            f"{function}: the KV-parallel arguments ({', '.join(changed)}) are the inner interface of "
            "attention_kv_parallel_segmented_cte; call jax_nkilib.nki.attention_kv_parallel_segmented_cte"
        )
    if dims["BQ"] % p["num_q_heads"] or dims["BQ"] // p["num_q_heads"] != dims["bs"]:
        raise ValueError(
            f"{function}: q has {dims['BQ']} rows; it must be bs * num_q_heads = {dims['bs']} * {p['num_q_heads']}"
        )
    kv_heads = dims["kv_heads"]
    if p["num_q_heads"] % kv_heads:
        raise ValueError(f"{function}: num_q_heads={p['num_q_heads']} must be a multiple of kv_heads={kv_heads}")
    if dims["block"] != p["block_size"]:
        raise ValueError(
            f"{function}: block_size={p['block_size']} does not match the caches' block axis {dims['block']}"
        )
    if p["prior_seg_size"] <= 0 or p["prior_seg_size"] % p["block_size"]:
        raise ValueError(
            f"{function}: prior_seg_size must be a positive multiple of block_size; got {p['prior_seg_size']}"
        )
    require_cache_dtypes(call)


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, head_dim_limit(call)
    if dims["Sq"] % call.params["block_size"]:
        unmet.append(f"Sq={dims['Sq']} must be a multiple of block_size={call.params['block_size']}")
    return unmet


def _outputs(call: CallInfo):
    """``out [BQ, Sq, d]`` (``[BQ, d, Sq]`` with ``tp_out``) in q's dtype."""
    layout = "BQ, d, Sq" if call.params["tp_out"] else "BQ, Sq, d"
    return [("out", call.shape(layout), call.avals["q"].dtype)]


ATTENTION_SEGMENTED_CTE_SPEC = KernelSpec(
    name="attention_segmented_cte",
    entry_point="nkilib.core.attention.attention_segmented_cte:attention_segmented_cte",
    operands=(
        Operand.switched("q", "tp_q", {True: "BQ, Sq, d", False: "BQ, d, Sq"}),
        Operand.switched(
            "k_cache",
            ("k_pre_transposed", "fp8_packed"),
            {
                (False, False): "n_blocks, kv_heads, block, d",
                (True, False): "n_kv_blocks, d, block",
                (False, True): "n_blocks, kv_heads, half_block, d, 2",
            },
            dtypes=CACHE_DTYPES,
        ),
        Operand.of("v_cache", "n_blocks, kv_heads, block, d", dtypes=CACHE_DTYPES),
        Operand.of("block_tables", "bs, max_blocks", dtypes=INT_DTYPES),
        Operand.of("prior_tokens", "1, 1", dtypes=INT_DTYPES),
        Operand.of("sink", "BQ, 1", optional=True),
        Operand.of("k_scale", "128, 1", dtypes=(jnp.float32,), optional=True),
        Operand.of("v_scale", "128, 1", dtypes=(jnp.float32,), optional=True),
        Operand.of("kvp_q_offset", "1, 1", dtypes=INT_DTYPES, optional=True),
        Operand.of("kvp_rank_id", "1, 1", dtypes=INT_DTYPES, optional=True),
    ),
    params=(
        Param("block_size", None, int, required=True),
        Param("prior_seg_size", None, int, required=True),
        Param("scale", 1.0, float),
        Param("tp_q", True, bool),
        Param("tp_out", False, bool),
        Param("sliding_window", None, int),
        Param("num_q_heads", 1, int),
        Param("k_pre_transposed", False, bool),
        Param("fp8_packed", False, bool),
        Param("kvp_group_size", 0, int),
        Param("kvp_cp_offset_int", 0, int),
        Param("kvp_seg_block_offset_int", 0, int),
        Param("kvp_prior_load_blocks", 0, int),
        Param("kvp_prior_fully_visible", False, bool),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_attention_segmented_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                "q": "BQ",
                "block_tables": "bs",
                "sink": "BQ",
                "k_cache": None,
                "v_cache": None,
                "prior_tokens": None,
                "k_scale": None,
                "v_scale": None,
                "kvp_q_offset": None,
                "kvp_rank_id": None,
            },
            outputs={"out": 0},
        ),
    ),
    mac_count=lambda call: (
        2 * call.dims["BQ"] * call.dims["Sq"] * call.dims["max_blocks"] * call.dims["block"] * call.dims["d"]
    ),
    family="attention",
    catalog="row 45",
    support={
        "idiomatic": "",
        "vjp": "JAX (differentiates the reference; no backward kernel)",
        "notes": "paged prefill over a cache holding prior and active tokens; FP8 (packed) caches; kvp_* are "
        "the inner interface of attention_kv_parallel_segmented_cte",
    },
)

attention_segmented_cte = make_kernel(ATTENTION_SEGMENTED_CTE_SPEC, vjp=reference_vjp)
