"""Arg specs of ``mla_qkv_cte_kernel``, ``mla_sparse_attention_cte_kernel``, ``mla_vupmx_oproj_cte_kernel`` and
``jax_nkilib.mla_attention`` (DeepSeek MLA prefill, dense and with the top-k indexer)."""

import jax.numpy as jnp
import ml_dtypes
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


def _qkv_cte(b, s, hidden, heads, nope, rope, latent, q_rank, dtype=jnp.float32):
    """``mla_qkv_cte_kernel``'s operands: packed MX rows (fp8 elements of normal draws, scale bytes 120, the rest of
    the scale region 0), fp8 x4 weight words of normal draws with compact scales 120, float gains, W_uk and angles."""

    def fp8_codes(rng, shape):
        return np.asarray(rng.standard_normal(shape) * 8, ml_dtypes.float8_e4m3fn).view(np.uint8)

    def words(rng, rows, cols):
        codes = fp8_codes(rng, (rows // 4, cols, 4)).astype(np.uint32)
        return jnp.asarray(codes[..., 0] | codes[..., 1] << 8 | codes[..., 2] << 16 | codes[..., 3] << 24)

    def build(rng):
        region = -(-hidden // 2048) * 128
        rows = np.concatenate([fp8_codes(rng, (b, s, hidden)), np.full((b, s, region), 120, np.uint8)], axis=-1)
        fused, q_out = q_rank + latent + rope, heads * (nope + rope)
        scales = lambda k, n: jnp.full((k // 128, -(-n // 128)), 120, jnp.uint8)  # noqa: E731
        built = (jnp.asarray(rows.view(ml_dtypes.float8_e4m3fn)), words(rng, hidden, fused), scales(hidden, fused))
        built += (words(rng, q_rank, q_out), scales(q_rank, q_out))
        gain = lambda n: jnp.asarray(1 + 0.1 * rng.standard_normal((1, n)), dtype)  # noqa: E731
        built += (gain(q_rank), gain(latent), normal(rng, (nope, heads * latent), dtype, scale=nope**-0.5))
        return built + angles(rng, (b, s, rope), dtype)

    return build


_QKV_CTE_OPERANDS = ("x_hbm_mx", "wqkv_a_hbm", "wqkv_a_scale_hbm", "wq_b_hbm", "wq_b_scale_hbm")
_QKV_CTE_OPERANDS += ("q_norm_gamma_hbm", "kv_norm_gamma_hbm", "wuk_hbm", "cos_cache_hbm", "sin_cache_hbm")


def _qkv_cte_kwargs(heads, nope, rope, latent, q_rank):
    return dict(n_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope, kv_lora_rank=latent, qk_lora_rank=q_rank)


_SPARSE_OPERANDS = ("q_lift_hbm", "q_pe_hbm", "c_kv_hbm", "k_pe_hbm", "topk_indices_hbm")
_NEURON_DENSE = _mla(1, 128, 256, 4, 128, 128, 64, 64, 64)  # dn + dr = 128: attention_cte's head-dim limit
_DENSE_KERNELS = ("rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "attention_cte")
_BATCH_MESH = Sharding(mesh=(("data", 8),), in_specs=(P("data"),) + (P(),) * 9, out_specs=P("data"))

register(
    ArgSpec(
        "mla_qkv_cte_kernel",
        nki.mla_qkv_cte_kernel,
        _QKV_CTE_OPERANDS,
        _qkv_cte(8, 1, 512, 1, 2, 2, 512, 512),
        kernels=("mla_qkv_cte_kernel",),
        kwargs=_qkv_cte_kwargs(1, 2, 2, 512, 512),
        sharding=Sharding(
            mesh=(("data", 8),), in_specs=(P("data"),) + (P(),) * 7 + (P("data"),) * 2, out_specs=P("data")
        ),
        neuron=_qkv_cte(1, 128, 512, 2, 128, 64, 512, 512, jnp.bfloat16),
        neuron_kwargs=_qkv_cte_kwargs(2, 128, 64, 512, 512),
        neuron_lnc=2,
        neuron_target="trn3",
        bad=BadInput("kv_lora_rank", lambda _: 256, "multiple of 512"),
        notes="the kernel is Trainium3's (under a trn2 target the reference runs); gradients: see "
        "mla_qkv_cte_kernel.float_operands (its float64 check compiles the float64 reference several times: "
        "-m slow; tests/mla checks W_uk's and kv_norm_gamma's gradients against the oracle in CI)",
    ),
    ArgSpec(
        "mla_qkv_cte_kernel.float_operands",
        nki.mla_qkv_cte_kernel,
        _QKV_CTE_OPERANDS,
        _qkv_cte(8, 1, 512, 1, 2, 2, 512, 512),
        kwargs=_qkv_cte_kwargs(1, 2, 2, 512, 512),
        kernels=("mla_qkv_cte_kernel",),
        neuron=_qkv_cte(1, 128, 512, 2, 128, 64, 512, 512, jnp.bfloat16),
        neuron_kwargs=_qkv_cte_kwargs(2, 128, 64, 512, 512),
        neuron_lnc=2,
        neuron_target="trn3",
        grad=("kv_norm_gamma_hbm", "wuk_hbm", "cos_cache_hbm", "sin_cache_hbm"),
        notes="the packed row, weight words and scales are quantized (no cotangent); q_norm_gamma_hbm feeds the "
        "MX-quantized qr (piecewise constant: zero cotangent, not numerically checkable)",
    ),
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
        neuron=_mla(1, 256, 1024, 4, 256, 512, 64, 64, 128, indexer=(4, 128), dtype=jnp.bfloat16),
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


def mx_x4_weight(rng, k, n):
    """``(words [k/4, n] uint32, scales [k/128, ceil(n/128)] uint8)``: random float8_e4m3fn elements (no NaN codes),
    element ``4r + q`` of column ``n`` in byte ``q`` of word ``[r, n]``, with compact block-128 scales near
    ``2**-9`` (weights of magnitude ~0.1)."""
    values = np.clip(rng.standard_normal((k, n)) * 64, -448, 448)
    codes = np.asarray(jnp.asarray(values, jnp.float8_e4m3fn)).view(np.uint8).astype(np.uint32).reshape(k // 4, 4, n)
    words = codes[:, 0] | (codes[:, 1] << 8) | (codes[:, 2] << 16) | (codes[:, 3] << 24)
    scales = rng.integers(116, 120, (k // 128, -(-n // 128)))
    return jnp.asarray(words, jnp.uint32), jnp.asarray(scales, jnp.uint8)


def _vupmx_oproj(b, s, h, latent, d_v, hid, dtype=jnp.float32):
    """``mla_vupmx_oproj_cte_kernel``'s ``out_attn, wuv_qtz, wuv_scale, wo_qtz, wo_scale``."""
    return lambda rng: (
        normal(rng, (b, s, h * latent), dtype, scale=0.3),
        *mx_x4_weight(rng, h * latent, d_v),
        *mx_x4_weight(rng, h * d_v, hid),
    )


_VUPMX_OPERANDS = ("out_attn_hbm", "wuv_qtz_hbm", "wuv_scale_hbm", "wo_qtz_hbm", "wo_scale_hbm")

register(
    ArgSpec(
        "mla_vupmx_oproj_cte_kernel",
        nki.mla_vupmx_oproj_cte_kernel,
        _VUPMX_OPERANDS,
        _vupmx_oproj(8, 3, 2, 64, 64, 40),
        kernels=("mla_vupmx_oproj_cte_kernel",),
        batch=("out_attn_hbm", "wo_scale_hbm"),
        sharding=Sharding(mesh=(("data", 8),), in_specs=(P("data"),) + (P(),) * 4, out_specs=P("data")),
        neuron=_vupmx_oproj(1, 128, 4, 512, 128, 512, jnp.bfloat16),
        neuron_lnc=2,
        neuron_target="trn3",
        bad=BadInput("wuv_scale_hbm", lambda s: s.astype(jnp.float32), "uint8"),
        notes="no gradient check: out_attn_hbm is bf16/MXFP8-rounded (zero cotangents) and the weights are integer "
        "words and scales; the kernel is Trainium3's, so its lowering is checked for trn3",
    ),
)
