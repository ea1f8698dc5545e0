"""Arg specs of the scan kernels (``cumsum``, ``linear_scan``, ``selective_scan``) and of ``jax_nkilib.cumsum``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register, uniform

_DATA = (("data", 8),)

register(
    ArgSpec(
        "cumsum",
        nki.cumsum,
        ("x",),
        lambda rng: (normal(rng, (8, 3, 37)),),
        kernels=("cumsum",),
        grad=("x",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("x", lambda x: x[0, 0], "layout"),
    ),
    ArgSpec(
        "jax_nkilib.cumsum",
        jax_nkilib.cumsum,
        ("x",),
        lambda rng: (normal(rng, (8, 21, 5)),),
        kwargs={"axis": 1},
        kernels=("cumsum",),
        only_kernels=False,
        grad=("x",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("axis", lambda axis: 3, "axis"),
    ),
)


def _selective_scan_args(rng, batch=8, channels=5, length=19, states=3):
    """Mamba-like values: positive small time steps, negative A, a small initial state."""
    return (
        normal(rng, (batch, channels, length)),
        uniform(rng, (batch, channels, length), 0.01, 0.3),
        uniform(rng, (channels, states), -1.0, -0.1),
        normal(rng, (batch, states, length)),
        normal(rng, (batch, states, length)),
        normal(rng, (channels,)),
        normal(rng, (batch, channels, states), scale=0.1),
    )


register(
    ArgSpec(
        "linear_scan",
        nki.linear_scan,
        ("decay", "data", "initial"),
        lambda rng: (uniform(rng, (8, 3, 37), 0.5, 1.0), normal(rng, (8, 3, 37)), normal(rng, (8, 3, 1))),
        kernels=("linear_scan",),
        grad=("decay", "data", "initial"),  # second order: tests/scan/test_linear_scan.py (slow)
        sharding=Sharding(_DATA, (P("data"), P("data"), P("data")), (P("data"), P("data"))),
        bad=BadInput("initial", lambda initial: initial[..., 0], "[..., P, 1]"),
    ),
    ArgSpec(
        "selective_scan",
        nki.selective_scan,
        ("x", "dt", "A", "B", "C", "D", "initial_state"),
        _selective_scan_args,
        kernels=("selective_scan",),
        grad=("x", "dt", "A", "B", "C", "D", "initial_state"),
        sharding=Sharding(
            _DATA, (P("data"), P("data"), P(), P("data"), P("data"), P(), P("data")), (P("data"), P("data"))
        ),
        bad=BadInput("B", lambda B: B[:, :, :-1], "layout"),
    ),
)


def _ssd_args(rng, batch=8, heads=3, length=20, headdim=5, dstate=4):
    """Mamba-2-like values: positive small time steps, negative A, a small initial state."""
    return (
        normal(rng, (batch, heads, length, headdim)),
        uniform(rng, (batch, heads, length), 0.01, 0.3),
        uniform(rng, (heads,), -1.0, -0.1),
        normal(rng, (batch, length, dstate)),
        normal(rng, (batch, length, dstate)),
        normal(rng, (heads,)),
        normal(rng, (batch, heads, dstate, headdim), scale=0.1),
    )


register(
    ArgSpec(
        "ssd",
        nki.ssd,
        ("x", "dt", "A", "B", "C", "D", "initial_state"),
        _ssd_args,
        kwargs={"chunk_size": 8},
        positional=5,
        kernels=("ssd",),
        grad=("x", "dt", "A", "B", "C", "D", "initial_state"),
        sharding=Sharding(
            _DATA, (P("data"), P("data"), P(), P("data"), P("data"), P(), P("data")), (P("data"), P("data"))
        ),
        neuron=lambda rng: _ssd_args(rng, batch=2, length=32),
        bad=BadInput("chunk_size", lambda chunk_size: 0, "positive"),
    ),
)


def _mamba_args(rng, batch=8, dim=4, length=13, dstate=3, groups=2):
    """``selective_scan_fn`` arguments: grouped B/C, a gate z, raw time steps (bias and softplus applied)."""
    return (
        normal(rng, (batch, dim, length)),
        normal(rng, (batch, dim, length), scale=0.5),
        uniform(rng, (dim, dstate), -1.0, -0.1),
        normal(rng, (batch, groups, dstate, length)),
        normal(rng, (batch, groups, dstate, length)),
        normal(rng, (dim,)),
        normal(rng, (batch, dim, length)),
        normal(rng, (dim,), scale=0.1),
    )


def _mamba2_args(rng, batch=8, length=11, heads=4, headdim=3, groups=2, dstate=2):
    """``mamba_chunk_scan_combined`` arguments: [b, L, h, p] inputs, grouped B/C, D per channel, a gate z."""
    return (
        normal(rng, (batch, length, heads, headdim)),
        normal(rng, (batch, length, heads), scale=0.5),
        uniform(rng, (heads,), -1.0, -0.1),
        normal(rng, (batch, length, groups, dstate)),
        normal(rng, (batch, length, groups, dstate)),
        normal(rng, (heads, headdim)),
        normal(rng, (batch, length, heads, headdim)),
        normal(rng, (heads,), scale=0.1),
        normal(rng, (batch, heads, headdim, dstate), scale=0.1),
    )


def _packed_mamba2_args(rng, batch=8, length=9, heads=2, headdim=2, dstate=2):
    """``mamba_chunk_scan_combined`` arguments of packed sequences: one group, and ``seq_idx [batch, L]``
    (non-decreasing: 0, 1 or 2 sequence changes per row)."""
    x, dt, A, B, C, D, _, _, h0 = _mamba2_args(rng, batch, length, heads, headdim, 1, dstate)
    seq_idx = jnp.sort(jnp.asarray(rng.integers(0, 3, size=(batch, length)), jnp.int32), axis=1)
    return x, dt, A, B, C, D, h0, seq_idx


register(
    ArgSpec(
        "jax_nkilib.selective_scan",
        jax_nkilib.selective_scan,
        ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"),
        _mamba_args,
        kwargs={"delta_softplus": True, "return_last_state": True},
        kernels=("selective_scan", "selective_scan"),  # one call per group
        only_kernels=False,
        grad=("u", "delta", "A", "B", "C", "D", "z", "delta_bias"),
        sharding=Sharding(
            _DATA, (P("data"),) * 2 + (P(),) + (P("data"),) * 2 + (P(), P("data"), P()), (P("data"), P("data"))
        ),
        bad=BadInput("B", lambda B: B[:, :, :, :-1], "[batch, dstate, L]"),
    ),
    ArgSpec(
        "jax_nkilib.ssd",
        jax_nkilib.ssd,
        ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"),
        _mamba2_args,
        kwargs={"chunk_size": 4, "dt_softplus": True, "return_final_states": True},
        positional=5,
        kernels=("ssd", "ssd"),  # one call per group
        only_kernels=False,
        grad=("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states"),
        sharding=Sharding(
            _DATA,
            (P("data"),) * 2 + (P(),) + (P("data"),) * 2 + (P(), P("data"), P(), P("data")),
            (P("data"), P("data")),
        ),
        bad=BadInput("initial_states", lambda h0: jnp.swapaxes(h0, 2, 3), "[batch, nheads, headdim, dstate]"),
    ),
    ArgSpec(
        "jax_nkilib.ssd.seq_idx",
        jax_nkilib.ssd,
        ("x", "dt", "A", "B", "C", "D", "initial_states", "seq_idx"),
        _packed_mamba2_args,
        kwargs={"chunk_size": 4, "dt_softplus": True, "return_final_states": True},
        positional=5,
        kernels=(),
        only_kernels=False,
        grad=("x", "dt", "A", "B", "C", "D", "initial_states"),
        sharding=Sharding(
            _DATA, (P("data"),) * 2 + (P(),) + (P("data"),) * 2 + (P(), P("data"), P("data")), (P("data"), P("data"))
        ),
        bad=BadInput("seq_idx", lambda seq_idx: seq_idx.astype(jnp.float32), "integer dtype"),
        neuron_fallback="`seq_idx`",
        notes="packed sequences: the chunked scan with state resets runs as JAX (the ssd kernel has no seq_idx)",
    ),
)
