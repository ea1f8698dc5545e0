"""``layernorm_tkg`` (catalog 1.19): token-generation LayerNorm with the transposed output of :mod:`.tkg_output`
(``input [B, S, H]``, ``gamma [1, H]``, ``beta [1, H]`` -> ``out [128, B*S, H/128]`` in ``input``'s dtype).

Math (float32 intermediates, or float64 for float64 inputs): ``mu = sum(x) * (1/H)``, ``var = sum(x^2) * (1/H) -
mu^2`` (one pass, as the kernel), then, each step rounded to ``input``'s dtype as the kernel's in-place SBUF tile:
``y = ((x - mu) * rsqrt(var + eps)) * gamma + beta``.

Reverse mode is JAX math written from these formulas (no backward kernel); ``use_heap_memory`` and ``shard_on_h``
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


def layer_statistics(x, eps: float):
    """``(mu, rsqrt(var + eps))`` per row of ``x [T, H]`` (wide dtype), the kernel's one-pass variance."""
    wide = x.dtype
    inv_h = jnp.asarray(1.0 / x.shape[-1], wide)
    mean = jnp.sum(x, axis=-1, keepdims=True) * inv_h
    var = jnp.sum(x * x, axis=-1, keepdims=True) * inv_h - mean * mean
    return mean, jax.lax.rsqrt(var + eps)


def layernorm_rows(x, gamma, beta, eps: float):
    """LayerNorm of ``x [..., H]`` over the last axis, each step rounded to ``x``'s dtype (the kernel's math)."""
    wide = accumulation_dtype(x.dtype)

    def rounded(v):
        return v.astype(x.dtype).astype(wide)

    xw = x.astype(wide)
    mean, inv_std = layer_statistics(xw, eps)
    y = rounded(rounded(xw - mean) * inv_std)
    if gamma is not None:
        y = rounded(y * gamma.reshape(-1).astype(wide))
    if beta is not None:
        y = rounded(y + beta.reshape(-1).astype(wide))
    return y.astype(x.dtype)


def reference_layernorm_tkg(input, gamma, beta=None, *, eps=1e-6, shard_on_h=False, use_heap_memory=False, lnc=1):
    """JAX reference of ``layernorm_tkg``: ``[128, B*S, H/128]`` (order by the call's LNC degree)."""
    del shard_on_h, use_heap_memory
    return (to_kernel_order(layernorm_rows(token_rows(input), gamma, beta, eps), lnc),)


def _layernorm_tkg_vjp(kernel, operands, params, outs, cotangents):
    """``xhat = (x - mu) r``: ``dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`` with ``dxhat = dy gamma``;
    ``dgamma = sum_rows(dy xhat)``, ``dbeta = sum_rows(dy)``."""
    x, gamma, beta = operands["input"], operands["gamma"], operands["beta"]
    dy = cotangent_rows(cotangents[0], params["lnc"])
    wide = accumulation_dtype(x.dtype)
    xw = token_rows(x).astype(wide)
    mean, r = layer_statistics(xw, params["eps"])
    xhat = (xw - mean) * r
    dxhat = dy * gamma.reshape(1, -1).astype(wide)
    dx = r * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True) - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    return {
        "input": dx.reshape(x.shape),
        "gamma": jnp.sum(dy * xhat, axis=0, keepdims=True),
        "beta": None if beta is None else jnp.sum(dy, axis=0, keepdims=True),
    }


def _layernorm_neuron_limits(call: CallInfo) -> list[str]:
    unmet = shard_limits(call, call.lnc)
    if call.params["shard_on_h"] and call.lnc != 2:
        unmet.append("shard_on_h needs LNC=2")
    rows, h1 = call.dims["B"] * call.dims["S"], call.dims["H"] // PARTITIONS
    used = (16 * rows * h1 + PARTITIONS) * 4  # the kernel sizes its SBUF manager so
    if used > SBUF_PARTITION_BYTES:
        unmet.append(
            f"SBUF capacity: (16*B*S*H/128 + 128)*4 = {used} bytes per partition exceed {SBUF_PARTITION_BYTES}"
        )
    return unmet


LAYERNORM_TKG_SPEC = KernelSpec(
    name="layernorm_tkg",
    entry_point="jax_nkilib_kernels.norm:layernorm_tkg",
    operands=(
        Operand.of("input", "B, S, H", doc="hidden states, H % 128 == 0"),
        Operand.of("gamma", "1, H", doc="LayerNorm weight"),
        Operand.of("beta", "1, H", optional=True, doc="LayerNorm bias"),
    ),
    params=(
        Param("eps", 1e-6, float, "epsilon added to the variance"),
        Param("shard_on_h", False, bool, "LNC=2: split H across the cores (2.32; same output)"),
        Param("use_heap_memory", False, bool, "SBUF heap instead of stack allocation (no numeric effect)"),
    ),
    reference=reference_layernorm_tkg,
    check=check_hidden,
    neuron_limits=_layernorm_neuron_limits,
    mac_count=lambda call: 5 * elements(call),
    **TKG_SPEC_FIELDS,
    support={
        "idiomatic": "layer_norm",
        "vjp": "JAX (hand-written from the LayerNorm formulas; no backward kernel)",
        "notes": f"output [{PARTITIONS}, B*S, H/{PARTITIONS}] in the LNC-dependent order; H % {PARTITIONS} == 0; "
        "one-pass variance as the "
        "kernel; SBUF-input variant n/a; device adapter jax_nkilib_kernels/norm.py",
    },
)


layernorm_tkg = make_kernel(LAYERNORM_TKG_SPEC, _layernorm_tkg_vjp)
