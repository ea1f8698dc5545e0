"""Bad inputs raise TypeError/ValueError at trace time, naming the function, the argument and the layout."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import RoPE, rope_hf

X = jnp.zeros((64, 2, 3, 5), jnp.float32)
T = jnp.zeros((32, 2, 5), jnp.float32)
Q = jnp.zeros((2, 4, 8, 16), jnp.float32)
K = jnp.zeros((2, 2, 8, 16), jnp.float32)
C = jnp.zeros((8, 16), jnp.float32)


def call_rope(*args, **kwargs):
    return lambda: RoPE(*args, **kwargs)


def call_rope_hf(*args, **kwargs):
    return lambda: rope_hf(*args, **kwargs)


CASES = [
    # (call, error type, fragments that the message must contain)
    (call_rope(X[0], T, T), ValueError, ["jax_nkilib.nki.RoPE", "`x_in`", "[d_head, B, n_heads, S]", "rank 3"]),
    (call_rope(X, T[:, :, :4], T[:, :, :4]), ValueError, ["`cos`", "[d_head/2, B, S]", "(32, 2, 4)"]),
    (call_rope(jnp.zeros((63, 2, 3, 5)), T, T), ValueError, ["`cos`", "d_head/2", "not an integer", "d_head=63"]),
    (call_rope(X, T, T.astype(jnp.bfloat16)), TypeError, ["`cos` and `sin`", "same dtype"]),
    (call_rope(X.astype(jnp.int32), T, T), TypeError, ["`x_in`", "dtype", "int32"]),
    (call_rope(X, T, T, contiguous_layout="yes"), TypeError, ["`contiguous_layout`", "bool"]),
    (call_rope(X, T, T, contiguous=True), TypeError, ["unexpected keyword argument `contiguous`"]),
    (call_rope(X, T.tolist(), T), TypeError, ["`cos`", "must be an array", "list"]),
    (call_rope(X, T, T, T), TypeError, ["takes 3 tensor arguments"]),
    (call_rope(X, T), TypeError, ["missing required tensor argument `sin`"]),
    (call_rope(jnp.zeros((64, 2, 0, 5)), T, T), ValueError, ["n_heads is 0"]),
    (call_rope_hf(Q, K, C, C, rope_cache=jnp.zeros((8, 32))), ValueError, ["either `cos` and `sin` or `rope_cache`"]),
    (call_rope_hf(Q, K), ValueError, ["missing `cos` and `sin` (or `rope_cache`)"]),
    (call_rope_hf(Q, K, C), ValueError, ["missing `sin`"]),
    (call_rope_hf(Q, K, C[:4], C[:4]), ValueError, ["S_rope=4", "S=8"]),
    (call_rope_hf(Q, K, jnp.zeros((3, 8, 16)), jnp.zeros((3, 8, 16))), ValueError, ["`cos`", "[B, S_rope, D]", "B=2"]),
    (call_rope_hf(Q, K, rope_cache=jnp.zeros((8, 16))), ValueError, ["`rope_cache`", "2*D", "32"]),
    (call_rope_hf(Q[..., :15], K[..., :15], C[:, :15], C[:, :15]), ValueError, ["head_dim D must be even"]),
    (call_rope_hf(Q, K.astype(jnp.bfloat16), C, C), TypeError, ["`q` and `k`", "same dtype"]),
    (call_rope_hf(Q, K[:1], C, C), ValueError, ["`k`", "[B, Hk, S, D]"]),
    (call_rope_hf(Q, K, C, C, backward=1), TypeError, ["`backward`", "bool"]),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_bad_layer1_input(case):
    call, error, fragments = CASES[case]
    with pytest.raises(error) as info:
        call()
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"


def test_errors_are_raised_at_trace_time_under_jit():
    with pytest.raises(ValueError, match="`cos`"):
        jax.jit(RoPE).trace(X, T[:, :1], T[:, :1])


XI = jnp.zeros((2, 5, 3, 8))
TI = jnp.zeros((5, 4))
IDIOMATIC = [
    ((XI[0, 0], TI, TI), ValueError, ["jax_nkilib.rope", "[..., seq, heads, head_dim]"]),
    ((XI[..., :7], TI, TI), ValueError, ["head_dim", "even", "7"]),
    ((XI, TI[:4], TI[:4]), ValueError, ["`cos`", "[seq, head_dim/2]", "(4, 4)"]),
    ((XI, TI, TI[:, :3]), ValueError, ["`sin`", "[seq, head_dim/2]", "(5, 3)"]),
    ((XI, TI, TI[None]), ValueError, ["same shape and dtype"]),
    ((XI.astype(jnp.int32), TI, TI), TypeError, ["`x`", "floating"]),
    ((XI, jnp.zeros((3, 5, 4)), jnp.zeros((3, 5, 4))), ValueError, ["batch axis of `cos` (3)", "(2,)"]),
    ((XI, np.zeros((5, 4)).tolist(), TI), TypeError, ["`cos` must be an array"]),
    # issue 11: in the op's terms, never the kernel's (x_in, d_head, B, ...)
    ((XI.astype(jnp.float8_e4m3fn), TI, TI), TypeError, ["jax_nkilib.rope", "`x`", "float8_e4m3fn"]),
    ((XI, TI.astype(jnp.float8_e5m2), TI.astype(jnp.float8_e5m2)), TypeError, ["jax_nkilib.rope", "`cos`"]),
    ((XI.reshape((1,) * 10 + XI.shape), TI, TI), ValueError, ["jax_nkilib.rope", "`x` has 11 leading axes"]),
    ((XI, TI, TI, "yes"), TypeError, ["jax_nkilib.rope", "`interleaved`", "Python bool"]),
    ((XI, TI, TI, 1), TypeError, ["`interleaved`", "Python bool"]),
]


@pytest.mark.parametrize("case", range(len(IDIOMATIC)))
def test_bad_idiomatic_input(case):
    args, error, fragments = IDIOMATIC[case]
    args, flags = (args[:3], dict(interleaved=args[3])) if len(args) == 4 else (args, {})
    with pytest.raises(error) as info:
        jax_nkilib.rope(*args, **flags)
    for fragment in fragments:
        assert fragment in str(info.value), f"{fragment!r} not in: {info.value}"


def test_bad_config_values():
    with pytest.raises(ValueError, match="lnc must be one of"):
        with jax_nkilib.config(lnc=3):
            pass
    with pytest.raises(ValueError, match="on_unsupported"):
        with jax_nkilib.config(on_unsupported="ignore"):
            pass


def test_idiomatic_static_flag_and_empty_input():
    # a traced `interleaved` was a TracerBoolConversionError; an empty x a kernel error naming "dimension B"
    with pytest.raises(TypeError, match="jax_nkilib.rope: `interleaved` must be static .*static_argnames"):
        jax.jit(lambda x, i: jax_nkilib.rope(x, TI, TI, interleaved=i))(XI, True)
    out = jax.jit(jax_nkilib.rope, static_argnames="interleaved")(XI, TI, TI, interleaved=np.bool_(True))
    assert out.shape == XI.shape
    empty = jnp.zeros((0, 5, 3, 8), jnp.bfloat16)
    assert jax_nkilib.rope(empty, TI, TI).shape == empty.shape
    assert jax_nkilib.rope(XI[:, :, :0], TI, TI).shape == (2, 5, 0, 8)
