"""Float64 NumPy oracle of DeepSeek-V3 multi-head latent attention (prefill) and the V3.2 top-k indexer, written
from the DeepSeek-V3 paper / HF ``modeling_deepseek`` semantics: un-absorbed per-head keys and values, RoPE on the
decoupled ``q_pe``/``k_pe`` (the shared ``k_pe`` broadcast to every head), causal softmax attention, and for the
indexer ``score[s, t] = sum_h w[s, h] relu(q_idx[s, h] . k_idx[t])`` keeping each query's top-k causal keys."""

import numpy as np


def rms_norm(x, weight, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def layer_norm(x, eps=1e-6):
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt(np.mean(centered**2, axis=-1, keepdims=True) + eps)


def rotate(t, cos, sin, interleaved):
    """``t [B, S, N, dr]`` rotated by angle tables ``[S, dr/2]`` or ``[B|1, S, dr/2]``: pair ``(a, b)`` ->
    ``(a cos - b sin, b cos + a sin)``; pairs are halves, or neighbours when ``interleaved``."""
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    if interleaved:
        a, b = t[..., 0::2], t[..., 1::2]
        out = np.empty_like(t)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, b * cos + a * sin
        return out
    half = t.shape[-1] // 2
    a, b = t[..., :half], t[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def indexer_keep(x, q_latent, index_wq, index_wk, index_weights, topk, cos, sin, dr, interleaved):
    """``[B, S, S]`` bool: the ``topk`` best-scoring causal keys of each query (all when fewer are causal)."""
    batch, seq, _ = x.shape
    heads, head_dim = index_wq.shape[1:]
    qi = np.einsum("bsr,rhd->bshd", q_latent, index_wq)
    qi[..., -dr:] = rotate(qi[..., -dr:], cos, sin, interleaved)
    ki = layer_norm(x @ index_wk)[:, :, None, :]
    ki[..., -dr:] = rotate(ki[..., -dr:], cos, sin, interleaved)
    w = (x @ index_weights) / np.sqrt(heads * head_dim)
    keep = np.zeros((batch, seq, seq), bool)
    for b in range(batch):
        for s in range(seq):
            scores = [sum(w[b, s, h] * max(qi[b, s, h] @ ki[b, t, 0], 0.0) for h in range(heads)) for t in range(s + 1)]
            order = sorted(range(s + 1), key=lambda t: (-scores[t], t))
            keep[b, s, order[:topk]] = True
    return keep


def mla(
    x,
    wq_a,
    q_norm_weight,
    wq_b,
    wkv_a,
    kv_norm_weight,
    wkv_b,
    wo,
    cos,
    sin,
    *,
    indexer=None,
    topk=None,
    scale=None,
    eps=1e-6,
    interleaved=False,
):
    """DeepSeek MLA prefill in float64: ``[B, S, D]``."""
    x, wq_a, q_norm_weight, wq_b, wkv_a, kv_norm_weight, wkv_b, wo, cos, sin = (
        np.asarray(a, np.float64) for a in (x, wq_a, q_norm_weight, wq_b, wkv_a, kv_norm_weight, wkv_b, wo, cos, sin)
    )
    batch, seq, _ = x.shape
    rkv, heads, dv = kv_norm_weight.shape[0], wo.shape[0], wo.shape[1]
    dr = wkv_a.shape[1] - rkv
    dn = wq_b.shape[2] - dr
    scale = 1 / np.sqrt(dn + dr) if scale is None else scale
    q_latent = rms_norm(x @ wq_a, q_norm_weight, eps)
    q = np.einsum("bsr,rhd->bshd", q_latent, wq_b)
    q_nope, q_pe = q[..., :dn], rotate(q[..., dn:], cos, sin, interleaved)
    kv_a = x @ wkv_a
    c_kv = rms_norm(kv_a[..., :rkv], kv_norm_weight, eps)
    k_pe = rotate(kv_a[:, :, None, rkv:], cos, sin, interleaved)[:, :, 0]
    kv = np.einsum("bsr,rhd->bshd", c_kv, wkv_b)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    keep = np.tril(np.ones((seq, seq), bool))[None].repeat(batch, 0)
    if indexer is not None:
        keep = indexer_keep(x, q_latent, *(np.asarray(w, np.float64) for w in indexer), topk, cos, sin, dr, interleaved)
    out = np.zeros((batch, seq, heads, dv))
    for b in range(batch):
        for h in range(heads):
            logits = (q_nope[b, :, h] @ k_nope[b, :, h].T + q_pe[b, :, h] @ k_pe[b].T) * scale
            logits = np.where(keep[b], logits, -np.inf)
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            out[b, :, h] = (p / p.sum(axis=-1, keepdims=True)) @ v[b, :, h]
    return np.einsum("bshv,hvd->bsd", out, wo)


def sparse_latent_attention(q_lift, q_pe, c_kv, k_pe, idx, scale):
    """``mla_sparse_attention_cte_kernel`` in float64: ``[B, S, H * L]``, each head's latent ``l = 4 g + u`` at
    column ``u * L/4 + g``; query ``s`` attends its gathered rows ``idx[b, s]`` that are ``<= s``."""
    q_lift, q_pe, c_kv, k_pe = (np.asarray(a, np.float64) for a in (q_lift, q_pe, c_kv, k_pe))
    batch, seq, heads, latent = q_lift.shape
    out = np.zeros((batch, seq, heads * latent))
    for b in range(batch):
        for s in range(seq):
            rows = [j for j in np.asarray(idx[b, s]) if j <= s]
            for h in range(heads):
                logits = np.array([(q_lift[b, s, h] @ c_kv[b, j] + q_pe[b, s, h] @ k_pe[b, j]) * scale for j in rows])
                p = np.exp(logits - logits.max())
                natural = (p / p.sum()) @ c_kv[b, rows]
                for l_index in range(latent):
                    group, sub = divmod(l_index, 4)
                    out[b, s, h * latent + sub * (latent // 4) + group] = natural[l_index]
    return out
