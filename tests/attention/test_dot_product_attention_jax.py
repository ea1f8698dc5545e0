"""JAX's own dot_product_attention test cases (jax-ml/jax tests/nn_test.py: testDotProductAttention,
testDotProductAttentionMask, testDotProductAttentionBiasGradient), ported: the same shapes, options and tolerances,
with jax_nkilib.dot_product_attention in the place of the implementation under test and
``jax.nn.dot_product_attention(implementation="xla")`` as the reference, forward and gradients."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib

reference = partial(jax.nn.dot_product_attention, implementation="xla")


def assert_all_close(expected, actual, *, atol, rtol):
    np.testing.assert_allclose(np.asarray(actual, np.float32), np.asarray(expected, np.float32), atol=atol, rtol=rtol)


# float16 beyond one case runs with `-m slow` (CI: bfloat16 for every grouping, float16 once)
@pytest.mark.parametrize(
    "dtype, group_num, use_vmap",
    [
        pytest.param(
            dtype, group, vmap, marks=[pytest.mark.slow] if dtype == jnp.float16 and (group, vmap) != (1, False) else []
        )
        for dtype in (jnp.bfloat16, jnp.float16)
        for group in (1, 2, 4)
        for vmap in (False, True)
    ],
)
def test_dot_product_attention(dtype, group_num, use_vmap):
    B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    Q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    K = jax.random.normal(keys[1], (B, S, N // G, H), dtype)
    V = jax.random.normal(keys[2], (B, S, N // G, H), dtype)
    grad = jax.random.normal(keys[3], (B, T, N, H), dtype)
    ours = jax_nkilib.dot_product_attention
    if use_vmap:
        ours = jax.vmap(ours, in_axes=(0, 0, 0, None, None), out_axes=0)
    K_ref, V_ref = jnp.repeat(K, G, axis=2), jnp.repeat(V, G, axis=2)  # the reference without GQA, as in JAX's test
    out_ref, vjp_ref = jax.vjp(reference, Q, K_ref, V_ref, None, None)
    out_ans, vjp_ans = jax.vjp(ours, Q, K, V, None, None)
    dQ_ref, dK_ref, dV_ref = vjp_ref(grad)[:3]
    dQ_ans, dK_ans, dV_ans = vjp_ans(grad)[:3]
    dK_ref = dK_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    dV_ref = dV_ref.reshape(B, S, N // G, G, H).sum(axis=3)
    assert_all_close(out_ref, out_ans, atol=0.01, rtol=0.01)
    assert_all_close(dQ_ref, dQ_ans, rtol=0.01, atol=0.01)
    assert_all_close(dK_ref, dK_ans, rtol=0.01, atol=0.01)
    assert_all_close(dV_ref, dV_ans, rtol=0.01, atol=0.01)


@pytest.mark.parametrize(
    "mask_mode",
    [
        "bias",
        "causal",
        "padding",
        "custom",
        ("causal", "padding"),
        ("custom", "padding"),
        ("bias", "causal"),
        ("causal", "sliding_window"),
    ],
)
def test_dot_product_attention_mask(mask_mode):
    if isinstance(mask_mode, str):
        mask_mode = (mask_mode,)
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 128, 128, 4, 32
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    Q = jax.random.normal(keys[0], (B, T, N, H), dtype)
    K = jax.random.normal(keys[1], (B, S, N, H), dtype)
    V = jax.random.normal(keys[2], (B, S, N, H), dtype)
    grad = jax.random.normal(keys[3], (B, T, N, H), dtype)
    bias, mask, q_seqlen, kv_seqlen, window_size = None, None, None, None, None
    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in mask_mode:
        bias = jax.random.normal(keys[4], (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    def call(sdpa, q, k, v, b, m, qs, kvs):
        return sdpa(
            q,
            k,
            v,
            b,
            m,
            is_causal=is_causal,
            query_seq_lengths=qs,
            key_value_seq_lengths=kvs,
            local_window_size=window_size,
        )

    args = (Q, K, V, bias, mask, q_seqlen, kv_seqlen)
    out_ref, vjp_ref = jax.vjp(partial(call, reference), *args)
    out_ans, vjp_ans = jax.vjp(partial(call, jax_nkilib.dot_product_attention), *args)
    dQ_ref, dK_ref, dV_ref, dbias_ref = vjp_ref(grad)[:4]
    dQ_ans, dK_ans, dV_ans, dbias_ans = vjp_ans(grad)[:4]
    assert_all_close(out_ref, out_ans, atol=0.01, rtol=0.01)
    assert_all_close(dQ_ref, dQ_ans, rtol=0.02, atol=0.02)
    assert_all_close(dK_ref, dK_ans, rtol=0.02, atol=0.02)
    assert_all_close(dV_ref, dV_ans, rtol=0.01, atol=0.01)
    if bias is not None:
        assert_all_close(dbias_ref, dbias_ans, rtol=0.02, atol=0.02)


@pytest.mark.parametrize("use_vmap", [False, True])
@pytest.mark.parametrize("batch_size", [1, 16])
def test_dot_product_attention_bias_gradient(batch_size, use_vmap):
    """JAX's case compares cuDNN for batch 1 only (cuDNN has no batched bias gradient); here every case runs."""
    dtype = jnp.bfloat16
    B, S, N, H = batch_size, 128, 4, 32
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    x = jax.random.normal(keys[0], (B, S, N, H), dtype)
    bias = jax.random.normal(keys[1], (B, N, S, S), dtype=dtype)
    mask = jnp.ones((1, 1, S), dtype=jnp.bool_)

    def attention(x, bias, mask, sdpa):
        return sdpa(query=x, key=x, value=x, bias=bias, mask=mask, is_causal=False)

    attn_ref = partial(attention, sdpa=reference)
    attn_ans = partial(attention, sdpa=jax_nkilib.dot_product_attention)
    if use_vmap:
        attn_ref = jax.vmap(attn_ref, in_axes=(0, 0, None))
        attn_ans = jax.vmap(attn_ans, in_axes=(0, 0, None))
    assert_all_close(jax.jit(attn_ref)(x, bias, mask), jax.jit(attn_ans)(x, bias, mask), atol=0.01, rtol=0.01)

    def backward(attn):
        return jax.jit(lambda x, bias, mask: jax.vjp(attn, x, bias, mask)[1](x))

    _, dbias_ref, _ = backward(attn_ref)(x, bias, mask)
    _, dbias_ans, _ = backward(attn_ans)(x, bias, mask)
    assert_all_close(dbias_ref, dbias_ans, rtol=0.1, atol=0.1)
