"""Hypothesis fuzz of the idiomatic ops: shapes, dtypes, parameter values and non-finite inputs.

Every call either raises a clear ``TypeError``/``ValueError`` that names the op, or returns a result that agrees with
a float64 NumPy oracle written here from the ops' documented semantics (and the documented contracts for NaN, large
offsets, non-finite quantization inputs and invalid run-time indices). Any other exception, or a finite result that
disagrees, fails. Examples are derandomized so CI is reproducible; each property runs a few dozen examples.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_nkilib

FUZZ = settings(
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
DTYPES = st.sampled_from([jnp.float32, jnp.bfloat16])
BAD_FLOATS = [float("nan"), float("inf"), -1.0, "0.1", True, None]


def clear_error(op: str):
    """A context manager that lets only a TypeError/ValueError naming ``op`` through."""
    return pytest.raises((TypeError, ValueError), match=rf"jax_nkilib\.{op}\b")


def values(draw, shape, dtype, *, offset=0.0, nonfinite=False):
    """Random values (plus a per-row offset), optionally with NaN/inf planted at a few positions."""
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) + offset
    if nonfinite and x.size:
        for _ in range(draw(st.integers(1, 3))):
            x.reshape(-1)[rng.integers(x.size)] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return np.asarray(jnp.asarray(x, dtype).astype(jnp.float32), np.float64)  # the values the op really sees


def tolerance(dtype, reduction=1):
    eps = float(jnp.finfo(dtype).eps)
    return 8 * eps * math.sqrt(reduction) + (1e-6 if dtype == jnp.float32 else 0.0)


def close_where_finite(got, want, tol, scale=1.0):
    """``got`` equals ``want`` where ``want`` is finite (within ``tol`` of ``scale``), NaN where ``want`` is NaN."""
    got = np.asarray(jnp.asarray(got, jnp.float32), np.float64)
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=tol, atol=tol * scale)
    assert np.isnan(got[np.isnan(want)]).all(), "a NaN input must give NaN where it is used"


# ------------------------------------------------------------------------------------------------------ norms
@st.composite
def norm_case(draw):
    rows = draw(st.integers(1, 5))
    hidden = draw(st.sampled_from([8, 24, 128, 200, 256]))
    dtype = draw(DTYPES)
    offset = draw(st.sampled_from([0.0, 0.0, 1e3, -3e4]))
    x = values(draw, (rows, hidden), dtype, offset=offset, nonfinite=draw(st.booleans()))
    weight = values(draw, (hidden,), dtype) if draw(st.booleans()) else None
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.0] + BAD_FLOATS))
    return x, weight, dtype, eps


@FUZZ
@given(norm_case())
def test_rms_norm(case):
    x, weight, dtype, eps = case
    args = (jnp.asarray(x, dtype), None if weight is None else jnp.asarray(weight, dtype))
    if not (isinstance(eps, float) and math.isfinite(eps) and eps >= 0):
        with clear_error("rms_norm"):
            jax_nkilib.rms_norm(*args, eps=eps)
        return
    got = jax_nkilib.rms_norm(*args, eps=eps)
    with np.errstate(all="ignore"):
        want = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 if weight is None else weight)
    scale = np.nanmax(np.abs(np.where(np.isfinite(want), want, 0)), initial=1.0)
    close_where_finite(got, want, tolerance(dtype, x.shape[-1]), scale)


@FUZZ
@given(norm_case())
def test_layer_norm_is_accurate_at_any_offset(case):
    x, weight, dtype, eps = case
    args = (jnp.asarray(x, dtype), None if weight is None else jnp.asarray(weight, dtype))
    if not (isinstance(eps, float) and math.isfinite(eps) and eps >= 0):
        with clear_error("layer_norm"):
            jax_nkilib.layer_norm(*args, eps=eps)
        return
    got = jax_nkilib.layer_norm(*args, eps=eps)
    with np.errstate(all="ignore"):
        centred = x - x.mean(-1, keepdims=True)
        want = centred / np.sqrt(np.mean(centred**2, -1, keepdims=True) + eps) * (1.0 if weight is None else weight)
    if eps == 0.0:
        want = np.where(np.isfinite(want), want, np.nan)  # a constant row divides 0 by 0
    scale = np.nanmax(np.abs(np.where(np.isfinite(want), want, 0)), initial=1.0)
    # bfloat16 rows far from 0 lose their low bits when the input is rounded, not in the op
    close_where_finite(got, want, tolerance(dtype, x.shape[-1]) * 4, scale)


# ------------------------------------------------------------------------------------------------------ rope
@st.composite
def rope_case(draw):
    batch, seq, heads = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 8, 64, 7]))
    dtype = draw(DTYPES)
    x = values(draw, (batch, seq, heads, head_dim), dtype, nonfinite=draw(st.booleans()))
    theta = values(draw, (seq, max(head_dim // 2, 1)), jnp.float32)
    interleaved = draw(st.sampled_from([False, True, 1, "yes"]))
    return x, theta, dtype, interleaved


@FUZZ
@given(rope_case())
def test_rope(case):
    x, theta, dtype, interleaved = case
    cos, sin = np.cos(theta), np.sin(theta)
    args = (jnp.asarray(x, dtype), jnp.asarray(cos, dtype), jnp.asarray(sin, dtype))
    if x.shape[-1] % 2 or not isinstance(interleaved, bool):
        with clear_error("rope"):
            jax_nkilib.rope(*args, interleaved=interleaved)
        return
    got = jax_nkilib.rope(*args, interleaved=interleaved)
    c = np.asarray(jnp.asarray(cos, dtype).astype(jnp.float32), np.float64)[None, :, None, :]
    s = np.asarray(jnp.asarray(sin, dtype).astype(jnp.float32), np.float64)[None, :, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        want = np.stack([a * c - b * s, b * c + a * s], -1).reshape(x.shape)
    else:
        a, b = np.split(x, 2, -1)
        want = np.concatenate([a * c - b * s, b * c + a * s], -1)
    with np.errstate(invalid="ignore"):
        close_where_finite(got, want, tolerance(dtype, 2) * 2, 3.0)


# ------------------------------------------------------------------------------------------------- attention
def attention_oracle(q, k, v, causal, scale, window):
    """float64 softmax(scale q k^T + mask) v with GQA; rows that see no key are 0."""
    batch, sq, heads, d = q.shape
    kv = k.shape[2]
    k = np.repeat(k, heads // kv, axis=2)
    v = np.repeat(v, heads // kv, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    i, j = np.arange(sq)[:, None], np.arange(k.shape[1])[None, :]
    visible = np.ones((sq, k.shape[1]), bool)
    if causal:
        visible &= j <= i
        if window:
            visible &= j > i - window
    logits = np.where(visible, logits, -np.inf)
    with np.errstate(invalid="ignore"):
        top = np.max(logits, -1, keepdims=True)
        weights = np.exp(logits - np.where(np.isfinite(top), top, 0))
        weights = np.where(visible, weights, 0.0)
        total = weights.sum(-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", weights / np.where(total == 0, 1, total), v)
    return np.where(np.moveaxis(total, 1, 2) == 0, 0.0, out)


@st.composite
def attention_case(draw):
    batch, seq = draw(st.integers(1, 2)), draw(st.integers(1, 12))
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 2))
    d = draw(st.sampled_from([4, 16]))
    dtype = draw(DTYPES)
    nan_query = draw(st.booleans())
    q = values(draw, (batch, seq, heads, d), dtype)
    if nan_query:
        q[0, draw(st.integers(0, seq - 1)), 0, 0] = np.nan
    k = values(draw, (batch, seq, kv, d), dtype)
    v = values(draw, (batch, seq, kv, d), dtype)
    causal = draw(st.booleans())
    scale = draw(st.sampled_from([None, 0.3, float("nan"), "0.5", float("inf")]))
    window = draw(st.sampled_from([None, None, 1, 3, 0, 2**31, 2.0]))
    return q, k, v, dtype, causal, scale, window


@FUZZ
@given(attention_case())
def test_attention(case):
    q, k, v, dtype, causal, scale, window = case
    args = [jnp.asarray(a, dtype) for a in (q, k, v)]
    valid_scale = scale is None or (isinstance(scale, float) and math.isfinite(scale))
    valid_window = window is None or (type(window) is int and 1 <= window < 2**31 and causal)
    if not (valid_scale and valid_window):
        with clear_error("attention"):
            jax_nkilib.attention(*args, causal=causal, scale=scale, sliding_window=window)
        return
    got = jax_nkilib.attention(*args, causal=causal, scale=scale, sliding_window=window)
    want = attention_oracle(q, k, v, causal, 1 / math.sqrt(q.shape[-1]) if scale is None else scale, window)
    close_where_finite(got, want, tolerance(dtype, q.shape[1]) * 4, 3.0)


# ------------------------------------------------------------------------------------------ decode: run-time indices
@st.composite
def decode_case(draw):
    batch, s_new, capacity = draw(st.integers(1, 3)), draw(st.integers(1, 2)), 16
    lens = [draw(st.integers(-3, capacity + 2)) for _ in range(batch)]
    return batch, s_new, capacity, lens, draw(st.integers(0, 2**31 - 1))


@settings(FUZZ, max_examples=8)
@given(decode_case())
def test_decode_attention_invalid_lengths_write_nothing_and_give_nan(case):
    batch, s_new, capacity, lens, seed = case
    rng = np.random.default_rng(seed)
    heads, kv, d = 2, 1, 8
    q = jnp.asarray(rng.standard_normal((batch, s_new, heads, d)), jnp.float32)
    k_new = jnp.asarray(rng.standard_normal((batch, s_new, kv, d)), jnp.float32)
    v_new = jnp.asarray(rng.standard_normal((batch, s_new, kv, d)), jnp.float32)
    k_cache = jnp.asarray(rng.standard_normal((batch, kv, capacity, d)), jnp.float32)
    v_cache = jnp.asarray(rng.standard_normal((batch, kv, capacity, d)), jnp.float32)
    out, k_out, v_out = jax_nkilib.decode_attention(q, k_new, v_new, k_cache, v_cache, jnp.asarray(lens, jnp.int32))
    for b, length in enumerate(lens):
        valid = 0 <= length <= capacity - 2 * s_new
        row = np.asarray(out[b])
        if not valid:
            assert np.isnan(row).all(), f"sequence {b} with cache_len {length} must give NaN rows"
            np.testing.assert_array_equal(k_out[b], k_cache[b])
            np.testing.assert_array_equal(v_out[b], v_cache[b])
            continue
        keys = np.concatenate([np.asarray(k_cache[b, :, :length]).transpose(1, 0, 2), np.asarray(k_new[b])])
        vals = np.concatenate([np.asarray(v_cache[b, :, :length]).transpose(1, 0, 2), np.asarray(v_new[b])])
        for i in range(s_new):  # token i sees the cache and the new tokens up to itself
            seen = length + i + 1
            want = attention_oracle(
                np.asarray(q[b, i])[None, None], keys[None, :seen], vals[None, :seen], False, 1 / math.sqrt(d), None
            )[0, 0]
            np.testing.assert_allclose(row[i], want, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.asarray(k_out[b, :, length : length + s_new]).transpose(1, 0, 2), k_new[b])


# ------------------------------------------------------------------------------------------------ quantizers
@st.composite
def fp8_case(draw):
    rows, cols = draw(st.integers(1, 4)), draw(st.sampled_from([1, 16, 64]))
    x = values(draw, (rows, cols), jnp.float32, nonfinite=draw(st.booleans()))
    mode = draw(st.sampled_from(["row", "static", "tensor", 3]))
    scale = draw(st.sampled_from([None, 0.05, 0.0, float("inf"), float("nan"), -1.0]))
    return x, mode, scale


@FUZZ
@given(fp8_case())
def test_quantize_fp8_leaves_non_finite_values_out_of_their_neighbours(case):
    x, mode, scale = case
    valid_mode = mode in ("row", "static")
    valid_scale = (scale is None) == (mode == "row") if valid_mode else True
    valid_value = scale is None or (math.isfinite(scale) and scale > 0)
    if not (valid_mode and valid_scale and valid_value):
        with clear_error("quantize_fp8"):
            jax_nkilib.quantize_fp8(
                jnp.asarray(x, jnp.float32), mode=mode, scale=None if scale is None else jnp.float32(scale)
            )
        return
    q, s = jax_nkilib.quantize_fp8(
        jnp.asarray(x, jnp.float32), mode=mode, scale=None if scale is None else jnp.float32(scale)
    )
    back = np.asarray(jax_nkilib.dequantize_fp8(q, s), np.float64)
    finite = np.isfinite(x)
    if mode == "row":  # the row's finite values set its scale: each comes back within FP8's half-ulp (2^-4)
        amax = np.max(np.abs(np.where(finite, x, 0)), -1, keepdims=True)
        np.testing.assert_allclose(back[finite], x[finite], rtol=2**-3, atol=float(np.max(amax)) * 2**-9 + 1e-12)
    else:
        limit = 240 * scale
        clipped = np.clip(x, -limit, limit)
        np.testing.assert_allclose(back[finite], clipped[finite], rtol=2**-3, atol=scale * 2**-9)
    assert np.isnan(back[np.isnan(x)]).all()
    assert np.all(np.abs(back[np.isinf(x)]) > 0) and np.all(np.sign(back[np.isinf(x)]) == np.sign(x[np.isinf(x)]))


@st.composite
def mx_case(draw):
    rows, blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    x = values(draw, (rows, 32 * blocks), jnp.float32, nonfinite=draw(st.booleans()))
    return x


@FUZZ
@given(mx_case())
def test_quantize_mx_keeps_a_nan_from_its_block_mates(x):
    data, scales = jax_nkilib.quantize_mx(jnp.asarray(x, jnp.float32))
    back = np.asarray(jax_nkilib.dequantize_mx(data, scales), np.float64)
    blocks = x.reshape(x.shape[0], -1, 32)
    finite = np.isfinite(blocks)
    amax = np.max(np.abs(np.where(finite, blocks, 0)), -1, keepdims=True)
    got = back.reshape(blocks.shape)
    # each finite value within E4M3's relative step (2^-3) or a block's smallest step (amax * 2^-9)
    np.testing.assert_allclose(
        got[finite], blocks[finite], rtol=2**-3, atol=float(np.max(amax, initial=0.0)) * 2**-8 + 1e-30
    )
    assert np.isnan(got[np.isnan(blocks)]).all()


# ---------------------------------------------------------------------------------- projections and mlp: parameters
@st.composite
def mlp_case(draw):
    eps = draw(st.sampled_from([1e-6, 0.0, float("nan"), -1.0, "1e-6"]))
    clamp = draw(st.sampled_from([None, (None, 5.0), (-5.0, 5.0), (5.0, -5.0), (float("nan"), 1.0), 3.0]))
    activation = draw(st.sampled_from(["silu", "gelu", "relu", "swish", "tanh"]))
    return eps, clamp, activation


@FUZZ
@given(mlp_case())
def test_mlp_parameters(case):
    eps, clamp, activation = case
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 4, 128)), jnp.float32)
    w_gate, w_up = (jnp.asarray(rng.standard_normal((128, 256)) * 0.05, jnp.float32) for _ in range(2))
    w_down = jnp.asarray(rng.standard_normal((256, 128)) * 0.05, jnp.float32)
    call = lambda: jax_nkilib.mlp(
        x,
        w_gate,
        w_up,
        w_down,
        activation=activation,
        norm="rms",  # noqa: E731
        norm_weight=jnp.ones(128),
        eps=eps,
        gate_clamp=clamp,
    )
    valid_eps = isinstance(eps, float) and math.isfinite(eps) and eps >= 0
    valid_clamp = clamp is None or (
        isinstance(clamp, tuple)
        and not any(isinstance(b, float) and math.isnan(b) for b in clamp)
        and (None in clamp or clamp[0] <= clamp[1])
    )
    try:
        out = call()
    except (TypeError, ValueError) as err:
        assert "jax_nkilib.mlp" in str(err)
        assert not (valid_eps and valid_clamp) or activation == "tanh", f"refused a valid call: {err}"
        return
    assert valid_eps and valid_clamp and activation != "tanh", "accepted an invalid parameter"
    assert np.isfinite(np.asarray(out)).all()


@st.composite
def qkv_case(draw):
    heads = draw(st.integers(1, 4))
    kv = draw(st.sampled_from([1, 2, 3]))
    d = draw(st.sampled_from([8, 16]))
    cut = draw(st.sampled_from([0, 0, 2, -2]))  # a split weight cut off a head boundary
    return heads, kv, d, cut


@FUZZ
@given(qkv_case())
def test_qkv_projection_split_weights_must_match_the_heads(case):
    heads, kv, d, cut = case
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((1, 4, 64)), jnp.float32)
    parts = [
        jnp.asarray(rng.standard_normal((64, n)) * 0.1, jnp.float32) for n in (heads * d + cut, kv * d, kv * d - cut)
    ]
    if cut:  # (any head counts are fine for the projection itself; grouping is attention's concern)
        with clear_error("qkv_projection"):
            jax_nkilib.qkv_projection(x, tuple(parts), num_q_heads=heads, num_kv_heads=kv)
        return
    q, k, v = jax_nkilib.qkv_projection(x, tuple(parts), num_q_heads=heads, num_kv_heads=kv)
    assert q.shape == (1, 4, heads, d) and k.shape == v.shape == (1, 4, kv, d)
    want = np.asarray(x, np.float64) @ np.asarray(parts[0], np.float64)
    np.testing.assert_allclose(np.asarray(q).reshape(1, 4, -1), want, rtol=2e-2, atol=2e-2)
