"""Overhead of jitted `jax_nkilib.rope` against a hand-written `jnp` RoPE on this machine (CPU).

Run: python tests/benchmarks/bench_rope.py [--batch 4 --seq 2048 --heads 32 --head-dim 128 --repeats 30]
(the default sizes are the arg spec ``rope.realistic``'s, see ``jax_nkilib/_src/tools/arg_specs``)

Reports ratios measured in one run (jax_nkilib / jnp): run time (median over interleaved repeats, forward and
forward+backward) and compile time (median of fresh lower+compile). A ratio of 1.00 means no overhead.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nkilib
from jax_nkilib._src.tools.arg_specs import arg_spec


def jnp_rope(x, cos, sin):
    """The usual hand-written RoPE on [batch, seq, heads, head_dim] with [seq, head_dim/2] tables."""
    half = x.shape[-1] // 2
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run_time_ratio(ours, theirs, args, repeats: int) -> tuple[float, float, float]:
    for fn in (ours, theirs):
        jax.block_until_ready(fn(*args))  # compile and warm up
    ours_t, theirs_t = [], []
    for i in range(repeats):  # interleave, alternating who goes first, so drift hits both alike
        pair = [(ours, ours_t), (theirs, theirs_t)]
        for fn, times in pair if i % 2 == 0 else pair[::-1]:
            times.append(timed(fn, *args))
    return (
        statistics.median(ours_t) / statistics.median(theirs_t),
        statistics.median(ours_t),
        statistics.median(theirs_t),
    )


def compile_time_ratio(ours, theirs, args, repeats: int) -> float:
    def compile_once(fn):
        start = time.perf_counter()
        jax.jit(lambda *a: fn(*a)).lower(*args).compile()  # a fresh function: no cache hit
        return time.perf_counter() - start

    ours_t, theirs_t = [], []
    for _ in range(repeats):
        ours_t.append(compile_once(ours))
        theirs_t.append(compile_once(theirs))
    return statistics.median(ours_t) / statistics.median(theirs_t)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    batch, seq, heads, head_dim = arg_spec("rope.realistic").shapes()[0].shape
    parser.add_argument("--batch", type=int, default=batch)
    parser.add_argument("--seq", type=int, default=seq)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    opts = parser.parse_args()

    dtype = jnp.dtype(opts.dtype)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((opts.batch, opts.seq, opts.heads, opts.head_dim)), dtype)
    theta = rng.uniform(-np.pi, np.pi, (opts.seq, opts.head_dim // 2))
    cos, sin = jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)
    args = (x, cos, sin)
    print(f"shape {x.shape} {dtype}, {jax.devices()[0].platform}, {opts.repeats} repeats")

    ours, theirs = jax.jit(jax_nkilib.rope), jax.jit(jnp_rope)
    np.testing.assert_allclose(
        np.asarray(ours(*args), np.float32),
        np.asarray(theirs(*args), np.float32),
        atol=2e-2 if dtype == jnp.bfloat16 else 1e-5,
    )
    ratio, t_ours, t_theirs = run_time_ratio(ours, theirs, args, opts.repeats)
    print(f"forward run time ratio      {ratio:.3f}  (medians {t_ours * 1e3:.2f} ms / {t_theirs * 1e3:.2f} ms)")

    def train_step(fn):
        return jax.jit(jax.grad(lambda x, c, s: jnp.sum(fn(x, c, s).astype(jnp.float32) ** 2), argnums=(0, 1, 2)))

    ratio, t_ours, t_theirs = run_time_ratio(train_step(jax_nkilib.rope), train_step(jnp_rope), args, opts.repeats)
    print(f"fwd+bwd run time ratio      {ratio:.3f}  (medians {t_ours * 1e3:.2f} ms / {t_theirs * 1e3:.2f} ms)")
    print(f"compile time ratio          {compile_time_ratio(jax_nkilib.rope, jnp_rope, args, 5):.3f}")


if __name__ == "__main__":
    main()
