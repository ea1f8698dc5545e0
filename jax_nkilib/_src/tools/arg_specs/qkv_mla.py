"""Arg specs of ``qkv_mla_mx`` and ``qkv_mla_mx_deepseek_v4`` (DeepSeek MLA QKV projections with MXFP8 weights:
``float8_e4m3fn_x4`` words as uint32 ``[K/4, N]`` and compact block-128 uint8 scales ``[K/128, ceil(N/128)]``).
They are inference kernels without a VJP: no operand is differentiable."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, angles, normal, register


def mx_weight(rng, k, n):
    """Random finite float8_e4m3fn codes packed 4 to a uint32 word along K (``[k/4, n]``) and compact scales near
    2**-4 (``[k/128, ceil(n/128)]``)."""
    codes = rng.integers(0, 0x48, (k // 4, n, 4)).astype(np.uint8)  # magnitudes below 2.5; the sign bit added below
    codes |= (rng.integers(0, 2, codes.shape) << 7).astype(np.uint8)
    words = np.ascontiguousarray(codes).view("<u4")[..., 0]
    return jnp.asarray(words, jnp.uint32), jnp.asarray(rng.integers(118, 124, (k // 128, -(-n // 128))), jnp.uint8)


def _gain(rng, n, dtype):
    return jnp.asarray(1 + 0.1 * rng.standard_normal((1, n)), dtype)


def _v32(b, s, h, qr, kvr, r, heads, dn, dv, dtype=jnp.float32):
    def build(rng):
        return (
            normal(rng, (b, s, h), dtype),
            *mx_weight(rng, h, qr + kvr + r),
            *mx_weight(rng, qr, heads * (dn + r)),
            _gain(rng, qr, dtype),
            *mx_weight(rng, kvr, heads * (dn + dv)),
            _gain(rng, kvr, dtype),
            *angles(rng, (b, s, r), dtype),
        )

    kwargs = dict(
        n_heads=heads, qk_nope_head_dim=dn, qk_rope_head_dim=r, v_head_dim=dv, kv_lora_rank=kvr, qk_lora_rank=qr
    )
    return build, kwargs


def _v4(b, s, h, qr, kvr, r, heads, head_dim, dtype=jnp.float32):
    def build(rng):
        return (
            normal(rng, (b, s, h), dtype),
            *mx_weight(rng, h, qr + kvr + r),
            *mx_weight(rng, qr, heads * head_dim),
            _gain(rng, qr, dtype),
            _gain(rng, kvr + r, dtype),
            *angles(rng, (b, s, r), dtype),
        )

    return build, dict(n_heads=heads, head_dim=head_dim, qk_rope_head_dim=r, kv_lora_rank=kvr, qk_lora_rank=qr)


V32_OPERANDS = (
    "x_hbm",
    "wqkv_a_hbm",
    "wqkv_a_scale_hbm",
    "wq_b_hbm",
    "wq_b_scale_hbm",
    "q_norm_gamma_hbm",
    "wkv_b_hbm",
    "wkv_b_scale_hbm",
    "kv_norm_gamma_hbm",
    "cos_cache_hbm",
    "sin_cache_hbm",
)
V4_OPERANDS = (
    "x_hbm",
    "wqkv_hbm",
    "wqkv_scale_hbm",
    "wq_b_hbm",
    "wq_b_scale_hbm",
    "q_norm_gamma_hbm",
    "kv_norm_gamma_hbm",
    "cos_cache_hbm",
    "sin_cache_hbm",
)
_ROWS = ("x_hbm", "cos_cache_hbm", "sin_cache_hbm")  # the operands with a batch (B) axis


def _batch_mesh(operands, outputs):
    specs = tuple(P("data") if name in _ROWS else P() for name in operands)
    return Sharding(mesh=(("data", 8),), in_specs=specs, out_specs=(P("data"),) * outputs)


_V32_SMALL, _V32_KWARGS = _v32(8, 3, 512, 512, 512, 4, 2, 3, 5)
_V32_NEURON, _V32_NEURON_KWARGS = _v32(1, 256, 1024, 512, 512, 64, 2, 128, 128, jnp.bfloat16)
_V4_SMALL, _V4_KWARGS = _v4(8, 3, 512, 512, 12, 4, 2, 10)
_V4_NEURON, _V4_NEURON_KWARGS = _v4(1, 256, 1024, 512, 448, 64, 4, 192, jnp.bfloat16)

register(
    ArgSpec(
        "qkv_mla_mx",
        nki.qkv_mla_mx,
        V32_OPERANDS,
        _V32_SMALL,
        kwargs=_V32_KWARGS,
        kernels=("qkv_mla_mx",),
        batch=_ROWS,
        sharding=_batch_mesh(V32_OPERANDS, 3),
        neuron=_V32_NEURON,
        neuron_kwargs=_V32_NEURON_KWARGS,
        bad=BadInput("wq_b_scale_hbm", lambda s: s[:-1], "QR/128"),
        notes="no VJP (MX-quantized inference projection): no operand is differentiable",
    ),
    ArgSpec(
        "qkv_mla_mx_deepseek_v4",
        nki.qkv_mla_mx_deepseek_v4,
        V4_OPERANDS,
        _V4_SMALL,
        kwargs=_V4_KWARGS,
        kernels=("qkv_mla_mx_deepseek_v4",),
        batch=_ROWS,
        sharding=_batch_mesh(V4_OPERANDS, 2),
        neuron=_V4_NEURON,
        neuron_kwargs=_V4_NEURON_KWARGS,
        bad=BadInput("kv_norm_gamma_hbm", lambda g: g[:, :-1], "kv_norm_gamma_hbm"),
        notes="no VJP (MX-quantized inference projection): no operand is differentiable",
    ),
)
