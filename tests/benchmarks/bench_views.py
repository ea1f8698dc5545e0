"""Layout views were decided by this measurement: each idiomatic op that called its kernel through a layout view,
timed against the same op with explicit transposes around a kernel-layout call, and against a plain `jnp` version.

Run: python tests/benchmarks/bench_views.py [--repeats 15] [--small]

A layer-2 op holds its tensors in JAX layouts; its kernel wants its own. Either the op passes a *view* (the primitive
gets operands in the JAX layout, and a view-aware reference computes on them directly on CPU/GPU), or it transposes
to the kernel layout, calls the kernel, and transposes back. At commit 8f8f513, where views existed, this script ran
both paths (every `kernel.call(..., view=...)` replaced by exactly those transposes). On XLA:CPU (jax 0.10.2, 2
loaded cores, 30 interleaved repeats, one run), explicit / view time, medians (best times):

    rope [2, 1024, 16, 128] float32   fwd 0.97 (0.73)   fwd+bwd 0.71 (0.75)
    rope [2, 1024, 16, 128] bfloat16  fwd 1.11 (1.21)   fwd+bwd 1.80 (1.93)
    rms_norm [4, 512, 4096] float32   fwd 0.72 (0.65)   fwd+bwd 0.99 (0.90)
    output_projection [2, 512, 16, 128] x [2048, 2048] float32   fwd 1.04 (0.87)   fwd+bwd 0.99 (0.99)
    mxfp8_matmul [256, 1024] x [1024, 1024] bfloat16   fwd 0.96 (0.98)   fwd+bwd 1.01 (0.88)

Views paid off in one case (bfloat16 RoPE forward+backward) and lost in another (float32 RoPE forward+backward);
explicit RoPE forward+backward ran at 0.9-1.0x of the `jnp` RoPE in float32 (not 7.1x slower), so views were removed:
the ops transpose explicitly. The script now times the ops (explicit transposes) against `jnp`: forward and
forward+backward (gradient of a weighted sum), median and best of interleaved repeats in one run. Not run by CI.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nkilib


# ------------------------------------------------------------------------------------------------- the cases
def jnp_rope(x, cos, sin):
    half = x.shape[-1] // 2
    c, s = cos[:, None, :].astype(x.dtype), sin[:, None, :].astype(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def jnp_rms_norm(x, weight):
    wide = x.astype(jnp.float32)
    return (wide * jax.lax.rsqrt(jnp.mean(wide * wide, -1, keepdims=True) + 1e-6) * weight).astype(x.dtype)


def jnp_output_projection(attn, w):
    return jnp.einsum(
        "bsk,kh->bsh", attn.reshape(*attn.shape[:2], -1), w.astype(attn.dtype), preferred_element_type=jnp.float32
    ).astype(attn.dtype)


def cases(small: bool):
    """``(name, op, jnp version, args, differentiated argnums)``; shapes a model would use."""
    rng = np.random.default_rng(0)
    scale = 4 if small else 1
    batch, seq, heads, head_dim = 2, 1024 // scale, 16, 128
    theta = rng.uniform(-np.pi, np.pi, (seq, head_dim // 2))
    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), dtype)
        cos, sin = jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)
        out.append((f"rope {x.shape} {jnp.dtype(dtype).name}", jax_nkilib.rope, jnp_rope, (x, cos, sin), (0,)))
    x = jnp.asarray(rng.standard_normal((4, 512 // scale, 4096)), jnp.float32)
    weight = jnp.asarray(rng.uniform(0.5, 1.5, 4096), jnp.float32)
    out.append((f"rms_norm {x.shape} float32", jax_nkilib.rms_norm, jnp_rms_norm, (x, weight), (0, 1)))
    attn = jnp.asarray(rng.standard_normal((batch, 512 // scale, heads, head_dim)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((heads * head_dim, 2048)) / 45, jnp.float32)
    out.append(
        (
            f"output_projection {attn.shape} x {w.shape} float32",
            jax_nkilib.output_projection,
            jnp_output_projection,
            (attn, w),
            (0, 1),
        )
    )
    return out


def forward_backward(fn, argnums):
    def loss(*args):
        out = fn(*args)
        return jnp.sum(out.astype(jnp.float32) * jnp.cos(jnp.arange(out.size, dtype=jnp.float32)).reshape(out.shape))

    return jax.grad(loss, argnums=argnums)


# ---------------------------------------------------------------------------------------------------- timing
def timed(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run_times(fns, args, repeats: int) -> list[list[float]]:
    """Run times of each compiled function, repeats interleaved (rotating who goes first)."""
    for fn in fns:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for i in range(repeats):
        order = list(range(len(fns)))
        order = order[i % len(fns) :] + order[: i % len(fns)]
        for j in order:
            times[j].append(timed(fns[j], args))
    return times


def compiled(fn, args):
    return jax.jit(fn).lower(*args).compile()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--small", action="store_true", help="quarter-size shapes (a quick check)")
    opts = parser.parse_args()
    print(f"{jax.devices()[0].platform}, jax {jax.__version__}, {opts.repeats} interleaved repeats; times in ms")
    print(f"{'case':58} {'pass':8} {'op':>8} {'jnp':>8} {'op/jnp':>7} {'best: op/jnp':>13}")
    for name, op, reference, args, argnums in cases(opts.small):
        for mode, wrap in (("fwd", lambda f: f), ("fwd+bwd", lambda f, a=argnums: forward_backward(f, a))):
            fns = [compiled(wrap(op), args), compiled(wrap(reference), args)]
            times = run_times(fns, args, opts.repeats)
            t, b = [statistics.median(x) for x in times], [min(x) for x in times]
            print(
                f"{name:58} {mode:8} {t[0] * 1e3:8.2f} {t[1] * 1e3:8.2f} {t[0] / t[1]:7.2f} {b[0] / b[1]:13.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
