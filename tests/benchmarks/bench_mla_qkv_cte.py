"""Overhead of jitted ``jax_nkilib.nki.mla_qkv_cte_kernel`` (on CPU: its MX reference) against the same absorbed MLA
projections written in ``jnp`` on float32 weights, on this machine.

Run: python tests/benchmarks/bench_mla_qkv_cte.py [--seq 256 --hidden 2048 --heads 16 --repeats 5]

DeepSeek-V3.2's per-head dims (q_lora_rank 1536, kv_lora_rank 512, nope 128, rope 64) with the hidden size scaled
down, batch 1, bfloat16 float operands. Reports the ratio measured in one run (jax_nkilib / jnp) of the median run
time over interleaved repeats. The kernel's reference decodes the packed MX rows, unpacks the fp8 x4 weight words and
broadcasts their block-128 scales on every call, MX-quantizes both matmul inputs and gathers the swizzled columns; the
baseline takes the activation and the (already dequantized, natural-order) weights as float32 arrays.
"""

import argparse
import functools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.mla import _qkv_cte

Q, L, D, R = 1536, 512, 128, 64


def jnp_absorbed(x, w_a, w_b, q_gamma, kv_gamma, wuk, cos, sin, heads):
    """q_lift, q_pe, c_kv, k_pe of the absorbed MLA projections in float32 (natural column order)."""
    rms = lambda t, g: t * jax.lax.rsqrt(jnp.mean(t * t, -1, keepdims=True) + 1e-6) * g.reshape(-1)  # noqa: E731
    fused = x @ w_a
    q = (rms(fused[..., :Q], q_gamma) @ w_b).reshape(*x.shape[:2], heads, D + R)

    def rope(t, c, s):
        even, odd = t[..., 0::2], t[..., 1::2]
        return jnp.stack([even * c - odd * s, even * s + odd * c], -1).reshape(t.shape)

    c, s = cos[..., : R // 2], sin[..., : R // 2]
    q_lift = jnp.einsum("bshd,dhl->bshl", q[..., :D], wuk.reshape(D, heads, L))
    k_pe = rope(fused[..., None, Q + L :], c[:, :, None], s[:, :, None])[:, :, 0]
    return q_lift, rope(q[..., D:], c[:, :, None], s[:, :, None]), rms(fused[..., Q : Q + L], kv_gamma), k_pe


def median_seconds(fn, args, repeats):
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    a = parser.parse_args()
    operands = _qkv_cte(1, a.seq, a.hidden, a.heads, D, R, L, Q, jnp.bfloat16)(np.random.default_rng(0))
    kwargs = dict(n_heads=a.heads, qk_nope_head_dim=D, qk_rope_head_dim=R, kv_lora_rank=L, qk_lora_rank=Q)
    kernel = jax.jit(functools.partial(nki.mla_qkv_cte_kernel, **kwargs))
    rng = np.random.default_rng(1)
    dense = (
        jnp.asarray(rng.standard_normal((1, a.seq, a.hidden)), jnp.float32),
        jnp.asarray(rng.standard_normal((a.hidden, Q + L + R)) * a.hidden**-0.5, jnp.float32),
        jnp.asarray(rng.standard_normal((Q, a.heads * (D + R))) * Q**-0.5, jnp.float32),
    ) + tuple(op.astype(jnp.float32) for op in operands[5:])
    baseline = jax.jit(functools.partial(jnp_absorbed, heads=a.heads))
    ours, theirs = [], []
    for _ in range(3):  # interleaved rounds
        ours.append(median_seconds(kernel, operands, a.repeats))
        theirs.append(median_seconds(baseline, dense, a.repeats))
    ratio = statistics.median(ours) / statistics.median(theirs)
    print(
        f"mla_qkv_cte_kernel reference / jnp absorbed projections (S={a.seq}, H={a.hidden}, N={a.heads}): {ratio:.2f}x"
    )


if __name__ == "__main__":
    main()
