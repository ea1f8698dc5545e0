"""rmsnorm_mx_prefill (catalog row 87) against a NumPy float64 oracle written from its torch reference
(``rmsnorm_mx_prefill_torch_ref``, ``reference_mx_dequant``, ``decode_packed_output``, ``swizzle_h_index``) and, for
NOAUX_TC, from the kernel's documented math (bias for selection only): packed MX bytes bit for bit wherever float32
rounding cannot decide them, router indices/affinities, residual and bf16 norm outputs; gradients;
jit/vmap/shard_map; Neuron dry-run lowering; errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.norm.rmsnorm_mx_prefill import RouterActFnType, rmsnorm_mx_prefill, swizzle_router_weights
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

E4M3 = ml_dtypes.float8_e4m3fn
REL = 4e-6  # bound on the float32 computation's relative error in the norm (for "determined" bytes)


# ------------------------------------------------------------------------------------------------ the oracle
def f64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float64))


def rounded(values, dtype):
    return np.asarray(values, np.float64).astype(np.dtype(dtype)).astype(np.float64)


def natural_index(h):
    """natural[n] = stored[src[n]] for the 4-way interleave (stored[q H/4 + p] = natural[4 p + q])."""
    src = np.zeros(h, np.int64)
    for p in range(h // 4):
        for q in range(4):
            src[4 * p + q] = q * (h // 4) + p
    return src


def swizzle_index(h):
    """Swizzled row s = k*512 + 128 q + p holds natural row k*512 + 4 p + q (the kernel doc's swizzle_h_index)."""
    index = np.zeros(h, np.int64)
    for k in range(h // 512):
        for q in range(4):
            for p in range(128):
                index[k * 512 + 128 * q + p] = k * 512 + 4 * p + q
    return index


def oracle_norm(hidden, gamma, residual=None, eps=1e-6, unpadded=None, interleaved=False):
    """float64 ``(z [T, H] natural order, x [T, H] pre-norm sum in the inputs' order)``."""
    b, s, h = hidden.shape
    x = f64(hidden).reshape(b * s, h)
    if residual is not None:
        x = rounded(x + f64(residual).reshape(b * s, h), hidden.dtype)
    natural = x[:, natural_index(h)] if interleaved else x
    inv_rms = 1.0 / np.sqrt((natural**2).sum(axis=1, keepdims=True) / (unpadded or h) + eps)
    return natural * inv_rms * f64(gamma).reshape(1, h), x


def quantize_block(values):
    """One MX block (32 float64 values exact in float32): reference_mx_dequant's rule with e4m3 max_exp 7."""
    exponents = (values.astype(np.float32).view(np.uint32) >> 23) & 0xFF
    scale = int(np.clip(int(exponents.max()) - 7, 0, 255))
    elements = np.clip(values / 2.0 ** (scale - 127), -448, 448).astype(np.float32).astype(E4M3)
    return elements.view(np.uint8), scale


def oracle_row_bytes(y, pack_scales):
    """uint8 ``[T, H + scale_region]`` of compute-dtype values ``y`` (decode_packed_output's scale columns)."""
    t, h = y.shape
    tiles = h // 512
    region = (-(-tiles // 4) if pack_scales else tiles) * 128
    row = np.zeros((t, h + region), np.uint8)
    for token in range(t):
        for k in range(tiles):
            base, shift = ((k // 4) * 128, (k % 4) * 4) if pack_scales else (k * 128, 0)
            for g in range(16):
                start = k * 512 + 32 * g
                row[token, start : start + 32], scale = quantize_block(y[token, start : start + 32])
                row[token, h + base + (g // 4) * 32 + shift + g % 4] = scale
    return row


def determined_bytes(z, compute_dtype, pack_scales):
    """``(bytes, mask)``: the oracle's packed bytes and where they cannot depend on float32 rounding (the bytes of
    z(1 - REL) and z(1 + REL) agree, and so do their blocks' scales)."""
    lo = oracle_row_bytes(rounded(z * (1 - REL), compute_dtype), pack_scales)
    hi = oracle_row_bytes(rounded(z * (1 + REL), compute_dtype), pack_scales)
    h = z.shape[1]
    mask = lo == hi
    scale_ok = mask[:, h:]  # a block whose scale is not determined leaves its elements undetermined too
    columns = np.zeros(h // 32, np.int64)
    for block in range(h // 32):
        k, g = block // 16, block % 16
        base, shift = ((k // 4) * 128, (k % 4) * 4) if pack_scales else (k * 128, 0)
        columns[block] = base + (g // 4) * 32 + shift + g % 4
    mask[:, :h] &= np.repeat(scale_ok[:, columns], 32, axis=1)
    return oracle_row_bytes(rounded(z, compute_dtype), pack_scales), mask


def assert_bytes(got_bytes, want, mask, minimum=0.97):
    assert got_bytes.shape == want.shape
    assert mask.mean() >= minimum, f"only {mask.mean():.3f} of the bytes are determined"
    np.testing.assert_array_equal(got_bytes[mask], want[mask])


def oracle_router(y, w_natural, bias, top_k, softmax):
    """float64 ``(index [T, top_k], dense affinities [T, E], determined tokens [T])``."""
    logits = y @ f64(w_natural) + (0.0 if bias is None else f64(bias).reshape(1, -1))
    order = np.argsort(-logits, axis=1, kind="stable")
    index = order[:, :top_k]
    ranked = np.take_along_axis(logits, order, axis=1)
    gaps = ranked[:, :-1] - ranked[:, 1:]
    determined = (gaps[:, : min(top_k, gaps.shape[1])] > 1e-3 * np.abs(logits).max()).all(axis=1)
    top = np.take_along_axis(logits, index, axis=1)
    weights = np.exp(top - top.max(axis=1, keepdims=True))
    weights = weights / weights.sum(axis=1, keepdims=True) if softmax else 1.0 / (1.0 + np.exp(-top))
    dense = np.zeros_like(logits)
    np.put_along_axis(dense, index, weights, axis=1)
    return index, dense, determined


def noaux_weights(w_natural):
    """The NOAUX_TC weight prep of the kernel's test: swizzle the rows, then lay them out partition-major
    (w[p, t, e] = w_swizzled[128 t + p, e])."""
    h, e = w_natural.shape
    swizzled = np.asarray(w_natural)[swizzle_index(h)]
    return jnp.asarray(swizzled.reshape(h // 128, 128, e).transpose(1, 0, 2).reshape(h, e))


def oracle_noaux(y, w_natural, bias, top_k, n_group, topk_group, scaling):
    """float64 ``(dense affinities [T, E], determined tokens [T])`` of the group-limited NOAUX_TC router: sigmoid
    scores, bias for selection only, groups ranked by their two best biased scores, L1-normalized pre-bias scores."""
    scores = 1.0 / (1.0 + np.exp(-(y @ f64(w_natural))))
    choice = scores + f64(bias).reshape(1, -1)
    t, e = choice.shape
    size = e // n_group
    dense, determined = np.zeros((t, e)), np.ones(t, bool)
    tol = 1e-4
    for token in range(t):
        groups = [sorted(choice[token, g * size : (g + 1) * size], reverse=True) + [-30000.0] for g in range(n_group)]
        group_score = np.array([grp[0] + grp[1] for grp in groups])
        ranked = np.argsort(-group_score, kind="stable")
        kept = ranked[:topk_group]
        if topk_group < n_group:
            determined[token] &= group_score[ranked[topk_group - 1]] - group_score[ranked[topk_group]] > tol
        masked = np.array([choice[token, x] - (0.0 if x // size in kept else 30000.0) for x in range(e)])
        order = np.argsort(-masked, kind="stable")
        selected = order[:top_k]
        if top_k < e:
            determined[token] &= masked[order[top_k - 1]] - masked[order[top_k]] > tol
        total = scores[token, selected].sum()
        dense[token, selected] = scores[token, selected] / (total + 1e-20) * scaling
    return dense, determined


def as_bytes(packed):
    return np.asarray(jax.lax.bitcast_convert_type(packed, jnp.uint8)).reshape(packed.shape[0], -1)


def problem(b=1, s=5, h=1536, dtype=jnp.bfloat16, e=0, router_dtype=jnp.bfloat16, residual=False, bias=False, seed=0):
    rng = np.random.default_rng(seed)
    hidden = jnp.asarray(rng.standard_normal((b, s, h)) * 2, dtype)
    gamma = jnp.asarray(rng.standard_normal((1, h)) + 0.5, dtype)
    res = jnp.asarray(rng.standard_normal((b, s, h)), dtype) if residual else None
    w = jnp.asarray(rng.standard_normal((h, e)) / np.sqrt(h), router_dtype) if e else None
    bias_ = jnp.asarray(rng.standard_normal((1, e)) * 0.1, jnp.float32) if e and bias else None
    return hidden, gamma, w, bias_, res


# ------------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize(
    "dtype, b, s, h, residual, pack_scales, unpadded",
    [
        (jnp.bfloat16, 1, 5, 1536, False, True, None),  # 3 H512 tiles: a partial scale fold
        (jnp.bfloat16, 2, 3, 2560, True, True, 2500),  # 5 tiles: two folds
        (jnp.float16, 3, 1, 1024, True, False, None),
        (jnp.float32, 1, 7, 512, False, False, 300),
    ],
)
def test_packed_row_matches_oracle(dtype, b, s, h, residual, pack_scales, unpadded):
    hidden, gamma, _, _, res = problem(b, s, h, dtype, residual=residual, seed=h)
    gamma_arg = gamma.reshape(-1) if dtype == jnp.float16 else gamma  # [H] is accepted too
    outs = rmsnorm_mx_prefill(
        hidden, gamma_arg, residual=res, pack_scales=pack_scales, unpadded_hidden_size=unpadded, eps=1e-5
    )
    packed = outs[0] if residual else outs
    z, x = oracle_norm(hidden, gamma, res, eps=1e-5, unpadded=unpadded)
    want, mask = determined_bytes(z, dtype, pack_scales)
    assert packed.dtype == jnp.float8_e4m3fn and packed.shape == want.shape
    assert_bytes(as_bytes(packed), want, mask)
    # decode_packed_output's dequantization is within one e4m3 half-ulp of each block's largest value
    scales = want[:, h:][
        :,
        [
            ((k // 4) * 128 + (k % 4) * 4 if pack_scales else k * 128) + (g // 4) * 32 + g % 4
            for k in range(h // 512)
            for g in range(16)
        ],
    ]
    decoded = as_bytes(packed)[:, :h].view(E4M3).astype(np.float64) * 2.0 ** (np.repeat(scales, 32, 1) - 127.0)
    block_max = np.repeat(np.abs(z).reshape(b * s, -1, 32).max(axis=2), 32, axis=1)
    assert np.all(np.abs(decoded - z) <= block_max / 14)
    if residual:
        assert outs[1].dtype == dtype and outs[1].shape == (b * s, h)
        np.testing.assert_array_equal(f64(outs[1]), x)


@pytest.mark.parametrize(
    "act, router_dtype, e, top_k, bias",
    [
        ("SIGMOID", jnp.bfloat16, 13, 3, True),
        ("SOFTMAX", jnp.float16, 8, 8, False),
        (RouterActFnType.SOFTMAX, jnp.bfloat16, 33, 1, True),
    ],
)
def test_router_matches_oracle(act, router_dtype, e, top_k, bias):
    hidden, gamma, w, b, res = problem(2, 9, 1024, e=e, router_dtype=router_dtype, residual=True, bias=bias, seed=e)
    w_perm = jnp.asarray(np.asarray(w)[swizzle_index(1024)])  # the kernel doc's host weight prep
    bias_arg = None if b is None else b.reshape(-1) if e == 13 else b  # [E] or [1, E]
    packed, index, affinities, residual_out, norm = rmsnorm_mx_prefill(
        hidden, gamma, w_perm, bias_arg, res, top_k=top_k, router_act_fn=act, emit_norm_bf16=True
    )
    z, x = oracle_norm(hidden, gamma, res)
    want, mask = determined_bytes(z, router_dtype, True)  # the router's dtype is the compute dtype
    assert_bytes(as_bytes(packed), want, mask)
    softmax = act in ("SOFTMAX", RouterActFnType.SOFTMAX)
    want_index, want_dense, determined = oracle_router(rounded(z, router_dtype), w, b, top_k, softmax)
    assert determined.mean() > 0.8
    assert index.dtype == jnp.int32 and index.shape == (18, top_k)
    np.testing.assert_array_equal(np.asarray(index)[determined], want_index[determined])
    assert affinities.dtype == jnp.bfloat16 and affinities.shape == (18, e)
    assert_close(f64(affinities)[determined], want_dense[determined], jnp.bfloat16)
    assert np.all(f64(affinities)[determined][want_dense[determined] == 0] == 0)
    np.testing.assert_array_equal(f64(residual_out), x)
    assert norm.dtype == jnp.bfloat16
    assert_close(f64(norm), z, jnp.bfloat16, ops=2)
    np.testing.assert_array_equal(f64(norm), rounded(f64(norm), jnp.bfloat16))


@pytest.mark.parametrize(
    "e, n_group, topk_group, top_k, pack", [(32, 4, 2, 3, False), (12, 6, 3, 4, True), (6, 6, 2, 1, False)]
)
def test_noaux_tc_router_matches_oracle(e, n_group, topk_group, top_k, pack):
    hidden, gamma, w, b, _ = problem(2, 5, 1024, e=e, bias=True, seed=20 + e)
    b = b * 3  # a bias large enough to change the selection, which only it may influence
    outs = rmsnorm_mx_prefill(
        hidden,
        gamma,
        noaux_weights(w),
        b,
        top_k=top_k,
        router_act_fn="NOAUX_TC",
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=2.5,
        pack_affinities=pack,
    )
    z, _ = oracle_norm(hidden, gamma)
    want_bytes, mask = determined_bytes(z, jnp.bfloat16, True)
    want, determined = oracle_noaux(rounded(z, jnp.bfloat16), w, b, top_k, n_group, topk_group, 2.5)
    assert determined.mean() > 0.8
    if pack:  # one output: the row viewed as float32, the affinities after H + scale_region bytes
        (packed,) = (outs,)
        assert packed.dtype == jnp.float32 and packed.shape == (10, (1024 + 128 + 4 * e) // 4)
        assert_bytes(as_bytes(packed)[:, :1152], want_bytes, mask)
        affinities = packed[:, 1152 // 4 :]
    else:
        packed, affinities = outs
        assert packed.dtype == jnp.float8_e4m3fn and affinities.dtype == jnp.float32
        assert_bytes(as_bytes(packed), want_bytes, mask)
    assert affinities.shape == (10, e)
    assert_close(f64(affinities)[determined], want[determined], jnp.float32, reduction=1024, ops=64)
    np.testing.assert_array_equal(f64(affinities)[determined] == 0, want[determined] == 0)
    np.testing.assert_allclose(f64(affinities).sum(axis=1), 2.5, rtol=1e-5)


def test_noaux_tc_weights_layout():
    w = jnp.arange(1024 * 3, dtype=jnp.float32).reshape(1024, 3)
    np.testing.assert_array_equal(np.asarray(swizzle_router_weights(w, "NOAUX_TC")), np.asarray(noaux_weights(w)))


def test_ties_pick_the_lower_expert():
    hidden, gamma, _, _, _ = problem(1, 2, 512, seed=3)
    w = jnp.zeros((512, 6), jnp.bfloat16)  # all logits equal the bias
    bias = jnp.asarray([[0.0, 1.0, 0.5, 1.0, 0.5, 1.0]], jnp.float32)
    _, index, affinities = rmsnorm_mx_prefill(hidden, gamma, w, bias, top_k=4, router_act_fn="SOFTMAX")
    np.testing.assert_array_equal(np.asarray(index), [[1, 3, 5, 2]] * 2)
    want = np.exp([1.0, 1.0, 1.0, 0.5]) / np.exp([1.0, 1.0, 1.0, 0.5]).sum()
    np.testing.assert_allclose(f64(affinities)[:, [1, 3, 5, 2]], np.tile(want, (2, 1)), rtol=2**-8)
    assert np.all(f64(affinities)[:, [0, 4]] == 0)


@pytest.mark.parametrize("pack_scales", [True, False])
def test_pack_affinities(pack_scales):
    hidden, gamma, w, b, _ = problem(1, 3, 512, e=5, bias=True, seed=4)
    packed, index = rmsnorm_mx_prefill(hidden, gamma, w, b, top_k=2, pack_affinities=True, pack_scales=pack_scales)
    separate = rmsnorm_mx_prefill(hidden, gamma, w, b, top_k=2, pack_scales=pack_scales)
    row = 512 + 128
    assert packed.dtype == jnp.bfloat16 and packed.shape == (3, (-(-(row + 10) // 4) * 4) // 2)
    data = as_bytes(packed)
    np.testing.assert_array_equal(data[:, :row], as_bytes(separate[0]))
    np.testing.assert_array_equal(
        np.asarray(packed)[:, row // 2 : row // 2 + 5].view(np.uint16), np.asarray(separate[2]).view(np.uint16)
    )
    assert np.all(data[:, row + 10 :] == 0)
    np.testing.assert_array_equal(np.asarray(index), np.asarray(separate[1]))


def test_hidden_interleaved():
    hidden, gamma, w, _, res = problem(1, 4, 1024, e=6, residual=True, seed=5)
    stored = lambda a: jnp.asarray(np.asarray(a)[..., np.argsort(natural_index(1024))])  # noqa: E731
    natural = rmsnorm_mx_prefill(hidden, gamma, w, None, res, top_k=2, emit_norm_bf16=True)
    inter = rmsnorm_mx_prefill(
        stored(hidden), gamma, w, None, stored(res), top_k=2, emit_norm_bf16=True, hidden_interleaved=True
    )
    z, x = oracle_norm(stored(hidden), gamma, stored(res), interleaved=True)
    want, mask = determined_bytes(z, jnp.bfloat16, True)
    assert_bytes(as_bytes(inter[0]), want, mask)
    for got, expected in zip(inter[:3] + inter[4:], natural[:3] + natural[4:]):  # natural-order outputs agree
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(expected, np.float32))
    np.testing.assert_array_equal(f64(inter[3]), x)  # the residual stream stays in the inputs' (interleaved) order


def test_swizzle_router_weights():
    w = jnp.arange(1024 * 2, dtype=jnp.float32).reshape(1024, 2)
    np.testing.assert_array_equal(np.asarray(swizzle_router_weights(w)), np.asarray(w)[swizzle_index(1024)])
    with pytest.raises(ValueError, match="H % 512 == 0"):
        swizzle_router_weights(jnp.zeros((768, 2)))


# ------------------------------------------------------------------------------------------------ gradients
def test_gradients_float64():
    hidden, gamma, _, _, res = problem(1, 3, 512, jnp.float64, residual=True, seed=6)
    rng = np.random.default_rng(7)
    ct_norm = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    ct_res = jnp.asarray(rng.standard_normal((3, 512)), jnp.float64)

    def outputs(a, g, r):
        _, residual_out, norm = rmsnorm_mx_prefill(a, g, residual=r, emit_norm_bf16=True, unpadded_hidden_size=500)
        return residual_out, norm

    d_hidden, d_gamma, d_res = jax.jit(lambda *args: jax.vjp(outputs, *args)[1]((ct_res, ct_norm)))(hidden, gamma, res)
    # analytic: z = x r g, r = (sum x^2 / n + eps)^-1/2 -> dx = c g r - x r^3 / n sum(c g x); dg = sum_t c x r
    x = f64(hidden).reshape(3, 512) + f64(res).reshape(3, 512)
    g, c = f64(gamma).reshape(1, 512), f64(ct_norm)
    r = 1.0 / np.sqrt((x * x).sum(1, keepdims=True) / 500 + 1e-6)
    dx = c * g * r - x * r**3 / 500 * (c * g * x).sum(1, keepdims=True) + f64(ct_res)
    np.testing.assert_allclose(f64(d_hidden).reshape(3, 512), dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f64(d_res).reshape(3, 512), dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(f64(d_gamma), (c * x * r).sum(0, keepdims=True), rtol=1e-10, atol=1e-12)
    quantized = jax.jit(jax.grad(lambda a: jnp.sum(rmsnorm_mx_prefill(a, gamma).astype(jnp.float64))))(hidden)
    assert not np.any(np.asarray(quantized))
    w = jnp.ones((512, 4), jnp.bfloat16)
    affinity_sum = lambda a: jnp.sum(rmsnorm_mx_prefill(a, gamma, w, top_k=2)[2].astype(jnp.float64))  # noqa: E731
    routed = jax.jit(jax.grad(affinity_sum))(hidden)
    assert not np.any(np.asarray(routed))


# ------------------------------------------------------------------------------------------------ transformations
def _routed(a, g, r, w, b):
    return rmsnorm_mx_prefill(a, g, w, b, r, top_k=2, emit_norm_bf16=True)


def test_jit_and_vmap_folding():
    hidden, gamma, w, b, res = problem(2, 3, 512, e=6, residual=True, bias=True, seed=8)
    fn = lambda a, g, r: _routed(a, g, r, w, b)  # noqa: E731
    for got, want in zip(jax.jit(fn)(hidden, gamma, res), fn(hidden, gamma, res)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    flipped = fn(-hidden, gamma, res)
    batched = jax.jit(jax.vmap(fn, in_axes=(0, None, None)))(jnp.stack([hidden, -hidden]), gamma, res)  # folds into B
    for got, want in zip(batched, flipped):
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want, np.float32))
    nested = jax.jit(jax.vmap(jax.vmap(fn, in_axes=(0, None, 0)), in_axes=(0, None, None)))(
        jnp.stack([jnp.stack([hidden, -hidden])] * 2), gamma, jnp.stack([res, res])
    )
    for got, want in zip(nested, flipped):
        np.testing.assert_array_equal(np.asarray(got[1, 1], np.float32), np.asarray(want, np.float32))


def test_vmap_unfoldable_operands_and_grad():
    hidden, gamma, w, b, _ = problem(2, 3, 512, e=6, bias=True, seed=8)
    fn = lambda g, ww: _routed(hidden, g, None, ww, b)[:2]  # noqa: E731
    mapped = jax.jit(jax.vmap(fn))(jnp.stack([gamma, 2 * gamma]), jnp.stack([w, -w]))  # batched gamma/weights: lax.map
    for got, want in zip(mapped, fn(2 * gamma, -w)):
        np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want, np.float32))
    loss = lambda a, g: jnp.sum(rmsnorm_mx_prefill(a, g, emit_norm_bf16=True)[1].astype(jnp.float32) ** 2)  # noqa
    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(jnp.stack([hidden, -hidden]), gamma)
    np.testing.assert_allclose(
        np.asarray(per_example[1], np.float32),
        np.asarray(jax.jit(jax.grad(loss))(-hidden, gamma), np.float32),
        rtol=1e-2,
        atol=1e-2,
    )


def test_shard_map():
    hidden, gamma, w, _, res = problem(8, 2, 512, e=4, residual=True, seed=9)
    fn = lambda a, g, r: rmsnorm_mx_prefill(a, g, w, None, r, top_k=2)  # noqa: E731
    mesh = mesh_1d()
    specs = (P("data"), P(), P("data"))
    sharded = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=(P("data"),) * 4))(
        *shard(mesh, specs, hidden, gamma, res)
    )
    for got, want in zip(sharded, fn(hidden, gamma, res)):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ------------------------------------------------------------------------------------------------ Neuron lowering
def test_neuron_lowering():
    hidden, gamma, w, b, res = problem(2, 64, 1024, e=16, residual=True, bias=True, seed=10)
    call = lambda *args: rmsnorm_mx_prefill(*args, top_k=4, emit_norm_bf16=True)  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(call, hidden, gamma, w, b, res)
        (cfg,) = kernel_configs(text)
        assert compute_operations(text) == []
        assert cfg["entry_point"] == "nkilib.core.rmsnorm.rmsnorm_mx_prefill:rmsnorm_mx_prefill"
        assert cfg["input_names"] == ["hidden_states", "gamma", "router_weights", "router_bias", "residual"]
        assert cfg["output_names"] == [
            "norm_quant_packed",
            "expert_index",
            "expert_affinities",
            "output_residual",
            "norm_bf16",
        ]
        assert cfg["params"]["top_k"] == 4 and cfg["params"]["emit_norm_bf16"] is True
        assert "tensor<128x1152xf8E4M3FN>" in text and "tensor<128x4xi32>" in text
        with jax_nkilib.config(lnc=2):  # the kernel splits the tokens over the logical cores
            (cfg,) = kernel_configs(neuron_text(call, hidden, gamma, w, b, res))
            assert cfg["grid"] == 2
        packed_call = lambda *args: rmsnorm_mx_prefill(*args, top_k=2, pack_affinities=True)  # noqa: E731
        text = neuron_text(packed_call, hidden, gamma, w, b)
        assert len(kernel_configs(text)) == 1 and "tensor<128x592xbf16>" in text  # (1024 + 128 + 2 * 16) / 2
        with pytest.warns(NeuronFallbackWarning, match="hidden_states must be bfloat16 or float16; got float32"):
            assert kernel_configs(neuron_text(call, *problem(1, 4, 512, jnp.float32)[:2])) == []
        with pytest.warns(NeuronFallbackWarning, match="top_k=9 must be <= 8"):
            neuron_text(lambda a, g, ww: rmsnorm_mx_prefill(a, g, ww, top_k=9), *problem(1, 4, 512, e=10)[:3])
        with pytest.warns(NeuronFallbackWarning, match="NOAUX_TC needs n_group <= 8; got n_group=16"):
            neuron_text(
                lambda a, g, ww, bb: rmsnorm_mx_prefill(a, g, ww, bb, router_act_fn="NOAUX_TC", n_group=16),
                *problem(1, 4, 512, e=16, bias=True)[:4],
            )
        with pytest.warns(NeuronFallbackWarning, match="E=520 must be <= 512"):
            neuron_text(lambda a, g, ww: rmsnorm_mx_prefill(a, g, ww), *problem(1, 2, 512, e=520)[:3])


# ------------------------------------------------------------------------------------------------ errors
H512 = (jnp.zeros((1, 4, 512), jnp.bfloat16), jnp.zeros((1, 512), jnp.bfloat16))


@pytest.mark.parametrize(
    "args, kwargs, error, fragment",
    [
        ((jnp.zeros((1, 4, 768)), jnp.zeros((1, 768))), {}, ValueError, "H=768 must be a multiple of 512"),
        (H512 + (jnp.zeros((500, 8)),), {}, ValueError, r"argument `router_weights` must have layout \[H, E\]"),
        (H512 + (jnp.zeros((512,)),), {}, ValueError, r"argument `router_weights` must have layout \[H, E\]"),
        (H512 + (jnp.zeros((512, 8)),), dict(top_k=0), ValueError, r"top_k must be in \[1, E=8\]"),
        (H512 + (jnp.zeros((512, 8)),), dict(top_k=9), ValueError, r"top_k must be in \[1, E=8\]"),
        (H512 + (jnp.zeros((512, 8)),), dict(router_act_fn="NOAUX_TC"), ValueError, "NOAUX_TC needs router_bias"),
        (
            H512 + (jnp.zeros((512, 8)), jnp.zeros(8)),
            dict(router_act_fn="NOAUX_TC", n_group=3),
            ValueError,
            "n_group must be a positive divisor of E=8",
        ),
        (
            H512 + (jnp.zeros((512, 8)), jnp.zeros(8)),
            dict(router_act_fn="NOAUX_TC", n_group=2, topk_group=3),
            ValueError,
            r"topk_group must be in \[1, n_group=2\]",
        ),
        (H512 + (jnp.zeros((512, 8)),), dict(router_act_fn="RELU"), TypeError, "RouterActFnType member"),
        (H512 + (jnp.zeros((512, 8)), jnp.zeros((1, 7))), {}, ValueError, "argument `router_bias`"),
        (H512 + (None, jnp.zeros((1, 8))), {}, ValueError, "router_bias .* without router_weights"),
        (H512, dict(unpadded_hidden_size=513), ValueError, r"unpadded_hidden_size must be in \(0, H=512\]"),
        (H512, dict(qmx_output_dtype=jnp.float8_e5m2), ValueError, "qmx_output_dtype must be float8_e4m3fn"),
        ((H512[0], jnp.zeros((1, 1024))), {}, ValueError, "argument `gamma`"),
        (H512, dict(residual=jnp.zeros((1, 3, 512))), ValueError, "argument `residual`"),
        ((jnp.zeros((1, 4, 512), jnp.int32), H512[1]), {}, TypeError, "argument `hidden_states` must have dtype"),
    ],
)
def test_bad_inputs(args, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        rmsnorm_mx_prefill(*args, **kwargs)
