"""The quickstart transformer block built from jax_nkilib ops against the same block in plain JAX (CPU).

Run: python tests/benchmarks/bench_block.py [--batch 2 --seq 512 --repeats 15]

The plain block uses ``jax.nn.dot_product_attention`` and ``jnp`` for the norms, projections, RoPE and SwiGLU MLP.
Reports ratios measured in one run (jax_nkilib / plain JAX): run time of the jitted forward and of a jitted
forward+backward (medians of interleaved repeats), and compile time. The kernels' references model the kernels'
precision (the qkv and mlp CTE paths compute float32 inputs in bfloat16), so the outputs agree to bfloat16 level.
"""

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import quickstart as block  # noqa: E402
from bench_rope import compile_time_ratio, jnp_rope, run_time_ratio  # noqa: E402


def plain_rms_norm(x, weight, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def plain_block(params, x, cos, sin):
    """The quickstart block in plain JAX."""
    b, s, _ = x.shape
    hd, hq, hkv = block.HEAD_DIM, block.HEADS, block.KV_HEADS
    h = plain_rms_norm(x, params["attn_norm"])
    q, k, v = jnp.split(h @ params["qkv"], [hq * hd, (hq + hkv) * hd], axis=-1)
    q, k, v = q.reshape(b, s, hq, hd), k.reshape(b, s, hkv, hd), v.reshape(b, s, hkv, hd)
    q, k = jnp_rope(q, cos, sin), jnp_rope(k, cos, sin)
    o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, s, hq * hd)
    x = x + o @ params["out"]
    h = plain_rms_norm(x, params["mlp_norm"])
    return x + (jax.nn.silu(h @ params["gate"]) * (h @ params["up"])) @ params["down"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    opts = parser.parse_args()
    params = block.init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (opts.batch, opts.seq, block.MODEL), jnp.float32)
    cos, sin = block.rotary_tables(opts.seq, block.HEAD_DIM)
    args = (params, x, cos, sin)
    print(f"x {x.shape} float32, {jax.devices()[0].platform}, {opts.repeats} repeats")

    ours, theirs = jax.jit(block.transformer_block), jax.jit(plain_block)
    np.testing.assert_allclose(np.asarray(ours(*args)), np.asarray(theirs(*args)), atol=5e-2)
    ratio, t_ours, t_theirs = run_time_ratio(ours, theirs, args, opts.repeats)
    print(f"forward run time ratio      {ratio:.3f}  (medians {t_ours * 1e3:.1f} ms / {t_theirs * 1e3:.1f} ms)")

    def train_step(fn):
        return jax.jit(jax.grad(lambda p, *a: jnp.sum(fn(p, *a) ** 2)))

    ratio, t_ours, t_theirs = run_time_ratio(
        train_step(block.transformer_block), train_step(plain_block), args, opts.repeats
    )
    print(f"fwd+bwd run time ratio      {ratio:.3f}  (medians {t_ours * 1e3:.1f} ms / {t_theirs * 1e3:.1f} ms)")
    print(f"compile time ratio          {compile_time_ratio(block.transformer_block, plain_block, args, 3):.3f}")


if __name__ == "__main__":
    main()
