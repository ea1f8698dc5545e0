"""Arg specs of ``jax_nkilib.mla_attention`` (DeepSeek MLA prefill, dense and with the top-k indexer)."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
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


_NEURON_DENSE = _mla(1, 128, 256, 4, 128, 128, 64, 64, 64)  # dn + dr = 128: attention_cte's head-dim limit
_DENSE_KERNELS = ("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "attention_cte")
_BATCH_MESH = Sharding(mesh=(("data", 8),), in_specs=(P("data"),) + (P(),) * 9, out_specs=P("data"))

register(
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
        _mla(2, 6, 12, 2, 8, 6, 4, 4, 6, indexer=(2, 6)),
        kwargs={"index_topk": 3},
        positional=len(OPERANDS),
        kernels=("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "RoPE", "layernorm_tkg", "RoPE"),
        only_kernels=False,
        grad=OPERANDS[:8],
        batch=("x",),
        neuron=_mla(1, 128, 256, 4, 128, 128, 64, 64, 64, indexer=(4, 128)),
        neuron_fallback="mla_sparse_attention_cte_kernel",
        bad=BadInput("index_topk", lambda _: 0, "index_topk"),
    ),
    ArgSpec(
        "mla_attention.realistic",
        jax_nkilib.mla_attention,
        OPERANDS,
        _mla(1, 2048, 7168, 16, 1536, 512, 128, 64, 128, dtype=jnp.bfloat16),
        kernels=("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "attention_cte"),
        only_kernels=False,
        size="realistic",
        notes="DeepSeek-V3's dims (16 of its 128 heads): dn + dr = 192 exceeds attention_cte's head dim, so its "
        "attention falls back with a NeuronFallbackWarning",
    ),
)
