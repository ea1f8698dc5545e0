"""Time of jax_nkilib.cumsum and jax_nkilib.pad (forward + backward) against jnp.cumsum / jnp.pad on CPU.

Run:
  python tests/benchmarks/bench_cumsum_pad.py

Off Neuron both ops run the kernels' JAX references: cumsum's is the kernel's tiled float32 scan (2048-column tiles
and a carry rounded to the dtype between them), pad's is jnp.pad with the kernel's mode. The ratio ours / plain JAX,
measured in one run (median of repeated jitted calls of the gradient of sum(op(x) * dy)), says what the reference's
fidelity to the kernel costs on CPU; on Neuron each op is the NKI kernel instead.
"""

import statistics
import time

import jax
import jax.numpy as jnp

import jax_nkilib

CASES = {
    "cumsum [512, 8192] f32, last axis": (
        (512, 8192),
        jnp.float32,
        lambda x: jax_nkilib.cumsum(x, axis=-1),
        lambda x: jnp.cumsum(x, axis=-1),
    ),
    "cumsum [512, 8192] bf16, last axis": (
        (512, 8192),
        jnp.bfloat16,
        lambda x: jax_nkilib.cumsum(x, axis=-1),
        lambda x: jnp.cumsum(x, axis=-1),
    ),
    "cumsum [16, 4096, 16] f32, axis 1": (
        (16, 4096, 16),
        jnp.float32,
        lambda x: jax_nkilib.cumsum(x, axis=1),
        lambda x: jnp.cumsum(x, axis=1),
    ),
    "pad [4, 32, 128, 128] f32, reflect 3x3": (
        (4, 32, 128, 128),
        jnp.float32,
        lambda x: jax_nkilib.pad(x, ((0, 0), (0, 0), (3, 3), (3, 3)), "reflect"),
        lambda x: jnp.pad(x, ((0, 0), (0, 0), (3, 3), (3, 3)), "reflect"),
    ),
    "pad [4, 32, 128, 128] f32, constant": (
        (4, 32, 128, 128),
        jnp.float32,
        lambda x: jax_nkilib.pad(x, ((0, 0), (0, 0), (1, 2), (1, 2))),
        lambda x: jnp.pad(x, ((0, 0), (0, 0), (1, 2), (1, 2))),
    ),
}


def seconds(fn, x, dy, repeats=7):
    # dy is an argument: a closed-over cotangent would be a constant, and XLA:CPU constant-folds cumsums of
    # constants (reduce-windows) for minutes
    step = jax.jit(jax.grad(lambda x, dy: jnp.sum((fn(x) * dy).astype(jnp.float32))))
    jax.block_until_ready(step(x, dy))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(x, dy))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"{'case':44s} {'ours ms':>9s} {'jnp ms':>9s} {'ratio':>6s}")
    for name, (shape, dtype, ours, plain) in CASES.items():
        x = jax.random.normal(jax.random.key(0), shape, dtype)
        dy = jax.random.normal(jax.random.key(1), jax.eval_shape(plain, x).shape, dtype)
        mine, theirs = seconds(ours, x, dy), seconds(plain, x, dy)
        print(f"{name:44s} {mine * 1e3:9.2f} {theirs * 1e3:9.2f} {mine / theirs:6.2f}")


if __name__ == "__main__":
    main()
