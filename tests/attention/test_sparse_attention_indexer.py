"""``jax_nkilib.nki.sparse_attention_indexer_mx_bf16score`` against a float64 NumPy oracle written from the newer
nki-library torch reference (``sparse_attention_indexer_mx_bf16score_torch_ref``, BF16 precision) and the kernel's
bf16 score row / mask and ascending ``nisa.topk`` order: scores (float32 and bfloat16 inputs, odd sizes, a prior
cache), top-k indices exactly (inputs whose ranking has no ties), the updated cache, both RoPE pairings, the Neuron
limits and bad inputs (jit, vmap, shard_map and the lowering also run in the conformance suite)."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.numerics import assert_close, f64

KERNEL = nki.sparse_attention_indexer_mx_bf16score


def bf16_kernel(*args, **kwargs):
    """The kernel with BF16 projections: ``args`` are ``x ... mask, qr_bf16_hbm`` (11 operands)."""
    return KERNEL(*args[:10], qr_bf16_hbm=args[10], precision="BF16", **kwargs)


# ------------------------------------------------------------------------------------------------- the oracle
def bf(a):
    """Round to bfloat16 (as the kernel/torch reference do), back in float64."""
    return np.asarray(a, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def rotate(x, cos, sin, layout):
    """RoPE on the first ``2 * cos.shape[-1]`` columns of ``x [..., D]`` (pairs by ``layout``), float64."""
    half = cos.shape[-1]
    out = np.array(x, np.float64)
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if layout == "INTERLEAVED" else (i, i + half)
        c, s = cos[..., i], sin[..., i]
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., a] * s + x[..., b] * c
    return out


def oracle(
    x,
    wq_b,
    wk,
    gamma,
    beta,
    wp,
    cos,
    sin,
    k_cache,
    mask,
    qr,
    index_topk,
    start_pos,
    layout="HALF_SPLIT",
    *,
    phase="all",
    end=None,
    mx=None,
):
    """float64, loops over batches and heads: ``"all"``: ``(index_score, topk ascending, updated k_cache)``;
    ``"kproj"``: ``k [M, D]``; ``"score"`` (keys from ``k_cache[:, :, :end]``): ``(index_score, topk)``.
    ``mx``: the MX mode's projection inputs ``(mx(x), Wk, qr, Wq)`` (float64, already rounded); ``wq_b``, ``wk`` and
    ``qr`` are then unused."""
    x, wq_b, wk, gamma, beta, wp, cos, sin, k_cache, mask, qr = map(
        f64, (x, wq_b, wk, gamma, beta, wp, cos, sin, k_cache, mask, qr)
    )
    batch, head_dim, _ = k_cache.shape
    heads, rows = wp.shape[0], x.shape[0]
    seq = rows // batch
    end = end if phase == "score" and end is not None else start_pos + seq
    scores, ks = np.zeros((rows, end)), np.zeros((rows, head_dim))
    cache = k_cache.copy()
    xk, wk, qr, wq_b = mx if mx is not None else (bf(x), bf(wk), bf(qr), bf(wq_b))
    for b in range(batch):
        r = slice(b * seq, (b + 1) * seq)
        k = xk[r] @ wk
        k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6) * gamma + beta
        ks[r] = k = bf(rotate(k, cos, sin, layout))  # [S, D]
        q = (qr[r] @ wq_b).reshape(seq, heads, head_dim)
        q = bf(np.stack([rotate(q[:, h], cos, sin, layout) for h in range(heads)], axis=1))
        w = bf(x[r]) @ bf(wp).T / np.sqrt(heads * head_dim)  # [S, H]
        if phase == "score":
            keys = bf(k_cache[b, :, :end]).T
        else:
            keys = np.concatenate([bf(k_cache[b, :, :start_pos]).T, k], axis=0)  # [end, D]
        score = np.zeros((seq, end))
        for h in range(heads):
            score += np.maximum(q[:, h] @ keys.T, 0.0) * w[:, h : h + 1]
        scores[r] = bf(bf(score) + bf(mask[r]))
        cache[b, :, start_pos : start_pos + seq] = k.T
    if phase == "kproj":
        return ks
    topk = np.argsort(-scores, axis=-1, kind="stable")[:, :index_topk][:, ::-1]  # ascending by score
    return (scores, topk) if phase == "score" else (scores, topk, cache)


# ------------------------------------------------------------------------------------------------- operands
def operands(b, s, dim, q, h, d, r, t, start_pos, dtype=jnp.float32, seed=0, mask=None):
    rng = np.random.default_rng(seed)
    arr = lambda shape, scale=1.0: jnp.asarray(rng.standard_normal(shape) * scale, dtype)  # noqa: E731
    theta = rng.uniform(-np.pi, np.pi, (s, r // 2))
    rows, end = b * s, start_pos + s
    return (
        arr((rows, dim)),
        arr((q, h * d), q**-0.5),
        arr((dim, d), dim**-0.5),
        jnp.asarray(1 + 0.1 * rng.standard_normal(d), dtype),
        arr((d,), 0.1),
        arr((h, dim), dim**-0.5),
        jnp.asarray(np.cos(theta), dtype),
        jnp.asarray(np.sin(theta), dtype),
        arr((b, d, t)),
        jnp.asarray(mask if mask is not None else 0.1 * rng.standard_normal((rows, end)), dtype),
        arr((rows, q)),
    )


def ranked_mask(rng, rows, start_pos, seq, step=0.25):
    """An additive mask whose distinct, ``step``-spaced values decide each row's ranking over its causal positions
    (``t <= start_pos + s``; the future is ``-1e4``): scores kept below ``step / 4`` cannot reorder them, so the
    top-k (and its order) has no ties."""
    end = start_pos + seq
    mask = np.full((rows, end), -1e4)
    for row in range(rows):
        valid = start_pos + row % seq + 1
        mask[row, :valid] = step * (rng.permutation(valid) + 1)
    return mask


# ------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "dtype, dims, layout",
    [
        (jnp.float32, (2, 5, 12, 8, 3, 8, 4, 9, 2), "HALF_SPLIT"),
        (jnp.bfloat16, (1, 7, 16, 12, 2, 6, 6, 11, 3), "INTERLEAVED"),
        pytest.param(jnp.float32, (3, 4, 8, 4, 1, 4, 2, 4, 0), "INTERLEAVED", marks=pytest.mark.slow),
    ],
)
def test_scores_and_cache_match_the_oracle(dtype, dims, layout):
    args = operands(*dims, dtype=dtype)
    start_pos, topk = dims[-1], 3
    score, idx, cache = jax.jit(lambda *a: bf16_kernel(*a, index_topk=topk, start_pos=start_pos, rope_layout=layout))(
        *args
    )
    want_score, _, want_cache = oracle(*args, topk, start_pos, layout)
    assert score.dtype == jnp.float32 and idx.dtype == jnp.int32 and cache.dtype == dtype
    assert score.shape == want_score.shape and idx.shape == (want_score.shape[0], topk)
    # both sides round Q, K and the score to bf16: a rounding flipped by float32 vs float64 is one bf16 ulp
    assert_close(score, want_score, jnp.bfloat16, reduction=dims[5], ops=2)
    assert_close(cache, want_cache, jnp.bfloat16, ops=2)
    untouched = np.ones(want_cache.shape, bool)
    untouched[:, :, start_pos : start_pos + dims[1]] = False
    assert np.array_equal(f64(cache)[untouched], f64(args[8])[untouched])  # the rest of the cache is kept


@pytest.mark.parametrize("layout", ["HALF_SPLIT", "INTERLEAVED"])
def test_topk_indices_are_exact_and_ascending(layout):
    b, s, start_pos, k = 2, 6, 5, 4
    mask = ranked_mask(np.random.default_rng(3), b * s, start_pos, s)
    args = list(operands(b, s, 12, 8, 2, 8, 4, 12, start_pos, mask=mask, seed=3))
    args[5] = args[5] * 1e-3  # per-head weights small: |score| << the mask's step
    score, idx, _ = bf16_kernel(*args, index_topk=k, start_pos=start_pos, rope_layout=layout)
    want_score, want_idx, _ = oracle(*args, k, start_pos, layout)
    assert np.array_equal(np.asarray(idx), want_idx)
    picked = np.take_along_axis(f64(score), np.asarray(idx), axis=-1)
    assert np.all(np.diff(picked, axis=-1) > 0)  # ascending, without ties


def test_topk_selects_the_largest_scores_of_natural_inputs():
    """Without a ranking mask the selected set holds the k largest scores (compared by value, as the kernel's own
    test does: robust to ties)."""
    args = operands(2, 9, 16, 8, 4, 8, 4, 10, 1, seed=5)
    score, idx, _ = bf16_kernel(*args, index_topk=5, start_pos=1)
    want_score, _, _ = oracle(*args, 5, 1)
    got = np.sort(np.take_along_axis(want_score, np.asarray(idx), axis=-1), axis=-1)
    want = np.sort(want_score, axis=-1)[:, -5:]
    assert_close(got, want, jnp.bfloat16, ops=2)


def test_kproj_phase_returns_the_projected_keys():
    args = operands(2, 5, 12, 8, 3, 8, 4, 9, 2, seed=7)
    k_seq = bf16_kernel(*args, index_topk=3, start_pos=2, phase="kproj")
    assert k_seq.shape == (10, 8) and k_seq.dtype == jnp.float32
    assert_close(k_seq, oracle(*args, 3, 2, phase="kproj"), jnp.bfloat16, ops=2)


def test_score_phase_scores_against_the_whole_cache():
    b, s, end = 2, 3, 7  # 3 local queries at positions 2..4 against 7 gathered keys
    args = operands(b, s, 12, 8, 2, 8, 4, 8, 0, seed=8, mask=np.zeros((b * s, end)))
    score, idx = bf16_kernel(*args, index_topk=3, start_pos=2, phase="score", end_pos_arg=end)
    want_score, _ = oracle(*args, 3, 2, phase="score", end=end)
    assert score.shape == (b * s, end) and idx.shape == (b * s, 3)
    assert_close(score, want_score, jnp.bfloat16, reduction=8, ops=2)


@pytest.mark.slow  # the shard_map version below runs in CI
@pytest.mark.parametrize("layout", ["HALF_SPLIT", "INTERLEAVED"])
def test_context_parallel_phases_compose_to_the_fused_call(layout):
    """Each of 2 ranks projects its 3 queries' K ("kproj"), the keys are gathered into the cache, and each rank
    scores its queries against all 6 ("score"): the same scores and top-k as one fused call over the 6 queries."""
    ranks, s, k = 2, 3, 3
    mask = ranked_mask(np.random.default_rng(9), ranks * s, 0, ranks * s)
    x, wq_b, wk, g, beta, wp, cos, sin, cache, _, qr = operands(1, ranks * s, 12, 8, 2, 8, 4, 6, 0, seed=9)
    wp = wp * 1e-3
    fused = bf16_kernel(x, wq_b, wk, g, beta, wp, cos, sin, cache, mask, qr, index_topk=k, rope_layout=layout)
    shard = lambda a, r: a[r * s : (r + 1) * s]  # noqa: E731
    weights = (wq_b, wk, g, beta, wp)
    keys = []
    for r in range(ranks):
        local = (shard(x, r), *weights, shard(cos, r), shard(sin, r), cache, shard(mask, r)[:, : (r + 1) * s])
        k_seq = bf16_kernel(*local, shard(qr, r), index_topk=k, start_pos=r * s, rope_layout=layout, phase="kproj")
        keys.append(k_seq)
    gathered = cache.at[0, :, : ranks * s].set(jnp.concatenate(keys).T)
    parts = [
        bf16_kernel(
            shard(x, r),
            *weights,
            shard(cos, r),
            shard(sin, r),
            gathered,
            shard(mask, r),
            shard(qr, r),
            index_topk=k,
            start_pos=r * s,
            rope_layout=layout,
            phase="score",
            end_pos_arg=ranks * s,
        )
        for r in range(ranks)
    ]
    np.testing.assert_allclose(jnp.concatenate([p[0] for p in parts]), fused[0], rtol=2**-7)
    assert np.array_equal(jnp.concatenate([p[1] for p in parts]), fused[1])


def test_derived_config_is_checked_against_the_shapes():
    args = operands(2, 3, 8, 4, 2, 4, 2, 4, 0)
    bf16_kernel(*args, index_topk=2, n_heads=2, head_dim=4, rope_head_dim=2, batch_size=2)
    with pytest.raises(ValueError, match="n_heads"):
        bf16_kernel(*args, index_topk=2, n_heads=3)


def test_not_differentiable():
    args = operands(1, 3, 8, 4, 2, 4, 2, 4, 0)
    with pytest.raises(Exception, match="sparse_attention_indexer_mx_bf16score"):
        jax.grad(lambda x: bf16_kernel(x, *args[1:], index_topk=2)[0].sum())(args[0])


def test_neuron_limits_name_what_the_kernel_needs():
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands(1, 5, 12, 8, 2, 8, 4, 6, 0)]
    fn = lambda *a: bf16_kernel(*a, index_topk=3)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning) as record:
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",))
    message = str(record[0].message)
    for fragment in ("wq_b must be bfloat16", "head_dim D=8 must be 128", "dim=12", "index_topk=3"):
        assert fragment in message


@pytest.mark.parametrize("phase, dim, named", [("all", 896, True), ("score", 512, True), ("all", 1024, False)])
def test_neuron_limits_need_eight_dim_tiles_where_the_kernel_scores(phase, dim, named):
    """The kernel's W projection (``w_projection_mx_batch``, run by the scoring phases) asserts
    ``ceil(dim / 128) >= 8``; below that the call falls back instead of lowering to a failing kernel."""
    b, s, start_pos, end = 1, 128, 0, 128
    args = operands(b, s, dim, 128, 2, 128, 64, 256, start_pos)
    device = {1: jnp.bfloat16, 2: jnp.bfloat16, 5: jnp.bfloat16, 8: jnp.bfloat16, 10: jnp.bfloat16}
    shapes = [jax.ShapeDtypeStruct(a.shape, device.get(i, jnp.float32)) for i, a in enumerate(args)]
    kwargs = {"index_topk": 32} | ({"phase": "score", "end_pos_arg": end} if phase == "score" else {})
    fn = lambda *a: bf16_kernel(*a, **kwargs)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",))
    messages = [str(w.message) for w in record if issubclass(w.category, NeuronFallbackWarning)]
    assert any(f"dim={dim} must be at least 1024" in m for m in messages) == named, messages


@pytest.mark.parametrize(
    "phase, lnc, named", [("all", 2, True), ("score", 2, True), ("kproj", 2, False), ("all", 1, False)]
)
def test_the_scoring_phases_need_lnc_1(phase, lnc, named, monkeypatch):
    """At LNC 2 the source's ``topk_over_score`` skips the second core's queries in the flat top-k (it compares
    global query rows with the core-local count), so the scoring phases fall back there."""
    monkeypatch.setattr(neuron_lowering, "_warned", set())  # the warning is once per call site and reasons
    args = operands(1, 128, 1024, 128, 2, 128, 64, 256, 0)
    device = {1: jnp.bfloat16, 2: jnp.bfloat16, 5: jnp.bfloat16, 8: jnp.bfloat16, 10: jnp.bfloat16}
    shapes = [jax.ShapeDtypeStruct(a.shape, device.get(i, jnp.float32)) for i, a in enumerate(args)]
    kwargs = {"index_topk": 32, "phase": phase} | ({"end_pos_arg": 128} if phase == "score" else {})
    fn = lambda *a: bf16_kernel(*a, **kwargs)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",))
    messages = [str(w.message) for w in record if issubclass(w.category, NeuronFallbackWarning)]
    assert any(f"LNC 1 (got LNC={lnc})" in m for m in messages) == named, messages


@pytest.mark.parametrize(
    "change, fragments",
    [
        (lambda a: (a[0][:-1], *a[1:9], a[9][:-1], a[10][:-1]), ["M = B*S", "x [M, dim]"]),
        (lambda a: (a[0], a[1][:, :-1], *a[2:]), ["wq_b [Q, H*D]"]),
        (lambda a: (*a[:9], a[9][:, :-1], a[10]), ["mask [M, end]"]),
        (lambda a: (*a[:8], a[8][:, :, :3], *a[9:]), ["k_cache [B, D, T]", "T >= end = 4"]),
        (lambda a: (a[0].astype(jnp.int32), *a[1:]), ["x", "dtype"]),
    ],
)
def test_bad_inputs_name_the_argument(change, fragments):
    args = change(operands(2, 3, 8, 4, 2, 4, 2, 4, 1))
    with pytest.raises((TypeError, ValueError)) as info:
        bf16_kernel(*args, index_topk=2, start_pos=1)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"index_topk": 5}, "index_topk"),
        ({"index_topk": 2, "start_pos": -1}, "start_pos"),
        ({"index_topk": 2, "rope_layout": "ROTATE"}, "rope_layout"),
        ({}, "index_topk"),
        ({"index_topk": 2, "end_pos_arg": 4}, "end_pos_arg"),
        ({"index_topk": 2, "phase": "qproj"}, "phase"),
    ],
)
def test_bad_params_name_the_parameter(kwargs, fragment):
    args = operands(2, 3, 8, 4, 2, 4, 2, 4, 0)
    with pytest.raises((TypeError, ValueError), match=fragment):
        bf16_kernel(*args, **kwargs)


# ------------------------------------------------------------------------------------------------- MX mode
def mx_rows(a, block_rows=None, emax=8):
    """MX e4m3 quantization of ``a [R, K]`` in blocks of 32 consecutive elements of a row (``block_rows``: blocks of
    ``block_rows`` rows x 128 columns instead, DeepSeek's compact weight scales): ``(codes uint8, scale bytes,
    dequantized float64)``; scale byte ``E - emax`` of the block's largest float32 exponent ``E`` (8: the OCP rule
    of the packers; 7: ``nisa.quantize_mx``'s default, the kernel's own quantization of ``x``)."""
    a32 = np.asarray(a, np.float32)
    exponent = ((a32.view(np.uint32) >> 23) & 0xFF).astype(np.int64)
    if block_rows is None:
        byte = exponent.reshape(a32.shape[0], -1, 32).max(-1) - emax  # [R, K/32]
        per_element = np.repeat(byte, 32, axis=1)
    else:
        rows, cols = a32.shape
        grid = np.pad(exponent, ((0, 0), (0, -cols % 128))).reshape(rows // block_rows, block_rows, -1, 128)
        byte = grid.max(axis=(1, 3)) - emax  # [R/block_rows, ceil(K/128)]
        per_element = np.repeat(np.repeat(byte, block_rows, axis=0), 128, axis=1)[:, :cols]
    scale = 2.0 ** (per_element - 127)
    elements = np.clip(a32 / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)
    return elements.view(np.uint8), byte.astype(np.uint8), elements.astype(np.float64) * scale


def words(codes):
    """uint32 words ``[..., n]`` of byte codes ``[..., 4n]`` (element ``4w + j`` in byte ``j``)."""
    grouped = codes.reshape(*codes.shape[:-1], -1, 4).astype(np.uint32)
    return np.sum(grouped << (8 * np.arange(4, dtype=np.uint32)), axis=-1).astype(np.uint32)


def pack_weight(w, compact=False):
    """``W [K, N]`` -> (x4 words ``[K/4, N]``, scales ``[K/32, N]`` or compact ``[K/128, ceil(N/128)]``, the
    dequantized W)."""
    if compact:
        codes, byte, deq = mx_rows(w, block_rows=128)  # blocks of 128 K x 128 N
        return words(codes.T.copy()).T.copy(), byte, deq
    codes, byte, deq = mx_rows(w.T)  # per column, blocks of 32 K
    return words(codes).T.copy(), byte.T.copy(), deq.T


def pack_qr(qr):
    """``qr [M, Q]`` -> the swizzled ``(qr_qtz_hbm, qr_scale_hbm)`` ``[ceil(M/128), 128, Q/512, 128]`` and the
    dequantized qr; scale rows outside each quadrant's first 4 hold 0xAB (ignored)."""
    m, q = qr.shape
    tiles = -(-m // 128)
    codes, byte, deq = mx_rows(np.pad(qr, ((0, tiles * 128 - m), (0, 0))))
    qtz = np.zeros((tiles, 128, q // 512, 128), np.uint32)
    scale = np.full((tiles, 128, q // 512, 128), 0xAB, np.uint8)
    for t in range(tiles):
        for c in range(q // 512):
            for s in range(128):
                row = codes[128 * t + s, 512 * c : 512 * (c + 1)]  # [4 j + h]
                qtz[t, :, c, s] = words(row)
                for i in range(16):
                    scale[t, (i // 4) * 32 + i % 4, c, s] = byte[128 * t + s, 16 * c + i]
    return qtz, scale, deq[:m]


def mx_operands(b, s, dim, q, h, d, r, t, start_pos, compact=False, seed=0, mask=None):
    """``(operands for the kernel, the oracle's mx tuple)``: float operands packed by the NumPy packers above."""
    rng = np.random.default_rng(seed)
    x, wq_f, wk_f, gamma, beta, wp, cos, sin, cache, mask_, qr_f = operands(
        b, s, dim, q, h, d, r, t, start_pos, seed=seed, mask=mask
    )
    wq, wq_scale, wq_deq = pack_weight(np.asarray(wq_f), compact)
    wk, wk_scale, wk_deq = pack_weight(np.asarray(wk_f), compact)
    qtz, qscale, qr_deq = pack_qr(np.asarray(qr_f) * (1 + rng.uniform(size=qr_f.shape)))
    ops = (x, wq, wk, gamma, beta, wp, cos, sin, cache, mask_, wq_scale, wk_scale, qtz, qscale)
    x_mx = mx_rows(np.asarray(x), emax=7)[2]  # the kernel's in-kernel quantize_mx (its default scale)
    mx_rounded = mx_rows(qr_deq)[2]  # the torch reference re-rounds the decoded qr (exact: already MX values)
    assert np.array_equal(mx_rounded, qr_deq)
    return tuple(map(jnp.asarray, ops)), (x_mx, wk_deq, qr_deq, wq_deq)


def mx_kernel(ops, **kwargs):
    return KERNEL(*ops[:10], wq_b_scale=ops[10], wk_scale=ops[11], qr_qtz_hbm=ops[12], qr_scale_hbm=ops[13], **kwargs)


@pytest.mark.parametrize("compact", [False, True])
def test_mx_projections_match_the_oracle(compact):
    dims = (2, 5, 128, 512, 3, 8, 4, 9, 2)
    ops, rounded = mx_operands(*dims, compact=compact, seed=11)
    score, idx, cache = jax.jit(lambda *a: mx_kernel(a, index_topk=3, start_pos=2, compact_scales=compact))(*ops)
    want_score, _, want_cache = oracle(*ops[:10], None, 3, 2, mx=rounded)
    assert_close(score, want_score, jnp.bfloat16, reduction=8, ops=2)
    assert_close(cache, want_cache, jnp.bfloat16, ops=2)


def test_mx_topk_is_exact():
    b, s, start_pos = 1, 6, 5
    mask = ranked_mask(np.random.default_rng(12), b * s, start_pos, s)
    ops, rounded = mx_operands(b, s, 64, 512, 2, 8, 4, 12, start_pos, seed=12, mask=mask)
    ops = (*ops[:5], ops[5] * 1e-3, *ops[6:])
    _, idx, _ = mx_kernel(ops, index_topk=4, start_pos=start_pos)
    _, want_idx, _ = oracle(*ops[:10], None, 4, start_pos, mx=rounded)
    assert np.array_equal(np.asarray(idx), want_idx)


def test_mx_packing_of_the_oracle_round_trips():
    """The test's packers invert: the words and scales decode (by hand) to the dequantized values."""
    w = np.random.default_rng(13).standard_normal((64, 5))
    packed, scale, deq = pack_weight(w)
    lanes = np.stack([(packed >> (8 * j)) & 0xFF for j in range(4)], axis=1).astype(np.uint8)  # [K/4, 4, N]
    decoded = lanes.reshape(64, 5).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    assert np.array_equal(decoded * 2.0 ** (np.repeat(scale, 32, axis=0).astype(int) - 127), deq)
    assert np.max(np.abs(deq - w)) <= 2**-3 * np.max(np.abs(w))


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda o: (*o[:10], o[10][:-1], *o[11:]), "wq_b_scale"),
        (lambda o: (o[0], o[1].astype(jnp.int32), *o[2:]), "uint32"),
        (lambda o: (*o[:13], o[13].astype(jnp.int32)), "qr_scale_hbm"),
        (lambda o: (*o[:12], o[12][:, :, :, :-1], o[13][:, :, :, :-1]), "qr_qtz_hbm"),
    ],
)
def test_mx_bad_inputs_name_the_argument(change, fragment):
    ops, _ = mx_operands(1, 3, 64, 512, 2, 8, 4, 4, 0)
    with pytest.raises((TypeError, ValueError), match=fragment):
        mx_kernel(change(ops), index_topk=2)


def test_precision_needs_its_own_operands():
    ops, _ = mx_operands(1, 3, 64, 512, 2, 8, 4, 4, 0)
    with pytest.raises(ValueError, match="missing qr_qtz_hbm"):
        KERNEL(*ops[:10], wq_b_scale=ops[10], wk_scale=ops[11], index_topk=2)
    args = operands(1, 3, 8, 4, 2, 4, 2, 4, 0)
    with pytest.raises(ValueError, match="needs qr_bf16_hbm"):
        KERNEL(*args[:10], index_topk=2, precision="BF16")
    with pytest.raises(ValueError, match="takes no MX operands; got wq_b_scale"):
        KERNEL(
            *args[:10], qr_bf16_hbm=args[10], wq_b_scale=jnp.zeros((1, 8), jnp.uint8), index_topk=2, precision="BF16"
        )


@pytest.mark.parametrize("rows, folds", [pytest.param(128, True, marks=pytest.mark.slow), (6, False)])
def test_mx_vmap_folds_whole_qr_tiles_into_the_batch(rows, folds):
    """vmap over the sequences: one kernel call when each element's rows fill whole 128-row qr tiles, else a loop."""
    ops, _ = mx_operands(1, rows, 64, 512, 2, 8, 4, rows, 0, seed=14)
    stacked = [jnp.stack([a, a[::-1]]) for a in (ops[0], ops[8], ops[9], ops[12], ops[13])]

    def one(x, cache, mask, qtz, qscale):
        return mx_kernel((x, *ops[1:8], cache, mask, *ops[10:12], qtz, qscale), index_topk=4)

    mapped = jax.vmap(one)
    assert ("scan" not in str(jax.make_jaxpr(mapped)(*stacked))) == folds  # lax.map is a scan
    out = mapped(*stacked)
    for i in range(2):
        for got, want in zip(out, one(*(a[i] for a in stacked))):
            np.testing.assert_array_equal(got[i], want)


def test_context_parallel_phases_inside_shard_map_match_the_fused_call():
    """8 ranks each hold 2 of 16 queries: "kproj" on each rank, ``all_gather`` of K over ``cp``, the gathered cache,
    then "score" against all 16 keys: the fused single-device call's scores and top-k."""
    from jax.sharding import PartitionSpec as P

    from tests.support.sharding import mesh_1d, run_sharded

    ranks, s, k = 8, 2, 4
    total = ranks * s
    mask = ranked_mask(np.random.default_rng(15), total, 0, total)
    x, wq_b, wk, g, beta, wp, cos, sin, cache, _, qr = operands(1, total, 12, 8, 2, 8, 4, total, 0, seed=15)
    wp = wp * 1e-3
    fused = bf16_kernel(x, wq_b, wk, g, beta, wp, cos, sin, cache, mask, qr, index_topk=k)

    def rank(x, cos, sin, mask, qr, wq_b, wk, g, beta, wp, cache):
        local = lambda c, m, **kw: bf16_kernel(x, wq_b, wk, g, beta, wp, cos, sin, c, m, qr, index_topk=k, **kw)  # noqa: E731
        k_local = local(cache[:, :, :s], mask[:, :s], phase="kproj")  # [s, D]; the mask's width is unused here
        keys = jax.lax.all_gather(k_local, "cp", tiled=True)  # [16, D] in rank order
        gathered = cache.at[0].set(keys.T)
        return local(gathered, mask, phase="score", end_pos_arg=total)

    rows = P("cp")
    specs = (rows,) * 5 + (P(),) * 6
    score, idx = run_sharded(
        rank, mesh_1d("cp", ranks), specs, (rows, rows), x, cos, sin, mask, qr, wq_b, wk, g, beta, wp, cache
    )
    np.testing.assert_allclose(score, fused[0], rtol=2**-7)
    assert np.array_equal(idx, fused[1])
