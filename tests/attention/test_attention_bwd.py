"""jax_nkilib.nki.attention_bwd against the float64 oracle's gradients; vmap; shard_map."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_nkilib.nki import attention_bwd
from tests.attention.oracle import allowed_mask, attention_rows, attention_rows_grads
from tests.support.data import random
from tests.support.numerics import assert_close


def problem(
    bs=2,
    heads=4,
    kv_heads=2,
    d=8,
    seq=128,
    dtype=jnp.float32,
    causal=True,
    window=0,
    scale=None,
    sinks_shape=None,
    bounds=None,
):
    """Inputs in attention_bwd's layouts and the oracle's gradients (rows = bs * heads, kv rows = bs * kv_heads)."""
    q, k, v = (
        random(s, dtype, i) for i, s in enumerate([(bs, heads, d, seq), (bs, kv_heads, d, seq), (bs, kv_heads, d, seq)])
    )
    dy = random((bs, heads, d, seq), dtype, 7)
    sinks = None if sinks_shape is None else random(sinks_shape, dtype, 8)
    scale_value = scale or 1 / np.sqrt(d)
    rows = lambda x: np.swapaxes(np.asarray(x, np.float64), 2, 3).reshape(-1, seq, d)  # noqa: E731
    ok = allowed_mask(
        seq,
        0,
        seq,
        causal=causal,
        window=window,
        bound_min=None if bounds is None else bounds[0],
        bound_max=None if bounds is None else bounds[1],
    )
    sink_rows = None if sinks is None else np.asarray(sinks, np.float64).reshape(bs * heads, -1)
    o, _, _, lse = attention_rows(rows(q), rows(k), rows(v), ok, scale_value, sink_rows)
    to_kernel = lambda x, h: jnp.asarray(np.swapaxes(x.reshape(bs, h, seq, d), 2, 3), dtype)  # noqa: E731
    lse_ref = jnp.asarray(np.swapaxes(lse.reshape(bs, heads, seq // 128, 128), 2, 3), jnp.float32)
    grads = attention_rows_grads(rows(q), rows(k), rows(v), ok, scale_value, rows(dy), sink_rows)
    want = [np.swapaxes(g.reshape(bs, -1, seq, d), 2, 3) for g in grads[:3]]
    if sinks is not None:
        want.append(grads[3].reshape(sinks.shape))
    return (q, k, v, to_kernel(o, heads), dy, lse_ref, sinks), want


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(causal=False),
        dict(kv_heads=1),
        dict(kv_heads=4),
        dict(window=40),
        dict(scale=0.2),
        dict(sinks_shape=(2, 4)),
        dict(sinks_shape=(2, 4, 3)),
    ],
)
def test_gradients_match_oracle(dtype, config):
    (q, k, v, o, dy, lse, sinks), want = problem(dtype=dtype, **config)
    got = attention_bwd(
        q,
        k,
        v,
        o,
        dy,
        lse,
        sinks,
        use_causal_mask=config.get("causal", True),
        softmax_scale=config.get("scale"),
        sliding_window=config.get("window") or None,
    )
    assert len(got) == len(want)
    for g, w, reduction in zip(got, want, (128, 256, 256, 128)):
        assert g.dtype == dtype and g.shape == w.shape
        assert_close(g, w, dtype, reduction=reduction, ops=8 if dtype == jnp.bfloat16 else 4)


def test_sequence_packing_bounds():
    lo = np.repeat([0.0, 64.0], 64).astype(np.float32)
    hi = np.repeat([64.0, 128.0], 64).astype(np.float32)
    (q, k, v, o, dy, lse, _), want = problem(causal=False, bounds=(lo, hi))
    got = attention_bwd(q, k, v, o, dy, lse, None, jnp.asarray(lo), jnp.asarray(hi))
    for g, w in zip(got, want):
        assert_close(g, w, jnp.float32, reduction=128)
