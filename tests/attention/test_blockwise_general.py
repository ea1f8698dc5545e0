"""The blockwise engine's general masking against a NumPy float64 oracle: right windows, segment ids, dense masks,
biases and logit soft-capping, forward and backward (dq, dk, dv, dbias), with odd sizes and grouped queries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_nkilib._src.attention.blockwise import attention_backward, attention_forward, block_pairs, log_sum_exp
from jax_nkilib._src.attention.masks import MaskRule
from tests.attention.oracle import allowed_mask, softmax_rows
from tests.support.data import random
from tests.support.numerics import assert_close, f64, tolerance

H_KV, G, SEQ_Q, SEQ_K, D = 2, 2, 37, 29, 8
BLOCKS = dict(block_q=16, block_k=16)  # neither sequence is a multiple of the blocks
SCALE = 0.4


# ------------------------------------------------------------------------------------------------ the oracle
def oracle_allowed(
    seq_q, n_prior, seq_k, *, causal=False, window=0, right_window=None, q_segments=None, kv_segments=None, mask=None
):
    """Booleans broadcast to [H_kv, G, Sq, S_prior + Sk] (prior slots first, at positions -n_prior..-1)."""
    ok = allowed_mask(seq_q, n_prior, seq_k, causal=causal, window=window)
    if right_window is not None:
        k_pos = np.concatenate([np.arange(n_prior) - n_prior, np.arange(seq_k)])
        ok &= k_pos[None, :] <= np.arange(seq_q)[:, None] + right_window
    if q_segments is not None:
        ok &= np.asarray(q_segments)[:, None] == np.asarray(kv_segments)[None, :]
    return ok if mask is None else ok & np.asarray(mask)


def logits_of(q, k, scale, bias, soft_cap):
    """(logits before masking, the tanh of the soft cap or None): soft_cap * tanh(scale q k^T / soft_cap) + bias."""
    s = scale * np.einsum("hgqd,hkd->hgqk", q, k)
    capped = None
    if soft_cap is not None:
        capped = np.tanh(s / soft_cap)
        s = soft_cap * capped
    return (s if bias is None else s + f64(bias)), capped


def dense_attention(q, k, v, ok, scale, bias=None, soft_cap=None):
    """q [H_kv, G, Sq, d], k/v [H_kv, Sk, d] -> o [H_kv, G, Sq, d] (rows with no allowed key: 0)."""
    q, k, v = f64(q), f64(k), f64(v)
    s, _ = logits_of(q, k, scale, bias, soft_cap)
    p = softmax_rows(s, np.broadcast_to(ok, s.shape), None)[0]
    return np.einsum("hgqk,hkd->hgqd", p, v)


def dense_attention_grads(q, k, v, ok, scale, dy, bias=None, soft_cap=None):
    """Gradients of sum(o * dy) for :func:`dense_attention`: (dq, dk, dv, dbias), dbias in the bias's shape."""
    q, k, v, dy = f64(q), f64(k), f64(v), f64(dy)
    s, capped = logits_of(q, k, scale, bias, soft_cap)
    p = softmax_rows(s, np.broadcast_to(ok, s.shape), None)[0]
    dp = np.einsum("hgqd,hkd->hgqk", dy, v)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))  # the gradient of the logits
    dbias = None
    if bias is not None:
        shape = np.shape(bias)
        padded = (1,) * (4 - len(shape)) + shape
        dbias = ds.sum(tuple(a for a in range(4) if padded[a] == 1), keepdims=True).reshape(shape)
    du = ds if capped is None else ds * (1 - capped**2)
    dq = scale * np.einsum("hgqk,hkd->hgqd", du, k)
    dk = scale * np.einsum("hgqk,hgqd->hkd", du, q)
    dv = np.einsum("hgqk,hgqd->hkd", p, dy)
    return dq, dk, dv, dbias


# ------------------------------------------------------------------------------------------------ helpers
def inputs(dtype=jnp.float64, n_prior=0, seq_q=SEQ_Q, seq_k=SEQ_K):
    return (
        random((H_KV, G, seq_q, D), dtype, 0),
        random((H_KV, n_prior + seq_k, D), dtype, 1),
        random((H_KV, n_prior + seq_k, D), dtype, 2),
        random((H_KV, G, seq_q, D), dtype, 3),
    )


def engine(q, k, v, dy, rule, *, bias=None, mask=None, soft_cap=None, **blocks):
    """The engine's (o, (dq, dk, dv, dsink, dbias))."""
    blocks = blocks or BLOCKS
    dense = dict(bias=bias, mask=mask, soft_cap=soft_cap)
    o, row_max, row_sum = attention_forward(q, k, v, rule, SCALE, **dense, **blocks)
    lse = log_sum_exp(row_max, row_sum)
    return o, attention_backward(q, k, v, o, dy, lse, rule, SCALE, **dense, return_dbias=True, **blocks)


def assert_matches(q, k, v, dy, rule, ok, dtype=jnp.float64, *, bias=None, mask=None, soft_cap=None):
    o, (dq, dk, dv, dsink, dbias) = engine(q, k, v, dy, rule, bias=bias, mask=mask, soft_cap=soft_cap)
    assert dsink is None and (dbias is None) == (bias is None)
    assert_close(o, dense_attention(q, k, v, ok, SCALE, bias, soft_cap), dtype, reduction=k.shape[1])
    want = dense_attention_grads(q, k, v, ok, SCALE, dy, bias, soft_cap)
    for got, expected, n in zip((dq, dk, dv, dbias), want, (k.shape[1], G * q.shape[2], G * q.shape[2], D)):
        if expected is None:
            continue
        assert got.shape == expected.shape and got.dtype == jnp.promote_types(dtype, jnp.float32)
        if np.max(np.abs(expected)) > 1e-9:
            assert_close(got, expected, dtype, reduction=n)
        else:  # a gradient that is 0 up to rounding (one key per row: P = 1, dS = 0): O(1) terms cancelled
            assert np.max(np.abs(np.asarray(got))) <= tolerance(dtype, n)
    return o, (dq, dk, dv, dbias)


# ------------------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize(
    "left, right, n_prior",
    [(3, 2, 0), (0, 0, 0), (100, 100, 0), (None, 3, 5)],  # jax's local_window_size (None: no left window)
)
def test_right_windows(left, right, n_prior):
    q, k, v, dy = inputs(n_prior=n_prior)
    window = 0 if left is None else left + 1
    rule = MaskRule(n_queries=SEQ_Q, n_active=SEQ_K, n_prior=n_prior, window=window, right_window=right)
    ok = oracle_allowed(SEQ_Q, n_prior, SEQ_K, window=window, right_window=right)
    assert_matches(q, k, v, dy, rule, ok)


def test_static_right_windows_skip_hidden_block_pairs_even_with_segment_ids():
    count = lambda rule: len(block_pairs(rule, 8, 8, 8, 8, by="query")[0])  # noqa: E731
    assert count(MaskRule(n_queries=64, n_active=64, right_window=0)) == 36  # the same pairs as causal
    assert count(MaskRule(n_queries=64, n_active=64, right_window=1)) == 43  # query 7 sees key 8: 36 + 7 pairs
    assert count(MaskRule(n_queries=64, n_active=64, window=1, right_window=8)) == 15  # the diagonal and one above
    assert count(MaskRule(n_queries=64, n_active=64, right_window=-64)) == 1  # nothing visible: one pair kept
    ids = jnp.zeros(64, jnp.int32)
    packed = MaskRule(n_queries=64, n_active=64, causal=True, q_segment_ids=ids, kv_segment_ids=ids)
    assert count(packed) == 36


@pytest.mark.parametrize("causal", [False, True])
def test_segment_ids(causal):
    q, k, v, dy = inputs()
    rng = np.random.default_rng(7)
    q_ids = rng.integers(0, 4, SEQ_Q).astype(np.int32)  # equal ids far apart: equality, not contiguity
    kv_ids = rng.integers(0, 3, SEQ_K).astype(np.int32)  # no key has id 3: those rows see nothing
    q_ids[:3] = 3
    rule = MaskRule(
        n_queries=SEQ_Q, n_active=SEQ_K, causal=causal, q_segment_ids=jnp.asarray(q_ids), kv_segment_ids=kv_ids
    )
    ok = oracle_allowed(SEQ_Q, 0, SEQ_K, causal=causal, q_segments=q_ids, kv_segments=kv_ids)
    o, (dq, _, _, dbias) = assert_matches(q, k, v, dy, rule, ok)
    empty = q_ids == 3
    assert dbias is None and np.all(np.asarray(o)[:, :, empty] == 0) and np.all(np.asarray(dq)[:, :, empty] == 0)


@pytest.mark.parametrize("shape", [(H_KV, G, SEQ_Q, 4 + SEQ_K), (1, 1, SEQ_Q, 4 + SEQ_K), (1, 1, 1, 4 + SEQ_K)])
def test_dense_masks_with_a_prefix(shape):
    q, k, v, dy = inputs(n_prior=4)
    mask = np.random.default_rng(8).random(shape) < 0.7
    rule = MaskRule(n_queries=SEQ_Q, n_active=SEQ_K, n_prior=4, causal=True)
    ok = oracle_allowed(SEQ_Q, 4, SEQ_K, causal=True, mask=mask)
    assert_matches(q, k, v, dy, rule, ok, mask=jnp.asarray(mask))


@pytest.mark.parametrize(
    "shape, soft_cap",
    [((H_KV, G, SEQ_Q, SEQ_K), 2.0), ((SEQ_Q, SEQ_K), None), ((H_KV, 1, 1, SEQ_K), 2.0)],
)
def test_bias_and_soft_cap(shape, soft_cap):
    q, k, v, dy = inputs()
    bias = random(shape, jnp.float64, 9)
    rule = MaskRule(n_queries=SEQ_Q, n_active=SEQ_K, causal=True)
    ok = oracle_allowed(SEQ_Q, 0, SEQ_K, causal=True)
    _, (_, _, _, dbias) = assert_matches(q, k, v, dy, rule, ok, bias=bias, soft_cap=soft_cap)
    if len(shape) == 4 and shape[2] == SEQ_Q:  # dS is exactly 0 where masked
        assert np.all(np.asarray(dbias)[..., ~ok] == 0)


def test_dbias_is_exactly_zero_where_masked_even_in_a_nan_row():
    """As the gradient of jax.nn.dot_product_attention's select: a NaN output gradient makes the row's dbias NaN only
    where the row attends."""
    q, k, v, dy = inputs(seq_q=6, seq_k=6)
    allowed = oracle_allowed(6, 0, 6, causal=True)  # as a dense mask: every block pair is visited
    dy = dy.at[:, :, 3].set(jnp.nan)
    rule, bias = MaskRule(n_queries=6, n_active=6), jnp.zeros((6, 6))
    _, (_, _, _, _, dbias) = engine(q, k, v, dy, rule, bias=bias, mask=jnp.asarray(allowed), block_q=4, block_k=4)
    assert np.all(np.isnan(dbias[3, :4])) and np.all(np.asarray(dbias)[~allowed] == 0)
    assert np.all(np.isfinite(np.delete(np.asarray(dbias), 3, axis=0)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_everything_at_once_in_low_precision_under_jit(dtype):
    q, k, v, dy = inputs(dtype)
    rng = np.random.default_rng(10)
    q_ids, kv_ids = np.sort(rng.integers(0, 3, SEQ_Q)), np.sort(rng.integers(0, 3, SEQ_K))
    mask = rng.random((1, G, SEQ_Q, SEQ_K)) < 0.8
    bias = random((1, 1, SEQ_Q, SEQ_K), jnp.float32, 11)

    @jax.jit
    def run(q, k, v, dy, q_ids, kv_ids, bias, mask):
        rule = MaskRule(
            n_queries=SEQ_Q, n_active=SEQ_K, window=6, right_window=2, q_segment_ids=q_ids, kv_segment_ids=kv_ids
        )
        return engine(q, k, v, dy, rule, bias=bias, mask=mask, soft_cap=3.0)

    o, (dq, dk, dv, _, dbias) = run(q, k, v, dy, jnp.asarray(q_ids), jnp.asarray(kv_ids), bias, jnp.asarray(mask))
    ok = oracle_allowed(SEQ_Q, 0, SEQ_K, window=6, right_window=2, q_segments=q_ids, kv_segments=kv_ids, mask=mask)
    assert o.dtype == dbias.dtype == jnp.float32 and dbias.shape == bias.shape
    assert_close(o, dense_attention(q, k, v, ok, SCALE, bias, 3.0), dtype, reduction=SEQ_K)
    want = dense_attention_grads(q, k, v, ok, SCALE, dy, bias, 3.0)
    for got, expected, n in zip((dq, dk, dv, dbias), want, (SEQ_K, G * SEQ_Q, G * SEQ_Q, D)):
        assert_close(got, expected, dtype, reduction=n)


def test_the_backward_is_the_gradient_of_the_forward():
    """check_grads on the float64 engine as a custom_vjp (finite differences of the forward against the backward),
    and the same case against the oracle's analytic gradients."""
    seq_q, seq_k = 11, 9
    q, k, v, dy = inputs(seq_q=seq_q, seq_k=seq_k)
    bias = random((1, G, seq_q, seq_k), jnp.float64, 12)
    mask = jnp.asarray(np.random.default_rng(13).random((seq_q, seq_k)) < 0.8)
    q_ids, kv_ids = jnp.asarray([0, 1, 1, 0, 2, 0, 1, 1, 0, 0, 1]), jnp.asarray([1, 0, 0, 1, 1, 0, 0, 1, 2])
    rule = MaskRule(
        n_queries=seq_q, n_active=seq_k, window=4, right_window=3, q_segment_ids=q_ids, kv_segment_ids=kv_ids
    )
    dense = dict(mask=mask, soft_cap=1.5, block_q=4, block_k=4)

    @jax.custom_vjp
    def attend(q, k, v, bias):
        return attention_forward(q, k, v, rule, SCALE, bias=bias, **dense)[0]

    def forward(q, k, v, bias):
        o, row_max, row_sum = attention_forward(q, k, v, rule, SCALE, bias=bias, **dense)
        return o, (q, k, v, bias, o, log_sum_exp(row_max, row_sum))

    def backward(residuals, do):
        q, k, v, bias, o, lse = residuals
        dq, dk, dv, _, dbias = attention_backward(
            q, k, v, o, do, lse, rule, SCALE, bias=bias, return_dbias=True, **dense
        )
        return dq, dk, dv, dbias

    attend.defvjp(forward, backward)
    check_grads(jax.jit(attend), (q, k, v, bias), order=1, modes=["rev"])
    ok = oracle_allowed(seq_q, 0, seq_k, window=4, right_window=3, q_segments=q_ids, kv_segments=kv_ids, mask=mask)
    _, vjp = jax.vjp(attend, q, k, v, bias)
    want = dense_attention_grads(q, k, v, ok, SCALE, dy, bias, 1.5)
    for got, expected in zip(vjp(dy), want):
        assert_close(got, expected, jnp.float64, reduction=seq_k)


def test_bad_arguments_are_refused():
    q, k, v, _ = inputs(seq_q=4, seq_k=4)
    ids = jnp.zeros(4, jnp.int32)
    with pytest.raises(ValueError, match="prefix keys carry no segment"):
        MaskRule(n_queries=4, n_active=4, n_prior=2, q_segment_ids=ids, kv_segment_ids=ids)
    with pytest.raises(ValueError, match="both or neither"):
        MaskRule(n_queries=4, n_active=4, q_segment_ids=ids)
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        MaskRule(n_queries=4, n_active=4, q_segment_ids=ids, kv_segment_ids=jnp.zeros(4))
    rule = MaskRule(n_queries=4, n_active=4)
    with pytest.raises(ValueError, match="every dim 1 or full"):
        attention_forward(q, k, v, rule, 1.0, bias=jnp.zeros((H_KV, G, 2, 4)))
    with pytest.raises(TypeError, match="boolean"):
        attention_forward(q, k, v, rule, 1.0, mask=jnp.ones((4, 4)))
    with pytest.raises(ValueError, match="soft_cap"):
        attention_forward(q, k, v, rule, 1.0, soft_cap=0.0)
