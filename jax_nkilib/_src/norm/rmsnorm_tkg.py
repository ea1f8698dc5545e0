"""``rmsnorm_tkg`` (catalog 1.19): token-generation RMSNorm with the transposed output of :mod:`.tkg_output`
(``input [B, S, H]``, ``gamma [1, H]`` -> ``out [128, B*S, H/128]`` in ``input``'s dtype).

Math (float32 intermediates, or float64 for float64 inputs; the output rounded to ``input``'s dtype):
``y = (x * gamma) * rsqrt(sum(x^2) * (1/hidden_actual) + eps)``; ``hidden_actual`` (default H) is the unpadded width
when the input is zero-padded to a multiple of 128. ``hidden_dim_tp`` and ``single_core_forced`` select the LNC=1
output order (see :mod:`.tkg_output`).

Reverse mode is JAX math written from this formula (no backward kernel); ``use_heap_memory`` and ``shard_on_h``
only change how the kernel runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.hardware import PARTITIONS, SBUF_PARTITION_BYTES
from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, KernelSpec, Operand, Param, accumulation_dtype
from .tkg_output import (
    TKG_SPEC_FIELDS,
    check_hidden,
    cotangent_rows,
    elements,
    shard_limits,
    to_kernel_order,
    token_rows,
)

RMSNORM_BXS_TILE = 512  # rmsnorm_tkg processes B*S in tiles of 512 rows


RMSNORM_CONTIGUOUS_LOAD_H = 2048  # up to this H the loader stages [128 rows, H] per partition


def rms_statistics(x, hidden_actual: int, eps: float):
    """``rsqrt(sum(x^2) * (1/hidden_actual) + eps)`` per row of ``x [T, H]`` (wide dtype), shape ``[T, 1]``."""
    wide = x.dtype
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) * jnp.asarray(1.0 / hidden_actual, wide) + eps)


def _rmsnorm_rows(x, gamma, eps, hidden_actual):
    wide = accumulation_dtype(x.dtype)
    xw = token_rows(x).astype(wide)
    return ((xw * gamma.reshape(1, -1).astype(wide)) * rms_statistics(xw, hidden_actual, eps)).astype(x.dtype)


def _rmsnorm_layout(hidden_dim_tp, single_core_forced, lnc):
    return 1 if hidden_dim_tp or single_core_forced else lnc


def reference_rmsnorm_tkg(
    input,
    gamma,
    *,
    eps=1e-6,
    hidden_actual=None,
    hidden_dim_tp=False,
    single_core_forced=False,
    shard_on_h=False,
    use_heap_memory=False,
    lnc=1,
):
    """JAX reference of ``rmsnorm_tkg``: ``[128, B*S, H/128]`` (order by the call's LNC degree)."""
    del shard_on_h, use_heap_memory  # same numbers and order as the default path
    y = _rmsnorm_rows(input, gamma, eps, hidden_actual or input.shape[-1])
    return (to_kernel_order(y, _rmsnorm_layout(hidden_dim_tp, single_core_forced, lnc), hidden_dim_tp),)


def _rmsnorm_tkg_vjp(kernel, operands, params, outs, cotangents):
    """``y = x g r``, ``r = (sum(x^2)/Ha + eps)^-1/2``: ``dx = r (dy g) - x r^3 sum(dy g x) / Ha``,
    ``dgamma = sum_rows(dy x r)``."""
    x, gamma = operands["input"], operands["gamma"]
    n = params["lnc"] if not (params["hidden_dim_tp"] or params["single_core_forced"]) else 1
    dy = cotangent_rows(cotangents[0], n, params["hidden_dim_tp"])
    wide = accumulation_dtype(x.dtype)
    xw, gw = token_rows(x).astype(wide), gamma.reshape(1, -1).astype(wide)
    hidden_actual = params["hidden_actual"] or x.shape[-1]
    r = rms_statistics(xw, hidden_actual, params["eps"])
    dyg = dy * gw
    dx = r * dyg - xw * (r**3) * jnp.sum(dyg * xw, axis=-1, keepdims=True) / hidden_actual
    dgamma = jnp.sum(dy * xw * r, axis=0, keepdims=True)
    return {"input": dx.reshape(x.shape), "gamma": dgamma}


def _check_rmsnorm(call: CallInfo) -> None:
    check_hidden(call)
    p, function = call.params, call.function
    if p["hidden_actual"] is not None and not 0 < p["hidden_actual"] <= call.dims["H"]:
        raise ValueError(f"{function}: hidden_actual must be in [1, H={call.dims['H']}]; got {p['hidden_actual']}")
    if p["shard_on_h"] and (p["hidden_dim_tp"] or p["single_core_forced"]):
        raise ValueError(
            f"{function}: shard_on_h cannot be combined with hidden_dim_tp or single_core_forced (the "
            "kernel asserts it)"
        )


def _sbuf_bytes(call: CallInfo, per_row_intermediates: int) -> int:
    rows, h1 = call.dims["B"] * call.dims["S"], call.dims["H"] // PARTITIONS
    itemsize = jnp.dtype(call.avals["input"].dtype).itemsize
    tile = min(rows, RMSNORM_BXS_TILE)
    staging = call.dims["H"] * itemsize if call.dims["H"] <= RMSNORM_CONTIGUOUS_LOAD_H else 0
    return rows * h1 * itemsize + per_row_intermediates * tile * h1 * 4 + staging + 2 * PARTITIONS * 4


def _rmsnorm_neuron_limits(call: CallInfo) -> list[str]:
    p = call.params
    n = 1 if p["hidden_dim_tp"] or p["single_core_forced"] else call.lnc
    unmet = shard_limits(call, n)
    if p["shard_on_h"] and call.lnc != 2:
        unmet.append("shard_on_h needs LNC=2")
    used = _sbuf_bytes(call, 2)
    if used > SBUF_PARTITION_BYTES:
        unmet.append(
            f"SBUF capacity: about {used} bytes per partition for B*S={call.dims['B'] * call.dims['S']}, "
            f"H={call.dims['H']} exceed {SBUF_PARTITION_BYTES}"
        )
    return unmet


RMSNORM_TKG_SPEC = KernelSpec(
    name="rmsnorm_tkg",
    entry_point="jax_nkilib_kernels.norm:rmsnorm_tkg",
    operands=(
        Operand.of("input", "B, S, H", doc="hidden states (zero-padded to H % 128 == 0, see hidden_actual)"),
        Operand.of("gamma", "1, H", doc="RMS norm weight"),
    ),
    params=(
        Param("eps", 1e-6, float, "epsilon inside the square root"),
        Param("hidden_actual", None, int, "unpadded H used for the mean (default H)"),
        Param("hidden_dim_tp", False, bool, "output order out[p, t, j] = y[t, j*128 + p]"),
        Param("single_core_forced", False, bool, "run on one core: the LNC=1 output order"),
        Param("shard_on_h", False, bool, "LNC=2: split H instead of B*S across the cores (same output)"),
        Param("use_heap_memory", False, bool, "SBUF heap instead of stack allocation (no numeric effect)"),
    ),
    reference=reference_rmsnorm_tkg,
    check=_check_rmsnorm,
    neuron_limits=_rmsnorm_neuron_limits,
    mac_count=lambda call: 3 * elements(call),
    **TKG_SPEC_FIELDS,
    support={
        "idiomatic": "rms_norm",
        "vjp": "JAX (hand-written from the RMSNorm formulas; no backward kernel)",
        "notes": f"output [{PARTITIONS}, B*S, H/{PARTITIONS}] in the LNC-dependent order; H % {PARTITIONS} == 0; "
        "SBUF-input variant n/a; "
        "device adapter jax_nkilib_kernels/norm.py",
    },
)


rmsnorm_tkg = make_kernel(RMSNORM_TKG_SPEC, _rmsnorm_tkg_vjp)
