"""jax_nkilib.nki.attention_segmented_cte: paged prefill against the float64 oracle; transformations; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import attention_segmented_cte
from tests.attention.oracle import segmented_cte_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close

BLOCK = 4


def problem(bs=2, num_q_heads=4, kv_heads=2, seq_q=8, d=8, n_blocks=12, max_blocks=6, dtype=jnp.float32):
    q = random((bs * num_q_heads, seq_q, d), dtype, 0)
    k_cache, v_cache = (random((n_blocks, kv_heads, BLOCK, d), dtype, s) for s in (1, 2))
    tables = np.stack([np.random.default_rng(b).permutation(n_blocks)[:max_blocks] for b in range(bs)])
    return q, k_cache, v_cache, jnp.asarray(tables, jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(sliding_window=6),
        dict(scale=0.3, sink=True),
        dict(prior=0),
        dict(kv_heads=1),
        dict(kv_heads=4, tp=True),
    ],
)
def test_matches_oracle(dtype, config):
    q, k_cache, v_cache, tables = problem(dtype=dtype, kv_heads=config.get("kv_heads", 2))
    prior = jnp.array([[config.get("prior", 12)]], jnp.int32)
    sink = random((8, 1), dtype, 5) if config.get("sink") else None
    tp = config.get("tp", False)
    out = attention_segmented_cte(
        jnp.swapaxes(q, 1, 2) if tp else q,
        k_cache,
        v_cache,
        tables,
        prior,
        sink,
        block_size=BLOCK,
        prior_seg_size=8,
        scale=config.get("scale", 1.0),
        tp_q=not tp,
        tp_out=tp,
        sliding_window=config.get("sliding_window"),
        num_q_heads=4,
    )
    want = segmented_cte_oracle(
        q,
        k_cache,
        v_cache,
        tables,
        prior,
        block_size=BLOCK,
        num_q_heads=4,
        scale=config.get("scale", 1.0),
        sliding_window=config.get("sliding_window"),
        sink=sink,
    )
    assert out.dtype == dtype
    assert_close(jnp.swapaxes(out, 1, 2) if tp else out, want, dtype, reduction=20)


def test_pre_transposed_keys_and_dequant_scales():
    q, k_cache, v_cache, tables = problem()
    prior = jnp.array([[8]], jnp.int32)
    k_t = jnp.swapaxes(k_cache.reshape(-1, BLOCK, 8), 1, 2)  # [n_blocks * kv_heads, d, block]
    scales = jnp.full((128, 1), 0.5, jnp.float32), jnp.full((128, 1), 2.0, jnp.float32)
    out = attention_segmented_cte(
        q,
        k_t,
        v_cache,
        tables,
        prior,
        None,
        *scales,
        block_size=BLOCK,
        prior_seg_size=8,
        num_q_heads=4,
        k_pre_transposed=True,
    )
    want = segmented_cte_oracle(
        q, np.asarray(k_cache) * 0.5, np.asarray(v_cache) * 2.0, tables, prior, block_size=BLOCK, num_q_heads=4
    )
    assert_close(out, want, jnp.float32, reduction=20)


def test_runtime_prior_under_jit():
    q, k_cache, v_cache, tables = problem(dtype=jnp.float64)
    fn = jax.jit(
        lambda q_, p: attention_segmented_cte(
            q_, k_cache, v_cache, tables, p, block_size=BLOCK, prior_seg_size=8, num_q_heads=4
        )
    )
    for prior in (0, 4, 16):
        p = jnp.array([[prior]], jnp.int32)
        assert_close(
            fn(q, p), segmented_cte_oracle(q, k_cache, v_cache, tables, p, block_size=BLOCK, num_q_heads=4), jnp.float64
        )


def test_neuron_lowering():
    q, k_cache, v_cache, tables = problem()
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(
            neuron_text(
                lambda *a: attention_segmented_cte(*a, block_size=BLOCK, prior_seg_size=8, num_q_heads=4),
                q,
                k_cache,
                v_cache,
                tables,
                jnp.array([[4]], jnp.int32),
            )
        )
    assert cfg["func_name"] == "attention_segmented_cte" and cfg["params"]["block_size"] == BLOCK


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(prior_seg_size=8, num_q_heads=4), "missing required parameter `block_size`"),
        (dict(block_size=BLOCK, prior_seg_size=6, num_q_heads=4), "multiple of block_size"),
        (dict(block_size=BLOCK, prior_seg_size=8, num_q_heads=3), "bs * num_q_heads"),
        (dict(block_size=BLOCK, prior_seg_size=8, num_q_heads=4, kvp_group_size=2), "attention_kv_parallel"),
    ],
)
def test_bad_inputs(kwargs, fragment):
    q, k_cache, v_cache, tables = problem()
    with pytest.raises(TypeError if "required" in fragment else ValueError) as info:
        attention_segmented_cte(q, k_cache, v_cache, tables, jnp.array([[4]], jnp.int32), **kwargs)
    assert fragment in str(info.value)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_packed_keys_and_fp8_values(fp8):
    q, k_cache, v_cache, tables = problem(dtype=jnp.bfloat16)
    k8, v8 = k_cache.astype(fp8), v_cache.astype(fp8)
    k_packed = jnp.swapaxes(k8.reshape(*k8.shape[:2], BLOCK // 2, 2, 8), 3, 4)  # [n, h, block / 2, d, 2]
    scales = jnp.full((128, 1), 0.5, jnp.float32), jnp.full((128, 1), 2.0, jnp.float32)
    prior = jnp.array([[8]], jnp.int32)
    out = attention_segmented_cte(
        q,
        k_packed,
        v8,
        tables,
        prior,
        None,
        *scales,
        block_size=BLOCK,
        prior_seg_size=8,
        num_q_heads=4,
        fp8_packed=True,
    )
    as64 = lambda c: np.asarray(c.astype(jnp.float32), np.float64)  # noqa: E731
    want = segmented_cte_oracle(q, as64(k8) * 0.5, as64(v8) * 2.0, tables, prior, block_size=BLOCK, num_q_heads=4)
    assert_close(out, want, jnp.bfloat16, reduction=20)
    with pytest.raises(ValueError, match="half_block, d, 2"):
        attention_segmented_cte(
            q, k_cache, v_cache, tables, prior, block_size=BLOCK, prior_seg_size=8, num_q_heads=4, fp8_packed=True
        )
