"""``jax_nkilib.mla_attention``: DeepSeek-V3 multi-head latent attention (MLA) for prefill, with the optional
DeepSeek-V3.2 sparse top-k indexer, in JAX layouts and bfloat16/float32 weights.

Math (``H`` heads, ``dn``/``dr`` the non-rotary/rotary query-key dims, ``dv`` the value dim, ``Rq``/``Rkv`` the
query/KV latent ranks)::

    q       = rms_norm(x @ wq_a, q_norm_weight) @ wq_b           # [B, S, H, dn + dr]
    q_nope, q_pe = q[..., :dn], rope(q[..., dn:])
    c_kv    = rms_norm((x @ wkv_a)[..., :Rkv], kv_norm_weight)    # [B, S, Rkv]   the latent KV
    k_pe    = rope((x @ wkv_a)[..., Rkv:])                        # [B, S, dr]    shared by every head
    k_nope, v = split(c_kv @ wkv_b, [dn, dv])                     # [B, S, H, dn], [B, S, H, dv]
    p       = softmax(scale * (q_nope . k_nope + q_pe . k_pe) + mask)      # causal (and the indexer's top-k)
    out     = (p @ v) @ wo                                        # [B, S, D]

The indexer (``indexer=(index_wq, index_wk, index_weights)``, ``index_topk=k``) scores key ``t`` for query ``s`` as
``sum_h w[s, h] * relu(qi[s, h] . ki[t])`` with ``qi = rope_last_dr(rms_norm(x @ wq_a, q_norm_weight) @ index_wq)``,
``ki = rope_last_dr(layer_norm(x @ index_wk))`` (no affine, eps 1e-6) and ``w = (x @ index_weights) / sqrt(Hi * di)``;
query ``s`` then attends only to the ``k`` best-scoring causal keys (all of them when ``s < k``; ties: the lower
position). The selection is not differentiable (DeepSeek trains the indexer by a separate loss): gradients flow
through the attention over the selected keys.

Kernels: the latent norms are ``rmsnorm_tkg`` (:func:`jax_nkilib.rms_norm`), the rotations ``RoPE``
(:func:`jax_nkilib.rope`). Dense causal attention is ``attention_cte`` (:func:`jax_nkilib.attention`, values
zero-padded from ``dv`` to ``dn + dr``, which leaves the result exact) where ``dn + dr <= 128``, else its reference
with a ``NeuronFallbackWarning``. The sparse path is ``mla_sparse_attention_cte_kernel`` in DeepSeek's absorbed form
(``q_lift = q_nope W_uk`` per head, attention over the latent ``c_kv`` and ``k_pe``, then ``W_uv``), one call per
sequence (the kernel takes ``B == 1``; a batch is a loop of calls), its other limits or fallback as the kernel's; a
``kv_lora_rank`` that is not a multiple of 4 runs as JAX with a ``NeuronFallbackWarning``. The indexer is
``sparse_attention_indexer_mx_bf16score`` (BF16 projections, :mod:`.mla_indexer`) where its inputs fit the kernel
(bfloat16, indexer heads of 128, hidden and q_lora_rank multiples of 128, hidden >= 1024,
``min(index_topk, S) % 16 == 0``, one rotary table), else XLA. The projections are XLA: the NKI MLA projection
kernels (``qkv_mla_mx``, ``mla_qkv_cte_kernel``, ``mla_vupmx_oproj_cte_kernel``, bound in :mod:`jax_nkilib.nki`) take
MXFP8 weights (fp8x4 words with block-128 scales) and MX-quantize their activations, so this float-weight op would
change its numerics by calling them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..attention.mla_sparse_attention_cte import H_PACK, from_mx_pack_columns, mla_sparse_attention_cte_kernel
from ..framework.validation import check_operand_layouts, static_bool, static_float, static_int
from ..neuron.reference_only import reference_only
from ..sharding import auto
from . import mla_indexer
from .attention import attention
from .norm import layer_norm, rms_norm
from .rope import rope

WHERE = "jax_nkilib.mla_attention"
LAYOUTS = {
    "x": "B, S, D",
    "wq_a": "D, Rq",
    "q_norm_weight": "Rq",
    "wq_b": "Rq, H, Dqk",
    "wkv_a": "D, Rkvr",
    "kv_norm_weight": "Rkv",
    "wkv_b": "Rkv, H, Dkv",
    "wo": "H, Dv, D",
    "cos": ("S, R2", "B, S, R2"),
    "sin": ("S, R2", "B, S, R2"),
}
INDEXER_LAYOUTS = {"index_wq": "Rq, Hi, Di", "index_wk": "D, Di", "index_weights": "D, Hi"}

MLA_SHARDING = auto.register_rule(
    auto.ShardingRule(
        WHERE,
        free={"b": "batch"},
        note="the sequence, the heads and the weights are replicated (the heads meet in the output projection)",
    )
)


def _dims(x, wq_a, q_norm_weight, wq_b, wkv_a, kv_norm_weight, wkv_b, wo, cos, sin, indexer):
    """Check the operands' layouts; return ``(dn, dr, dv)`` and the indexer's ``(Hi, Di)`` (or ``None``)."""
    dims = check_operand_layouts(
        WHERE,
        LAYOUTS,
        positive=("B", "S", "D", "H", "Rq", "Rkv"),
        x=x,
        wq_a=wq_a,
        q_norm_weight=q_norm_weight,
        wq_b=wq_b,
        wkv_a=wkv_a,
        kv_norm_weight=kv_norm_weight,
        wkv_b=wkv_b,
        wo=wo,
        cos=cos,
        sin=sin,
    )
    dr = dims["Rkvr"] - dims["Rkv"]
    if dr <= 0 or dr != 2 * dims["R2"]:
        raise ValueError(
            f"{WHERE}: `wkv_a` must have layout [D, Rkv + dr] with dr = 2 * cos.shape[-1] = {2 * dims['R2']} "
            f"rotary dims after the Rkv={dims['Rkv']} latent columns; got shape {tuple(wkv_a.shape)}"
        )
    dn, dv = dims["Dqk"] - dr, dims["Dv"]
    if dn <= 0:
        raise ValueError(
            f"{WHERE}: `wq_b` must have layout [Rq, H, dn + dr] with dn >= 1 and dr={dr}; got shape {tuple(wq_b.shape)}"
        )
    if dims["Dkv"] != dn + dv:
        raise ValueError(
            f"{WHERE}: `wkv_b` must have layout [Rkv, H, dn + dv] = [{dims['Rkv']}, {dims['H']}, {dn + dv}] "
            f"(dn={dn} from `wq_b`, dv={dv} from `wo`); got shape {tuple(wkv_b.shape)}"
        )
    if cos.shape != sin.shape:
        raise ValueError(f"{WHERE}: `cos` and `sin` must have the same shape; got {cos.shape} and {sin.shape}")
    if cos.ndim == 3 and cos.shape[0] not in (1, dims["B"]):
        raise ValueError(f"{WHERE}: `cos` [B, S, dr/2] must have batch 1 or {dims['B']}; got shape {cos.shape}")
    if indexer is None:
        return (dn, dr, dv), None
    if not isinstance(indexer, (tuple, list)) or len(indexer) != 3:
        raise TypeError(f"{WHERE}: `indexer` must be a tuple (index_wq, index_wk, index_weights); got {indexer!r}")
    index = check_operand_layouts(
        WHERE,
        INDEXER_LAYOUTS,
        positive=("Hi",),
        known={"Rq": dims["Rq"], "D": dims["D"]},
        **dict(zip(INDEXER_LAYOUTS, indexer)),
    )
    if index["Di"] < dr:
        raise ValueError(
            f"{WHERE}: `index_wq` [Rq, Hi, Di] needs Di >= dr={dr} (the indexer rotates its last dr dims); got "
            f"Di={index['Di']}"
        )
    return (dn, dr, dv), (index["Hi"], index["Di"])


def _rope_tail(t, cos, sin, dr, interleaved):
    """``t [B, S, N, d]`` with its last ``dr`` dims rotated."""
    return jnp.concatenate([t[..., :-dr], rope(t[..., -dr:], cos, sin, interleaved=interleaved)], axis=-1)


def _indexer_topk(x, q_latent, indexer, topk, cos, sin, dr, interleaved):
    """``[B, S, min(topk, S)]`` int32: each query's best causal keys by the indexer's score, best first (ties: the
    lower position), padded with later positions where fewer are causal (masked by the attention). Not
    differentiable."""
    if mla_indexer.fits(x, q_latent, indexer[0], cos, topk):
        return mla_indexer.kernel_indexer_topk(x, q_latent, indexer, topk, cos, sin, dr, interleaved)
    index_wq, index_wk, index_weights = (jax.lax.stop_gradient(w) for w in indexer)
    x, q_latent = jax.lax.stop_gradient(x), jax.lax.stop_gradient(q_latent)
    heads, head_dim = index_wq.shape[1:]
    qi = _rope_tail(jnp.einsum("bsr,rhd->bshd", q_latent, index_wq), cos, sin, dr, interleaved)
    ki = _rope_tail(layer_norm(x @ index_wk)[:, :, None, :], cos, sin, dr, interleaved)[:, :, 0]
    accumulate = jnp.promote_types(x.dtype, jnp.float32)
    weights = (x @ index_weights).astype(accumulate) / math.sqrt(heads * head_dim)
    logits = jnp.einsum("bshd,btd->bsht", qi, ki, preferred_element_type=accumulate)
    score = jnp.einsum("bsht,bsh->bst", jax.nn.relu(logits), weights)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    score = jnp.where(causal, score, -jnp.inf)
    return jax.lax.top_k(score, min(topk, seq))[1].astype(jnp.int32)


def _indexer_selection(x, q_latent, indexer, topk, cos, sin, dr, interleaved):
    """``[B, S, S]`` bool: the causal keys :func:`_indexer_topk` picks for each query."""
    chosen = _indexer_topk(x, q_latent, indexer, topk, cos, sin, dr, interleaved)
    seq = x.shape[1]
    causal = jnp.tril(jnp.ones((seq, seq), bool))
    picked = jnp.zeros((x.shape[0], seq, seq), bool)
    picked = jax.vmap(jax.vmap(lambda row, idx: row.at[idx].set(True)))(picked, chosen)
    return picked & causal


def _masked_attention(q, k, v, allowed, scale):
    """``softmax(scale q k^T | allowed) v`` with float32 statistics; ``q, k [B, S, H, d]``, ``v [B, S, H, dv]``."""
    accumulate = jnp.promote_types(q.dtype, jnp.float32)
    logits = jnp.einsum("bshd,bthd->bhst", q, k, preferred_element_type=accumulate) * scale
    logits = jnp.where(allowed[:, None], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1)
    return jnp.einsum("bhst,bthd->bshd", probs.astype(v.dtype), v, preferred_element_type=accumulate).astype(v.dtype)


def mla_attention(
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
    index_topk: int | None = None,
    softmax_scale: float | None = None,
    eps: float = 1e-6,
    interleaved: bool = False,
):
    """DeepSeek-V3 MLA prefill (causal self-attention over ``x``'s sequence); see the module docstring for the math.

    Args:
      x: ``[B, S, D]`` hidden states (bfloat16, float32 or float64).
      wq_a: ``[D, Rq]``; q_norm_weight: ``[Rq]``; wq_b: ``[Rq, H, dn + dr]`` (each head's non-rotary dims first).
      wkv_a: ``[D, Rkv + dr]`` (the latent, then the shared rotary key); kv_norm_weight: ``[Rkv]``;
      wkv_b: ``[Rkv, H, dn + dv]`` (each head's ``k_nope`` then ``v``); wo: ``[H, dv, D]``.
      cos, sin: ``[S, dr/2]`` or ``[B, S, dr/2]`` rotary tables (:func:`jax_nkilib.rope`'s); ``interleaved`` picks
        neighbour pairs (the original DeepSeek checkpoints) instead of halves (HF's permuted weights).
      indexer: optional ``(index_wq [Rq, Hi, Di], index_wk [D, Di], index_weights [D, Hi])``, with
        ``index_topk`` (a static int >= 1): each query attends to its ``index_topk`` best causal keys only.
      softmax_scale: defaults to ``1/sqrt(dn + dr)``; eps: the RMSNorms' epsilon.

    Returns ``[B, S, D]`` in ``x``'s dtype. Differentiable in ``x`` and every weight (the indexer's selection is
    not). All operands share ``x``'s dtype; matmuls accumulate in float32 (float64 for float64 inputs).
    """
    (dn, dr, dv), _ = _dims(x, wq_a, q_norm_weight, wq_b, wkv_a, kv_norm_weight, wkv_b, wo, cos, sin, indexer)
    if (indexer is None) != (index_topk is None):
        raise ValueError(f"{WHERE}: `indexer` and `index_topk` go together; got only one of them")
    if index_topk is not None:
        index_topk = static_int(WHERE, "index_topk", index_topk, minimum=1)
    interleaved = static_bool(WHERE, "interleaved", interleaved)
    eps = static_float(WHERE, "eps", eps, minimum=0.0)
    scale = 1.0 / math.sqrt(dn + dr) if softmax_scale is None else static_float(WHERE, "softmax_scale", softmax_scale)
    weights = (wq_a, q_norm_weight, wq_b, wkv_a, kv_norm_weight, wkv_b, wo)
    dtypes = {jnp.result_type(a) for a in (x, *weights, cos, sin, *(indexer or ()))}
    if len(dtypes) > 1:
        raise TypeError(f"{WHERE}: every operand must have `x`'s dtype {x.dtype}; got {sorted(map(str, dtypes))}")
    table = "s_" if cos.ndim == 2 else ("_" if cos.shape[0] == 1 else "b") + "s_"
    operands = [auto.ShardedArgument("x", x, "bs_")]
    operands += [auto.ShardedArgument(f"w{i}", w, "_" * w.ndim) for i, w in enumerate(weights)]
    operands += [auto.ShardedArgument("cos", cos, table), auto.ShardedArgument("sin", sin, table)]
    if indexer is not None:
        operands.append(auto.ShardedArgument("indexer", tuple(indexer), tuple("_" * w.ndim for w in indexer)))
    sharded = auto.plan(MLA_SHARDING, operands)
    options = dict(index_topk=index_topk, softmax_scale=scale, eps=eps, interleaved=interleaved)
    if sharded:
        return sharded.run(
            lambda x, *rest, axes: mla_attention(x, *rest[:9], indexer=rest[9] if len(rest) > 9 else None, **options),
            "bs_",
        )
    return _mla(x, weights, cos, sin, indexer, dn, dr, dv, **options)


def _mla(x, weights, cos, sin, indexer, dn, dr, dv, *, index_topk, softmax_scale, eps, interleaved):
    """The checked, unsharded computation."""
    wq_a, q_norm_weight, wq_b, wkv_a, kv_norm_weight, wkv_b, wo = weights
    rkv = kv_norm_weight.shape[0]
    if cos.ndim == 3 and cos.shape[0] == 1:
        cos, sin = cos[0], sin[0]
    q_latent = rms_norm(x @ wq_a, q_norm_weight, eps=eps)
    q = _rope_tail(jnp.einsum("bsr,rhd->bshd", q_latent, wq_b), cos, sin, dr, interleaved)
    kv_a = x @ wkv_a
    c_kv = rms_norm(kv_a[..., :rkv], kv_norm_weight, eps=eps)
    k_pe = rope(kv_a[..., None, rkv:], cos, sin, interleaved=interleaved)  # [B, S, 1, dr]
    kv = jnp.einsum("bsr,rhd->bshd", c_kv, wkv_b)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (*k_nope.shape[:-1], dr))], axis=-1)
    if indexer is None:
        v_padded = jnp.pad(v, [(0, 0)] * 3 + [(0, dn + dr - dv)]) if dv < dn + dr else v
        if dv <= dn + dr:
            out = attention(q, k, v_padded, causal=True, scale=softmax_scale)[..., :dv]
        else:  # values wider than queries and keys: no attention kernel shape fits
            seq = x.shape[1]
            causal = jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), bool)), (x.shape[0], seq, seq))
            out = reference_only(
                _masked_attention(q, k, v, causal, softmax_scale),
                op=WHERE,
                reasons=(f"value head dim dv={dv} exceeds the query/key head dim {dn + dr}",),
            )
    elif rkv % H_PACK:  # the kernel's output packs the latent in groups of 4
        allowed = _indexer_selection(x, q_latent, indexer, index_topk, cos, sin, dr, interleaved)
        reason = f"kv_lora_rank={rkv} is not a multiple of {H_PACK} (mla_sparse_attention_cte_kernel's MX 4-pack)"
        out = reference_only(_masked_attention(q, k, v, allowed, softmax_scale), op=WHERE, reasons=(reason,))
    else:
        chosen = _indexer_topk(x, q_latent, indexer, index_topk, cos, sin, dr, interleaved)
        w_uk, w_uv = wkv_b[..., :dn], wkv_b[..., dn:]
        q_lift = jnp.einsum("bshn,rhn->bshr", q[..., :dn], w_uk)  # the absorbed query: q_nope . k_nope = q_lift . c_kv
        one_sequence = lambda *a: mla_sparse_attention_cte_kernel(  # noqa: E731  (the kernel takes B == 1)
            *(t[None] for t in a), softmax_scale=softmax_scale
        )[0]
        packed = jax.vmap(one_sequence)(q_lift, q[..., dn:], c_kv, k_pe[:, :, 0], chosen)
        out = jnp.einsum("bshr,rhv->bshv", from_mx_pack_columns(packed, q.shape[2]), w_uv)
    return jnp.einsum("bshv,hvd->bsd", out, wo)
