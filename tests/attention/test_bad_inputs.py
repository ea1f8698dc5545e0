"""Bad attention inputs raise TypeError/ValueError naming the function, the argument and the contract."""

import jax
import jax.numpy as jnp
import pytest

import jax_nkilib
from jax_nkilib.nki import attention_bwd, attention_cte, attention_tkg

Q, K, V = jnp.zeros((4, 16, 8)), jnp.zeros((2, 8, 16)), jnp.zeros((2, 16, 8))
I32 = jnp.int32

CTE = [
    (
        lambda: attention_cte(Q[0], K, V),
        ValueError,
        ["attention_cte", "`q`", "[B, Sq, d]", "(the layout for tp_q=True)"],
    ),
    (lambda: attention_cte(Q, K, V, tp_k=True), ValueError, ["`k`", "[B_kv, Sk, d]", "tp_k=True"]),
    (lambda: attention_cte(Q[:3], K, V), ValueError, ["B=3", "multiple of the KV batch B_kv=2"]),
    (lambda: attention_cte(Q, K, V, sliding_window=4, scale=0.5), ValueError, ["scale must be 1.0"]),
    (lambda: attention_cte(Q, K, V, sliding_window=4, causal_mask=False), ValueError, ["require causal_mask"]),
    (lambda: attention_cte(Q, K, V, cp_offset=jnp.zeros((1, 1), I32)), ValueError, ["global_cp_deg"]),
    (lambda: attention_cte(Q, K, V, cp_offset=jnp.zeros((1, 1), I32), global_cp_deg=64), ValueError, ["[1, 32]"]),
    (lambda: attention_cte(Q, K, V, K, V), ValueError, ["k_prior, v_prior and prior_used_len together"]),
    (
        lambda: attention_cte(Q, K, V, prior_used_len=jnp.zeros((1,), jnp.float32)),
        TypeError,
        ["`prior_used_len`", "int32"],
    ),
    (lambda: attention_cte(Q, K, V, cache_softmax=True), ValueError, ["multiple of 128", "Sq=16"]),
    (lambda: attention_cte(Q, K.astype(jnp.bfloat16), V), TypeError, ["share one dtype"]),
    (lambda: attention_cte(Q, K, V, softmax_dtype=jnp.int32), TypeError, ["softmax_dtype must be float32 or bf"]),
    (lambda: attention_cte(Q, K, V, bound_min=jnp.zeros((16, 1), I32)), ValueError, ["both bound_min and bound_max"]),
    (lambda: attention_cte(Q, K, V, sink=jnp.zeros((4,))), ValueError, ["`sink`", "[B, 1]"]),
    (lambda: attention_cte(Q, K, V, scale="big"), TypeError, ["`scale`", "float"]),
    (lambda: attention_cte(Q, K, V, scale=float("nan")), ValueError, ["attention_cte", "`scale`", "finite", "nan"]),
    (
        lambda: attention_cte(Q, K, V, sliding_window=2**31),
        ValueError,
        ["attention_cte", "`sliding_window`", "[0, 2147483647]"],
    ),
    (lambda: attention_cte(Q, K, V, sliding_window=-1), ValueError, ["`sliding_window`", "got -1"]),
]

QB, KB, LSE = jnp.zeros((1, 4, 8, 128)), jnp.zeros((1, 2, 8, 128)), jnp.zeros((1, 4, 128, 1))
BWD = [
    (
        lambda: attention_bwd(QB, KB[..., :64], KB[..., :64], QB, QB, LSE, use_causal_mask=True),
        ValueError,
        ["causal masking requires Sq == Sk"],
    ),
    (lambda: attention_bwd(QB, KB, KB, QB, QB, LSE, sliding_window=8), ValueError, ["requires use_causal_mask"]),
    (lambda: attention_bwd(QB, KB, KB, QB, QB, LSE[..., :1, :]), ValueError, ["`lse_ref`", "[bs, H, 128, Sq/128]"]),
    (
        lambda: attention_bwd(QB[..., :100], KB, KB, QB[..., :100], QB[..., :100], LSE),
        ValueError,
        ["`lse_ref`", "Sq/128"],
    ),
    (
        lambda: attention_bwd(QB, KB[:, :1].repeat(3, 1), KB[:, :1].repeat(3, 1), QB, QB, LSE),
        ValueError,
        ["multiple of KV heads H_kv=3"],
    ),
    (lambda: attention_bwd(QB, KB, KB, QB.astype(jnp.bfloat16), QB, LSE), TypeError, ["share one dtype"]),
    (
        lambda: attention_bwd(QB, KB, KB, QB, QB, LSE, use_causal_mask=True, sliding_window=-1),
        ValueError,
        ["attention_bwd", "`sliding_window`", "[0, 2147483647]", "got -1"],
    ),
    (
        lambda: attention_bwd(QB, KB, KB, QB, QB, LSE, softmax_scale=float("inf")),
        ValueError,
        ["attention_bwd", "`softmax_scale`", "finite"],
    ),
]

QT, KT = jnp.zeros((1, 2, 1, 4)), jnp.zeros((1, 1, 1, 4))
TKG = [
    (
        lambda: attention_tkg(
            QT,
            KT,
            KT,
            jnp.zeros((1, 1, 128, 4)),
            jnp.zeros((1, 128, 4)),
            jnp.ones((128, 1, 2, 1), jnp.uint8),
            tp_k_prior=True,
        ),
        ValueError,
        ["attention_tkg", "`v_prior`", "rank 4", "needs active_blocks_table", "(1, 128, 4)"],
    ),
]

X = jnp.zeros((2, 16, 4, 8))
P = jnp.zeros((2, 4, 16, 8))  # a prefix cache for X: [batch, kv_heads, max_prior, head_dim]
IDIOMATIC = [
    (
        lambda: jax_nkilib.attention(X[0], X, X, causal=True),
        ValueError,
        ["jax_nkilib.attention", "[batch, seq, heads, head_dim]"],
    ),
    (lambda: jax_nkilib.attention(X, X[:, :, :3], X[:, :, :3], causal=True), ValueError, ["multiple of kv heads (3)"]),
    (lambda: jax_nkilib.attention(X, X, X[..., :4], causal=True), ValueError, ["same shape"]),
    (lambda: jax_nkilib.attention(X, X, X, sinks=jnp.zeros(3), causal=True), ValueError, ["`sinks`", "[heads]"]),
    (lambda: jax_nkilib.attention(X, X, X, causal=False, sliding_window=4), ValueError, ["needs causal=True"]),
    (lambda: jax_nkilib.attention(X, X, X, prefix=(X, X), causal=True), TypeError, ["(k_prior, v_prior, prior_len)"]),
    (  # a cache in the [batch, max_prior, kv_heads, head_dim] layout of q/k/v
        lambda: jax_nkilib.attention(X, X, X, prefix=(X, X, 2), causal=True),
        ValueError,
        ["k_prior", "[batch, kv_heads, prior_len_max, head_dim]"],
    ),
    # issue 11: static values checked at trace time, the user's argument and axis named
    (
        lambda: jax_nkilib.attention(X, X, X, scale=float("nan"), causal=True),
        ValueError,
        ["jax_nkilib.attention", "`scale`", "finite", "nan"],
    ),
    (lambda: jax_nkilib.attention(X, X, X, scale=float("inf"), causal=True), ValueError, ["`scale`", "finite"]),
    (
        lambda: jax_nkilib.attention(X, X, X, scale="0.5", causal=True),
        TypeError,
        ["`scale`", "finite Python float", "str"],
    ),
    (lambda: jax_nkilib.attention(X, X, X, scale=True, causal=True), TypeError, ["`scale`", "bool"]),
    (
        lambda: jax_nkilib.attention(X, X, X, sliding_window=2**31, causal=True),
        ValueError,
        ["jax_nkilib.attention", "`sliding_window`", "[1, 2147483647]", "2147483648"],
    ),
    (lambda: jax_nkilib.attention(X, X, X, sliding_window="4", causal=True), TypeError, ["`sliding_window`", "str"]),
    (lambda: jax_nkilib.attention(X, X, X, sliding_window=4.0, causal=True), TypeError, ["`sliding_window`", "float"]),
    (lambda: jax_nkilib.attention(X, X, X, sliding_window=0, causal=True), ValueError, ["`sliding_window`", "got 0"]),
    (lambda: jax_nkilib.attention(X, X, X, causal=1), TypeError, ["`causal`", "bool"]),
    (lambda: jax_nkilib.attention(X, X[:, :, :0], X[:, :, :0], causal=True), ValueError, ["`k` has kv_heads = 0"]),
    (
        lambda: jax_nkilib.attention(X[..., :0], X[..., :0], X[..., :0], causal=True),
        ValueError,
        ["`q` has head_dim = 0"],
    ),
    (
        lambda: jax_nkilib.attention(X[:0], X[:0], X[:0], causal=True),
        ValueError,
        ["jax_nkilib.attention", "`q` has batch = 0"],
    ),
    (
        lambda: jax_nkilib.attention(X, X.astype(jnp.bfloat16), X, causal=True),
        TypeError,
        ["jax_nkilib.attention", "`q`, `k`, `v` must share one floating dtype"],
    ),
    (
        lambda: jax_nkilib.attention(X.astype(jnp.int32), X, X, causal=True),
        TypeError,
        ["`q`", "floating dtype", "int32"],
    ),
    (
        lambda: jax_nkilib.attention(X, X, X, prefix=(P, P, 2.7), causal=True),
        TypeError,
        ["prefix prior_len", "int", "float"],
    ),
    (
        lambda: jax_nkilib.attention(X, X, X, prefix=(P, P, jnp.float32(2)), causal=True),
        TypeError,
        ["prefix prior_len"],
    ),
    (
        lambda: jax_nkilib.attention(X, X, X, prefix=(P, P, 17), causal=True),
        ValueError,
        ["prefix prior_len", "[0, 16]"],
    ),
    (lambda: jax_nkilib.attention(X, X, X, prefix=(P, P, -1), causal=True), ValueError, ["prefix prior_len", "got -1"]),
    (
        lambda: jax_nkilib.attention(X, X, X, prefix=(P, P.astype(jnp.bfloat16), 2), causal=True),
        TypeError,
        ["`q`, `k_prior`, `v_prior` must share one floating dtype"],
    ),
    (lambda: jax_nkilib.attention(X, X, X, sinks=[1.0] * 4, causal=True), TypeError, ["`sinks`", "array"]),
]


@pytest.mark.parametrize("case", CTE + BWD + TKG + IDIOMATIC, ids=lambda c: "|".join(c[2]))
def test_bad_input(case):
    call, error, fragments = case
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"


@pytest.mark.parametrize(
    "op, name",
    [
        (lambda s: jax_nkilib.attention(X, X, X, scale=s, causal=True), "scale"),
        (lambda s: jax_nkilib.attention(X, X, X, sliding_window=s, causal=True), "sliding_window"),
        (
            lambda s: jax_nkilib.decode_attention(
                X[:, :1], X[:, :1], X[:, :1], X.swapaxes(1, 2), X.swapaxes(1, 2), jnp.zeros(2, jnp.int32), scale=s
            ),
            "scale",
        ),
    ],
)
def test_traced_static_values_say_they_are_static(op, name):
    with pytest.raises(TypeError) as info:
        jax.jit(op)(2)
    assert f"`{name}` must be static" in str(info.value) and "static_argnames" in str(info.value)
