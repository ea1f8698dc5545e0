"""Arg specs of the attention kernels and of ``jax_nkilib.attention`` / ``jax_nkilib.decode_attention``."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import (
    ArgSpec,
    BadInput,
    Sharding,
    angles,
    drop_last_axis,
    integers,
    normal,
    register,
)

_DATA = (("data", 8),)


def _data(n_operands, n_outputs=1, replicated=()):
    """Everything sharded along axis 0 over ``data`` (``replicated`` operand indices excepted)."""
    ins = tuple(P() if i in replicated else P("data") for i in range(n_operands))
    return Sharding(_DATA, ins, P("data") if n_outputs == 1 else (P("data"),) * n_outputs)


def _cte(b, b_kv, sq, sk, d):
    """attention_cte's ``q [B, Sq, d]``, ``k [B_kv, d, Sk]``, ``v [B_kv, Sk, d]``."""
    return lambda rng: (normal(rng, (b, sq, d)), normal(rng, (b_kv, d, sk)), normal(rng, (b_kv, sk, d)))


def _bwd(bs, h, h_kv, d, s):
    """attention_bwd's q, k, v, o, dy ``[bs, heads, d, S]`` and lse ``[bs, H, 128, S/128]``."""

    def build(rng):
        q, o, dy = (normal(rng, (bs, h, d, s)) for _ in range(3))
        k, v = (normal(rng, (bs, h_kv, d, s)) for _ in range(2))
        return q, k, v, o, dy, uniform_lse(rng, (bs, h, 128, s // 128))

    return build


def _flax_mask(rng, batch, seq):
    """A Flax-style float32 1/0 mask ``[B, 1, T, T]``: causal and key padding (key 0 is always visible)."""
    lengths = jnp.asarray(rng.integers(1, seq + 1, size=(batch,)))
    keys = jnp.arange(seq)
    allowed = (keys[None, :] <= keys[:, None])[None] & (keys < lengths[:, None])[:, None, :]
    return allowed[:, None].astype(jnp.float32)


def uniform_lse(rng, shape):
    return jnp.asarray(rng.uniform(1.0, 3.0, shape), jnp.float32)


def _tkg(b, h, s_a, d, s_full, s_prior):
    """attention_tkg's q, k/v active, k/v prior and a ``[S_prior, B, H, s_a]`` uint8 mask."""

    def build(rng):
        return (
            normal(rng, (b, h, s_a, d)),
            normal(rng, (b, 1, s_a, d)),
            normal(rng, (b, 1, s_a, d)),
            normal(rng, (b, 1, d, s_full)),
            normal(rng, (b, 1, s_full, d)),
            jnp.asarray(rng.uniform(size=(s_prior, b, h, s_a)) < 0.6, jnp.uint8),
        )

    return build


def _segmented(bs, heads, kv_heads, seq_q, d, n_blocks, max_blocks, block, prior):
    """attention_segmented_cte's q, paged caches, block tables and ``prior_tokens``."""

    def build(rng):
        tables = np.stack([rng.permutation(n_blocks)[:max_blocks] for _ in range(bs)])
        return (
            normal(rng, (bs * heads, seq_q, d)),
            normal(rng, (n_blocks, kv_heads, block, d)),
            normal(rng, (n_blocks, kv_heads, block, d)),
            jnp.asarray(tables, jnp.int32),
            integers(prior),
        )

    return build


_KVP_GROUP, _KVP_Q_START = 8, 40


def _kv_parallel(rng, qh=2, s=8, d=16, block=4, n_blocks=5, max_blocks=3):
    """Per-rank kv-parallel inputs stacked along axis 0 (ranks = the 8 devices of ``kvp``)."""
    g = _KVP_GROUP
    tables = np.stack([rng.permutation(n_blocks)[:max_blocks] for _ in range(g)])
    ranks = np.arange(g, dtype=np.int32)[:, None]
    return (
        normal(rng, (g * qh, s, d)),
        normal(rng, (g * n_blocks, 1, block, d)),
        normal(rng, (g * n_blocks, 1, block, d)),
        jnp.asarray(tables, jnp.int32),
        jnp.asarray(_KVP_Q_START - ranks * max_blocks * block, jnp.int32),
        jnp.asarray(ranks),
    )


def _mx_cache(rng, n_blocks):
    """An MXFP8 KV-cache ``[n_blocks, 32, 160]`` (float32 words): finite fp8 codes, scales near 2**0."""
    words = np.zeros((n_blocks, 32, 160, 4), np.uint8)
    codes = rng.integers(0, 0x7F, (n_blocks, 32, 128, 4)) | (rng.integers(0, 2, (n_blocks, 32, 128, 4)) << 7)
    words[:, :, :128] = codes
    words[:, :4, 128:] = rng.integers(122, 130, (n_blocks, 4, 32, 4))
    return jnp.asarray(words.view(np.float32)[..., 0])


def _mxfp8_tkg(b, h, s_a, n_blocks, s_prior):
    def build(rng):
        return (
            normal(rng, (b, h, s_a, 128), jnp.bfloat16),
            normal(rng, (b, s_a, 128), jnp.bfloat16),
            normal(rng, (b, s_a, 128), jnp.bfloat16),
            _mx_cache(rng, n_blocks),
            _mx_cache(rng, n_blocks),
            jnp.asarray(rng.uniform(size=(b, h, s_a, s_prior + s_a)) < 0.7, jnp.uint8),
        )

    return build


def _swa(batch=2, seq=8, hidden=16, n_q=4, n_kv=2, d=8, n_blocks=16, max_blocks=6, block=4, prior=9, dtype=jnp.float32):
    """swa_fused_cte's hidden states, weights, paged caches, tables, rope tables, sinks, prior length, biases."""
    width = (n_q + 2 * n_kv) * d

    def build(rng):
        tables = rng.permutation(n_blocks)[: batch * max_blocks].reshape(batch, max_blocks)
        cos, sin = angles(rng, (batch, seq, d))
        return (
            normal(rng, (batch, seq, hidden), dtype, 0.5),
            normal(rng, (hidden, width), dtype, 0.3),
            normal(rng, (n_q * d, hidden), dtype, 0.3),
            normal(rng, (n_blocks, n_kv, block, d), dtype),
            normal(rng, (n_blocks, n_kv, block, d), dtype),
            jnp.asarray(tables, jnp.int32),
            cos,
            sin,
            normal(rng, (batch, n_q)),
            integers(prior),
            normal(rng, (1, width), dtype, 0.2),
            normal(rng, (1, hidden), dtype, 0.2),
        )

    return build


def _positions(rng, rows, cols, start=64):
    return jnp.asarray(np.broadcast_to(np.sort(rng.integers(start, start + 128, cols)), (rows, cols)), jnp.int32)


def _decode(batch, s_new, heads, kv_heads, d, max_len):
    def build(rng):
        return (
            normal(rng, (batch, s_new, heads, d)),
            normal(rng, (batch, s_new, kv_heads, d)),
            normal(rng, (batch, s_new, kv_heads, d)),
            normal(rng, (batch, kv_heads, max_len, d)),
            normal(rng, (batch, kv_heads, max_len, d)),
            jnp.asarray(rng.integers(0, max_len - 2 * s_new + 1, batch), jnp.int32),
        )  # the kernel's scratch

    return build


def _decode_sinks(batch, s_new, heads, kv_heads, d, max_len, per_sequence):
    """decode_attention's operands and sinks ``[batch, heads]`` (``per_sequence``) or ``[heads]``."""

    def build(rng):
        return _decode(batch, s_new, heads, kv_heads, d, max_len)(rng) + (
            normal(rng, (batch, heads) if per_sequence else (heads,)),
        )

    return build


def _qkv(batch, sq, sk, heads, kv_heads, d):
    return lambda rng: (
        normal(rng, (batch, sq, heads, d)),
        normal(rng, (batch, sk, kv_heads, d)),
        normal(rng, (batch, sk, kv_heads, d)),
    )


_SWA_FLAGS = dict(block_size=4, num_q_heads=4, num_kv_heads=2, d_head=8)
_SWA_OPERANDS = (
    "hidden_states",
    "qkv_weight",
    "op_weight",
    "k_cache",
    "v_cache",
    "block_tables",
    "cos_cache",
    "sin_cache",
    "sink",
    "prior_tokens",
    "qkv_bias",
    "op_bias",
)
_KVP_FLAGS = dict(replica_groups="kvp", group_size=_KVP_GROUP, block_size=4, seg_size=8, global_q_offset=_KVP_Q_START)
_GEN_MASK = dict(bs=2, q_head=3, s_active=2, is_s_prior_sharded=False, s_prior_per_shard=256, n_sprior_tile=2)

register(
    ArgSpec(
        "attention_cte",
        nki.attention_cte,
        ("q", "k", "v"),
        _cte(16, 8, 16, 16, 8),
        kwargs={"scale": 0.3},
        kernels=("attention_cte",),
        grad=("q", "k", "v"),
        sharding=_data(3),
        neuron=_cte(4, 2, 256, 256, 64),
        bad=BadInput("k", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "attention_cte.window",
        nki.attention_cte,
        ("q", "k", "v"),
        _cte(2, 1, 6, 9, 4),
        kwargs={"sliding_window": 5},
        kernels=("attention_cte",),
        grad=("q", "k", "v"),
        neuron=_cte(2, 1, 256, 256, 64),
    ),
    ArgSpec(
        "attention_cte.realistic",
        nki.attention_cte,
        ("q", "k", "v"),
        _cte(32, 8, 2048, 2048, 128),
        kernels=("attention_cte",),
        size="realistic",
    ),
    ArgSpec(
        "attention_bwd",
        nki.attention_bwd,
        ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "lse_ref"),
        _bwd(8, 4, 2, 8, 128),
        kwargs={"use_causal_mask": True},
        kernels=("attention_bwd",),
        sharding=_data(6, 3),
        neuron=_bwd(1, 4, 2, 64, 512),
        bad=BadInput("lse_ref", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "attention_tkg",
        nki.attention_tkg,
        ("q", "k_active", "v_active", "k_prior", "v_prior", "mask"),
        _tkg(8, 4, 3, 8, 16, 16),
        kernels=("attention_tkg",),
        grad=("q", "k_active", "v_active", "k_prior", "v_prior"),
        batch=("q", "k_active", "v_active"),
        sharding=Sharding(_DATA, (P("data"),) * 5 + (P(None, "data"),), P("data")),
        neuron=_tkg(2, 4, 3, 8, 256, 128),
        bad=BadInput("mask", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "attention_segmented_cte",
        nki.attention_segmented_cte,
        ("q", "k_cache", "v_cache", "block_tables", "prior_tokens"),
        _segmented(8, 4, 2, 8, 8, 12, 6, 4, 8),
        kwargs=dict(block_size=4, prior_seg_size=8, num_q_heads=4),
        kernels=("attention_segmented_cte",),
        grad=("q", "k_cache", "v_cache"),
        batch=("q", "block_tables"),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P("data"), P()), P("data")),
        neuron=_segmented(2, 4, 2, 8, 8, 12, 6, 4, 4),
        bad=BadInput("block_size", lambda _: 8, "block axis"),
    ),
    ArgSpec(
        "attention_kv_parallel_segmented_cte",
        nki.attention_kv_parallel_segmented_cte,
        ("q", "k_cache", "v_cache", "block_tables", "kvp_q_offset", "kvp_rank_id"),
        _kv_parallel,
        kwargs=_KVP_FLAGS,
        kernels=("attention_kv_parallel_segmented_cte",),
        grad=("q", "k_cache", "v_cache"),
        batch=("q",),
        sharding=Sharding((("kvp", 8),), (P("kvp"),) * 6, P("kvp"), collective=True),
        bad=BadInput("seg_size", lambda _: 6, "multiple of block_size"),
    ),
    ArgSpec(
        "attention_mxfp8_tkg",
        nki.attention_mxfp8_tkg,
        ("q", "k_active", "v_active", "k_prior", "v_prior", "mask"),
        _mxfp8_tkg(8, 2, 1, 2, 250),
        kernels=("attention_mxfp8_tkg",),
        batch=("q", "k_active"),
        sharding=Sharding(_DATA, (P("data"), P("data"), P("data"), P(), P(), P("data")), P("data")),
        neuron=lambda rng: (
            *_mxfp8_tkg(1, 32, 1, 16, 2000)(rng),
            jnp.eye(128, dtype=jnp.bfloat16),
            jnp.arange(16, dtype=jnp.int32)[None],
        ),
        bad=BadInput("mask", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "swa_fused_cte",
        nki.swa_fused_cte,
        _SWA_OPERANDS,
        _swa(),
        kwargs=_SWA_FLAGS,
        kernels=("swa_fused_cte",),
        grad=("hidden_states", "qkv_weight", "op_weight", "sink"),
        grad_output=lambda out: out[0],
        batch=("hidden_states", "cos_cache", "sin_cache"),
        neuron=_swa(1, 128, 128, 4, 2, 64, 16, 8, 32, 0, jnp.bfloat16),
        neuron_kwargs=dict(block_size=32, num_q_heads=4, num_kv_heads=2, d_head=64, scale=0.125),
        bad=BadInput("block_size", lambda _: 8, "block_size=8"),
    ),
    ArgSpec(
        "gen_mask_tkg",
        nki.gen_mask_tkg,
        ("pos_ids",),
        lambda rng: (_positions(rng, 128, 4),),
        kwargs=_GEN_MASK,
        kernels=("gen_mask_tkg",),
        sharding=Sharding(_DATA, (P(),), P()),
        bad=BadInput("n_sprior_tile", lambda _: None, "n_sprior_tile"),
    ),
    ArgSpec(
        "gen_mask_tkg_hbm",
        nki.gen_mask_tkg_hbm,
        ("pos_ids_hbm",),
        lambda rng: (_positions(rng, 1, 6, 5),),
        kwargs=dict(bs=2, q_head=3, s_active=3, s_prior=256),
        kernels=("gen_mask_tkg_hbm",),
        sharding=Sharding(_DATA, (P(),), P()),
        bad=BadInput("s_prior", lambda _: None, "s_prior"),
    ),
    ArgSpec(
        "attention",
        jax_nkilib.attention,
        ("q", "k", "v"),
        _qkv(8, 16, 16, 4, 2, 8),
        kwargs=dict(causal=True),
        kernels=("attention_cte",),
        only_kernels=False,
        grad=("q", "k", "v"),
        sharding=_data(3),
        neuron=_qkv(2, 256, 256, 4, 2, 64),
        bad=BadInput("q", drop_last_axis, "q"),
    ),
    ArgSpec(
        "attention.heads_sharded",
        jax_nkilib.attention,
        ("q", "k", "v"),
        _qkv(2, 8, 8, 16, 8, 8),
        kwargs=dict(causal=True),
        kernels=("attention_cte",),
        only_kernels=False,
        sharding=Sharding((("model", 8),), (P(None, None, "model"),) * 3, P(None, None, "model")),
        neuron=_qkv(2, 256, 256, 16, 8, 64),
    ),
    ArgSpec(
        "attention.realistic",
        jax_nkilib.attention,
        ("q", "k", "v"),
        _qkv(1, 4096, 4096, 8, 8, 64),
        kwargs=dict(causal=True),
        kernels=("attention_cte",),
        only_kernels=False,
        size="realistic",
    ),
    ArgSpec(
        "dot_product_attention",
        jax_nkilib.dot_product_attention,
        ("query", "key", "value"),
        _qkv(8, 16, 16, 4, 2, 8),
        kwargs=dict(is_causal=True),
        kernels=("attention_cte",),
        only_kernels=False,
        grad=("query", "key", "value"),
        sharding=_data(3),
        neuron=_qkv(2, 256, 256, 4, 2, 64),
        bad=BadInput("query", drop_last_axis, "query"),
    ),
    ArgSpec(
        "dot_product_attention.bias_soft_cap_padding",
        jax_nkilib.dot_product_attention,
        ("query", "key", "value", "bias", "key_value_seq_lengths"),
        lambda rng: (
            *_qkv(8, 16, 16, 4, 2, 8)(rng),
            normal(rng, (8, 1, 16, 16)),
            jnp.asarray(rng.integers(1, 17, size=(8,)), jnp.int32),
        ),
        positional=4,
        kwargs=dict(logits_soft_cap=5.0, local_window_size=(6, 2)),
        kernels=(),
        only_kernels=False,
        grad=("query", "key", "value", "bias"),
        sharding=_data(5),
        neuron_fallback="dense `bias`",
        notes="the blockwise route: no kernel computes a bias, a soft cap or a two-sided window",
    ),
    ArgSpec(
        "flax_attention_fn",
        jax_nkilib.flax_attention_fn,
        ("query", "key", "value", "mask"),
        lambda rng: (*_qkv(8, 16, 16, 4, 2, 8)(rng), _flax_mask(rng, 8, 16)),
        positional=3,
        kernels=(),
        only_kernels=False,
        grad=("query", "key", "value"),
        sharding=_data(4),
        bad=BadInput("query", drop_last_axis, "query"),
        neuron_fallback="dense boolean `mask`",
        notes="Flax's attention_fn with one of its float32 1/0 masks (causal and key padding): the blockwise route",
    ),
    ArgSpec(
        "decode_attention",
        jax_nkilib.decode_attention,
        ("q", "k_new", "v_new", "k_cache", "v_cache", "cache_len"),
        _decode(8, 2, 4, 2, 8, 16),
        kernels=("attention_tkg",),
        only_kernels=False,
        grad=("q", "k_new", "v_new", "k_cache", "v_cache"),
        grad_output=lambda out: out[0],
        sharding=_data(6, 3),
        neuron=_decode(2, 2, 4, 2, 8, 256),
        bad=BadInput("q", drop_last_axis, "q"),
    ),
    ArgSpec(
        "decode_attention.window_sequence_sinks",
        jax_nkilib.decode_attention,
        ("q", "k_new", "v_new", "k_cache", "v_cache", "cache_len", "sinks"),
        _decode_sinks(8, 2, 4, 2, 8, 16, per_sequence=True),
        kwargs={"sliding_window": 5},
        positional=6,
        kernels=("attention_tkg",),
        only_kernels=False,
        grad=("q", "k_new", "v_new", "k_cache", "v_cache", "sinks"),
        grad_output=lambda out: out[0],
        sharding=_data(7, 3),
        neuron=_decode_sinks(2, 2, 4, 2, 8, 256, per_sequence=True),
        neuron_kwargs={"sliding_window": 128},
        bad=BadInput("sliding_window", lambda _: 0, "sliding_window"),
        notes="per-sequence sinks: one attention_tkg call per sequence (a loop over the batch)",
    ),
    ArgSpec(
        "decode_attention.heads_sharded_window_sinks",
        jax_nkilib.decode_attention,
        ("q", "k_new", "v_new", "k_cache", "v_cache", "cache_len", "sinks"),
        _decode_sinks(2, 1, 16, 8, 8, 16, per_sequence=False),
        kwargs={"sliding_window": 3},
        positional=6,
        kernels=("attention_tkg",),
        only_kernels=False,
        grad=("q", "k_new", "v_new", "sinks"),
        grad_output=lambda out: out[0],
        sharding=Sharding(
            (("model", 8),),
            (P(None, None, "model"),) * 3 + (P(None, "model"),) * 2 + (P(), P("model")),
            (P(None, None, "model"), P(None, "model"), P(None, "model")),
        ),
        neuron=_decode_sinks(2, 1, 16, 8, 8, 256, per_sequence=False),
        neuron_kwargs={"sliding_window": 128},
        bad=BadInput("sinks", drop_last_axis, "sinks"),
    ),
)
