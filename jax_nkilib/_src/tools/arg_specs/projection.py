"""Arg specs of the projection kernels (``qkv`` and its TKG / KV-cache variants, ``output_projection_cte`` /
``_tkg``) and of ``jax_nkilib.qkv_projection`` / ``output_projection`` / ``quantize_weight_fp8``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, angles, drop_last_axis, normal, register

_DATA = (("data", 8),)
_HEADS = dict(num_q_heads=2, num_kv_heads=1, d_head=4)
_WIDTH = (2 + 2 * 1) * 4
_NEURON_HEADS = dict(num_q_heads=2, num_kv_heads=1, d_head=64)


def _qkv(b, s, h, width=_WIDTH, dtype=jnp.float32, rope=False):
    """qkv's ``input [B, S, H]``, ``fused_qkv_weights [H, I]``, ``bias [1, I]`` (and ``[B, S, d]`` rope tables)."""

    def build(rng):
        x, w, bias = normal(rng, (b, s, h), dtype), normal(rng, (h, width), dtype, 0.4), normal(rng, (1, width), dtype)
        if not rope:
            return x, w, bias
        cos, sin = angles(rng, (b, s, 2))
        return x, w, bias, jnp.concatenate([cos, cos], -1), jnp.concatenate([sin, sin], -1)

    return build


def _qkv_tkg(b, s, h, width=_WIDTH, dtype=jnp.float32):
    """The TKG path's input, weights, no bias / scales, and the fused residual's ``mlp_prev``, ``attention_prev``."""

    def build(rng):
        return (
            normal(rng, (b, s, h), dtype),
            normal(rng, (h, width), dtype, 0.4),
            None,
            None,
            None,
            normal(rng, (b, s, h), dtype, 0.5),
            normal(rng, (b, s, h), dtype, 0.5),
        )

    return build


def _qkv_cache(b, s, h, width, max_s, kv, dtype=jnp.float32, cache_dtype=jnp.float32, d=4):
    """The KV-cache path: input, weights, ``[B, S, d]`` rope tables, flat caches ``[B, max_S, KV]`` and unit scales
    ``[128, 1]``."""

    def build(rng):
        cos, sin = angles(rng, (b, s, d // 2))
        return (
            normal(rng, (b, s, h), dtype),
            normal(rng, (h, width), dtype, 0.4),
            jnp.concatenate([cos, cos], -1),
            jnp.concatenate([sin, sin], -1),
            normal(rng, (b, max_s, kv)).astype(cache_dtype),
            normal(rng, (b, max_s, kv)).astype(cache_dtype),
            jnp.ones((128, 1), jnp.float32),
            jnp.ones((128, 1), jnp.float32),
        )

    return build


def _attention(layout, b, s, n, d, h, dtype=jnp.float32):
    """output_projection's attention in ``layout`` (``cte`` ``[B, N, D, S]``, ``tkg`` ``[D, B, N, S]``), weight
    ``[N*D, H]`` and bias ``[1, H]``."""
    shape = (b, n, d, s) if layout == "cte" else (d, b, n, s)
    return lambda rng: (normal(rng, shape, dtype), normal(rng, (n * d, h), dtype, 0.4), normal(rng, (1, h), dtype))


def _split(b, s, heads, d, h, dtype=jnp.float32):
    """jax_nkilib.output_projection's ``attn [batch, seq, heads, head_dim]`` and ``w [heads*head_dim, hidden]``."""
    return lambda rng: (normal(rng, (b, s, heads, d), dtype), normal(rng, (heads * d, h), dtype))


def _fused(b, s, h, width=_WIDTH, dtype=jnp.float32):
    return lambda rng: (normal(rng, (b, s, h), dtype), normal(rng, (h, width), dtype, 0.4))


_QKV_TKG = ("input", "fused_qkv_weights", "bias", "qkv_w_scale", "qkv_in_scale", "mlp_prev", "attention_prev")
_QKV_CACHE = dict(_HEADS, fused_rope=True)

register(
    ArgSpec(
        "qkv",
        nki.qkv,
        ("input", "fused_qkv_weights", "bias", "cos_cache", "sin_cache"),
        _qkv(8, 3, 8, rope=True),
        positional=3,
        kwargs=dict(_HEADS, fused_rope=True),
        kernels=("qkv",),
        grad=("input", "fused_qkv_weights", "bias", "cos_cache"),
        batch=("input", "cos_cache", "sin_cache"),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P("data"), P("data")), P("data")),
        neuron=lambda rng: _qkv(1, 128, 256, 256, jnp.bfloat16)(rng)[:3] + (None, None),
        neuron_kwargs=_NEURON_HEADS,
        bad=BadInput("fused_qkv_weights", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "qkv.tkg_fused_residual",
        nki.qkv,
        _QKV_TKG,
        _qkv_tkg(8, 3, 8),
        kwargs=dict(fused_residual_add=True),
        kernels=("qkv",),
        grad=("input", "fused_qkv_weights", "mlp_prev"),
        batch=("input", "mlp_prev", "attention_prev"),
        sharding=Sharding(_DATA, (P("data"), P(), None, None, None, P("data"), P("data")), (P("data"), P("data"))),
        neuron=_qkv_tkg(1, 4, 256, 256, jnp.bfloat16),
        neuron_kwargs=dict(fused_residual_add=True, **_NEURON_HEADS),
        bad=BadInput("mlp_prev", drop_last_axis, "mlp_prev"),
    ),
    ArgSpec(
        "qkv.kv_cache",
        nki.qkv,
        ("input", "fused_qkv_weights", "cos_cache", "sin_cache", "k_cache", "v_cache", "k_scale", "v_scale"),
        _qkv_cache(2, 4, 8, _WIDTH, 6, 4),
        positional=2,
        kwargs=_QKV_CACHE,
        kernels=("qkv",),
        batch=("input", "cos_cache", "sin_cache"),
        neuron=_qkv_cache(1, 128, 256, 256, 256, 64, jnp.bfloat16, jnp.float8_e4m3, 64),
        neuron_kwargs=dict(_NEURON_HEADS, fused_rope=True, kv_dtype=jnp.float8_e4m3),
        bad=BadInput("k_cache", drop_last_axis, "k_cache"),
    ),
    ArgSpec(
        "output_projection_cte",
        nki.output_projection_cte,
        ("attention", "weight", "bias"),
        _attention("cte", 8, 3, 2, 4, 7),
        kernels=("output_projection_cte",),
        grad=("attention", "weight", "bias"),
        sharding=Sharding(_DATA, (P("data"), P(), P()), P("data")),
        neuron=_attention("cte", 2, 4, 2, 64, 256, jnp.bfloat16),
        bad=BadInput("attention", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "output_projection_tkg",
        nki.output_projection_tkg,
        ("attention", "weight", "bias"),
        _attention("tkg", 8, 3, 2, 4, 7),
        kernels=("output_projection_tkg",),
        grad=("attention", "weight", "bias"),
        grad_order=2,
        sharding=Sharding(_DATA, (P(None, "data"), P(), P()), P("data")),
        neuron=_attention("tkg", 2, 4, 2, 64, 256, jnp.bfloat16),
        bad=BadInput("weight", lambda w: w[:-1], "weight"),
    ),
    ArgSpec(
        "output_projection",
        jax_nkilib.output_projection,
        ("attn", "w"),
        _split(8, 3, 2, 4, 5),
        kernels=("output_projection_cte",),
        only_kernels=False,
        grad=("attn", "w"),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        neuron=_split(2, 128, 2, 64, 256, jnp.bfloat16),
        bad=BadInput("w", lambda w: w[:-1], "w"),
    ),
    ArgSpec(
        "output_projection.decode",
        jax_nkilib.output_projection,
        ("attn", "w"),
        _split(2, 1, 2, 4, 5),
        kernels=("output_projection_tkg",),
        only_kernels=False,
        grad=("attn", "w"),
        neuron=_split(2, 1, 2, 64, 256, jnp.bfloat16),
    ),
    ArgSpec(
        "qkv_projection",
        jax_nkilib.qkv_projection,
        ("x", "w"),
        _fused(8, 3, 8),
        kwargs=dict(num_q_heads=2, num_kv_heads=1, norm="rms"),
        kernels=("qkv",),
        only_kernels=False,
        grad=("x", "w"),
        sharding=Sharding(_DATA, (P("data"), P()), (P("data"),) * 3),
        neuron=_fused(1, 128, 256, 16 * 64, jnp.bfloat16),
        neuron_kwargs=dict(num_q_heads=8, num_kv_heads=4),
        bad=BadInput("w", lambda w: w[:, :-1], "w"),
    ),
    ArgSpec(
        "quantize_weight_fp8",
        jax_nkilib.quantize_weight_fp8,
        ("w",),
        lambda rng: (normal(rng, (16, 24)),),
        kernels=(),
        only_kernels=False,
        batch=(),
        bad=BadInput("mode", lambda _: "blocks", "mode"),
    ),
)
