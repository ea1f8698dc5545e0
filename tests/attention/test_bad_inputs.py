"""Bad attention inputs raise TypeError/ValueError naming the function, the argument and the contract."""

import jax.numpy as jnp
import pytest

import jax_nkilib
from jax_nkilib.nki import attention_bwd, attention_cte

Q, K, V = jnp.zeros((4, 16, 8)), jnp.zeros((2, 8, 16)), jnp.zeros((2, 16, 8))
I32 = jnp.int32

CTE = [
    (lambda: attention_cte(Q[0], K, V), ValueError,
     ["attention_cte", "`q`", "[B, Sq, d]", "(the layout for tp_q=True)"]),
    (lambda: attention_cte(Q, K, V, tp_k=True), ValueError, ["`k`", "[B_kv, Sk, d]", "tp_k=True"]),
    (lambda: attention_cte(Q[:3], K, V), ValueError, ["B=3", "multiple of the KV batch B_kv=2"]),
    (lambda: attention_cte(Q, K, V, sliding_window=4, scale=0.5), ValueError, ["scale must be 1.0"]),
    (lambda: attention_cte(Q, K, V, sliding_window=4, causal_mask=False), ValueError, ["require causal_mask"]),
    (lambda: attention_cte(Q, K, V, cp_offset=jnp.zeros((1, 1), I32)), ValueError, ["global_cp_deg"]),
    (lambda: attention_cte(Q, K, V, cp_offset=jnp.zeros((1, 1), I32), global_cp_deg=64), ValueError, ["[1, 32]"]),
    (lambda: attention_cte(Q, K, V, K, V), ValueError, ["k_prior, v_prior and prior_used_len together"]),
    (lambda: attention_cte(Q, K, V, prior_used_len=jnp.zeros((1,), jnp.float32)), TypeError,
     ["`prior_used_len`", "int32"]),
    (lambda: attention_cte(Q, K, V, cache_softmax=True), ValueError, ["multiple of 128", "Sq=16"]),
    (lambda: attention_cte(Q, K.astype(jnp.bfloat16), V), TypeError, ["share one dtype"]),
    (lambda: attention_cte(Q, K, V, softmax_dtype=jnp.int32), TypeError, ["softmax_dtype must be float32 or bf"]),
    (lambda: attention_cte(Q, K, V, bound_min=jnp.zeros((16, 1), I32)), ValueError, ["both bound_min and bound_max"]),
    (lambda: attention_cte(Q, K, V, sink=jnp.zeros((4,))), ValueError, ["`sink`", "[B, 1]"]),
    (lambda: attention_cte(Q, K, V, scale="big"), TypeError, ["`scale`", "float"]),
]

QB, KB, LSE = jnp.zeros((1, 4, 8, 128)), jnp.zeros((1, 2, 8, 128)), jnp.zeros((1, 4, 128, 1))
BWD = [
    (lambda: attention_bwd(QB, KB[..., :64], KB[..., :64], QB, QB, LSE, use_causal_mask=True), ValueError,
     ["causal masking requires Sq == Sk"]),
    (lambda: attention_bwd(QB, KB, KB, QB, QB, LSE, sliding_window=8), ValueError, ["requires use_causal_mask"]),
    (lambda: attention_bwd(QB, KB, KB, QB, QB, LSE[..., :1, :]), ValueError, ["`lse_ref`", "[bs, H, 128, Sq/128]"]),
    (lambda: attention_bwd(QB[..., :100], KB, KB, QB[..., :100], QB[..., :100], LSE), ValueError,
     ["`lse_ref`", "Sq/128"]),
    (lambda: attention_bwd(QB, KB[:, :1].repeat(3, 1), KB[:, :1].repeat(3, 1), QB, QB, LSE), ValueError,
     ["multiple of KV heads H_kv=3"]),
    (lambda: attention_bwd(QB, KB, KB, QB.astype(jnp.bfloat16), QB, LSE), TypeError, ["share one dtype"]),
]

X = jnp.zeros((2, 16, 4, 8))
IDIOMATIC = [
    (lambda: jax_nkilib.attention(X[0], X, X), ValueError, ["jax_nkilib.attention", "[batch, seq, heads, head_dim]"]),
    (lambda: jax_nkilib.attention(X, X[:, :, :3], X[:, :, :3]), ValueError, ["multiple of kv heads (3)"]),
    (lambda: jax_nkilib.attention(X, X, X[..., :4]), ValueError, ["same shape"]),
    (lambda: jax_nkilib.attention(X, X, X, sinks=jnp.zeros(3)), ValueError, ["`sinks`", "[heads]"]),
    (lambda: jax_nkilib.attention(X, X, X, causal=False, sliding_window=4), ValueError, ["needs causal=True"]),
    (lambda: jax_nkilib.attention(X, X, X, prefix=(X, X)), TypeError, ["(k_prior, v_prior, prior_len)"]),
]


@pytest.mark.parametrize("case", CTE + BWD + IDIOMATIC, ids=lambda c: "|".join(c[2]))
def test_bad_input(case):
    call, error, fragments = case
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"
