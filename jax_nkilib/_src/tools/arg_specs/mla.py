"""Arg specs of ``mla_sparse_attention_cte_kernel`` and ``jax_nkilib.mla_attention`` (DeepSeek MLA prefill, dense
and with the top-k indexer)."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, angles, drop_last_axis, normal, register

OPERANDS = ("x", "wq_a", "q_norm_weight", "wq_b", "wkv_a", "kv_norm_weight", "wkv_b", "wo", "cos", "sin")


def _mla(b, s, d, h, rq, rkv, dn, dr, dv, indexer=None, dtype=jnp.float32):
    """``mla_attention``'s operands (weights scaled so the logits stay O(1)); ``indexer``: ``(Hi, Di)``."""

    def build(rng):
        w = lambda *shape: normal(rng, shape, dtype, scale=shape[0] ** -0.5)  # noqa: E731
        gain = lambda n: jnp.asarray(1 + 0.1 * rng.standard_normal(n), dtype)  # noqa: E731
        built = (normal(rng, (b, s, d), dtype), w(d, rq), gain(rq), w(rq, h, dn + dr), w(d, rkv + dr), gain(rkv))
        built += (w(rkv, h, dn + dv), w(h, dv, d) / h**0.5, *angles(rng, (s, dr // 2), dtype))
        if indexer:
            hi, di = indexer
            built += ((w(rq, hi, di), w(d, di), w(d, hi)),)
        return built

    return build


def topk_indices(rng, b, s, s_kv, k):
    """``[b, s, k]`` int32 rows of ``[0, s_kv)``, each query's first one causal (``<= s``), repeats allowed."""
    idx = rng.integers(0, s_kv, (b, s, k))
    idx[:, :, 0] = rng.integers(0, np.arange(s) + 1, (b, s))
    return jnp.asarray(idx, jnp.int32)


def _sparse_kernel(b, s, h, latent, r, s_kv, k, dtype=jnp.float32):
    """``mla_sparse_attention_cte_kernel``'s ``q_lift, q_pe, c_kv, k_pe, topk_indices``."""
    return lambda rng: (
        normal(rng, (b, s, h, latent), dtype, scale=latent**-0.25),
        normal(rng, (b, s, h, r), dtype, scale=r**-0.25),
        normal(rng, (b, s_kv, latent), dtype, scale=latent**-0.25),
        normal(rng, (b, s_kv, r), dtype, scale=r**-0.25),
        topk_indices(rng, b, s, s_kv, k),
    )


_SPARSE_OPERANDS = ("q_lift_hbm", "q_pe_hbm", "c_kv_hbm", "k_pe_hbm", "topk_indices_hbm")
_NEURON_DENSE = _mla(1, 128, 256, 4, 128, 128, 64, 64, 64)  # dn + dr = 128: attention_cte's head-dim limit
_DENSE_KERNELS = ("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "attention_cte")
_BATCH_MESH = Sharding(mesh=(("data", 8),), in_specs=(P("data"),) + (P(),) * 9, out_specs=P("data"))

register(
    ArgSpec(
        "mla_sparse_attention_cte_kernel",
        nki.mla_sparse_attention_cte_kernel,
        _SPARSE_OPERANDS,
        _sparse_kernel(8, 5, 2, 8, 4, 7, 3),
        kernels=("mla_sparse_attention_cte_kernel",),
        kwargs={"softmax_scale": 0.5},
        grad=_SPARSE_OPERANDS[:4],
        sharding=Sharding(mesh=(("data", 8),), in_specs=(P("data"),) * 5, out_specs=P("data")),
        neuron=_sparse_kernel(1, 128, 4, 512, 64, 256, 128, jnp.bfloat16),
        bad=BadInput("topk_tiled", lambda _: True, "topk_tiled"),
    ),
    ArgSpec(
        "mla_attention",
        jax_nkilib.mla_attention,
        OPERANDS,
        _mla(8, 5, 12, 2, 8, 6, 4, 4, 6),
        kernels=_DENSE_KERNELS,
        only_kernels=False,
        grad=OPERANDS[:8],
        batch=("x", "wq_b", "wo"),
        sharding=_BATCH_MESH,
        neuron=_NEURON_DENSE,
        bad=BadInput("wq_b", drop_last_axis, "[Rq, H, Dqk]"),
    ),
    ArgSpec(
        "mla_attention.sparse_topk",
        jax_nkilib.mla_attention,
        OPERANDS + ("indexer",),
        _mla(2, 6, 12, 2, 8, 8, 4, 4, 6, indexer=(2, 6)),
        kwargs={"index_topk": 3},
        positional=len(OPERANDS),
        kernels=("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "sparse_attention_indexer_mx_bf16score")
        + ("mla_sparse_attention_cte_kernel",),
        only_kernels=False,
        grad=OPERANDS[:8],
        batch=("x",),
        neuron=_mla(1, 256, 256, 4, 256, 512, 64, 64, 128, indexer=(4, 128), dtype=jnp.bfloat16),
        neuron_kwargs={"index_topk": 128},
        bad=BadInput("index_topk", lambda _: 0, "index_topk"),
    ),
    ArgSpec(
        "mla_attention.realistic",
        jax_nkilib.mla_attention,
        OPERANDS,
        _mla(1, 2048, 7168, 16, 1536, 512, 128, 64, 128, dtype=jnp.bfloat16),
        kernels=("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE"),
        only_kernels=False,
        size="realistic",
        notes="DeepSeek-V3's dims (16 of its 128 heads): dn + dr = 192 exceeds attention_cte's head dim, so its "
        "attention falls back with a NeuronFallbackWarning",
    ),
)
