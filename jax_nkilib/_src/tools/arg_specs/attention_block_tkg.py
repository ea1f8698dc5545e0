"""Arg specs of ``jax_nkilib.nki.attention_block_tkg``: a flat cache updated in place with RMSNorm, RoPE and the
output projection; and variants for the transposed cache with the Q/K norms and a sink, the block cache, FP8 KV, the
LNC-2 transposed output and KV data parallelism (a collective over 8 ranks)."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)
_REQUIRED = ("X", "W_qkv", "K_cache", "V_cache", "attention_mask")


def _mask(rng, s_ctx, batch, heads, seq):
    """Random visibility of the prior slots, causal over the last ``seq``."""
    m = rng.uniform(size=(s_ctx, batch, heads, seq)) < 0.6
    tail = np.arange(seq)[:, None] <= np.arange(seq)[None, :]
    m[s_ctx - seq :] = np.broadcast_to(tail[:, None, None, :], (seq, batch, heads, seq))
    return jnp.asarray(m, jnp.uint8)


def _tables(rng, d, batch, seq, dtype):
    theta = rng.uniform(-np.pi, np.pi, (d // 2, batch, seq))
    return jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)


def _flat(batch=8, seq=1, hidden=128, d=16, q=2, s_max=24, s_ctx=20, dtype=jnp.float32, transposed=False):
    """X, W_qkv, caches, mask, gamma, cos, sin, update index, W_out, bias_out."""

    def build(rng):
        k_cache = normal(rng, (batch, s_max, d), dtype)
        starts = rng.permutation(s_max - seq)[:batch].astype(np.uint32)[:, None]
        return (
            normal(rng, (batch, seq, hidden), dtype),
            normal(rng, (hidden, d * (q + 2)), dtype, hidden**-0.5),
            jnp.swapaxes(k_cache, 1, 2) if transposed else k_cache,
            normal(rng, (batch, s_max, d), dtype),
            _mask(rng, s_ctx, batch, q, seq),
            normal(rng, (1, hidden), dtype),
            *_tables(rng, d, batch, seq, dtype),
            jnp.asarray(starts),
            normal(rng, (q * d, hidden), dtype, (q * d) ** -0.5),
            normal(rng, (1, hidden), dtype, 0.3),
        )

    return build


_FLAT_OPERANDS = _REQUIRED + ("rmsnorm_X_gamma", "cos", "sin", "kv_cache_update_idx", "W_out", "bias_out")
_FLAT_FLAGS = dict(rmsnorm_X_enabled=True, update_cache=True)


def _qk_norms(batch=2, seq=2, hidden=128, d=16, q=2, s_max=24, s_ctx=20, dtype=jnp.float32):
    """Transposed K cache, no update, Q/K norms before and after RoPE, a sink, no projection."""

    def build(rng):
        return (
            normal(rng, (batch, seq, hidden), dtype),
            normal(rng, (hidden, d * (q + 2)), dtype, hidden**-0.5),
            normal(rng, (batch, d, s_max), dtype),
            normal(rng, (batch, s_max, d), dtype),
            _mask(rng, s_ctx, batch, q, seq),
            *_tables(rng, d, batch, seq, dtype),
            *(normal(rng, (1, d), dtype) for _ in range(4)),
            normal(rng, (q, 1), dtype),
        )

    return build


_QK_OPERANDS = _REQUIRED + (
    "cos",
    "sin",
    "rmsnorm_QK_pre_rope_W_Q",
    "rmsnorm_QK_pre_rope_W_K",
    "rmsnorm_QK_post_rope_W_Q",
    "rmsnorm_QK_post_rope_W_K",
    "sink",
)
_QK_FLAGS = dict(
    K_cache_transposed=True,
    rmsnorm_QK_pre_rope_enabled=True,
    rmsnorm_QK_post_rope_enabled=True,
    rope_contiguous_layout=False,
)


def _block(batch=2, d=16, q=2, block_len=16, n_blocks=16, pool=40, dtype=jnp.float32):
    """A block pool with its table (every slot visible: the mask's slot order is the kernel's) and slot updates."""

    def build(rng):
        table = rng.permutation(pool)[: batch * n_blocks].reshape(batch, n_blocks).astype(np.int32)
        slots = np.array([[table[b, 1] * block_len + b] for b in range(batch)], np.uint32)
        return (
            normal(rng, (batch, 1, 128), dtype),
            normal(rng, (128, d * (q + 2)), dtype, 128**-0.5),
            normal(rng, (pool, block_len, d), dtype),
            normal(rng, (pool, block_len, d), dtype),
            jnp.ones((n_blocks * block_len, batch, q, 1), jnp.uint8),
            jnp.asarray(table),
            jnp.asarray(slots),
        )

    return build


def _fp8(batch=2, d=16, q=2, s_max=24, s_ctx=20, hidden=128, dtype=jnp.float32):
    def build(rng):
        return (
            normal(rng, (batch, 1, hidden), dtype),
            normal(rng, (hidden, d * (q + 2)), dtype, hidden**-0.5),
            normal(rng, (batch, s_max, d), jnp.float8_e4m3),
            normal(rng, (batch, s_max, d), jnp.float8_e4m3),
            _mask(rng, s_ctx, batch, q, 1),
            jnp.full((1, 1), 0.5, jnp.float32),
            jnp.full((128, 1), 2.0, jnp.float32),
        )

    return build


def _kvdp(ranks=8, batch=8, hidden=128, d=16, q=1, s_max=24, s_ctx=20, dtype=jnp.float32):
    """Global arrays whose rank slices are each rank's operands: X and W_qkv per rank, cache rows per rank."""

    def build(rng):
        b_attn = batch // ranks
        return (
            normal(rng, (ranks * batch, 1, hidden), dtype),
            normal(rng, (ranks * hidden, d * (q + 2)), dtype, hidden**-0.5),
            normal(rng, (ranks * b_attn, s_max, d), dtype),
            normal(rng, (ranks * b_attn, s_max, d), dtype),
            _mask(rng, s_ctx, ranks * b_attn, q * ranks, 1),
            normal(rng, (ranks * q * d, hidden), dtype, (q * d) ** -0.5),
        )

    return build


register(
    ArgSpec(
        "attention_block_tkg",
        nki.attention_block_tkg,
        _FLAT_OPERANDS,
        _flat(),
        kwargs=_FLAT_FLAGS,
        positional=len(_REQUIRED),
        kernels=("attention_block_tkg",),
        grad=("X", "W_qkv", "K_cache", "V_cache", "rmsnorm_X_gamma", "W_out"),
        batch=("X", "K_cache", "V_cache", "cos", "sin", "bias_out"),
        sharding=Sharding(
            _DATA,
            (P("data"), P(), P("data"), P("data"), P(None, "data"), P(), P(None, "data"), P(None, "data"))
            + (P("data"), P(), P()),
            (P("data"), P("data"), P("data")),
        ),
        neuron=_flat(batch=2, hidden=256, d=64, q=4, s_max=512, s_ctx=256, dtype=jnp.bfloat16),
        bad=BadInput("attention_mask", drop_last_axis, "attention_mask"),
    ),
    ArgSpec(
        "attention_block_tkg.qk_norms",
        nki.attention_block_tkg,
        _QK_OPERANDS,
        _qk_norms(),
        kwargs=_QK_FLAGS,
        positional=len(_REQUIRED),
        kernels=("attention_block_tkg",),
        grad=("X", "W_qkv", "K_cache", "rmsnorm_QK_pre_rope_W_Q", "rmsnorm_QK_post_rope_W_K", "sink"),
        neuron=_qk_norms(batch=2, seq=2, hidden=256, d=128, q=2, s_max=256, s_ctx=256, dtype=jnp.bfloat16),
        bad=BadInput("sink", drop_last_axis, "sink"),
    ),
    ArgSpec(
        "attention_block_tkg.block_cache",
        nki.attention_block_tkg,
        _REQUIRED + ("active_blocks_table", "kv_cache_update_idx"),
        _block(),
        kwargs=dict(update_cache=True),
        positional=len(_REQUIRED),
        kernels=("attention_block_tkg",),
        grad=("X", "W_qkv", "K_cache", "V_cache"),
        batch=("X",),
        bad=BadInput("K_cache_transposed", lambda _: True, "K_cache_transposed=False"),
    ),
    ArgSpec(
        "attention_block_tkg.fp8_kv",
        nki.attention_block_tkg,
        _REQUIRED + ("k_scale", "v_scale"),
        _fp8(),
        positional=len(_REQUIRED),
        kernels=("attention_block_tkg",),
        batch=("X",),
        neuron=_fp8(d=64, s_max=256, s_ctx=256, hidden=256, dtype=jnp.bfloat16),
        bad=BadInput("v_scale", lambda _: None, "k_scale and v_scale"),
        notes="FP8 outputs: no gradient check",
    ),
    ArgSpec(
        "attention_block_tkg.transposed_out_lnc2",
        nki.attention_block_tkg,
        _FLAT_OPERANDS,
        _flat(batch=2, hidden=256),
        kwargs=dict(_FLAT_FLAGS, transposed_out=True),
        positional=len(_REQUIRED),
        kernels=("attention_block_tkg",),
        batch=("X",),
        neuron=_flat(batch=2, hidden=256, d=64, q=4, s_max=512, s_ctx=256, dtype=jnp.bfloat16),
        neuron_lnc=2,
        bad=BadInput("W_out", lambda _: None, "W_out"),
    ),
    ArgSpec(
        "attention_block_tkg.kvdp",
        nki.attention_block_tkg,
        _REQUIRED + ("W_out",),
        _kvdp(),
        kwargs=dict(KVDP=8, KVDP_replica_group="kvdp"),
        positional=len(_REQUIRED),
        kernels=("attention_block_tkg",),
        grad=("X", "W_qkv", "K_cache"),
        batch=("X",),
        sharding=Sharding(
            (("kvdp", 8),),
            (P("kvdp"), P("kvdp"), P("kvdp"), P("kvdp"), P(None, "kvdp"), P("kvdp")),
            (P("kvdp"), P(None, "kvdp"), P("kvdp")),
            collective=True,
        ),
        neuron=_kvdp(hidden=256, d=64, s_max=256, s_ctx=256, dtype=jnp.bfloat16),
        bad=BadInput("KVDP", lambda _: 4, "KVDP=4"),
    ),
)
