"""Arg specs of the rotary-embedding kernels (``RoPE``, ``rope_hf``) and ``jax_nkilib.rope``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, angles, drop_last_axis, normal, register


def _kernel_rope(d, b, h, s, dtype=jnp.float32):
    """``RoPE``'s ``x_in [d_head, B, n_heads, S]`` and its ``[d_head/2, B, S]`` tables."""
    return lambda rng: (normal(rng, (d, b, h, s), dtype), *angles(rng, (d // 2, b, s), dtype))


def _hf(b, hq, hk, s, d, table=None):
    """``rope_hf``'s ``q [B, Hq, S, D]``, ``k [B, Hk, S, D]`` and ``[B, S, D]`` tables."""
    return lambda rng: (normal(rng, (b, hq, s, d)), normal(rng, (b, hk, s, d)), *angles(rng, table or (b, s, d)))


def _rope(b, s, h, d, table=None, dtype=jnp.float32):
    """``jax_nkilib.rope``'s ``x [batch, seq, heads, head_dim]`` and ``[batch, seq, head_dim/2]`` tables."""
    return lambda rng: (normal(rng, (b, s, h, d), dtype), *angles(rng, table or (b, s, d // 2), dtype))


_BATCH_AXIS_1 = Sharding(
    mesh=(("data", 8),), in_specs=(P(None, "data"), P(None, "data"), P(None, "data")), out_specs=P(None, "data")
)
_BATCH = Sharding(mesh=(("data", 8),), in_specs=(P("data"),) * 4, out_specs=(P("data"), P("data")))

register(
    ArgSpec(
        "RoPE",
        nki.RoPE,
        ("x_in", "cos", "sin"),
        _kernel_rope(8, 8, 3, 5),
        kernels=("RoPE",),
        grad=("x_in", "cos", "sin"),
        grad_order=2,
        sharding=_BATCH_AXIS_1,
        neuron=_kernel_rope(64, 2, 4, 16),
        bad=BadInput("x_in", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "RoPE.split_halves",
        nki.RoPE,
        ("x_in", "cos", "sin"),
        _kernel_rope(8, 8, 2, 3),
        kernels=("RoPE",),
        kwargs={"contiguous_layout": False},
        grad=("x_in", "cos", "sin"),
        grad_order=2,
        sharding=_BATCH_AXIS_1,
        neuron=_kernel_rope(64, 2, 4, 16),
        bad=BadInput("cos", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "RoPE.realistic",
        nki.RoPE,
        ("x_in", "cos", "sin"),
        _kernel_rope(128, 4, 32, 2048),
        kernels=("RoPE",),
        size="realistic",
    ),
    ArgSpec(
        "rope_hf",
        nki.rope_hf,
        ("q", "k", "cos", "sin"),
        _hf(8, 2, 1, 3, 4),
        kernels=("rope_hf",),
        grad=("q", "k", "cos", "sin"),
        grad_order=2,
        sharding=_BATCH,
        neuron=_hf(2, 4, 2, 128, 64),
        bad=BadInput("q", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "rope_hf.shared_tables",
        nki.rope_hf,
        ("q", "k", "cos", "sin"),
        _hf(2, 2, 1, 3, 4, table=(3, 4)),
        kernels=("rope_hf",),
        grad=("q", "k", "cos", "sin"),
        grad_order=2,
        batch=("q", "k"),
        neuron=_hf(2, 4, 2, 128, 64, table=(128, 64)),
        bad=BadInput("k", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "rope",
        jax_nkilib.rope,
        ("x", "cos", "sin"),
        _rope(8, 3, 2, 4),
        kernels=("RoPE",),
        only_kernels=False,
        neuron=_rope(2, 16, 4, 64),
        grad=("x", "cos", "sin"),
        grad_order=2,
        sharding=Sharding(mesh=(("data", 8),), in_specs=(P("data"),) * 3, out_specs=P("data")),
        bad=BadInput("x", lambda x: x[..., :3], "head_dim"),
    ),
    ArgSpec(
        "rope.interleaved_shared_tables",
        jax_nkilib.rope,
        ("x", "cos", "sin"),
        _rope(2, 3, 8, 4, table=(3, 2)),
        kwargs={"interleaved": True},
        kernels=("RoPE",),
        only_kernels=False,
        grad=("x", "cos", "sin"),
        neuron=_rope(2, 16, 4, 64, table=(16, 32)),
        grad_order=2,
        sharding=Sharding(
            mesh=(("model", 8),), in_specs=(P(None, None, "model"), P(), P()), out_specs=P(None, None, "model")
        ),
    ),
    ArgSpec(
        "rope.realistic",
        jax_nkilib.rope,
        ("x", "cos", "sin"),
        _rope(4, 2048, 32, 128, table=(2048, 64)),
        kernels=("RoPE",),
        only_kernels=False,
        size="realistic",
    ),
)
