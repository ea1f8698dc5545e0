"""``sparse_attention_indexer_mx_bf16score`` (catalog row 53, docs-only): DeepSeek-V3.2's sparse attention indexer
with its MX or BF16 projections, the flat top-k output and the context-parallel phases.

Source followed: the newer nki-library source in the public code index,
``experimental/sparse_attention_indexer/sparse_attention_indexer_mx_bf16score.py`` (kernel),
``sparse_attention_indexer_mx_bf16score_torch.py`` (``sparse_attention_indexer_mx_bf16score_torch_ref``),
``sparse_attention_indexer_torch.py`` (``_block32_mx_quant_dequant``), ``sparse_attention_indexer_utils.py``
(``topk_over_score``, ``validate_sai_config``), ``sparse_attention_indexer_mx_bf16score_helpers.py``
(``score_against_cache_bf16``) and the test helpers (MX packing). Its signature adds ``compact_scales``,
``precision``, ``rope_layout`` and ``qr_bf16_hbm`` to the 2.32 API reference's (which has only the MX mode). The
adapter (``jax_nkilib_kernels/indexer.py``) passes ``emit_flat_topk=True``, and the newer arguments only when a call
uses them (the MX mode with half-split RoPE and native scales is 2.32's call). Not bound: the snake and tiled top-k
layouts, and the pre-cast/pre-quantized ``x_non_mx``/``x_mx_data``/``x_mx_scale`` inputs (the kernel makes them itself).

Layouts: ``x [M, dim]`` (``M = B*S``, batch-major rows), ``k_norm_gamma``/``k_norm_beta [D]``,
``weights_proj [H, dim]``, ``cos``/``sin [S, R/2]`` (rows: this call's positions), ``k_cache [B, D, T]``
(``T >= end``), ``mask [M, end]`` additive; ``end = start_pos + S``. ``precision="BF16"``: ``wq_b [Q, H*D]``,
``wk [dim, D]``, ``qr_bf16_hbm [M, Q]`` (q-normed compressed query). ``precision="MX"`` (the kernel's default):
``wq_b [Q/4, H*D]`` and ``wk [dim/4, D]`` x4 words with ``wq_b_scale``/``wk_scale``, and the swizzled
``qr_qtz_hbm``/``qr_scale_hbm [ceil(M/128), 128, Q/512, 128]`` of an upstream QKV kernel (layouts in
:mod:`.sparse_attention_indexer_mx`). Outputs ``index_score [M, end]`` float32, ``topk_indices [M, index_topk]``
int32 and the updated ``k_cache``.

Math per batch ``b`` and query row ``s`` (``bf()`` rounds to bfloat16, ``mx()`` is an MX block-32 fp8 round trip
along the contraction; float32 otherwise)::

    BF16: xk = bf(x), Wk = bf(wk), qr = bf(qr_bf16_hbm), Wq = bf(wq_b)
    MX:   xk = mx(x), Wk, Wq = the decoded weights, qr = the decoded qr_qtz_hbm (MX values already)
    k = RoPE_R(LayerNorm_eps=1e-6(xk @ Wk) * gamma + beta)                 # [S, D], RoPE on the first R columns
    q = RoPE_R(qr @ Wq) per head                                           # [S, H, D]
    w = (bf(x) @ bf(weights_proj).T) / sqrt(H * D)                         # [S, H]
    keys[t] = bf(k_cache[b, :, t]) for t < start_pos,  bf(k[t - start_pos]) for start_pos <= t < end
    score[s, t] = sum_h relu(bf(q[s, h]) . keys[t]) * w[s, h]
    index_score = bf(bf(score) + bf(mask))
    topk_indices[s] = positions of the index_topk largest index_score[s, :], ASCENDING by score
    k_cache[b, :, start_pos:end] = bf(k).T

Context-parallel phases (``phase``): ``"all"`` is the above. ``"kproj"`` computes only ``k`` and returns it
seq-major, ``(k_seq_out [M, D],)`` (bf16-rounded, in ``k_cache``'s dtype; the cache is not written). ``"score"``
computes no ``k``: ``keys[t] = bf(k_cache[b, :, t])`` for ``t < end = end_pos_arg`` (default ``start_pos + S``),
the mask is ``[M, end]``, and it returns ``(index_score, topk_indices)`` (the cache is not written). A CP parent runs
``"kproj"`` on each rank's query shard, gathers the ranks' K into the cache, then runs ``"score"`` with
``start_pos = rank * S`` and ``end_pos_arg = ranks * S``.

RoPE pairs ``(x_i, x_{i+R/2})`` (``rope_layout="HALF_SPLIT"``, DeepSeek) or ``(x_{2i}, x_{2i+1})``
(``"INTERLEAVED"``, GLM): ``(a, b) -> (a cos - b sin, a sin + b cos)``. The roundings are the torch reference's
(projection inputs, Q and K to bf16) plus the kernel's bf16 score row and mask (``score_row_sb``/``mask_sb`` are
bf16, and ``nisa.topk`` ranks bf16 values); the reference accumulates in float32 where the kernel's PSUM is bf16.
Other kernel roundings it does not model (the torch reference does not either): Q is stored in bf16 before its
RoPE, the relu'd logits are bf16, and the score row is accumulated head by head in a bf16 buffer.
Prior positions come from ``k_cache`` (the kernel loads them; the torch reference models them as zeros, its tests
use a zero cache). The top-k order is ``nisa.topk``'s ascending order (its ISA reference: "the K largest values in
ascending order"; the kernel's docstring and its golden ``_topk_idx_golden``, which reverses a descending argsort);
between equal scores it is unspecified (the kernel's test compares value sets), and so is the choice among ties at
the k-th place. Caveat: the 2.33 ISA reference adds ``nisa.topk(..., sorted=False)`` and no longer states the order
of unsorted results; the kernel does not pass ``sorted``. The updated cache holds bf16-rounded K in ``k_cache``'s dtype.

Not differentiable (no VJP): it selects positions; the kernel has no backward.

The MX activation rounding ``mx(x)`` uses ``nisa.quantize_mx``'s default scale (the alternative emax 7,
:func:`..quant.mx_weights.quantize_activation`), what the kernel computes as compiled here; the torch reference uses
the OCP rule (emax 8), and re-quantizes the decoded ``qr`` (a no-op for OCP-packed ``qr``), which the kernel
multiplies as it is. ``mx(x)`` starts from float32 ``x`` (the source's host replica of the kernel's in-kernel
quantization, ``_swizzle_and_quantize_x_for_mx``, rounds ``x`` to bf16 first).

Neuron limits (source asserts and the flat top-k scatter): ``D == 128``, ``dim`` and ``Q`` multiples of 128 (BF16)
or 512 (MX), ``dim >= 1024`` in the phases that score (``"all"``, ``"score"``: the W projection
``w_projection_mx_batch`` asserts ``ceil(dim / 128) >= 8``, its 8 PSUM banks), ``index_topk`` a multiple of 16
(the flat scatter writes ``index_topk // 16`` columns per partition) and at most ``end`` rounded up to 16
(``"kproj"``: at least 8, which the kernel asserts in every phase), ``ceil(S / 128) <= 64``; bfloat16
``weights_proj``/``k_cache`` (and BF16's ``qr_bf16_hbm``/``wq_b``/``wk``), float32 ``x`` (the kernel casts it),
``cos``/``sin``/``gamma``/``beta``; LNC 1 in the phases that score (at LNC 2 the source's ``topk_over_score`` compares
global query rows with the core-local query count, so the second core writes none of its flat top-k rows; read
from the source, not checked on hardware).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..framework.validation import require
from ..quant import mx
from ..quant.mx_weights import COMPACT_BLOCK, compact_blocks, decode_weight, quantize_activation
from ..rope.pairs import rotate_pairs
from .sparse_attention_indexer_mx import PARTITIONS, QR_TILE, decode_qr

LAYERNORM_EPS = 1e-6
ROPE_LAYOUTS = ("HALF_SPLIT", "INTERLEAVED")
PHASES = ("all", "kproj", "score")
PRECISIONS = ("MX", "BF16")
KERNEL_HEAD_DIM = 128
MX_OPERANDS = ("wq_b_scale", "wk_scale", "qr_qtz_hbm", "qr_scale_hbm")
TOPK_CHUNKS = 16  # nisa.topk's 16-partition snake: the flat output holds index_topk // 16 columns per partition
MAX_S_TILES = 64
KERNEL_MIN_TOPK = 8  # validate_sai_config: "index_topk must be >= 8 (DVE min)"
MIN_DIM_TILES = 8  # w_projection_mx_batch (the scoring phases): ceil(dim / 128) >= 8, one per PSUM bank


def _bf16(a, dtype):
    return a.astype(jnp.bfloat16).astype(dtype)


def rope(x, cos, sin, layout):
    """RoPE on the last axis of ``x`` (its ``2 * cos.shape[-1]`` columns), pairs by ``layout`` (module doc)."""
    return rotate_pairs(x, cos, sin, interleaved=layout == "INTERLEAVED")


def _rope_head(x, cos, sin, layout):
    r = 2 * cos.shape[-1]
    return jnp.concatenate([rope(x[..., :r], cos, sin, layout), x[..., r:]], axis=-1)


def indexer_keys(xk, wk, gamma, beta, cos, sin, rope_layout, compute):
    """K of the current rows, ``[B, S, D]`` (before its bf16 rounding) from the rounded ``xk`` and ``wk``:
    projection, LayerNorm, RoPE."""
    k = xk @ wk
    mean = jnp.mean(k, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(k - mean), axis=-1, keepdims=True)
    k = (k - mean) * jax.lax.rsqrt(var + LAYERNORM_EPS) * gamma.astype(compute) + beta.astype(compute)
    return _rope_head(k, cos, sin, rope_layout)


def _projection_inputs(x, wq_b, wk, qr, mx_operands, precision, compact_scales, compute):
    """``(xk, Wk, qr, Wq)``, the rounded inputs of the K and Q projections (module doc)."""
    if precision == "BF16":
        return _bf16(x, compute), _bf16(wk, compute), _bf16(qr, compute), _bf16(wq_b, compute)
    wq_b_scale, wk_scale, qr_qtz, qr_scale = mx_operands
    xk = quantize_activation(x).astype(compute)
    wk = decode_weight(wk, wk_scale, compact_scales).astype(compute)
    wq = decode_weight(wq_b, wq_b_scale, compact_scales).astype(compute)
    return xk, wk, decode_qr(qr_qtz, qr_scale, x.shape[0]).astype(compute), wq


def reference_sparse_attention_indexer(
    x,
    wq_b,
    wk,
    k_norm_gamma,
    k_norm_beta,
    weights_proj,
    cos,
    sin,
    k_cache,
    mask,
    wq_b_scale=None,
    wk_scale=None,
    qr_qtz_hbm=None,
    qr_scale_hbm=None,
    qr_bf16_hbm=None,
    *,
    index_topk,
    start_pos=0,
    phase="all",
    end_pos_arg=None,
    compact_scales=False,
    precision="MX",
    rope_layout="HALF_SPLIT",
):
    """JAX reference (module doc): ``phase="all"``: ``(index_score [M, end] f32, topk_indices [M, index_topk] int32,
    k_cache)``; ``"kproj"``: ``(k_seq_out [M, D],)``; ``"score"``: ``(index_score, topk_indices)``."""
    compute = jnp.promote_types(x.dtype, jnp.float32)
    batch, head_dim, _ = k_cache.shape
    heads = weights_proj.shape[0]
    rows, dim = x.shape
    seq = rows // batch
    end = key_end(phase, start_pos, seq, end_pos_arg)
    cs, sn = cos.astype(compute), sin.astype(compute)
    mx_operands = (wq_b_scale, wk_scale, qr_qtz_hbm, qr_scale_hbm)
    xk, wk, qr, wq = _projection_inputs(x, wq_b, wk, qr_bf16_hbm, mx_operands, precision, compact_scales, compute)
    if phase != "score":
        k = indexer_keys(xk.reshape(batch, seq, dim), wk, k_norm_gamma, k_norm_beta, cs, sn, rope_layout, compute)
        k = _bf16(k, compute)
    if phase == "kproj":
        return (k.reshape(rows, head_dim).astype(k_cache.dtype),)
    q = (qr @ wq).reshape(batch, seq, heads, head_dim)
    q = _bf16(_rope_head(q, cs[:, None], sn[:, None], rope_layout), compute)
    w = (_bf16(x, compute) @ _bf16(weights_proj, compute).T).reshape(batch, seq, heads) / math.sqrt(heads * head_dim)
    if phase == "score":
        keys = jnp.swapaxes(_bf16(k_cache[:, :, :end], compute), 1, 2)  # [B, end, D]
    else:
        keys = jnp.concatenate([jnp.swapaxes(_bf16(k_cache[:, :, :start_pos], compute), 1, 2), k], axis=1)
    logits = jnp.einsum("bshd,btd->bsht", q, keys)
    score = jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), w)
    score = _bf16(_bf16(score, compute) + _bf16(mask.reshape(batch, seq, end), compute), compute)
    _, descending = jax.lax.top_k(score, index_topk)
    index_score = score.reshape(rows, end).astype(jnp.float32)
    topk = descending[..., ::-1].reshape(rows, index_topk).astype(jnp.int32)
    if phase == "score":
        return index_score, topk
    updated = jax.lax.dynamic_update_slice(k_cache, jnp.swapaxes(k, 1, 2).astype(k_cache.dtype), (0, 0, start_pos))
    return index_score, topk, updated


def key_end(phase, start_pos, seq, end_pos_arg):
    """The key range ``[0, end)`` scored: ``end_pos_arg`` in the ``"score"`` phase when given, else
    ``start_pos + S``."""
    return end_pos_arg if phase == "score" and end_pos_arg is not None else start_pos + seq


def q_lora_rank(call: CallInfo) -> int:
    """``Q``: ``qr_bf16_hbm``'s width (BF16) or 512 per word-column block of ``qr_qtz_hbm`` (MX)."""
    return call.dims["Q"] if call.params["precision"] == "BF16" else QR_TILE * call.dims["Qt"]


def _check_operand_set(call: CallInfo) -> None:
    function, p = call.function, call.params
    if p["precision"] == "BF16":
        given = [name for name in MX_OPERANDS if call.avals.get(name) is not None]
        require(call.avals.get("qr_bf16_hbm") is not None, function, "precision='BF16' needs qr_bf16_hbm [B*S, Q]")
        require(not given, function, f"precision='BF16' takes no MX operands; got {', '.join(given)}")
        require(not p["compact_scales"], function, "parameter `compact_scales` applies to precision='MX' only")
        return
    missing = [name for name in MX_OPERANDS if call.avals.get(name) is None]
    require(
        not missing,
        function,
        f"precision='MX' needs wq_b_scale, wk_scale, qr_qtz_hbm and qr_scale_hbm; missing {', '.join(missing)}",
    )
    require(
        call.avals.get("qr_bf16_hbm") is None, function, "precision='MX' takes qr_qtz_hbm/qr_scale_hbm, not qr_bf16_hbm"
    )


def _check_mx_layouts(call: CallInfo) -> None:
    function, dims, avals = call.function, call.dims, call.avals
    for name, dtype in (("wq_b", jnp.uint32), ("wk", jnp.uint32), ("qr_qtz_hbm", jnp.uint32)):
        if avals[name].dtype != dtype:
            raise TypeError(f"{function}: {name} must hold uint32 float8_e4m3fn_x4 words; got {avals[name].dtype}")
    for name in ("wq_b_scale", "wk_scale", "qr_scale_hbm"):
        if avals[name].dtype != jnp.uint8:
            raise TypeError(f"{function}: {name} must hold uint8 e8m0 scales; got {avals[name].dtype}")
    q = q_lora_rank(call)
    require(
        dims["Q4"] * 4 == q,
        function,
        f"wq_b [Q/4, H*D] words need Q/4 = {q // 4} rows (Q = 512 * qr_qtz_hbm.shape[2]); got {dims['Q4']}",
    )
    if call.params["compact_scales"]:
        want = (q // COMPACT_BLOCK, compact_blocks(dims["N"]))
        got = (dims["Qs"], dims["Ns"])
        require(got == want, function, f"wq_b_scale (compact) must be [Q/128, ceil(H*D/128)] = {want}; got {got}")
        want = compact_blocks(dims["D"])
        require(dims["Ds"] == want, function, f"wk_scale (compact) [dim/128, ceil(D/128)] needs {want} columns")
    else:
        require(
            dims["Qs"] * mx.BLOCK_SIZE == q,
            function,
            f"wq_b_scale [Q/32, H*D] needs Q/32 = {q // mx.BLOCK_SIZE} rows; got {dims['Qs']}",
        )
    tiles = -(-dims["M"] // PARTITIONS)
    require(
        dims["St"] == tiles,
        function,
        f"qr_qtz_hbm [ceil(B*S/128), 128, Q/512, 128] needs {tiles} row tiles for B*S={dims['M']}; got {dims['St']}",
    )


def _check(call: CallInfo) -> None:
    function, dims, p = call.function, call.dims, call.params
    _check_operand_set(call)
    if p["precision"] == "MX":
        _check_mx_layouts(call)
    batch, seq = dims["B"], dims["S"]
    end = key_end(p["phase"], p["start_pos"], seq, p["end_pos_arg"])
    if dims["M"] != batch * seq:
        raise ValueError(
            f"{function}: x [M, dim] needs M = B*S rows (batch-major); got M={dims['M']} with B={batch} "
            f"(k_cache [B, D, T]) and S={seq} (cos [S, R/2])"
        )
    if dims["N"] != dims["H"] * dims["D"]:
        raise ValueError(
            f"{function}: wq_b [Q, H*D] needs H*D = {dims['H']}*{dims['D']} columns (H from weights_proj [H, dim], "
            f"D from k_cache [B, D, T]); got {dims['N']}"
        )
    if 2 * dims["Rh"] > dims["D"]:
        raise ValueError(f"{function}: cos/sin [S, R/2] need R = {2 * dims['Rh']} <= head_dim D={dims['D']}")
    if p["start_pos"] < 0:
        raise ValueError(f"{function}: parameter `start_pos` must be >= 0; got {p['start_pos']}")
    if p["end_pos_arg"] is not None and (p["phase"] != "score" or p["end_pos_arg"] < 1):
        raise ValueError(
            f"{function}: parameter `end_pos_arg` (the key range of phase='score') must be a positive int with "
            f"phase='score', else None; got {p['end_pos_arg']!r} with phase={p['phase']!r}"
        )
    if dims["E"] != end:
        where = "end_pos_arg" if p["phase"] == "score" and p["end_pos_arg"] is not None else "start_pos + S"
        raise ValueError(f"{function}: mask [M, end] needs end = {where} = {end} columns; got {dims['E']}")
    if dims["T"] < end:
        raise ValueError(f"{function}: k_cache [B, D, T] needs T >= end = {end}; got T={dims['T']}")
    top = end if p["phase"] != "kproj" else p["index_topk"]  # "kproj" selects nothing
    if not 1 <= p["index_topk"] <= top:
        raise ValueError(f"{function}: parameter `index_topk` must be in [1, end = {end}]; got {p['index_topk']}")


def _output_avals(call: CallInfo):
    dims, p = call.dims, call.params
    cache = call.avals["k_cache"]
    if p["phase"] == "kproj":
        return (("k_seq_out", (dims["M"], dims["D"]), cache.dtype),)
    end = key_end(p["phase"], p["start_pos"], dims["S"], p["end_pos_arg"])
    scored = (("index_score", (dims["M"], end), jnp.float32), ("topk_indices", (dims["M"], p["index_topk"]), jnp.int32))
    return scored if p["phase"] == "score" else (*scored, ("k_cache", cache.shape, cache.dtype))


_DEVICE_DTYPES = {
    "x": jnp.float32,
    "k_norm_gamma": jnp.float32,
    "k_norm_beta": jnp.float32,
    "weights_proj": jnp.bfloat16,
    "cos": jnp.float32,
    "sin": jnp.float32,
    "k_cache": jnp.bfloat16,
}
_BF16_DEVICE_DTYPES = {"wq_b": jnp.bfloat16, "wk": jnp.bfloat16, "qr_bf16_hbm": jnp.bfloat16}


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, p = call.dims, call.params
    end = key_end(p["phase"], p["start_pos"], dims["S"], p["end_pos_arg"])
    device = _DEVICE_DTYPES | (_BF16_DEVICE_DTYPES if p["precision"] == "BF16" else {})
    unmet = [
        f"{name} must be {jnp.dtype(dtype).name}; got {call.avals[name].dtype}"
        for name, dtype in device.items()
        if call.avals[name].dtype != dtype
    ]
    if dims["D"] != KERNEL_HEAD_DIM:
        unmet.append(f"head_dim D={dims['D']} must be {KERNEL_HEAD_DIM}")
    multiple = PARTITIONS if p["precision"] == "BF16" else QR_TILE
    for name, size in (("dim", dims["dim"]), ("q_lora_rank Q", q_lora_rank(call))):
        if size % multiple:
            unmet.append(f"{name}={size} must be a multiple of {multiple} with precision={p['precision']}")
    if p["phase"] != "kproj" and -(-dims["dim"] // PARTITIONS) < MIN_DIM_TILES:
        unmet.append(
            f"dim={dims['dim']} must be at least {MIN_DIM_TILES * PARTITIONS} in phase={p['phase']!r} (the W "
            f"projection needs ceil(dim / {PARTITIONS}) >= {MIN_DIM_TILES})"
        )
    if p["phase"] != "kproj" and call.lnc > 1:
        unmet.append(
            f"LNC 1 (got LNC={call.lnc}): with the queries split over the cores, the source's topk_over_score "
            "(sparse_attention_indexer_utils.py) gets the core-local query count but global query rows, so the "
            "second core writes none of its flat top-k rows (read from the source; not checked on hardware)"
        )
    if p["phase"] == "kproj":
        if p["index_topk"] < KERNEL_MIN_TOPK:
            unmet.append(f"index_topk={p['index_topk']} must be >= {KERNEL_MIN_TOPK} (asserted in every phase)")
    elif p["index_topk"] % TOPK_CHUNKS:
        unmet.append(
            f"index_topk={p['index_topk']} must be a multiple of {TOPK_CHUNKS} (the flat top-k output holds "
            f"index_topk // {TOPK_CHUNKS} columns of the 16-partition snake)"
        )
    elif p["index_topk"] > TOPK_CHUNKS * -(-end // TOPK_CHUNKS):
        unmet.append(f"index_topk={p['index_topk']} exceeds end={end} rounded up to {TOPK_CHUNKS}")
    if -(-dims["S"] // PARTITIONS) > MAX_S_TILES:
        unmet.append(f"S={dims['S']}: ceil(S / {PARTITIONS}) must be <= {MAX_S_TILES}")
    return unmet


def _x4_words(params, dtype) -> str | None:
    """MX weight words reach the kernel as ``float8_e4m3fn_x4``."""
    return "float8_e4m3fn_x4" if dtype == jnp.uint32 else None


# vmap: the mapped axis becomes more sequences (B' = V*B, rows V*B*S batch-major), one kernel call; the swizzled MX
# qr tiles merge only when each element's rows fill whole 128-row tiles. Weights and tables must be unbatched.
_FOLD_INTO_BATCH = FoldPlan(
    axes={"x": "M", "k_cache": "B", "mask": "M", "qr_bf16_hbm": "M", "qr_qtz_hbm": "St", "qr_scale_hbm": "St"},
    outputs={"index_score": 0, "topk_indices": 0, "k_cache": 0, "k_seq_out": 0},
    when=lambda call: call.params["precision"] == "BF16" or call.dims["M"] % PARTITIONS == 0,
)

_WORDS = (jnp.uint32,)
_SCALES = (jnp.uint8,)
_SCALE_LAYOUT = "St, 128, Qt, 128"

SPARSE_ATTENTION_INDEXER_SPEC = KernelSpec(
    name="sparse_attention_indexer_mx_bf16score",
    entry_point="jax_nkilib_kernels.indexer:sparse_attention_indexer_mx_bf16score",
    operands=(
        Operand.of("x", "M, dim", doc="hidden states, B*S batch-major rows"),
        Operand.switched(
            "wq_b",
            "precision",
            {"BF16": "Q, N", "MX": "Q4, N"},
            dtypes=FLOAT_DTYPES + _WORDS,
            device_dtype=_x4_words,
            doc="query up-projection [Q, H*D] (BF16) or its x4 words [Q/4, H*D] (MX)",
        ),
        Operand.switched(
            "wk",
            "precision",
            {"BF16": "dim, D", "MX": "dim/4, D"},
            dtypes=FLOAT_DTYPES + _WORDS,
            device_dtype=_x4_words,
            doc="key projection [dim, D] (BF16) or its x4 words [dim/4, D] (MX)",
        ),
        Operand.of("k_norm_gamma", "D", doc="key LayerNorm scale"),
        Operand.of("k_norm_beta", "D", doc="key LayerNorm shift"),
        Operand.of("weights_proj", "H, dim", doc="per-head score weights projection"),
        Operand.of("cos", "S, Rh", doc="RoPE cosines of this call's positions [S, rope_head_dim/2]"),
        Operand.of("sin", "S, Rh", doc="RoPE sines"),
        Operand.of("k_cache", "B, D, T", doc="key cache (transposed), updated at [start, end)"),
        Operand.of("mask", "M, E", doc="additive mask [B*S, end]"),
        Operand.switched(
            "wq_b_scale",
            "compact_scales",
            {False: "Qs, N", True: "Qs, Ns"},
            dtypes=_SCALES,
            optional=True,
            doc="MX: wq_b's e8m0 scales [Q/32, H*D] (compact: [Q/128, ceil(H*D/128)])",
        ),
        Operand.switched(
            "wk_scale",
            "compact_scales",
            {False: "dim/32, D", True: "dim/128, Ds"},
            dtypes=_SCALES,
            optional=True,
            doc="MX: wk's e8m0 scales [dim/32, D] (compact: [dim/128, ceil(D/128)])",
        ),
        Operand.of("qr_qtz_hbm", _SCALE_LAYOUT, dtypes=_WORDS, optional=True, doc="MX: swizzled qr x4 words"),
        Operand.of("qr_scale_hbm", _SCALE_LAYOUT, dtypes=_SCALES, optional=True, doc="MX: qr's e8m0 scales"),
        Operand.of("qr_bf16_hbm", "M, Q", optional=True, doc="BF16: q-normed compressed query [B*S, Q]"),
    ),
    params=(
        Param("index_topk", None, int, "positions selected per query", required=True),
        Param("start_pos", 0, int, "cache position of the first query row (prior keys come from k_cache)"),
        Param("phase", "all", PHASES, "context-parallel split: 'all', or 'kproj' then 'score' (module doc)"),
        Param("end_pos_arg", None, int, "phase='score': the key range [0, end_pos_arg) (default start_pos + S)"),
        Param("compact_scales", False, bool, "MX weight scales in DeepSeek's 128 x 128 block layout"),
        Param("precision", "MX", PRECISIONS, "the Q and K projections: MX (fp8 words) or BF16"),
        Param("rope_layout", "HALF_SPLIT", ROPE_LAYOUTS, "RoPE pairing: DeepSeek's half split or interleaved"),
    ),
    outputs=(),
    output_avals=_output_avals,
    reference=reference_sparse_attention_indexer,
    check=_check,
    neuron_limits=_neuron_limits,
    aliases={"k_cache": "k_cache"},
    fold_plans=(_FOLD_INTO_BATCH,),
    derived_params=(
        ("n_heads", "H"),
        ("head_dim", "D"),
        ("rope_head_dim", lambda call: 2 * call.dims["Rh"]),
        ("batch_size", "B"),
    ),
    mac_count=lambda call: (
        call.dims["M"]
        * (
            q_lora_rank(call) * call.dims["N"]
            + call.dims["dim"] * (call.dims["D"] + call.dims["H"])
            + call.dims["N"] * key_end(call.params["phase"], call.params["start_pos"], call.dims["S"], None)
        )
    ),
    family="attention",
    catalog="row 53, section 3",
    nondifferentiable_outputs=("index_score", "topk_indices", "k_cache", "k_seq_out"),
    support={
        "idiomatic": "mla_attention (its top-k indexer where the inputs fit)",
        "vjp": "none (a selection kernel; no backward kernel)",
        "notes": "docs-only (2.32) + the newer source's signature: MX (x4 words, native or compact scales, swizzled "
        "qr_qtz_hbm) or BF16 projections, flat top-k ([B*S, K] int32, ascending by score), the CP phases "
        "kproj/score; the k_cache is returned updated (aliased); snake/tiled top-k not bound; Neuron: "
        "head_dim == 128, dim and Q multiples of 512 (MX) or 128 (BF16), dim >= 1024 and LNC 1 "
        "(scoring phases), index_topk % 16 == 0; device adapter "
        "jax_nkilib_kernels/indexer.py",
    },
)

sparse_attention_indexer_mx_bf16score = make_kernel(SPARSE_ATTENTION_INDEXER_SPEC)
