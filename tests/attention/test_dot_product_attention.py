"""jax_nkilib.dot_product_attention: a float64 oracle of its semantics, packed and padded batches against separate
sequences, the routes on Neuron, and bad inputs. JAX's own test cases are in test_dot_product_attention_jax.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

dpa = jax_nkilib.dot_product_attention


def oracle(
    q,
    k,
    v,
    bias=None,
    mask=None,
    *,
    scale=None,
    causal=False,
    q_len=None,
    kv_len=None,
    window=None,
    q_ids=None,
    kv_ids=None,
    soft_cap=None,
    sinks=None,
):
    """``(out [B, T, N, H], lse [B, T, N])`` in float64 from the semantics in the op's docstring (rows that see no
    key give 0 and lse +inf; query rows past q_len give 0)."""
    q, k, v = f64(q), f64(k), f64(v)
    batch, seq_q, heads, d = q.shape
    seq_k, kv_heads = k.shape[1], k.shape[2]
    k, v = np.repeat(k, heads // kv_heads, axis=2), np.repeat(v, heads // kv_heads, axis=2)
    scale = 1 / np.sqrt(d) if scale is None else scale
    logits = scale * np.einsum("btnh,bsnh->bnts", q, k)
    if soft_cap is not None:
        logits = soft_cap * np.tanh(logits / soft_cap)
    if bias is not None:
        logits = logits + f64(bias).reshape((1,) * (4 - np.ndim(bias)) + np.shape(bias))
    i, j = np.arange(seq_q)[:, None], np.arange(seq_k)[None, :]
    ok = np.ones((batch, heads, seq_q, seq_k), bool)
    if mask is not None:
        ok &= np.asarray(mask).reshape((1,) * (4 - np.ndim(mask)) + np.shape(mask))
    if causal:
        ok &= j <= i
    if window is not None:
        left, right = (window, window) if isinstance(window, int) else window
        ok &= (j >= i - left) & (j <= i + right)
    if kv_len is not None:
        ok &= j[None, None] < np.asarray(kv_len)[:, None, None, None]
    if q_ids is not None:
        kv_ids = q_ids if kv_ids is None else kv_ids
        ok &= np.asarray(q_ids)[:, None, :, None] == np.asarray(kv_ids)[:, None, None, :]
    s = np.where(ok, logits, -np.inf)
    if sinks is not None:
        sink = np.broadcast_to(f64(sinks), (batch, heads))[:, :, None, None]
        s = np.concatenate([s, np.broadcast_to(sink, s.shape[:3] + (1,))], axis=-1)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m)
    total = e.sum(-1, keepdims=True)
    p = np.where(total > 0, e / np.where(total > 0, total, 1), 0.0)[..., :seq_k]
    out = np.einsum("bnts,bsnh->btnh", p, v)
    lse = np.where(total[..., 0] > 0, m[..., 0] + np.log(np.where(total[..., 0] > 0, total[..., 0], 1)), np.inf)
    if q_len is not None:
        out = np.where((np.arange(seq_q)[None, :] < np.asarray(q_len)[:, None])[:, :, None, None], out, 0.0)
    return out, np.transpose(lse, (0, 2, 1))


def _inputs(dtype, batch=2, seq_q=37, seq_k=37, heads=4, kv_heads=2, d=16, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (batch, seq_q, heads, d), dtype)
    k = jax.random.normal(keys[1], (batch, seq_k, kv_heads, d), dtype)
    v = jax.random.normal(keys[2], (batch, seq_k, kv_heads, d), dtype)
    return q, k, v


IDS = np.array([[0] * 10 + [1] * 20 + [2] * 7, [5] * 37])
CASES = {
    "plain": {},
    "causal": dict(is_causal=True),
    "padding": dict(query_seq_lengths=np.array([20, 37], np.int32), key_value_seq_lengths=np.array([11, 30], np.int32)),
    "causal_window": dict(is_causal=True, local_window_size=(5, 3)),
    "two_sided_window": dict(local_window_size=(4, 2)),
    "segments": dict(is_causal=True, query_segment_ids=IDS),
    "bias": dict(bias="bias"),
    "mask": dict(mask="mask", is_causal=True),
    "soft_cap_bias_sinks": dict(logits_soft_cap=2.0, bias="bias", sinks="sinks"),
    "sinks_window": dict(is_causal=True, local_window_size=(6, 0), sinks="sinks"),
}


def _arguments(case, dtype, q):
    rng = np.random.default_rng(1)
    kwargs = dict(CASES[case])
    if kwargs.get("bias") == "bias":
        kwargs["bias"] = jnp.asarray(rng.normal(size=(1, q.shape[2], q.shape[1], q.shape[1])), dtype)
    if kwargs.get("mask") == "mask":
        kwargs["mask"] = jnp.asarray(rng.random((q.shape[0], 1, q.shape[1], q.shape[1])) < 0.7)
    if kwargs.get("sinks") == "sinks":
        kwargs["sinks"] = jnp.asarray(rng.normal(size=(q.shape[2],)), dtype)
    return kwargs


def _oracle_kwargs(kwargs):
    rename = dict(
        is_causal="causal",
        query_seq_lengths="q_len",
        key_value_seq_lengths="kv_len",
        local_window_size="window",
        query_segment_ids="q_ids",
        key_value_segment_ids="kv_ids",
        logits_soft_cap="soft_cap",
    )
    return {rename.get(name, name): value for name, value in kwargs.items()}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_and_residual_match_the_oracle(case, dtype):
    q, k, v = _inputs(dtype)
    kwargs = _arguments(case, dtype, q)
    out, lse = jax.jit(lambda q, k, v: dpa(q, k, v, return_residual=True, **kwargs))(q, k, v)
    expected, expected_lse = oracle(q, k, v, **_oracle_kwargs(kwargs))
    assert out.dtype == dtype and lse.dtype == dtype
    assert_close(out, expected, dtype, reduction=37)
    finite = np.isfinite(expected_lse)
    if "query_seq_lengths" in kwargs:  # rows past the length: their residual is unspecified
        finite &= (np.arange(37)[None, :] < kwargs["query_seq_lengths"][:, None])[:, :, None]
    assert_close(np.where(finite, lse, 0), np.where(finite, expected_lse, 0), dtype, reduction=37)
    assert jax_nkilib.dot_product_attention(q, k, v, **kwargs).shape == q.shape


@pytest.mark.parametrize("case", ["padding", "segments", "two_sided_window", "soft_cap_bias_sinks", "mask"])
def test_gradients_float64(case):
    q, k, v = _inputs(jnp.float64, batch=2, seq_q=37, seq_k=37, d=8)
    kwargs = _arguments(case, jnp.float64, q)
    diff = {name: kwargs.pop(name) for name in ("bias", "sinks") if name in kwargs}
    names = list(diff)
    fn = lambda q, k, v, *extra: dpa(q, k, v, **kwargs, **dict(zip(names, extra)))
    check_grads(fn, (q, k, v, *diff.values()), order=1, modes=["rev"])


def test_packed_batch_matches_each_sequence_alone():
    """Three sequences in one row (segment ids) and a right-padded batch: the same outputs and gradients as each
    sequence run alone. (Jitted: op by op, each call would compile every primitive.)"""
    dpa = jax.jit(jax_nkilib.dot_product_attention, static_argnames=("is_causal",))
    lengths = (10, 20, 7)
    q, k, v = _inputs(jnp.float32, batch=1, seq_q=sum(lengths), seq_k=sum(lengths), seed=3)
    ids = np.repeat(np.arange(3), lengths)[None]
    dy = jax.random.normal(jax.random.key(9), q.shape)

    packed = lambda q, k, v: dpa(q, k, v, is_causal=True, query_segment_ids=ids)
    packed_out = packed(q, k, v)
    packed_grads = jax.grad(lambda *a: jnp.sum(packed(*a) * dy), argnums=(0, 1, 2))(q, k, v)
    start = 0
    for length in lengths:
        piece = slice(start, start + length)
        alone = lambda q, k, v, piece=piece: jnp.sum(dpa(q, k, v, is_causal=True) * dy[:, piece])
        args = tuple(x[:, piece] for x in (q, k, v))
        np.testing.assert_allclose(packed_out[:, piece], dpa(*args, is_causal=True), rtol=1e-5, atol=1e-6)
        for packed_grad, grad in zip(packed_grads, jax.grad(alone, argnums=(0, 1, 2))(*args)):
            np.testing.assert_allclose(packed_grad[:, piece], grad, rtol=1e-5, atol=1e-6)
        start += length

    # right padding: sequence b is its first seq[b] tokens of 37
    pieces = (slice(0, 10), slice(10, 37))
    pad = lambda x: jnp.stack([jnp.pad(x[0, p], ((0, 37 - (p.stop - p.start)), (0, 0), (0, 0))) for p in pieces])
    seq = jnp.array([10, 27], jnp.int32)
    out = dpa(pad(q), pad(k), pad(v), is_causal=True, query_seq_lengths=seq, key_value_seq_lengths=seq)
    for row, p in enumerate(pieces):
        alone = dpa(q[:, p], k[:, p], v[:, p], is_causal=True)[0]
        np.testing.assert_allclose(out[row, : p.stop - p.start], alone, rtol=1e-5, atol=1e-6)
    assert not np.any(out[0, 10:]) and not np.any(out[1, 27:])


def test_default_is_not_causal_like_jax():
    q, k, v = _inputs(jnp.float32)
    np.testing.assert_allclose(
        dpa(q, k, v), jax.nn.dot_product_attention(q, k, v, implementation="xla"), rtol=1e-5, atol=1e-6
    )


def test_unbatched_inputs_and_vmap():
    q, k, v = _inputs(jnp.float32)
    unbatched = dpa(q[0], k[0], v[0], is_causal=True)
    assert unbatched.shape == q.shape[1:]
    np.testing.assert_allclose(unbatched, dpa(q, k, v, is_causal=True)[0], rtol=1e-6)
    np.testing.assert_allclose(jax.vmap(lambda *a: dpa(*a, is_causal=True))(q, k, v), dpa(q, k, v, is_causal=True))


def _kernel_names(fn, *args):
    return [config["func_name"] for config in kernel_configs(neuron_text(fn, *args))]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(is_causal=True),
        dict(is_causal=True, local_window_size=(8, 0)),
        dict(local_window_size=(8, 0)),
        dict(is_causal=True, query_seq_lengths=np.array([64, 30], np.int32)),
        dict(is_causal=True, query_segment_ids=np.repeat(np.arange(2), 64).reshape(1, -1).repeat(2, 0)),
    ],
)
def test_kernel_route_lowers_to_attention_cte(kwargs):
    q, k, v = _inputs(jnp.bfloat16, seq_q=128, seq_k=128)
    with jax_nkilib.neuron.dry_run():
        forward = _kernel_names(lambda q, k, v: dpa(q, k, v, **kwargs), q, k, v)
        backward = _kernel_names(jax.grad(lambda q, k, v: dpa(q, k, v, **kwargs).astype(jnp.float32).sum()), q, k, v)
    assert forward == ["attention_cte"]
    assert sorted(backward) == ["attention_bwd", "attention_cte"]


@pytest.mark.parametrize(
    "kwargs, reason",
    [
        (dict(bias=np.zeros((1, 1, 128, 128), np.float32)), "dense `bias`"),
        (dict(mask=np.ones((1, 1, 128, 128), bool)), "dense boolean `mask`"),
        (dict(logits_soft_cap=30.0), "logits_soft_cap"),
        (dict(local_window_size=(4, 2)), "right side"),
    ],
)
def test_other_calls_fall_back_on_neuron_naming_the_reason(kwargs, reason):
    q, k, v = _inputs(jnp.bfloat16, seq_q=128, seq_k=128)
    fn = lambda q, k, v: dpa(q, k, v, **kwargs)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match=reason):
        assert _kernel_names(fn, q, k, v) == []
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error"):
        with pytest.raises(NeuronUnsupportedError, match=reason):
            neuron_text(fn, q, k, v)
    with pytest.raises(ValueError, match=reason):
        dpa(q, k, v, implementation="nki", **kwargs)


X = jnp.zeros((2, 8, 4, 16))


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda: dpa(X, X, X, implementation="flash"), ValueError, ["`implementation`", "'flash'"]),
        (lambda: dpa(X, X, X, mask=jnp.ones((1, 1, 8, 8))), TypeError, ["`mask`", "boolean"]),
        (lambda: dpa(X, X, X, bias=jnp.ones((1, 3, 8, 8))), ValueError, ["`bias`", "[batch, heads, seq_q, seq_kv]"]),
        (lambda: dpa(X, X, X, query_seq_lengths=jnp.ones(2)), TypeError, ["`query_seq_lengths`", "integer"]),
        (lambda: dpa(X, X, X, key_value_seq_lengths=jnp.ones(3, jnp.int32)), ValueError, ["key_value_seq_lengths"]),
        (lambda: dpa(X, X, X, local_window_size=(1, 2, 3)), ValueError, ["`local_window_size`", "(left, right)"]),
        (lambda: dpa(X, X, X, local_window_size=-1), ValueError, ["`local_window_size`"]),
        (lambda: dpa(X, X, X, logits_soft_cap=0.0), ValueError, ["`logits_soft_cap`"]),
        (lambda: dpa(X, X[:, :, :3], X[:, :, :3]), ValueError, ["multiple of key/value heads"]),
        (lambda: dpa(X, X.astype(jnp.bfloat16), X), TypeError, ["`query`", "`key`", "one floating dtype"]),
        (lambda: dpa(X, X, X, is_causal=1), TypeError, ["`is_causal`", "bool"]),
        (lambda: dpa(X, X, X, implementation="xla", logits_soft_cap=3.0), ValueError, ["logits_soft_cap"]),
        (lambda: dpa(X[0], X, X), ValueError, ["unbatched"]),
    ],
)
def test_bad_inputs_name_the_argument(call, error, words):
    with pytest.raises(error) as raised:
        call()
    for word in words:
        assert word in str(raised.value)


def test_cudnn_off_a_gpu_is_the_blockwise_route():
    """implementation="cudnn" is JAX's cuDNN attention where a GPU takes the call (checked on a GPU by
    tests/benchmarks/bench_gpu_attention.py); off a GPU it is the same computation as the default."""
    q, k, v = _inputs(jnp.bfloat16)
    for kwargs in (dict(is_causal=True), dict(logits_soft_cap=3.0)):
        np.testing.assert_array_equal(dpa(q, k, v, implementation="cudnn", **kwargs), dpa(q, k, v, **kwargs))
