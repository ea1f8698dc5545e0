"""The MXFP8 SwiGLU MLP datapath of ``mlp_forward_mxfp8_nki`` / ``mlp_backward_mxfp8_nki``, in JAX.

Every matmul is ``nc_matmul_mx`` on operands quantized along their contraction (wrapX blocks, alternative emax,
float8_e4m3fn elements: :func:`jax_nkilib._src.quant.mx.mx_round_trip_wrapx`), accumulated in float32. ``bf(.)``
rounds to bfloat16 (the backward kernel's fixed dtype), ``r(.)`` to the forward's ``dtype``::

    forward   gate = x Wg^T, up = x Wu^T (float32);  a = silu(gate);  h = r(a * up);  out = r(h Wd^T)
              checkpoints: gate_pre = r(gate), gate_act = r(a), up = r(up), intermediate = h
    backward  (checkpoints read as bf16; missing ones recomputed: gate_pre/up = bf(clamp(x Wg^T / x Wu^T)) with the
              activation clamps, gate_act = bf(silu(gate_pre)), intermediate = bf(gate_act * up))
              d = dy Wd                                                       (float32, contraction H)
              dg = bf(d * bf(bf(silu'(gate_pre)) * up)) * [lower < gate_pre < upper]   (non-linear clamps)
              du = bf(d * gate_act) * [lower < up < upper]                              (linear clamps)
              dX = bf([dg du] Wgu)          (contraction 2I)
              dWgu = bf([dg du]^T bf(x))    (contraction S)
              dWd = bf(bf(dy)^T intermediate)   (contraction S)

``silu(x) = x sigmoid(x)``, ``silu'(x) = s (1 + x (1 - s))`` with ``s = sigmoid(x)``. The kernels' matmuls that read a
transposed copy (``Wgu^T``, ``Wd^T``, ``x^T``, ``dy^T``) read a bfloat16 copy. ``fp8_x4_dtype`` is not forwarded to
the matmuls by the kernels: every matmul quantizes to float8_e4m3fn. Roundings (engine outputs, DMA casts of the
float32 accumulators) are taken as round-to-nearest-even.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..quant import mx

_HIGHEST = jax.lax.Precision.HIGHEST
BF16 = jnp.bfloat16
CLAMPS = (
    "linear_clamp_upper_limit",
    "linear_clamp_lower_limit",
    "non_linear_clamp_upper_limit",
    "non_linear_clamp_lower_limit",
)


def mx_contract(a, b, a_axis: int, b_axis: int, quantize_a: bool = True, quantize_b: bool = True):
    """float32 ``sum_k a[.., k, ..] b[.., k, ..]`` over ``a_axis`` / ``b_axis`` (the remaining axes of ``a`` then of
    ``b``), each operand MX-quantized along its contraction unless already dequantized."""
    a = mx.mx_round_trip_wrapx(a, a_axis) if quantize_a else a.astype(jnp.float32)
    b = mx.mx_round_trip_wrapx(b, b_axis) if quantize_b else b.astype(jnp.float32)
    return jnp.tensordot(a, b, axes=(a_axis, b_axis), precision=_HIGHEST)


def silu(x):
    return x * jax.nn.sigmoid(x)


def silu_derivative(x):
    s = jax.nn.sigmoid(x)
    return s * (1 + x * (1 - s))


def clamp(x, upper, lower):
    """The kernels' activation clamp: ``min(x, upper)`` then ``max(., lower)`` (``None``: no bound)."""
    x = x if upper is None else jnp.minimum(x, upper)
    return x if lower is None else jnp.maximum(x, lower)


def inside(x, upper, lower):
    """The gradient clamp mask: 1 where ``lower < x < upper`` (``None``: no bound), else 0 (NaN: 0)."""
    mask = jnp.ones(x.shape, bool)
    if upper is not None:
        mask &= x < upper
    if lower is not None:
        mask &= x > lower
    return mask.astype(x.dtype)


def forward(hidden, gate_up, down, quantize, dtype):
    """``(out [S, H], gate_pre, gate_act, up, intermediate [S, I])`` from raw or dequantized ``hidden [S, H]``,
    ``gate_up [2I, H]``, ``down [H, I]`` (``quantize``: per operand, whether it still needs MX quantization)."""
    q_hidden, q_gate_up, q_down = quantize
    i = gate_up.shape[0] // 2
    projections = mx_contract(hidden, gate_up, 1, 1, q_hidden, q_gate_up)  # [S, 2I]; rows quantize independently
    gate, up = projections[:, :i], projections[:, i:]
    act = silu(gate)
    intermediate = (act * up).astype(dtype)
    out = mx_contract(intermediate, down, 1, 1, True, q_down).astype(dtype)
    return out, gate.astype(dtype), act.astype(dtype), up.astype(dtype), intermediate


def recompute(hidden, gate_up, quantize_gate_up, checkpoints, clamps):
    """The backward kernel's phase 0: the missing checkpoints (bf16), from ``hidden [S, H]`` and ``gate_up``."""
    gate_pre, gate_act, up, intermediate = (None if c is None else c.astype(BF16) for c in checkpoints)
    if gate_pre is None or up is None:
        i = gate_up.shape[0] // 2
        projections = mx_contract(hidden, gate_up, 1, 1, True, quantize_gate_up)
        new_gate = clamp(
            projections[:, :i], clamps["non_linear_clamp_upper_limit"], clamps["non_linear_clamp_lower_limit"]
        ).astype(BF16)
        new_up = clamp(
            projections[:, i:], clamps["linear_clamp_upper_limit"], clamps["linear_clamp_lower_limit"]
        ).astype(BF16)
        gate_pre = new_gate if gate_pre is None else gate_pre
        up = new_up if up is None else up
    if gate_act is None:
        gate_act = silu(gate_pre.astype(jnp.float32)).astype(BF16)
    if intermediate is None:
        intermediate = (gate_act.astype(jnp.float32) * up.astype(jnp.float32)).astype(BF16)
    return gate_pre, gate_act, up, intermediate


def backward(output_grad, checkpoints, down_t, gate_up_t, hidden_t, output_grad_t, clamps):
    """``(dX [S, H], dWgu [2I, H], dWd [H, I])`` bf16.

    ``checkpoints``: bf16 ``(gate_pre, gate_act, up, intermediate)``. The other matmul operands are ``(value,
    quantize)`` pairs in ``[F, K]`` form: ``down_t`` = ``Wd^T [I, H]``, ``gate_up_t`` = ``Wgu^T [H, 2I]``,
    ``hidden_t`` = ``x^T [H, S]``, ``output_grad_t`` = ``dy^T [H, S]``.
    """
    gate_pre, gate_act, up, intermediate = (c.astype(jnp.float32) for c in checkpoints)
    d = mx_contract(output_grad, down_t[0], 1, 1, True, down_t[1])  # [S, I]
    d_gate_act = (silu_derivative(gate_pre).astype(BF16).astype(jnp.float32) * up).astype(BF16).astype(jnp.float32)
    d_gate = (d * d_gate_act).astype(BF16) * inside(
        gate_pre, clamps["non_linear_clamp_upper_limit"], clamps["non_linear_clamp_lower_limit"]
    ).astype(BF16)
    d_up = (d * gate_act).astype(BF16) * inside(
        up, clamps["linear_clamp_upper_limit"], clamps["linear_clamp_lower_limit"]
    ).astype(BF16)
    d_gate_up = jnp.concatenate([d_gate, d_up], axis=1)  # [S, 2I] bf16
    dx = mx_contract(d_gate_up, gate_up_t[0], 1, 1, True, gate_up_t[1]).astype(BF16)
    dw_gate_up = mx_contract(d_gate_up, hidden_t[0], 0, 1, True, hidden_t[1]).astype(BF16)  # [2I, H]
    dw_down = mx_contract(output_grad_t[0], intermediate, 1, 0, output_grad_t[1], True).astype(BF16)  # [H, I]
    return dx, dw_gate_up, dw_down
