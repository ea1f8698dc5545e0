"""``linear_scan`` (catalog row 39, section 1.27): the first-order linear recurrence along the last axis.

Source: nki-library pull request 1 (``refs/pull/1/head``, ``ebe57b2``)
``src/nkilib_src/nkilib/experimental/scan/linear_scan.py`` (``@nki.jit linear_scan(decay, data, initial=None)``), its
tests ``test/integration/nkilib/experimental/scan/test_linear_scan.py`` (NumPy golden ``golden_linear_scan_np``) and
the 2.32 API reference ``nki/library/api/linear-scan.rst`` (module ``nkilib.experimental.scan``).

``linear_scan(decay [..., P, L], data [..., P, L], initial [..., P, 1] = None) -> (result, final_state)``::

    result[..., t] = decay[..., t] * result[..., t - 1] + data[..., t],    result[..., -1] := initial (or 0)

``result`` has decay's shape and dtype; ``final_state [..., P, 1]`` is float32 (float64 off Neuron for float64
inputs). Here the leading ``...`` is zero, one or two dimensions (the kernel collapses any number).

Numerics, as the kernel computes them: ``L`` is processed in tiles of 2048 columns; inside a tile the state is a
float32 (``tensor_tensor_scan``) and each output is rounded to decay's dtype; the next tile starts from the previous
tile's last *output*, already rounded. ``final_state`` is the last output (rounded, then widened to float32).

Reverse mode: with ``g = d result`` (plus ``d final_state`` at ``t = L - 1``), the adjoint state
``lam[t] = g[t] + decay[t + 1] * lam[t + 1]`` is the same recurrence run backwards, computed by this kernel on the
reversed sequence (in float32, float64 for float64 inputs); then ``d data = lam``,
``d decay[t] = lam[t] * result[t - 1]`` and ``d initial = decay[0] * lam[0]``.

Neuron: no documented limits (P is tiled at 128 partitions, L at 2048 columns); one core (no LNC sharding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.compat import varying_like
from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, accumulation_dtype

LINEAR_SCAN_F_TILE = 2048  # columns per tensor_tensor_scan tile; the carry between tiles is rounded to decay's dtype


def _combine(earlier, later):
    """Compose two affine maps ``s -> a * s + b`` (``earlier`` first): the associative step of the recurrence."""
    a1, b1 = earlier
    a2, b2 = later
    return a1 * a2, a2 * b1 + b2


def affine_prefix(decay, data, axis=-1):
    """``(A, Bc)`` with ``state[t] = A[t] * state[-1] + Bc[t]``: the recurrence's prefix maps along ``axis``, by
    ``jax.lax.associative_scan`` (logarithmic depth, memory linear in the length)."""
    return jax.lax.associative_scan(_combine, (decay, data), axis=axis)


def tiled_linear_scan(decay, data, initial, dtype):
    """The kernel's scan of ``rows [R, L]`` from ``initial [R]`` (all in the wide dtype) as ``dtype``: wide states
    inside each tile of :data:`LINEAR_SCAN_F_TILE` columns, the carry into the next tile rounded to ``dtype``."""
    wide = decay.dtype
    count, length = decay.shape
    tiles = -(-length // LINEAR_SCAN_F_TILE)
    if tiles == 1:
        gains, offsets = affine_prefix(decay, data)
        return (gains * initial[:, None] + offsets).astype(dtype)
    pad = ((0, 0), (0, tiles * LINEAR_SCAN_F_TILE - length))  # identity maps: decay 1, data 0
    shape = (count, tiles, LINEAR_SCAN_F_TILE)
    gains, offsets = affine_prefix(
        jnp.pad(decay, pad, constant_values=1).reshape(shape), jnp.pad(data, pad).reshape(shape)
    )

    def carry_step(carry, tile):  # the next tile's initial state: this tile's last output, rounded to dtype
        gain, offset = tile
        return (gain * carry + offset).astype(dtype).astype(wide), carry

    _, carries = jax.lax.scan(carry_step, varying_like(initial, decay), (gains[:, :, -1].T, offsets[:, :, -1].T))
    out = (gains * carries.T[:, :, None] + offsets).astype(dtype)
    return out.reshape(count, tiles * LINEAR_SCAN_F_TILE)[:, :length]


def reference_linear_scan(decay, data, initial=None):
    """JAX reference of ``linear_scan``: the kernel's tiled recurrence (see the module docstring)."""
    wide = accumulation_dtype(decay.dtype)
    length = decay.shape[-1]
    rows_decay = decay.reshape(-1, length).astype(wide)
    rows_data = data.reshape(-1, length).astype(wide)
    start = jnp.zeros(rows_decay.shape[:1], wide) if initial is None else initial.reshape(-1).astype(wide)
    result = tiled_linear_scan(rows_decay, rows_data, start, decay.dtype).reshape(decay.shape)
    return result, result[..., -1:].astype(wide)


def _linear_scan_vjp(kernel, operands, params, outs, cotangents):
    """The adjoint recurrence run backwards by the kernel (see the module docstring)."""
    decay, data, initial = operands["decay"], operands["data"], operands.get("initial")
    result, _ = outs
    d_result, d_final = cotangents
    wide = accumulation_dtype(decay.dtype)
    g = jnp.zeros(decay.shape, wide) if d_result is None else d_result.astype(wide)
    g_final = jnp.zeros(decay.shape[:-1] + (1,), wide) if d_final is None else d_final.astype(wide)
    # lam[t] = decay[t + 1] * lam[t + 1] + g[t], lam[L - 1] = g[L - 1] + g_final: reversed, a forward scan from g_final
    backward_decay = jnp.concatenate([jnp.ones_like(g[..., :1]), jnp.flip(decay[..., 1:].astype(wide), -1)], -1)
    lam_reversed, _ = kernel.call({"decay": backward_decay, "data": jnp.flip(g, -1), "initial": g_final}, params)
    lam = jnp.flip(lam_reversed, -1)
    start = jnp.zeros(g_final.shape, wide) if initial is None else initial.astype(wide)
    previous = jnp.concatenate([start, result[..., :-1].astype(wide)], -1)
    grads = {
        "decay": (lam * previous).astype(decay.dtype),
        "data": lam.astype(data.dtype),
    }
    if initial is not None:
        grads["initial"] = (decay[..., :1].astype(wide) * lam[..., :1]).astype(initial.dtype)
    return grads


def _check_linear_scan(call: CallInfo) -> None:
    decay, data = call.avals["decay"], call.avals["data"]
    if data.shape != decay.shape:
        raise ValueError(
            f"{call.function}: `data` must have decay's shape [..., P, L] = {decay.shape}; got {data.shape}"
        )
    initial = call.avals.get("initial")
    if initial is not None and initial.shape != decay.shape[:-1] + (1,):
        raise ValueError(
            f"{call.function}: `initial` must have layout [..., P, 1] = {decay.shape[:-1] + (1,)} (decay's shape "
            f"with L replaced by 1); got {initial.shape}"
        )


def _outputs(call: CallInfo):
    """``result`` of decay's shape and dtype, ``final_state [..., P, 1]`` in float32 (float64 for float64)."""
    decay = call.avals["decay"]
    return [
        ("result", decay.shape, decay.dtype),
        ("final_state", decay.shape[:-1] + (1,), accumulation_dtype(decay.dtype)),
    ]


_SEQUENCES = ("P, L", "B, P, L", "B, H, P, L")
_STATES = ("P, 1", "B, P, 1", "B, H, P, 1")

LINEAR_SCAN_SPEC = KernelSpec(
    name="linear_scan",
    entry_point="nkilib.experimental.scan.linear_scan:linear_scan",
    operands=(
        Operand.of("decay", *_SEQUENCES, doc="multiplicative coefficients decay[t]"),
        Operand.of("data", *_SEQUENCES, doc="additive inputs data[t], decay's shape"),
        Operand.of("initial", *_STATES, optional=True, doc="the state before t = 0 (zero when absent)"),
    ),
    params=(),
    outputs=(),
    output_avals=_outputs,
    reference=reference_linear_scan,
    check=_check_linear_scan,
    neuron_split_dims=("P",),
    fold_plans=tuple(  # the vmapped axis merges into P (rows are independent); outputs' P axis is rank - 2
        FoldPlan(
            axes={"decay": "P", "data": "P", "initial": "P"},
            outputs={"result": rank - 2, "final_state": rank - 2},
            when=lambda call, rank=rank: call.avals["decay"].ndim == rank,
        )
        for rank in (2, 3, 4)
    ),
    family="scan",
    catalog="1.27",
    support={
        "vjp": "kernel (the adjoint recurrence: linear_scan of the reversed cotangent)",
        "notes": f"nki-library PR 1 (experimental, 2.32 docs); float32 state in tiles of {LINEAR_SCAN_F_TILE} "
        "columns, the carry between tiles in decay's dtype; final_state float32; one core",
    },
)


linear_scan = make_kernel(LINEAR_SCAN_SPEC, _linear_scan_vjp)
