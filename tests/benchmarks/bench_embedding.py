"""Time of an embedding lookup forward+backward: jax_nkilib.embedding_lookup vs jnp.take (CPU, one process).

Run:
  python tests/benchmarks/bench_embedding.py             # vocab 32000, dim 1024, 4096 ids, float32 and bfloat16

Both compute ``sum(lookup(table, ids) * dy)`` and its gradient with respect to the table under ``jax.jit``; off
Neuron ours is the gather/scatter_add references (a clamped take, an add-scatter), so the ratio shows the cost of the
binding's extra steps (clamping, the LNC padding, the custom_vjp), not the kernels'. Reported: the median of 7 runs of
each, as the ratio ours / jnp.take, measured in the same process.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

import jax_nkilib


def median_seconds(fn, *args, runs: int = 7) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step(lookup):
    return jax.jit(jax.value_and_grad(lambda table, ids, dy: jnp.sum(lookup(table, ids).astype(jnp.float32) * dy)))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ids", type=int, default=4096)
    args = parser.parse_args()
    ours = step(jax_nkilib.embedding_lookup)
    plain = step(lambda table, ids: jnp.take(table, ids, axis=0))
    keys = jax.random.split(jax.random.key(0), 3)
    ids = jax.random.randint(keys[1], (args.ids,), 0, args.vocab, jnp.int32)
    dy = jax.random.normal(keys[2], (args.ids, args.dim), jnp.float32)
    print(f"vocab {args.vocab}, dim {args.dim}, {args.ids} ids (repeats included), forward + table gradient, CPU")
    for dtype in (jnp.float32, jnp.bfloat16):
        table = jax.random.normal(keys[0], (args.vocab, args.dim), jnp.float32).astype(dtype)
        t_ours, t_plain = median_seconds(ours, table, ids, dy), median_seconds(plain, table, ids, dy)
        print(f"{jnp.dtype(dtype).name:>9}: time ratio jax_nkilib / jnp.take = {t_ours / t_plain:.2f}")


if __name__ == "__main__":
    main()
