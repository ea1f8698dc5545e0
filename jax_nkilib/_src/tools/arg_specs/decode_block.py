"""Arg specs of ``jax_nkilib.decode_block``: one fused ``attention_block_tkg`` with one kv head, the composed
``qkv`` / ``attention_tkg`` / ``output_projection_tkg`` route with several."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, angles, drop_last_axis, normal, register

_OPERANDS = ("x", "kv_cache", "cache_len", "qkv_weight", "out_weight", "rope", "norm_weight")
_BATCH = ("x", "kv_cache", "cache_len", "rope", "norm_weight")  # the last is an array: vmap's partial case
_GRAD = ("x", "qkv_weight", "out_weight", "norm_weight")


def _block(batch, seq, hidden, heads, kv_heads, d, max_len):
    """``x``, the caches, ``cache_len`` (within the kernels' scratch rule), QKV weights grouped by kv head, the
    output projection, the norm gain and per-sequence RoPE tables."""

    def build(rng):
        caches = tuple(normal(rng, (batch, kv_heads, max_len, d)) for _ in range(2))
        return (
            normal(rng, (batch, seq, hidden)),
            caches,
            jnp.asarray(rng.integers(0, max_len - 2 * seq + 1, batch), jnp.int32),
            normal(rng, (hidden, kv_heads, heads // kv_heads + 2, d), scale=hidden**-0.5),
            normal(rng, (heads * d, hidden), scale=(heads * d) ** -0.5),
            angles(rng, (batch, seq, d // 2)),
            normal(rng, (hidden,)),
        )

    return build


def _data_sharded():
    """The batch over 8 devices: x, caches, cache_len and tables split, the weights replicated."""
    ins = (P("data"), P("data"), P("data"), P(), P(), P("data"), P())
    return Sharding((("data", 8),), ins, (P("data"), P("data")))


register(
    ArgSpec(
        "decode_block",
        jax_nkilib.decode_block,
        _OPERANDS,
        _block(8, 1, 128, 4, 1, 16, 128),
        kwargs={"num_q_heads": 4, "num_kv_heads": 1},
        positional=3,
        kernels=("attention_block_tkg",),
        only_kernels=False,
        grad=_GRAD,
        batch=_BATCH,
        grad_output=lambda out: out[0],
        sharding=_data_sharded(),
        neuron=_block(2, 1, 128, 4, 1, 16, 256),
        bad=BadInput("x", drop_last_axis, "x"),
        notes="one kv head: the fused block (the mask and RoPE tables built around the one kernel)",
    ),
    ArgSpec(
        "decode_block.grouped_query",
        jax_nkilib.decode_block,
        _OPERANDS,
        _block(8, 2, 128, 6, 2, 8, 32),
        kwargs={"num_q_heads": 6, "num_kv_heads": 2},
        positional=3,
        kernels=("qkv", "attention_tkg", "output_projection_tkg"),
        only_kernels=False,
        grad=_GRAD,
        batch=_BATCH,
        grad_output=lambda out: out[0],
        sharding=_data_sharded(),
        neuron=_block(2, 2, 128, 6, 2, 8, 256),
        bad=BadInput("out_weight", drop_last_axis, "out_weight"),
        notes="two kv heads: the composed ops",
    ),
)
