"""Time of jax_nkilib.conv (forward + backward) against lax.conv_general_dilated on CPU, for each kernel route.

Run:
  python tests/benchmarks/bench_conv.py

Off Neuron every route runs the kernels' JAX references (a float32-accumulated lax convolution in the kernel's
layout, the operands transposed to it and the output back, bias/activation epilogue rounding), so the ratio
ours / lax, measured in one run (median of repeated jitted calls of the gradient of sum(conv(x, w) * dy) in x and w),
says what the layout glue and the reference's fidelity cost on CPU; on Neuron each route is one NKI kernel call.
"""

import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

import jax_nkilib

CASES = {  # name: (lhs shape, rhs shape, dtype, kwargs)
    "conv1d NWC [8, 1024, 256] K=5 -> 256, f32": (
        (8, 1024, 256),
        (5, 256, 256),
        jnp.float32,
        dict(window_strides=(1,), padding="SAME", dimension_numbers=("NWC", "WIO", "NWC")),
    ),
    "conv1d NCW [8, 256, 1024] K=3 s=2, bf16": (
        (8, 256, 1024),
        (256, 256, 3),
        jnp.bfloat16,
        dict(window_strides=(2,), padding="VALID"),
    ),
    "depthwise NCW [8, 512, 2048] K=4, bf16": (
        (8, 512, 2048),
        (512, 1, 4),
        jnp.bfloat16,
        dict(window_strides=(1,), padding=[(3, 0)], feature_group_count=512),
    ),
    "conv3d NDHWC [2, 8, 32, 32, 32] 3^3 -> 32, f32": (
        (2, 8, 32, 32, 32),
        (3, 3, 3, 32, 32),
        jnp.float32,
        dict(window_strides=(1, 1, 1), padding="SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC")),
    ),
}


def seconds(fn, x, w, dy, repeats=5):
    step = jax.jit(jax.grad(lambda x, w, dy: jnp.sum((fn(x, w) * dy).astype(jnp.float32)), argnums=(0, 1)))
    jax.block_until_ready(step(x, w, dy))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(x, w, dy))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"{'case':48s} {'ours ms':>9s} {'lax ms':>9s} {'ratio':>6s}")
    for name, (lhs_shape, rhs_shape, dtype, kwargs) in CASES.items():
        x = jax.random.normal(jax.random.key(0), lhs_shape, dtype)
        w = jax.random.normal(jax.random.key(1), rhs_shape, dtype) * 0.1
        plain = lambda x, w, kwargs=kwargs: lax.conv_general_dilated(x, w, **kwargs)  # noqa: E731
        ours = lambda x, w, kwargs=kwargs: jax_nkilib.conv(x, w, **kwargs)  # noqa: E731
        dy = jax.random.normal(jax.random.key(2), jax.eval_shape(plain, x, w).shape, dtype)
        mine, theirs = seconds(ours, x, w, dy), seconds(plain, x, w, dy)
        print(f"{name:48s} {mine * 1e3:9.2f} {theirs * 1e3:9.2f} {mine / theirs:6.2f}")


if __name__ == "__main__":
    main()
