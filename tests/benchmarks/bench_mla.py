"""Overhead of jitted `jax_nkilib.mla_attention` against a hand-written `jnp` DeepSeek MLA on this machine (CPU).

Run: python tests/benchmarks/bench_mla.py [--seq 512 --heads 8 --topk 128 --repeats 10]

DeepSeek-V3's per-head dims (hidden 7168 scaled down to 1024, q_lora_rank 1536 -> 384, kv_lora_rank 512,
dn 128, dr 64, dv 128), float32, batch 1. Reports ratios measured in one run (jax_nkilib / jnp): the median forward
and forward+backward run time over interleaved repeats, dense causal and with the top-k indexer. On CPU
jax_nkilib runs its kernels' references: the dense attention is attention_cte's blockwise reference (the score matrix
is never formed), the sparse path gathers each query's top-k latent rows (mla_sparse_attention_cte_kernel's
reference), while the jnp baseline forms the full [S, S] scores and masks them.
"""

import argparse
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nkilib

D, RQ, RKV, DN, DR, DV, HI, DI = 1024, 384, 512, 128, 64, 128, 8, 128


def rms(x, w, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rope_halves(t, cos, sin):
    half = t.shape[-1] // 2
    c, s = cos[:, None, :], sin[:, None, :]
    a, b = t[..., :half], t[..., half:]
    return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def jnp_mla(x, wq_a, qn, wq_b, wkv_a, kvn, wkv_b, wo, cos, sin, indexer=None, topk=None):
    """The usual un-absorbed MLA in jnp (HF modeling_deepseek's order), the indexer as a [S, S] mask."""
    seq = x.shape[1]
    q_latent = rms(x @ wq_a, qn)
    q = jnp.einsum("bsr,rhd->bshd", q_latent, wq_b)
    q = jnp.concatenate([q[..., :DN], jax.vmap(rope_halves, (0, None, None))(q[..., DN:], cos, sin)], axis=-1)
    kv_a = x @ wkv_a
    c_kv = rms(kv_a[..., :RKV], kvn)
    k_pe = jax.vmap(rope_halves, (0, None, None))(kv_a[..., None, RKV:], cos, sin)
    kv = jnp.einsum("bsr,rhd->bshd", c_kv, wkv_b)
    k = jnp.concatenate([kv[..., :DN], jnp.broadcast_to(k_pe, kv[..., :DN].shape[:-1] + (DR,))], axis=-1)
    logits = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(DN + DR)
    allowed = jnp.tril(jnp.ones((seq, seq), bool))[None]
    if indexer is not None:
        iq, ik, iw = (jax.lax.stop_gradient(w) for w in indexer)
        qi = jnp.einsum("bsr,rhd->bshd", jax.lax.stop_gradient(q_latent), iq)
        qi = jnp.concatenate([qi[..., :-DR], jax.vmap(rope_halves, (0, None, None))(qi[..., -DR:], cos, sin)], -1)
        kx = jax.lax.stop_gradient(x) @ ik
        kx = (kx - kx.mean(-1, keepdims=True)) * jax.lax.rsqrt(kx.var(-1, keepdims=True) + 1e-6)
        ki = jnp.concatenate(
            [kx[..., :-DR], jax.vmap(rope_halves, (0, None, None))(kx[:, :, None, -DR:], cos, sin)[:, :, 0]], -1
        )
        w = (jax.lax.stop_gradient(x) @ iw) / math.sqrt(HI * DI)
        score = jnp.einsum("bsh,bsht->bst", w, jax.nn.relu(jnp.einsum("bshd,btd->bsht", qi, ki)))
        score = jnp.where(allowed, score, -jnp.inf)
        threshold = jax.lax.top_k(score, min(topk, seq))[0][..., -1:]
        allowed = allowed & (score >= threshold)
    logits = jnp.where(allowed[:, None], logits, -jnp.inf)
    out = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(logits, axis=-1), kv[..., DN:])
    return jnp.einsum("bshv,hvd->bsd", out, wo)


def operands(seq, heads, key=0):
    rng = np.random.default_rng(key)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)  # noqa: E731
    theta = np.arange(seq)[:, None] * 10000.0 ** (-np.arange(0, DR, 2) / DR)
    args = (jnp.asarray(rng.standard_normal((1, seq, D)), jnp.float32), w(D, RQ), jnp.ones(RQ), w(RQ, heads, DN + DR))
    args += (w(D, RKV + DR), jnp.ones(RKV), w(RKV, heads, DN + DV), w(heads, DV, D))
    args += (jnp.asarray(np.cos(theta), jnp.float32), jnp.asarray(np.sin(theta), jnp.float32))
    return args, (w(RQ, HI, DI), w(D, DI), w(D, HI))


def median_ratio(ours, theirs, args, repeats):
    for fn in (ours, theirs):
        jax.block_until_ready(fn(*args))
    times = ([], [])
    for i in range(repeats):
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for which in order:
            start = time.perf_counter()
            jax.block_until_ready((ours, theirs)[which](*args))
            times[which].append(time.perf_counter() - start)
    return statistics.median(times[0]) / statistics.median(times[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    a = parser.parse_args()
    args, indexer = operands(a.seq, a.heads)
    for name, extra in (("dense", {}), (f"top-{a.topk}", {"indexer": indexer, "topk": a.topk})):
        kwargs = {"indexer": extra["indexer"], "index_topk": extra["topk"]} if extra else {}
        ours = lambda *x, kw=kwargs: jax_nkilib.mla_attention(*x, **kw)  # noqa: E731
        theirs = lambda *x, e=extra: jnp_mla(*x, **e)  # noqa: E731
        forward = median_ratio(jax.jit(ours), jax.jit(theirs), args, a.repeats)
        grad = lambda f: jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) ** 2), argnums=(0, 3, 6, 7)))  # noqa: E731
        backward = median_ratio(grad(ours), grad(theirs), args, a.repeats)
        print(
            f"mla_attention {name:>9} S={a.seq} H={a.heads}: forward x{forward:.2f}, "
            f"forward+backward x{backward:.2f} (jax_nkilib / jnp)"
        )


if __name__ == "__main__":
    main()
