"""jax_nkilib.nki.attention_cte against the float64 oracle: every flag, gradients of the variants no arg spec covers,
vmap of the queries and of a runtime length (jit, the rest of vmap, shard_map: tests/conformance)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from jax_nkilib.nki import attention_cte
from tests.attention.oracle import allowed_mask, attention_rows, attention_rows_grads
from tests.support.data import random
from tests.support.numerics import assert_close

I32 = jnp.int32


def make(b=4, b_kv=2, sq=16, sk=16, d=8, dtype=jnp.float32, s_prior=0, seed=0):
    q = random((b, sq, d), dtype, seed)
    k = random((b_kv, sk, d), dtype, seed + 1)  # [B_kv, Sk, d]; transposed below for tp_k=False
    v = random((b_kv, sk, d), dtype, seed + 2)
    prior = (random((b_kv, s_prior, d), dtype, seed + 3), random((b_kv, s_prior, d), dtype, seed + 4))
    return q, k, v, prior


def kernel_layout(x, seq_first):
    return x if seq_first else jnp.swapaxes(x, 1, 2)


CASES = {
    # name: (make kwargs, call kwargs, oracle mask kwargs)
    "full": ({}, dict(scale=0.3, causal_mask=False), {}),
    "causal": ({}, dict(scale=0.3), dict(causal=True)),
    "causal_odd": (dict(sq=97, sk=97, b=3, b_kv=1), dict(scale=0.25), dict(causal=True)),
    "rectangular": (dict(sq=5, sk=23), dict(scale=0.5, causal_mask=False), {}),
    "mha": (dict(b=3, b_kv=3), dict(scale=0.3), dict(causal=True)),
    "window": ({}, dict(sliding_window=5), dict(causal=True, window=5)),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_oracle(name, dtype):
    make_kw, call_kw, mask_kw = CASES[name]
    q, k, v, _ = make(dtype=dtype, **make_kw)
    out = attention_cte(q, kernel_layout(k, False), v, **call_kw)
    ok = allowed_mask(q.shape[1], 0, k.shape[1], **mask_kw)
    want = attention_rows(q, k, v, ok, call_kw.get("scale", 1.0))[0]
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, want, dtype, reduction=k.shape[1])


@pytest.mark.parametrize("tp_q, tp_k, tp_out", [(False, True, True), (True, True, False), (False, False, True)])
def test_transpose_flags(tp_q, tp_k, tp_out):
    q, k, v, _ = make()
    out = attention_cte(
        kernel_layout(q, tp_q), kernel_layout(k, tp_k), v, scale=0.3, tp_q=tp_q, tp_k=tp_k, tp_out=tp_out
    )
    want = attention_rows(q, k, v, allowed_mask(16, 0, 16, causal=True), 0.3)[0]
    assert_close(out, kernel_layout(jnp.asarray(want), not tp_out), jnp.float32)


def test_sink_prefix_and_context_parallel():
    q, k, v, (kp, vp) = make(s_prior=7)
    sink = random((4, 1), jnp.float32, 9)
    used = jnp.array([5], I32)
    out = attention_cte(q, kernel_layout(k, False), v, kernel_layout(kp, False), vp, used, sink)
    ok = allowed_mask(16, 7, 16, prior_used=5, causal=True)
    want = attention_rows(q, jnp.concatenate([kp, k], 1), jnp.concatenate([vp, v], 1), ok, 1.0, sink)[0]
    assert_close(out, want, jnp.float32)
    for strided, offset in ((False, 8), (True, 1)):
        out = attention_cte(
            q[:, :4],
            kernel_layout(k, False),
            v,
            cp_offset=jnp.array([[offset]], I32),
            global_cp_deg=4,
            cp_strided_q_slicing=strided,
        )
        ok = allowed_mask(4, 0, 16, q_base=offset, q_stride=4 if strided else 1, causal=True)
        assert_close(out, attention_rows(q[:, :4], k, v, ok, 1.0)[0], jnp.float32)


def test_sequence_packing_bounds_and_empty_rows():
    q, k, v, _ = make()
    lo = jnp.array([0] * 8 + [8] * 7 + [3], I32).reshape(16, 1)
    hi = jnp.array([8] * 15 + [3], I32).reshape(16, 1)  # the last row has an empty range
    out = attention_cte(q, kernel_layout(k, False), v, bound_min=lo, bound_max=hi, scale=0.5, causal_mask=False)
    ok = allowed_mask(16, 0, 16, bound_min=lo, bound_max=hi)
    assert_close(out, attention_rows(q, k, v, ok, 0.5)[0], jnp.float32)
    assert np.all(np.asarray(out[:, -1]) == 0) and np.all(np.isfinite(out))


def test_cache_softmax_statistics():
    q, k, v, _ = make(sq=128, sk=128)
    sink = random((4, 1), jnp.float32, 9)
    out, neg_max, recip = attention_cte(q, kernel_layout(k, False), v, sink=sink, scale=0.3, cache_softmax=True)
    assert neg_max.shape == recip.shape == (4, 128, 1) and neg_max.dtype == jnp.float32
    kr = np.repeat(np.asarray(k, np.float64), 2, axis=0)
    s = 0.3 * np.asarray(q, np.float64) @ np.swapaxes(kr, 1, 2)
    s = np.where(allowed_mask(128, 0, 128, causal=True)[None], s, -np.inf)
    s = np.concatenate([s, np.broadcast_to(np.asarray(sink, np.float64)[:, None], (4, 128, 1))], -1)
    m = s.max(-1)
    lse = m + np.log(np.exp(s - m[..., None]).sum(-1))
    np.testing.assert_allclose(-neg_max[:, :, 0], m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(-(neg_max + jnp.log(recip))[:, :, 0], lse, rtol=1e-5, atol=1e-5)
    (bf16_stats,) = attention_cte(q, kernel_layout(k, False), v, cache_softmax=True, softmax_dtype=jnp.bfloat16)[1:2]
    assert bf16_stats.dtype == jnp.bfloat16


@pytest.mark.parametrize("name", ["causal", "window", "rectangular"])
def test_gradients_float64(name):
    make_kw, call_kw, _ = CASES[name]
    q, k, v, _ = make(
        dtype=jnp.float64,
        b=2,
        b_kv=1,
        d=4,
        **{**make_kw, "sq": min(make_kw.get("sq", 6), 6), "sk": min(make_kw.get("sk", 6), 9)},
    )
    sink = random((2, 1), jnp.float64, 5)
    check_grads(
        lambda a, b, c, s: attention_cte(a, b, c, sink=s, **call_kw),
        (q, kernel_layout(k, False), v, sink),
        order=1,
        modes=["rev"],
    )


def test_gradients_with_prefix_and_context_parallel_float64():
    q, k, v, (kp, vp) = make(dtype=jnp.float64, b=2, b_kv=1, sq=4, sk=6, d=4, s_prior=3)
    fn = lambda a, b, c, d_, e: attention_cte(
        a,
        b,
        c,
        d_,
        e,
        jnp.array([2], I32),  # noqa: E731
        cp_offset=jnp.array([[2]], I32),
        global_cp_deg=2,
    )
    check_grads(fn, (q, kernel_layout(k, False), v, kernel_layout(kp, False), vp), order=1, modes=["rev"])


@pytest.mark.parametrize("sink", [False, True])
def test_kernel_backward_matches_oracle_gradients(sink):
    """Sq % 128 == 0 takes the attention_bwd path; its gradients equal the float64 oracle's."""
    q, k, v, _ = make(sq=128, sk=128, b=4, b_kv=2)
    s = random((4, 1), jnp.float32, 3) if sink else None
    dy = random(q.shape, jnp.float32, 4)
    _, vjp = jax.vjp(lambda a, b, c, t: attention_cte(a, b, c, sink=t, scale=0.3), q, kernel_layout(k, False), v, s)
    dq, dk, dv, dsink = vjp(dy)
    want = attention_rows_grads(q, k, v, allowed_mask(128, 0, 128, causal=True), 0.3, dy, None if s is None else s)
    assert_close(dq, want[0], jnp.float32, reduction=128)
    assert_close(jnp.swapaxes(dk, 1, 2), want[1], jnp.float32, reduction=256)
    assert_close(dv, want[2], jnp.float32, reduction=256)
    if sink:
        assert_close(dsink, want[3], jnp.float32, reduction=128)


def test_vmap_of_the_queries_and_of_a_runtime_length():
    # jit, vmap of every operand, nested vmap, vmap of grad: the conformance spec attention_cte
    q, k, v, _ = make()
    kt = kernel_layout(k, False)
    fn = lambda a, b, c: attention_cte(a, b, c, scale=0.3)  # noqa: E731
    qs = jnp.stack([q, 2 * q])
    out = jax.vmap(fn, in_axes=(0, None, None))(qs, kt, v)
    assert_close(out[1], attention_rows(2 * q, k, v, allowed_mask(16, 0, 16, causal=True), 0.3)[0], jnp.float32)
    used = jnp.array([[1], [3]], I32)  # a batched runtime length: lax.map fallback
    _, _, _, (kp, vp) = make(s_prior=4)
    out = jax.vmap(lambda n: attention_cte(q, kt, v, kernel_layout(kp, False), vp, n))(used)
    ok = allowed_mask(16, 4, 16, prior_used=3, causal=True)
    assert_close(
        out[1], attention_rows(q, jnp.concatenate([kp, k], 1), jnp.concatenate([vp, v], 1), ok, 1.0)[0], jnp.float32
    )
