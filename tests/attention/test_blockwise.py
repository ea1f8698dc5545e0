"""The blockwise engine with small blocks: skipped block pairs never change the result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nkilib._src.attention.blockwise import attention_backward, attention_forward, block_pairs, log_sum_exp
from jax_nkilib._src.attention.masks import MaskRule
from tests.attention.oracle import allowed_mask, attention_rows, attention_rows_grads
from tests.support.data import random

RULES = {
    "causal": dict(causal=True),
    "window": dict(causal=True, window=5),
    "prefix": dict(causal=True, n_prior=6),
    "prefix_window": dict(causal=True, window=4, n_prior=6),
    "full": dict(),
}


@pytest.mark.parametrize("name", list(RULES))
def test_small_blocks_match_the_oracle(name):
    config = dict(RULES[name])
    n_prior = config.pop("n_prior", 0)
    seq_q, seq_k, d = 19, 17, 4
    rule = MaskRule(n_queries=seq_q, n_active=seq_k, n_prior=n_prior, **config)
    q = random((2, 3, seq_q, d), jnp.float64, 0)
    k, v = random((2, n_prior + seq_k, d), jnp.float64, 1), random((2, n_prior + seq_k, d), jnp.float64, 2)
    out, row_max, row_sum = attention_forward(q, k, v, rule, 0.5, block_q=4, block_k=5)
    ok = allowed_mask(seq_q, n_prior, seq_k, causal=config.get("causal", False), window=config.get("window", 0))
    rows = lambda x: np.asarray(x).reshape(-1, *x.shape[2:])  # noqa: E731
    want = attention_rows(rows(q), np.asarray(k), np.asarray(v), ok, 0.5)[0]
    np.testing.assert_allclose(rows(out), want, atol=1e-12)
    dy = random(q.shape, jnp.float64, 3)
    grads = attention_backward(q, k, v, out, dy, log_sum_exp(row_max, row_sum), rule, 0.5, block_q=4, block_k=5)
    want = attention_rows_grads(rows(q), np.asarray(k), np.asarray(v), ok, 0.5, rows(dy))
    np.testing.assert_allclose(rows(grads[0]), want[0], atol=1e-12)
    np.testing.assert_allclose(grads[1], want[1], atol=1e-12)
    np.testing.assert_allclose(grads[2], want[2], atol=1e-12)


def test_causal_and_window_rules_skip_hidden_block_pairs():
    causal = MaskRule(n_queries=64, n_active=64, causal=True)
    assert len(block_pairs(causal, 8, 8, 8, 8, by="query")[0]) == 36  # the lower triangle of 8 x 8 blocks
    band = MaskRule(n_queries=64, n_active=64, causal=True, window=8)
    assert len(block_pairs(band, 8, 8, 8, 8, by="key")[0]) == 15  # the diagonal and one below
    runtime = MaskRule(n_queries=64, n_active=64, causal=True, q_base=jnp.array(3))
    assert len(block_pairs(runtime, 8, 8, 8, 8, by="query")[0]) == 64  # unknown offsets: every pair
    i, j, starts = block_pairs(causal, 8, 8, 8, 8, by="key")
    assert list(np.asarray(j)[:8]) == [0] * 8 and bool(starts[0]) and bool(starts[8]) and not bool(starts[1])


def test_jit_of_the_engine():
    rule = MaskRule(n_queries=16, n_active=16, causal=True)
    q, k = random((1, 2, 16, 4), jnp.float32, 0), random((1, 16, 4), jnp.float32, 1)
    eager = attention_forward(q, k, k, rule, 1.0, block_q=4, block_k=4)[0]
    jitted = jax.jit(lambda a, b: attention_forward(a, b, b, rule, 1.0, block_q=4, block_k=4)[0])(q, k)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)
