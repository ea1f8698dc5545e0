"""Overhead of jitted `jax_nkilib.nki.qkv_mla_mx` / `qkv_mla_mx_deepseek_v4` against a plain `jnp` MLA projection
with the same weights already decoded to float32, on this machine (CPU).

Run: python tests/benchmarks/bench_qkv_mla_mx.py [--seq 512 --hidden 2048 --heads 8 --repeats 10]

DeepSeek-like dims scaled down (q_lora_rank 512, kv_lora_rank 512, dn 128, dr 64, dv 128; v4: head_dim 192),
bfloat16 inputs, batch 1. Reports ratios measured in one run (jax_nkilib / jnp): the median forward time over
interleaved repeats. Off Neuron, jax_nkilib runs the kernels' references, which decode the x4 weight words and
compact scales on every call and MX-quantize each matmul's activations (the kernels' datapath); the baseline does
neither (float weights, unquantized activations), so the ratio is the price of replaying the MX numerics.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.qkv_mla import mx_weight

QR, KVR, DN, DR, DV, HEAD_DIM = 512, 512, 128, 64, 128, 192


def decode(words, scales):
    """float32 [K, N] of x4 words [K/4, N] and compact block-128 scales (NumPy, outside the timed region)."""
    codes = np.asarray(words).view(np.uint8).reshape(words.shape[0], words.shape[1], 4)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32).transpose(0, 2, 1).reshape(-1, words.shape[1])
    s = np.asarray(scales).astype(np.float32) - 127
    full = np.repeat(np.repeat(s, 128, axis=0), 128, axis=1)[: values.shape[0], : values.shape[1]]
    return jnp.asarray(values * 2.0**full)


def rms(x, gamma, eps=1e-6):
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return x if gamma is None else x * gamma


def rope_tail(t, cos, sin, rope):
    half = rope // 2
    a, b = t[..., -rope:-half], t[..., -half:]
    c, s = cos[..., :half], sin[..., :half]
    return jnp.concatenate([t[..., :-rope], a * c - b * s, a * s + b * c], axis=-1)


def unswizzle(t):
    *lead, d = t.shape
    return jnp.moveaxis(t.reshape(*lead, 4, d // 512, 128), -3, -1).reshape(*lead, d)


def jnp_v32(x, wa, wqb, gq, wkvb, gkv, cos, sin, heads):
    x = unswizzle(x.astype(jnp.float32))
    a = x @ wa
    q = (rms(unswizzle(a[..., :QR]), gq[0]) @ wqb).reshape(*x.shape[:2], heads, DN + DR)
    q = rope_tail(q, cos[:, :, None], sin[:, :, None], DR)
    kv = (rms(unswizzle(a[..., QR : QR + KVR]), gkv[0]) @ wkvb).reshape(*x.shape[:2], heads, DN + DV)
    k_pe = rope_tail(a[..., QR + KVR :], cos, sin, DR)[:, :, None]
    k = jnp.concatenate([kv[..., :DN], jnp.broadcast_to(k_pe, (*kv.shape[:3], DR))], axis=-1)
    return tuple(o.astype(jnp.bfloat16) for o in (q, k, kv[..., DN:]))


def jnp_v4(x, w, wqb, gq, gkv, cos, sin, heads):
    x = unswizzle(x.astype(jnp.float32))
    a = x @ w
    q = (rms(unswizzle(a[..., :QR]), gq[0]) @ wqb).reshape(*x.shape[:2], heads, HEAD_DIM)
    q = rope_tail(rms(q, None), cos[:, :, None], sin[:, :, None], DR)
    kv = rope_tail(rms(a[..., QR:], gkv[0]), cos, sin, DR)
    return q.astype(jnp.bfloat16), kv.astype(jnp.bfloat16)


def median_ratio(ours, theirs, args_ours, args_theirs, repeats):
    for fn, args in ((ours, args_ours), (theirs, args_theirs)):
        jax.block_until_ready(fn(*args))
    times = {0: [], 1: []}
    for _ in range(repeats):
        for i, (fn, args) in enumerate(((ours, args_ours), (theirs, args_theirs))):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]) / statistics.median(times[1])


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    rng = np.random.default_rng(0)
    bf16 = jnp.bfloat16
    x = jnp.asarray(rng.standard_normal((1, a.seq, a.hidden)), bf16)
    theta = rng.uniform(-np.pi, np.pi, (1, a.seq, DR))
    cos, sin = jnp.asarray(np.cos(theta), bf16), jnp.asarray(np.sin(theta), bf16)
    gain = lambda n: jnp.asarray(1 + 0.1 * rng.standard_normal((1, n)), bf16)  # noqa: E731

    wa, wqb, wkvb = (
        mx_weight(rng, a.hidden, QR + KVR + DR),
        mx_weight(rng, QR, a.heads * (DN + DR)),
        mx_weight(rng, KVR, a.heads * (DN + DV)),
    )
    gq, gkv = gain(QR), gain(KVR)
    kw = dict(n_heads=a.heads, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV, kv_lora_rank=KVR)
    ours = jax.jit(lambda *args: nki.qkv_mla_mx(*args, **kw, qk_lora_rank=QR))
    theirs = jax.jit(lambda *args: jnp_v32(*args, heads=a.heads))
    ratio = median_ratio(
        ours,
        theirs,
        (x, *wa, *wqb, gq, *wkvb, gkv, cos, sin),
        (x, decode(*wa), decode(*wqb), gq, decode(*wkvb), gkv, cos, sin),
        a.repeats,
    )
    print(f"qkv_mla_mx             S={a.seq} H={a.hidden} heads={a.heads}: jax_nkilib / jnp = {ratio:.2f}")

    w, wqb4 = mx_weight(rng, a.hidden, QR + KVR + DR), mx_weight(rng, QR, a.heads * HEAD_DIM)
    gkv4 = gain(KVR + DR)
    kw4 = dict(n_heads=a.heads, head_dim=HEAD_DIM, qk_rope_head_dim=DR, kv_lora_rank=KVR, qk_lora_rank=QR)
    ours4 = jax.jit(lambda *args: nki.qkv_mla_mx_deepseek_v4(*args, **kw4))
    theirs4 = jax.jit(lambda *args: jnp_v4(*args, heads=a.heads))
    ratio4 = median_ratio(
        ours4,
        theirs4,
        (x, *w, *wqb4, gq, gkv4, cos, sin),
        (x, decode(*w), decode(*wqb4), gq, gkv4, cos, sin),
        a.repeats,
    )
    print(f"qkv_mla_mx_deepseek_v4 S={a.seq} H={a.hidden} heads={a.heads}: jax_nkilib / jnp = {ratio4:.2f}")


if __name__ == "__main__":
    main()
