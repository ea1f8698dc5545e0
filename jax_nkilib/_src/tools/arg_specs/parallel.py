"""Arg specs of the collective kernels (HBM collectives, all-gathers, ring attention, batch sharding) and of
``jax_nkilib.all_gather_matmul`` / ``matmul_reduce_scatter`` / ``ring_attention`` and the ring layout helpers.

Collective kernels take mesh axes as replica groups, so they run inside ``jax.shard_map``: their specs' operands
are global arrays (per-rank blocks stacked along the sharded axis) and their :class:`Sharding` is collective."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register, uniform

RANKS = 8


def _ring(axis, in_specs, out_specs):
    """A collective sharding over one mesh axis of the 8 devices."""
    return Sharding(((axis, RANKS),), in_specs, out_specs, collective=True)


def _blocks(rows, cols, dtype=jnp.float32):
    """Per-rank ``[rows, cols]`` blocks stacked along axis 0."""
    return lambda rng: (normal(rng, (RANKS * rows, cols), dtype),)


def _seq_last(rng, b, h, d, s, dtype):
    return normal(rng, (b, h, d, RANKS * s), dtype)


def _ring_fwd(b=1, h=2, d=16, s=4, dtype=jnp.float32):
    """ring_attention_spmd_fwd's ``q``, ``k`` ``[b, h, d, S]`` and ``v`` ``[b, h, S, d]`` (S over the ring)."""
    return lambda rng: (
        _seq_last(rng, b, h, d, s, dtype),
        _seq_last(rng, b, h, d, s, dtype),
        normal(rng, (b, h, RANKS * s, d), dtype),
    )


def _ring_bwd(b=1, n=2, d=8, s=128, dtype=jnp.float32):
    """ring_attention_spmd_bwd's q, k, v, o, dy ``[B, N, D, S]`` and ``lse [B, N, 128, S/128]``."""

    def build(rng):
        tensors = tuple(_seq_last(rng, b, n, d, s, dtype) for _ in range(5))
        return tensors + (uniform(rng, (b, n, 128, RANKS * s // 128), 1.0, 3.0),)

    return build


def _rank_table(rng):
    return (normal(rng, (RANKS, 5, 3)),)


def _batch_shard(rng):
    """attn_q_batch_shard's per-rank ``[n, B, S, d]`` queries and its ``iota_workers`` table (rank -> offset)."""
    return normal(rng, (RANKS * 2, 8, 3, 5)), jnp.asarray(np.arange(RANKS)[None], jnp.int32)


def _qkv(b, s, h, d):
    return lambda rng: tuple(normal(rng, (b, s, h, d)) for _ in range(3))


_SEQ_LAST, _SEQ_MID = P(None, None, None, "cp"), P(None, None, "cp", None)
_X = P("x")
_TP = dict(replica_groups="tp", tp_degree=RANKS)
_FG = dict(_TP, num_groups=1)
_RING = dict(replica_groups="cp", num_workers=RANKS)

register(
    ArgSpec(
        "all_reduce_hbm_kernel",
        nki.all_reduce_hbm_kernel,
        ("input",),
        _blocks(8, 3),
        kwargs={"replica_group": "x"},
        kernels=("all_reduce_hbm_kernel",),
        grad=("input",),
        sharding=_ring("x", (_X,), _X),
        bad=BadInput("replica_group", lambda _: "y", "y"),
    ),
    ArgSpec(
        "all_gather_hbm_kernel",
        nki.all_gather_hbm_kernel,
        ("input",),
        _blocks(8, 3),
        kwargs={"replica_group": "x", "num_ranks": RANKS},
        kernels=("all_gather_hbm_kernel",),
        grad=("input",),
        sharding=_ring("x", (_X,), _X),
        bad=BadInput("num_ranks", lambda _: 4, "num_ranks"),
    ),
    ArgSpec(
        "reduce_scatter_hbm_kernel",
        nki.reduce_scatter_hbm_kernel,
        ("input",),
        _blocks(8, 3),
        kwargs={"replica_group": "x", "num_ranks": RANKS},
        kernels=("reduce_scatter_hbm_kernel",),
        grad=("input",),
        sharding=_ring("x", (_X,), _X),
        bad=BadInput("num_ranks", lambda _: 4, "num_ranks"),
    ),
    ArgSpec(
        "all_to_all_hbm_kernel",
        nki.all_to_all_hbm_kernel,
        ("input",),
        _blocks(8, 3),
        kwargs={"replica_group": "x"},
        kernels=("all_to_all_hbm_kernel",),
        grad=("input",),
        sharding=_ring("x", (_X,), _X),
        bad=BadInput("replica_group", lambda _: 3, "replica_group"),
    ),
    ArgSpec(
        "rank_id_kernel",
        nki.rank_id_kernel,
        ("in_tensor",),
        _rank_table,
        kernels=("rank_id_kernel",),
        sharding=_ring("x", (P(),), _X),
        bad=BadInput("in_tensor", drop_last_axis, "in_tensor"),
    ),
    ArgSpec(
        "dma_copy_rank_id_kernel",
        nki.dma_copy_rank_id_kernel,
        ("in_tensor", "rank_id_lookup"),
        lambda rng: (*_rank_table(rng), jnp.asarray(rng.permutation(RANKS)[None], jnp.int32)),
        kernels=("dma_copy_rank_id_kernel",),
        batch=("in_tensor",),
        sharding=_ring("x", (P(), P()), _X),
        bad=BadInput("rank_id_lookup", drop_last_axis, "rank_id_lookup"),
    ),
    ArgSpec(
        "fine_grained_allgather",
        nki.fine_grained_allgather,
        ("lhs",),
        _blocks(3, 5),
        kwargs=_FG,
        kernels=("fine_grained_allgather",),
        grad=("lhs",),
        sharding=_ring("tp", (P("tp"),), P("tp")),
        neuron=_blocks(4, 128),
        bad=BadInput("tp_degree", lambda _: 4, "tp_degree"),
    ),
    ArgSpec(
        "allgather_compute_matmul",
        nki.allgather_compute_matmul,
        ("lhs", "rhs"),
        lambda rng: (normal(rng, (RANKS * 3, 5)), normal(rng, (5, RANKS * 2))),
        kwargs=_FG,
        kernels=("allgather_compute_matmul",),
        grad=("lhs", "rhs"),
        sharding=_ring("tp", (P("tp"), P(None, "tp")), P(None, None, "tp")),
        neuron=lambda rng: (normal(rng, (RANKS * 4, 128)), normal(rng, (128, RANKS * 8))),
        bad=BadInput("tp_degree", lambda _: 4, "tp_degree"),
    ),
    ArgSpec(
        "allgather_sb2sb",
        nki.allgather_sb2sb,
        ("inp",),
        lambda rng: (normal(rng, (3, RANKS * 4)),),
        kwargs=_TP,
        kernels=("allgather_sb2sb",),
        grad=("inp",),
        sharding=_ring("tp", (P(None, "tp"),), P("tp")),
        neuron=lambda rng: (normal(rng, (16, RANKS * 4)),),
        bad=BadInput("tp_degree", lambda _: 4, "tp_degree"),
    ),
    ArgSpec(
        "allgather_sb2sb_tiled",
        nki.allgather_sb2sb_tiled,
        ("inp",),
        lambda rng: (normal(rng, (3, RANKS * 4)),),
        kwargs=_TP,
        kernels=("allgather_sb2sb_tiled",),
        grad=("inp",),
        sharding=_ring("tp", (P(None, "tp"),), P("tp")),
        neuron=lambda rng: (normal(rng, (16, RANKS * 4)),),
        bad=BadInput("tp_degree", lambda _: 4, "tp_degree"),
    ),
    ArgSpec(
        "ring_attention_spmd_fwd",
        nki.ring_attention_spmd_fwd,
        ("q", "k", "v"),
        _ring_fwd(),
        kwargs=dict(_RING, use_causal_mask=True),
        kernels=("ring_attention_spmd_fwd",),
        grad=("q", "k", "v"),
        sharding=_ring("cp", (_SEQ_LAST, _SEQ_LAST, _SEQ_MID), _SEQ_MID),
        neuron=_ring_fwd(d=64, s=128, dtype=jnp.bfloat16),
        bad=BadInput("num_workers", lambda _: 4, "num_workers"),
    ),
    ArgSpec(
        "ring_attention_spmd_bwd",
        nki.ring_attention_spmd_bwd,
        ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "lse_ref"),
        _ring_bwd(),
        kwargs=dict(_RING, use_causal_mask=True),
        kernels=("ring_attention_spmd_bwd",),
        batch=("q_ref", "dy_ref"),
        sharding=_ring("cp", (_SEQ_LAST,) * 6, (_SEQ_LAST,) * 3),
        neuron=_ring_bwd(d=64, dtype=jnp.bfloat16),
        bad=BadInput("num_workers", lambda _: 4, "num_workers"),
    ),
    ArgSpec(
        "ring_attention_unpermute",
        nki.ring_attention_unpermute,
        ("x",),
        lambda rng: (normal(rng, (2, RANKS * 8, 8)),),
        kwargs=_RING,
        kernels=("ring_attention_unpermute",),
        grad=("x",),
        sharding=_ring("cp", (P(None, "cp"),), P(None, "cp")),
        neuron=lambda rng: (normal(rng, (2, RANKS * 16, 8), jnp.bfloat16),),
        bad=BadInput("x", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "attn_q_batch_shard",
        nki.attn_q_batch_shard,
        ("input", "iota_workers"),
        _batch_shard,
        kwargs=dict(gqa_group_size=RANKS, replica_group="g", layout="NBSd"),
        kernels=("attn_q_batch_shard",),
        only_kernels=False,
        grad=("input",),
        batch=("input",),
        sharding=_ring("g", (P("g"), P()), P("g")),
        bad=BadInput("iota_workers", drop_last_axis, "iota_workers"),
    ),
    ArgSpec(
        "all_gather_matmul",
        jax_nkilib.all_gather_matmul,
        ("x", "w"),
        lambda rng: (normal(rng, (24, 12)), normal(rng, (12, 16))),
        kwargs={"axis_name": "r"},
        kernels=("allgather_compute_matmul",),
        only_kernels=False,
        grad=("x", "w"),
        sharding=_ring("r", (P("r"), P()), P("r")),
        bad=BadInput("w", drop_last_axis, "w"),
    ),
    ArgSpec(
        "matmul_reduce_scatter",
        jax_nkilib.matmul_reduce_scatter,
        ("x", "w"),
        lambda rng: (normal(rng, (24, 16)), normal(rng, (16, 8))),
        kwargs={"axis_name": "r"},
        kernels=(),
        only_kernels=False,
        grad=("x", "w"),
        sharding=_ring("r", (P(None, "r"), P("r")), P("r")),
        bad=BadInput("w", drop_last_axis, "w"),
    ),
    ArgSpec(
        "ring_attention",
        jax_nkilib.ring_attention,
        ("q", "k", "v"),
        _qkv(1, 32, 2, 8),
        kwargs={"axis_name": "cp"},
        kernels=(),
        only_kernels=False,
        grad=("q", "k", "v"),
        sharding=_ring("cp", (P(None, "cp"),) * 3, P(None, "cp")),
        bad=BadInput("q", drop_last_axis, "q"),
    ),
    ArgSpec(
        "ring_attention.realistic",
        jax_nkilib.ring_attention,
        ("q", "k", "v"),
        _qkv(1, 65536, 8, 64),
        kwargs={"axis_name": "cp"},
        kernels=(),
        only_kernels=False,
        sharding=_ring("cp", (P(None, "cp"),) * 3, P(None, "cp")),
        size="realistic",
    ),
    ArgSpec(
        "to_ring_layout",
        jax_nkilib.to_ring_layout,
        ("x",),
        lambda rng: (normal(rng, (2, 32, 3)),),
        kwargs=dict(layout="zigzag", axis_size=RANKS),
        kernels=(),
        only_kernels=False,
        grad=("x",),
        bad=BadInput("axis_size", lambda _: 3, "axis_size"),
    ),
    ArgSpec(
        "from_ring_layout",
        jax_nkilib.from_ring_layout,
        ("x",),
        lambda rng: (normal(rng, (2, 32, 3)),),
        kwargs=dict(layout="striped", axis_size=RANKS),
        kernels=(),
        only_kernels=False,
        grad=("x",),
        bad=BadInput("axis_size", lambda _: 3, "axis_size"),
    ),
    ArgSpec(
        "token_positions",
        jax_nkilib.token_positions,
        ("rank",),
        lambda rng: (jnp.asarray(rng.integers(0, RANKS), jnp.int32),),
        positional=0,
        kwargs=dict(layout="zigzag", axis_size=RANKS, local_len=4),
        kernels=(),
        only_kernels=False,
        bad=BadInput("local_len", lambda _: 3, "local_len"),
    ),
)
