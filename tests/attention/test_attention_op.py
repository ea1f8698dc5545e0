"""jax_nkilib.attention: JAX layouts, GQA/MQA, sliding window, sinks, prefix cache; gradients; vmap; shard_map
without collectives (jit, check_grads of causal GQA, vmap of grad, shard_map values: tests/conformance)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from tests.attention.oracle import idiomatic_attention
from tests.support.data import random
from tests.support.numerics import assert_close, assert_no_worse_than_plain
from tests.support.sharding import mesh_1d, shard


def qkv(batch=2, sq=16, sk=16, heads=4, kv_heads=2, d=8, dtype=jnp.float32):
    return (
        random((batch, sq, heads, d), dtype, 0),
        random((batch, sk, kv_heads, d), dtype, 1),
        random((batch, sk, kv_heads, d), dtype, 2),
    )


CONFIGS = {
    "causal_gqa": ({}, {}),
    "non_causal": ({}, dict(causal=False)),
    "mqa_odd": (dict(sq=97, sk=97, kv_heads=1), {}),
    "mha_rect": (dict(sq=5, sk=11, kv_heads=4), dict(causal=False, scale=0.2)),
    "window": ({}, dict(sliding_window=3)),
    "sinks": ({}, dict(sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_matches_oracle(name, dtype):
    shape_kw, call_kw = CONFIGS[name]
    q, k, v = qkv(dtype=dtype, **shape_kw)
    out = jax_nkilib.attention(q, k, v, **{"causal": True, **call_kw})
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out, idiomatic_attention(q, k, v, **call_kw), dtype, reduction=k.shape[1])


def test_bf16_error_is_that_of_plain_bf16_attention():
    q, k, v = qkv(sq=64, sk=64, heads=2, kv_heads=2, d=32, dtype=jnp.bfloat16)
    plain = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    assert_no_worse_than_plain(
        jax_nkilib.attention(q, k, v, causal=True), plain, idiomatic_attention(q, k, v), factor=2.0
    )


def test_prefix_cache_with_runtime_length():
    q, k, v = qkv()
    kp, vp = random((2, 2, 6, 8), seed=5), random((2, 2, 6, 8), seed=6)  # [batch, kv_heads, max_prior, d]
    for used in (0, 4, 6):
        out = jax.jit(lambda n: jax_nkilib.attention(q, k, v, prefix=(kp, vp, n), sliding_window=10, causal=True))(used)
        want = idiomatic_attention(q, k, v, prefix=(kp, vp, used), sliding_window=10)
        assert_close(out, want, jnp.float32)


def test_rows_without_keys_are_zero_not_nan():
    q, k, v = qkv(sq=12, sk=4)
    out = jax_nkilib.attention(q, k, v, sliding_window=2, causal=True)  # queries 5.. see no key
    assert np.all(np.isfinite(out)) and np.all(np.asarray(out[:, 5:]) == 0)
    grads = jax.grad(lambda a: jnp.sum(jax_nkilib.attention(a, k, v, sliding_window=2, causal=True)))(q)
    assert np.all(np.isfinite(grads))


@pytest.mark.parametrize("name", ["window", "sinks", "mha_rect"])  # causal GQA: the conformance spec attention
def test_gradients_float64(name):
    shape_kw, call_kw = CONFIGS[name]
    q, k, v = qkv(
        batch=1,
        dtype=jnp.float64,
        **{**shape_kw, "sq": min(shape_kw.get("sq", 6), 6), "sk": min(shape_kw.get("sk", 6), 6)},
    )
    sinks = call_kw.pop("sinks", None)
    args = (q, k, v) + (() if sinks is None else (sinks.astype(jnp.float64),))
    fn = lambda *a: jax_nkilib.attention(*a[:3], sinks=a[3] if len(a) > 3 else None, **{"causal": True, **call_kw})  # noqa: E731
    check_grads(fn, args, order=1, modes=["rev"])


def test_gradients_with_prefix_float64():
    q, k, v = qkv(batch=1, sq=4, sk=4, dtype=jnp.float64)
    kp, vp = random((1, 2, 3, 8), jnp.float64, 5), random((1, 2, 3, 8), jnp.float64, 6)
    check_grads(
        lambda *a: jax_nkilib.attention(*a[:3], prefix=(a[3], a[4], 2), causal=True),
        (q, k, v, kp, vp),
        order=1,
        modes=["rev"],
    )


def test_float32_gradients_against_oracle_gradients():
    """The kernel-backward path (seq 128) against central differences of the float64 oracle in a random direction."""
    q, k, v = qkv(batch=1, sq=128, sk=128, heads=2, kv_heads=1, d=8)
    sinks = jnp.array([0.3, -0.2])
    dy = random(q.shape, jnp.float32, 9)
    grads = jax.grad(
        lambda *a: jnp.sum(jax_nkilib.attention(*a[:3], sinks=a[3], causal=True) * dy), argnums=(0, 1, 2, 3)
    )(q, k, v, sinks)
    base = [np.asarray(x, np.float64) for x in (q, k, v, sinks)]
    for i, grad in enumerate(grads):
        direction = np.random.default_rng(i).standard_normal(base[i].shape)
        eps = 1e-5
        plus = [b + eps * direction if j == i else b for j, b in enumerate(base)]
        minus = [b - eps * direction if j == i else b for j, b in enumerate(base)]
        f = lambda a: np.sum(idiomatic_attention(*a[:3], sinks=a[3]) * np.asarray(dy, np.float64))  # noqa: E731
        numeric = (f(plus) - f(minus)) / (2 * eps)
        np.testing.assert_allclose(np.sum(np.asarray(grad, np.float64) * direction), numeric, rtol=1e-4)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_vmap_and_nested_vmap_of_the_queries():
    # vmap of grad: the conformance spec attention
    q, k, v = qkv()
    qs = jnp.stack([q, -q])
    out = jax.vmap(jax_nkilib.attention, in_axes=(0, None, None))(qs, k, v)
    assert_close(out[1], idiomatic_attention(-q, k, v), jnp.float32)
    nested = jax.vmap(jax.vmap(jax_nkilib.attention, in_axes=(0, 0, 0)), in_axes=(0, None, None))(
        qs[:, :, None], k[:, None], v[:, None]
    )
    assert_close(nested[:, :, 0], np.stack([idiomatic_attention(x, k, v) for x in (q, -q)]), jnp.float32)


@pytest.mark.parametrize("axis, spec", [("data", P("data")), ("model", P(None, None, "model"))])
def test_batch_or_head_sharded_gradients_need_no_collective(axis, spec):
    # values inside shard_map vs unsharded: the conformance specs attention and attention.heads_sharded; gradients
    # too for the batch-sharded one (attention)
    mesh = mesh_1d(axis)
    q, k, v = qkv(batch=8, heads=8, kv_heads=8) if axis == "data" else qkv(heads=16, kv_heads=8)
    args = shard(mesh, (spec,) * 3, q, k, v)
    fn = jax.shard_map(
        functools.partial(jax_nkilib.attention, causal=True), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )
    grad_fn = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))
    if axis == "model":
        unsharded = jax.grad(lambda *a: jnp.sum(jax_nkilib.attention(*a, causal=True) ** 2), argnums=(0, 1, 2))(q, k, v)
        for got, want in zip(grad_fn(*args), unsharded):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    compiled = grad_fn.lower(*args).compile().as_text()
    assert "all-reduce" not in compiled and "all-gather" not in compiled


@pytest.mark.slow
def test_long_sequence_forward_and_backward_fit_in_memory():
    """Issue 3's bar: batch 1, seq 32768, 8 heads, head_dim 128, causal, f32, forward+backward, peak RSS < 3 GiB.

    Run in a fresh process by tests/benchmarks/bench_attention.py --long (which reports time and peak memory)."""
    import os
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[2]  # importable without installing the package
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, "tests/benchmarks/bench_attention.py", "--long"],
        capture_output=True,
        text=True,
        check=True,
        cwd=root,
        env=env,
    )
    peak_gib = float(result.stdout.split("peak_rss_gib=")[1].split()[0])
    assert peak_gib < 3.0, result.stdout
