"""``selective_scan`` (catalog row 40, section 1.27): Mamba's fused discretization, recurrence and output projection.

Source: nki-library pull request 1 (``refs/pull/1/head``, ``ebe57b2``)
``src/nkilib_src/nkilib/experimental/scan/selective_scan.py`` (``@nki.jit selective_scan(x, dt, A, B, C, D=None,
initial_state=None)``), its tests ``test/integration/nkilib/experimental/scan/test_selective_scan.py`` (NumPy golden
``golden_selective_scan_np``) and the 2.32 API reference ``nki/library/api/selective-scan.rst``.

``selective_scan(x [b, c, L], dt [b, c, L], A [c, N], B [b, N, L], C [b, N, L], D [c] = None,
initial_state [b, c, N] = None) -> (y [b, c, L], final_state [b, c, N])``, per state dimension ``n``::

    state[b, c, n, t] = exp(dt[b, c, t] * A[c, n]) * state[b, c, n, t - 1] + dt[b, c, t] * x[b, c, t] * B[b, n, t]
    y[b, c, t] = sum_n C[b, n, t] * state[b, c, n, t] + D[c] * x[b, c, t]

with ``state[..., -1] = initial_state`` (or 0). Everything is computed in float32 (the carry between the kernel's
512-column tiles too); ``y`` is rounded once to x's dtype, ``final_state`` is float32 (float64 off Neuron for float64
inputs). The JAX reference runs the recurrence with ``jax.lax.associative_scan`` over ``[b, c, N, L]``: memory linear
in L, no unrolling over the sequence.

Reverse mode: the reference's VJP (the library has no backward kernel).

Neuron: no documented limits (channels tiled at 128 partitions, L at 512 columns); one core (no LNC sharding).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, accumulation_dtype
from .linear_scan import affine_prefix

SELECTIVE_SCAN_F_TILE = 512  # the kernel's column tile (its carry is float32: no effect on the numerics)


def reference_selective_scan(x, dt, A, B, C, D=None, initial_state=None):
    """JAX reference of ``selective_scan`` (see the module docstring)."""
    wide = accumulation_dtype(x.dtype)
    x_w, dt_w = x.astype(wide), dt.astype(wide)
    decay = jnp.exp(dt_w[:, :, None, :] * A.astype(wide)[None, :, :, None])  # [b, c, N, L]
    inputs = (dt_w * x_w)[:, :, None, :] * B.astype(wide)[:, None, :, :]
    gains, offsets = affine_prefix(decay, inputs, axis=-1)
    states = offsets if initial_state is None else gains * initial_state.astype(wide)[..., None] + offsets
    y = jnp.einsum("bcnl,bnl->bcl", states, C.astype(wide))
    if D is not None:
        y = y + D.astype(wide)[None, :, None] * x_w
    return y.astype(x.dtype), states[..., -1]


def _outputs(call: CallInfo):
    """``y`` of x's shape and dtype, ``final_state [b, c, N]`` in float32 (float64 for float64 inputs)."""
    x, A = call.avals["x"], call.avals["A"]
    return [("y", x.shape, x.dtype), ("final_state", x.shape[:2] + A.shape[1:], accumulation_dtype(x.dtype))]


SELECTIVE_SCAN_SPEC = KernelSpec(
    name="selective_scan",
    entry_point="nkilib.experimental.scan.selective_scan:selective_scan",
    operands=(
        Operand.of("x", "batch, channels, L", doc="the input sequence"),
        Operand.of("dt", "batch, channels, L", doc="positive time steps"),
        Operand.of("A", "channels, N", doc="state matrix (negative for a stable recurrence)"),
        Operand.of("B", "batch, N, L", doc="input projection, shared by the channels"),
        Operand.of("C", "batch, N, L", doc="output projection, shared by the channels"),
        Operand.of("D", "channels", optional=True, doc="skip connection weights"),
        Operand.of("initial_state", "batch, channels, N", optional=True, doc="the state before t = 0 (zero)"),
    ),
    params=(),
    outputs=(),
    output_avals=_outputs,
    reference=reference_selective_scan,
    neuron_split_dims=("batch",),
    fold_plans=(
        FoldPlan(
            axes={
                "x": "batch",
                "dt": "batch",
                "A": None,
                "B": "batch",
                "C": "batch",
                "D": None,
                "initial_state": "batch",
            },
            outputs={"y": 0, "final_state": 0},
        ),
    ),
    family="scan",
    catalog="1.27",
    support={
        "idiomatic": "selective_scan",
        "vjp": "reference (associative scan; no backward kernel)",
        "notes": "nki-library PR 1 (experimental, 2.32 docs); float32 throughout, y rounded to x's dtype, "
        "final_state float32; one core",
    },
)


selective_scan = make_kernel(SELECTIVE_SCAN_SPEC, reference_vjp)
