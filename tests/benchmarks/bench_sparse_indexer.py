"""Overhead of jitted `jax_nkilib.nki.sparse_attention_indexer_mx_bf16score` against a hand-written `jnp` DeepSeek
indexer on this machine (CPU).

Run: python tests/benchmarks/bench_sparse_indexer.py [--seq 1024 --heads 64 --topk 256 --repeats 10]

DeepSeek-V3.2's indexer dims (64 heads of 128, rope 64; hidden 7168 and q_lora_rank 1536 scaled down to 1024 and
512), batch 1, prefill from position 0. Reports ratios measured in one run (jax_nkilib / jnp) of the median run time
over interleaved repeats, for the BF16 and MX projection modes. On CPU jax_nkilib runs the kernel's reference: its
bf16 roundings (and, for MX, the decoding of the x4 weight words, the swizzled qr and the MX rounding of x) are the
extra work; the jnp baseline is the same math in float32 with `jax.lax.top_k`.
"""

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.sparse_indexer import indexer_operands, mx_indexer_operands

DIM, Q, D, R = 1024, 512, 128, 64


def jnp_indexer(x, wq_b, wk, gamma, beta, wp, cos, sin, mask, qr, heads, topk):
    """The indexer in float32 jnp: K projection + LayerNorm + RoPE, Q projection + RoPE, weighted relu scores."""

    def rope(t, c, s):
        a, b = t[..., : R // 2], t[..., R // 2 : R]
        return jnp.concatenate([a * c - b * s, a * s + b * c, t[..., R:]], axis=-1)

    k = x @ wk
    k = (k - k.mean(-1, keepdims=True)) * jax.lax.rsqrt(k.var(-1, keepdims=True) + 1e-6) * gamma + beta
    k = rope(k, cos, sin)
    q = rope((qr @ wq_b).reshape(x.shape[0], heads, D), cos[:, None], sin[:, None])
    w = x @ wp.T / math.sqrt(heads * D)
    score = jnp.einsum("sh,sht->st", w, jax.nn.relu(jnp.einsum("shd,td->sht", q, k))) + mask
    return score, jax.lax.top_k(score, topk)[1]


def timed(fn, args, repeats):
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=64)
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    rng = np.random.default_rng(0)
    bf16 = indexer_operands(1, a.seq, DIM, Q, a.heads, D, R, a.seq, 0)(rng)
    mx_ops = mx_indexer_operands(1, a.seq, DIM, Q, a.heads, D, R, a.seq, 0)(rng)
    ours_bf16 = jax.jit(
        lambda *o: nki.sparse_attention_indexer_mx_bf16score(
            *o[:10], qr_bf16_hbm=o[10], index_topk=a.topk, precision="BF16"
        )[:2]
    )
    ours_mx = jax.jit(
        lambda *o: nki.sparse_attention_indexer_mx_bf16score(
            *o[:10], wq_b_scale=o[10], wk_scale=o[11], qr_qtz_hbm=o[12], qr_scale_hbm=o[13], index_topk=a.topk
        )[:2]
    )
    x, wq_b, wk, gamma, beta, wp, cos, sin, _, mask, qr = bf16
    baseline = jax.jit(lambda *o: jnp_indexer(*o, a.heads, a.topk))
    base_args = (x, wq_b, wk, gamma, beta, wp, cos, sin, mask, qr)
    runs = {"bf16": [], "mx": [], "jnp": []}
    for _ in range(3):  # interleave the candidates so that machine load affects them alike
        runs["bf16"] += timed(ours_bf16, bf16, a.repeats)
        runs["mx"] += timed(ours_mx, mx_ops, a.repeats)
        runs["jnp"] += timed(baseline, base_args, a.repeats)
    base = statistics.median(runs["jnp"])
    print(f"S={a.seq} heads={a.heads} head_dim={D} topk={a.topk} dim={DIM} q_lora_rank={Q} (CPU, one run)")
    for name in ("bf16", "mx"):
        print(f"  jax_nkilib ({name} projections) / jnp: {statistics.median(runs[name]) / base:.2f}x")


if __name__ == "__main__":
    main()
