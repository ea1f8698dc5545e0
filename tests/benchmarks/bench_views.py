"""Do layout views pay off? Each idiomatic op that calls its kernel through a layout view, timed against the same op
with explicit transposes around a kernel-layout call (and against a plain `jnp` version where there is one).

Run: python tests/benchmarks/bench_views.py [--repeats 15] [--small]

A layer-2 op holds its tensors in JAX layouts; its kernel wants its own. Either the op passes a *view* (the
primitive gets operands in the JAX layout, and a view-aware reference computes on them directly on CPU/GPU), or it
transposes to the kernel layout, calls the kernel, and transposes back. The explicit path here replaces every
`kernel.call(..., view=...)` by exactly those transposes, so both paths run the same op code, the same kernel and the
same VJP rules. Reports, per case, the median run time of the jitted forward and forward+backward (gradient of a
weighted sum), interleaved repeats in one run, and the ratios explicit / view and view / jnp, of the medians and of
the best times (on a loaded machine the best time is the steadier estimate: contention only adds). Not run by CI.
"""

import argparse
import contextlib
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nkilib
from jax_nkilib._src.framework import views
from jax_nkilib._src.framework.primitive import Kernel

_VIEW_CALL = Kernel.call


def _explicit_call(self, operands, params, view=None, derived=None):
    """``Kernel.call`` where a layout view becomes explicit transposes around a kernel-layout call."""
    if not view:
        return _VIEW_CALL(self, operands, params, derived=derived)
    operands = {name: None if value is None else jnp.asarray(value) for name, value in operands.items()}
    layout = views.make_view(self.spec, view, {n: v.ndim for n, v in operands.items() if v is not None}, params)
    in_kernel = {name: None if value is None else views.to_kernel(value, views.permutation_of(layout, name))
                 for name, value in operands.items()}
    outs = _VIEW_CALL(self, in_kernel, params, derived=derived)
    produced = self.spec.present_outputs(params, [name for name, value in operands.items() if value is not None])
    return tuple(views.to_given(out, views.permutation_of(layout, output.name)) for out, output in zip(outs, produced))


@contextlib.contextmanager
def explicit_transposes():
    """Trace the ops with explicit transposes instead of layout views."""
    Kernel.call = _explicit_call
    try:
        yield
    finally:
        Kernel.call = _VIEW_CALL


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
    return jnp.einsum("bsk,kh->bsh", attn.reshape(*attn.shape[:2], -1), w.astype(attn.dtype),
                      preferred_element_type=jnp.float32).astype(attn.dtype)


def cases(small: bool):
    """``(name, op, jnp version or None, args, differentiated argnums)``; shapes a model would use."""
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
    out.append((f"output_projection {attn.shape} x {w.shape} float32", jax_nkilib.output_projection,
                jnp_output_projection, (attn, w), (0, 1)))
    lhs = jnp.asarray(rng.standard_normal((256 // scale, 1024)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((1024, 1024)) / 32, jnp.bfloat16)
    out.append((f"mxfp8_matmul {lhs.shape} x {rhs.shape} bfloat16", jax_nkilib.mxfp8_matmul, None, (lhs, rhs),
                (0, 1)))
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
        order = order[i % len(fns):] + order[:i % len(fns)]
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
    print(f"{'case':58} {'pass':8} {'view':>8} {'explicit':>9} {'jnp':>8} {'expl/view':>10} {'view/jnp':>9} "
          f"{'best: expl/view':>16} {'view/jnp':>9}")
    for name, op, reference, args, argnums in cases(opts.small):
        for mode, wrap in (("fwd", lambda f: f), ("fwd+bwd", lambda f: forward_backward(f, argnums))):
            view_fn = compiled(wrap(op), args)
            with explicit_transposes():
                explicit_fn = compiled(wrap(op), args)
            fns = [view_fn, explicit_fn] + ([compiled(wrap(reference), args)] if reference else [])
            got = jax.tree.leaves(view_fn(*args))
            want = jax.tree.leaves(explicit_fn(*args))
            for a, b in zip(got, want):  # the two paths compute the same thing
                np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-2)
            times = run_times(fns, args, opts.repeats) + [[float("nan")]]
            t, b = [statistics.median(x) for x in times], [min(x) for x in times]
            print(f"{name:58} {mode:8} {t[0] * 1e3:8.2f} {t[1] * 1e3:9.2f} {t[2] * 1e3:8.2f} {t[1] / t[0]:10.2f} "
                  f"{t[0] / t[2]:9.2f} {b[1] / b[0]:16.2f} {b[0] / b[2]:9.2f}", flush=True)


if __name__ == "__main__":
    main()
