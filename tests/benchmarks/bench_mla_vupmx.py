"""Cost of `jax_nkilib.nki.mla_vupmx_oproj_cte_kernel`'s CPU reference against a plain `jnp` V-up + o_proj on the
same MXFP8 weights, on this machine.

Run: python tests/benchmarks/bench_mla_vupmx.py [--seq 128 --heads 16 --hidden 7168 --repeats 10]

DeepSeek-V3.2 dims per rank (kv_lora_rank 512, d_v 128; 16 of the 128 heads by default), batch 1. Both take the
x4 weight words and compact block-128 scales and decode them on every call; the baseline then runs two float32
matmuls (bf16 latent, bf16 between them), while the reference also replays the kernel's MX pipeline (the MXFP8 round
trips of both activations). Reports ratios measured in one run (reference / baseline) of the median jitted run
time over interleaved repeats, and how far the MX pipeline moves the result from the plain one.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.mla import mx_x4_weight

LATENT, D_V = 512, 128


def decode(words, scales):
    """Natural float32 ``[4 G, N]`` weight from x4 words ``[G, N]`` and compact block-128 scales."""
    codes = jnp.stack([(words >> (8 * q)) & 0xFF for q in range(4)], axis=1).astype(jnp.uint8)  # [G, 4, N]
    values = jax.lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(jnp.float32).reshape(-1, words.shape[1])
    factor = jnp.exp2(scales.astype(jnp.float32) - 127)
    return values * jnp.repeat(jnp.repeat(factor, 128, axis=0), 128, axis=1)[:, : words.shape[1]]


def plain(out_attn, wuv, wuv_scale, wo, wo_scale):
    b, s, width = out_attn.shape
    heads = 4 * wo.shape[0] // D_V
    latent = out_attn.reshape(b, s, heads, 4, width // heads // 4).swapaxes(-1, -2).reshape(b, s, heads, -1)
    v = jnp.einsum("bshl,hlj->bshj", latent.astype(jnp.float32), decode(wuv, wuv_scale).reshape(heads, -1, D_V))
    v = v.astype(jnp.bfloat16).astype(jnp.float32).reshape(b, s, -1)
    return (v @ decode(wo, wo_scale)).astype(jnp.bfloat16)


def median_times(fns, args, repeats):
    for fn in fns:
        jax.block_until_ready(fn(*args))
    times = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    rng = np.random.default_rng(0)
    out_attn = jnp.asarray(rng.standard_normal((1, a.seq, a.heads * LATENT)) * 0.3, jnp.bfloat16)
    args = (out_attn, *mx_x4_weight(rng, a.heads * LATENT, D_V), *mx_x4_weight(rng, a.heads * D_V, a.hidden))
    ours, baseline = jax.jit(nki.mla_vupmx_oproj_cte_kernel), jax.jit(plain)
    t_ours, t_plain = median_times((ours, baseline), args, a.repeats)
    gap = float(jnp.max(jnp.abs(ours(*args).astype(jnp.float32) - baseline(*args).astype(jnp.float32))))
    scale = float(jnp.max(jnp.abs(baseline(*args).astype(jnp.float32))))
    print(f"S={a.seq} H={a.heads} L={LATENT} d_v={D_V} HID={a.hidden} on {jax.devices()[0].platform}")
    print(f"reference / plain jnp time: {t_ours / t_plain:.2f}")
    print(f"largest |reference - plain| / largest |plain| (the MX activation rounding): {gap / scale:.3f}")


if __name__ == "__main__":
    main()
