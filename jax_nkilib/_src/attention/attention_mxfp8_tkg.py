"""``attention_mxfp8_tkg`` (catalog row 47, Trn3, docs-only): decode attention over an MXFP8 block KV cache.

Layouts: ``q [B, H, s_active, d]``; ``k_active, v_active [B, s_active, d]``; ``k_prior, v_prior [num_blocks, 32,
160]`` float32 words, one 128-token block each (:func:`jax_nkilib._src.quant.mx.encode_mx_block`: 128 columns of
``float8_e4m3fn_x4`` words in the swizzled ``[d // 4, 4 * 128]`` layout, then 32 columns of e8m0 scale bytes, 4 per
word, valid in rows 0..3; K blocks contract ``d``, V blocks the tokens); ``mask [B, H, s_active, s_prior +
s_active]`` (nonzero = attend; the first ``s_prior`` columns cover the cache tokens, the last ``s_active`` the
active tokens, whose causality the caller encodes); ``identity_hbm [>=128, >=128]`` bfloat16 (the kernel's PE
reductions; unused by the math); ``active_blocks_table [B, n] int32`` (row ``b``'s cache is the concatenation of
blocks ``table[b]``, entries in ``[0, num_blocks)``; ``None`` = blocks ``0..num_blocks-1`` in order). Output
``[B, H, s_active, d]`` bfloat16.
``d = 128`` is fixed by the block format; cache tokens at or past ``s_prior`` are masked.

Semantics (the kernel's MXFP8 datapath, LNC=1). Query rows are ``r = h * s_active + s``. ``q``, ``k_active`` and
``v_active`` are read as bfloat16 (the kernel's only input dtype); ``q * (1/sqrt(d))`` is rounded to bfloat16.
MXFP8 round trips (:func:`~jax_nkilib._src.quant.mx.mx_round_trip`, blocks of 32 consecutive elements along the
matmul contraction, as the kernel's swizzle + ``quantize_mx`` make them): the scaled q along ``d``; per 2048-token
chunk (16 blocks of the table) ``scores = q_rt . k`` (float32), masked to -65504 and rounded to bfloat16; online
softmax with running max starting at -1e38: ``m' = max(m, max scores)``, ``c = exp(m - m')``, ``p = bf16(exp(scores
- m'))``, ``l = l c + sum p``, ``acc = acc c + mx(p) . v`` with ``p`` quantized along the tokens. The active tokens
are one more chunk: ``k_active`` quantized along ``d``, ``v_active`` along the tokens, padded with masked zero
tokens to 2048 (the kernel computes the whole chunk; this matters only to rows that see nothing, whose output is
then the mean of every V row, padding included). ``out = bf16(acc * (1 / l))``.

Where this deliberately differs from the torch reference ``attention_mxfp8_tkg_torch_ref`` (which the kernel's
tests compare with a tolerance): that reference quantizes q, the active K/V and the probabilities in 8-row x 4-column
blocks of the unswizzled arrays and keeps q * scale and exp(scores - m) in float32; the kernel (and this reference)
quantizes 32 consecutive contraction elements from bfloat16 tiles. Its manual cache decoder reads NaN element
bytes as +-480; here they stay NaN. With LNC=2 the kernel splits the chunks between the two cores (each with its own
running max) and merges the partial softmax states, which changes roundings slightly; this reference is the LNC=1
order. On CPU the chunking extends to any number of blocks (a last partial chunk) and any H, s_active.

The output is piecewise constant in every float input (all pass through bf16/MXFP8 rounding), so reverse mode
gives zero cotangents. The newer kernel requires ``identity_hbm`` and ``active_blocks_table``; an older revision
(mask ``[B, H, 1, s_prior]``, ``s_active = 1``) is not bound.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..framework.primitive import make_kernel, zero_cotangents
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Output
from ..quant import mx
from .checks import require_same_dtype

D_HEAD = 128  # the block format fixes d: a block is 128 tokens x 128 head dims
BLOCK_TOKENS = 128
CHUNK_BLOCKS = 16  # 4 folds of 4 blocks: 2048 tokens per online-softmax step
CHUNK_TOKENS = CHUNK_BLOCKS * BLOCK_TOKENS
MASKED_SCORE = -65504.0  # the kernel's select_reduce fill (bfloat16 rounds it to -65536)
RUNNING_MAX_INIT = -1e38
KERNEL_HEADS = (32, 64)
KERNEL_S_ACTIVE = (1, 2, 4, 8)
MASK_DTYPES = (jnp.uint8, jnp.bool_)
_HIGHEST = jax.lax.Precision.HIGHEST


def _softmax_step(state, q_rt, keys, values, visible):
    """One online-softmax chunk: ``keys, values [B, T, d]`` float32 (dequantized), ``visible [B, rows, T]``."""
    running_max, running_sum, acc = state
    scores = jnp.einsum("brd,btd->brt", q_rt, keys, precision=_HIGHEST)
    scores = jnp.where(visible, scores, MASKED_SCORE).astype(jnp.bfloat16).astype(jnp.float32)
    new_max = jnp.maximum(running_max, scores.max(axis=-1, keepdims=True))
    correction = jnp.exp(running_max - new_max)
    probs = jnp.exp(scores - new_max).astype(jnp.bfloat16)  # the kernel's bf16 score tile, in place
    running_sum = running_sum * correction + probs.astype(jnp.float32).sum(axis=-1, keepdims=True)
    update = jnp.einsum("brt,btd->brd", mx.mx_round_trip(probs, axis=-1), values, precision=_HIGHEST)
    return new_max, running_sum, acc * correction + update


def _cache_chunk(k_prior, v_prior, blocks):
    """Dequantized ``(keys, values) [B, n * 128, d]`` of cache blocks ``blocks [B, n]``."""
    keys = mx.decode_mx_block(k_prior[blocks], "d_head")  # [B, n, 128, d]
    values = mx.decode_mx_block(v_prior[blocks], "block_len")
    batch, n = blocks.shape
    return keys.reshape(batch, n * BLOCK_TOKENS, -1), values.reshape(batch, n * BLOCK_TOKENS, -1)


def reference_attention_mxfp8_tkg(
    q, k_active, v_active, k_prior, v_prior, mask, identity_hbm=None, active_blocks_table=None
):
    """JAX reference of ``attention_mxfp8_tkg``: ``(out [B, H, s_active, d] bfloat16,)`` (see the module doc)."""
    del identity_hbm  # the kernel's PE-reduction operand
    batch, heads, s_active, d = q.shape
    rows = heads * s_active
    scaled = (q.astype(jnp.bfloat16).astype(jnp.float32) * jnp.float32(1.0 / math.sqrt(d))).astype(jnp.bfloat16)
    q_rt = mx.mx_round_trip(scaled.reshape(batch, rows, d), axis=-1)
    visible = (mask != 0).reshape(batch, rows, mask.shape[-1])
    s_prior = mask.shape[-1] - s_active
    table = active_blocks_table
    if table is None:
        table = jnp.broadcast_to(jnp.arange(k_prior.shape[0], dtype=jnp.int32), (batch, k_prior.shape[0]))
    n_blocks = table.shape[1]
    n_tokens = n_blocks * BLOCK_TOKENS
    prior_visible = jnp.pad(visible[..., :s_prior], ((0, 0), (0, 0), (0, n_tokens - s_prior)))
    state = (
        jnp.full((batch, rows, 1), RUNNING_MAX_INIT, jnp.float32),
        jnp.zeros((batch, rows, 1), jnp.float32),
        jnp.zeros((batch, rows, d), jnp.float32),
    )

    def chunk(state, blocks_and_visible):
        blocks, chunk_visible = blocks_and_visible
        return _softmax_step(state, q_rt, *_cache_chunk(k_prior, v_prior, blocks), chunk_visible), None

    n_full = n_blocks // CHUNK_BLOCKS
    if n_full:
        tables = jnp.moveaxis(table[:, : n_full * CHUNK_BLOCKS].reshape(batch, n_full, CHUNK_BLOCKS), 1, 0)
        masks = jnp.moveaxis(
            prior_visible[..., : n_full * CHUNK_TOKENS].reshape(batch, rows, n_full, CHUNK_TOKENS), 2, 0
        )
        state, _ = jax.lax.scan(chunk, state, (tables, masks))
    if n_blocks % CHUNK_BLOCKS:  # CPU extension: a last partial chunk
        state, _ = chunk(state, (table[:, n_full * CHUNK_BLOCKS :], prior_visible[..., n_full * CHUNK_TOKENS :]))

    width = CHUNK_TOKENS * -(-s_active // CHUNK_TOKENS)  # the active chunk, padded with masked zero tokens
    keys = mx.mx_round_trip(k_active.astype(jnp.bfloat16), axis=-1)  # contraction d
    values = mx.mx_round_trip(v_active.astype(jnp.bfloat16), axis=-2)  # contraction: the tokens
    pad = ((0, 0), (0, width - s_active), (0, 0))
    state = _softmax_step(
        state,
        q_rt,
        jnp.pad(keys, pad),
        jnp.pad(values, pad),
        jnp.pad(visible[..., s_prior:], ((0, 0), (0, 0), (0, width - s_active))),
    )
    _, running_sum, acc = state
    out = (acc * (1.0 / running_sum)).astype(jnp.bfloat16)
    return (out.reshape(batch, heads, s_active, d),)


def _check(call: CallInfo) -> None:
    dims, function = call.dims, call.function
    if dims["d"] != D_HEAD:
        raise ValueError(
            f"{function}: q, k_active and v_active must have d = {D_HEAD}, fixed by the MXFP8 cache "
            f"block [num_blocks, 32, 160] (128 tokens x 128 head dims); got d = {dims['d']}"
        )
    require_same_dtype(call, ("q", "k_active", "v_active"), "q, k_active and v_active")
    n_keys, s_active = dims["n_keys"], dims["s_active"]
    bucket = dims.get("n_table", dims["n_blocks"]) * BLOCK_TOKENS
    if not s_active <= n_keys <= bucket + s_active:
        raise ValueError(
            f"{function}: mask must be [B, H, s_active, s_prior + s_active] with 0 <= s_prior <= "
            f"{bucket} (the cache's 128-token blocks); got a last axis of {n_keys} for "
            f"s_active = {s_active}"
        )
    identity = call.avals.get("identity_hbm")
    if identity is not None and min(identity.shape) < 128:
        raise ValueError(
            f"{function}: identity_hbm must be a [>=128, >=128] bfloat16 identity; got shape {tuple(identity.shape)}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    avals, dims, unmet = call.avals, call.dims, []
    if avals["q"].dtype != jnp.bfloat16:
        unmet.append(f"q, k_active and v_active must be bfloat16; got {avals['q'].dtype}")
    if dims["H"] not in KERNEL_HEADS:
        unmet.append(f"H={dims['H']} query heads must be 32 or 64")
    if dims["s_active"] not in KERNEL_S_ACTIVE:
        unmet.append(f"s_active={dims['s_active']} must be 1, 2, 4 or 8")
    if dims["n_blocks"] % CHUNK_BLOCKS:
        unmet.append(f"num_blocks={dims['n_blocks']} must be a multiple of {CHUNK_BLOCKS} (2048-token chunks)")
    if avals["mask"].dtype != jnp.uint8:
        unmet.append(f"mask must be uint8; got {avals['mask'].dtype}")
    if avals.get("identity_hbm") is None:
        unmet.append("the kernel needs identity_hbm (a [128, 128] bfloat16 identity)")
    if avals.get("active_blocks_table") is None:
        unmet.append("the kernel needs active_blocks_table (pass the sequential table for a contiguous cache)")
    elif dims["n_table"] != dims["n_blocks"]:
        unmet.append(f"active_blocks_table must be [B, num_blocks={dims['n_blocks']}]; got {dims['n_table']} columns")
    return unmet


def _mac_count(call: CallInfo) -> int:
    dims = call.dims
    tokens = dims.get("n_table", dims["n_blocks"]) * BLOCK_TOKENS + CHUNK_TOKENS
    return 2 * dims["B"] * dims["H"] * dims["s_active"] * tokens * dims["d"]


ATTENTION_MXFP8_TKG_SPEC = KernelSpec(
    name="attention_mxfp8_tkg",
    entry_point="nkilib.experimental.attention_mxfp8.attention_mxfp8_tkg:attention_mxfp8_tkg",
    operands=(
        Operand.of("q", "B, H, s_active, d", dtypes=FLOAT_DTYPES),
        Operand.of("k_active", "B, s_active, d", dtypes=FLOAT_DTYPES),
        Operand.of("v_active", "B, s_active, d", dtypes=FLOAT_DTYPES),
        Operand.of("k_prior", "n_blocks, 32, 160", dtypes=(jnp.float32,), doc="MXFP8 K blocks (float32 words)"),
        Operand.of("v_prior", "n_blocks, 32, 160", dtypes=(jnp.float32,), doc="MXFP8 V blocks (float32 words)"),
        Operand.of("mask", "B, H, s_active, n_keys", dtypes=MASK_DTYPES),
        Operand.of("identity_hbm", "id_rows, id_cols", dtypes=(jnp.bfloat16,), optional=True),
        Operand.of("active_blocks_table", "B, n_table", dtypes=INT_DTYPES, optional=True),
    ),
    params=(),
    outputs=(Output.of("out_hbm", "B, H, s_active, d", "bfloat16"),),
    reference=reference_attention_mxfp8_tkg,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                "q": "B",
                "k_active": "B",
                "v_active": "B",
                "mask": "B",
                "active_blocks_table": "B",
                "k_prior": None,
                "v_prior": None,
                "identity_hbm": None,
            },
            outputs=("B",),
        ),
    ),
    mac_count=_mac_count,
    family="attention",
    catalog="row 47",
    support={
        "idiomatic": "",
        "vjp": "zero cotangents (every float input is MXFP8/bf16-rounded; no backward kernel)",
        "notes": f"MXFP8 block KV cache [num_blocks, 32, 160], d={D_HEAD}; Neuron: bf16, "
        f"H in {{{', '.join(map(str, KERNEL_HEADS))}}}, s_active in {{{', '.join(map(str, KERNEL_S_ACTIVE))}}}, "
        f"num_blocks % {CHUNK_BLOCKS} == 0, identity_hbm and active_blocks_table given (Trn3); "
        "reference emulates the kernel's MXFP8 datapath at LNC=1",
    },
)

# zero gradients: every float input passes through bf16/MXFP8 rounding (the output is piecewise constant)
attention_mxfp8_tkg = make_kernel(ATTENTION_MXFP8_TKG_SPEC, vjp=zero_cotangents)
