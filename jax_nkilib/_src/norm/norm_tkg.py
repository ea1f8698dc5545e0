"""``rmsnorm_tkg`` and ``layernorm_tkg`` (catalog 1.19): token-generation norms with a transposed output.

Layouts: ``input [B, S, H]`` (H % 128 == 0), ``gamma [1, H]``, ``beta [1, H]``; output ``out [128, B*S, H/128]`` in
``input``'s dtype. The kernels also take the input already in SBUF as ``[128, B*S, H/128]``; a JAX array is always in
HBM, so that variant does not apply here.

Output order. Row ``t`` (of ``B*S``, batch-major) of the normalized ``y [B*S, H]`` is cut into ``n`` shards of
``H/128/n`` column tiles; shard ``k`` (columns ``k*128*H2 .. (k+1)*128*H2``, ``H2 = H/128/n``) goes to
``out[p, t, k*H2 + j] = y[t, k*128*H2 + p*H2 + j]``. ``n`` is the LNC degree (``jax_nkilib.config(lnc=...)``), or 1
for rmsnorm_tkg with ``hidden_dim_tp`` or ``single_core_forced``; ``hidden_dim_tp`` instead gives ``out[p, t, j] =
y[t, j*128 + p]``. (With ``H/128`` not divisible by ``n`` the last shard takes the remainder, as the kernel's loader.)

Math (float32 intermediates, or float64 for float64 inputs; the output rounded to ``input``'s dtype):

* rmsnorm_tkg: ``y = (x * gamma) * rsqrt(sum(x^2) * (1/hidden_actual) + eps)``; ``hidden_actual`` (default H) is
  the unpadded width when the input is zero-padded to a multiple of 128.
* layernorm_tkg: ``mu = sum(x) * (1/H)``, ``var = sum(x^2) * (1/H) - mu^2`` (one pass, as the kernel), then, each
  step rounded to ``input``'s dtype as the kernel's in-place SBUF tile: ``y = ((x - mu) * rsqrt(var + eps)) * gamma
  + beta``.

Reverse mode is JAX math written from these formulas (no backward kernel); ``use_heap_memory`` and
``single_core_forced``/``shard_on_h`` (beyond the layout) only change how the kernel runs.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..framework.hardware import PARTITIONS, SBUF_PARTITION_BYTES
from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype

RMSNORM_BXS_TILE = 512  # rmsnorm_tkg processes B*S in tiles of 512 rows
RMSNORM_CONTIGUOUS_LOAD_H = 2048  # up to this H the loader stages [128 rows, H] per partition


def shard_widths(h1: int, n: int) -> list[int]:
    """Column tiles per shard: ``h1 // n`` each, the last shard taking the remainder."""
    base = h1 // n
    return [base] * (n - 1) + [h1 - base * (n - 1)]


def rows_from_tiles(tiles, n: int, hidden_dim_tp: bool = False):
    """``[T, 128, H/128]`` (the output with its first two axes swapped) to rows ``[T, H]``: the inverse order of
    the module docstring."""
    t, p, h1 = tiles.shape
    if hidden_dim_tp:
        return jnp.swapaxes(tiles, 1, 2).reshape(t, p * h1)
    if n == 1:
        return tiles.reshape(t, p * h1)
    if h1 % n == 0:
        return jnp.swapaxes(tiles.reshape(t, p, n, h1 // n), 1, 2).reshape(t, p * h1)
    pieces, start = [], 0
    for width in shard_widths(h1, n):
        pieces.append(tiles[:, :, start:start + width].reshape(t, p * width))
        start += width
    return jnp.concatenate(pieces, axis=1)


def tiles_from_rows(rows, n: int, hidden_dim_tp: bool = False):
    """Inverse of :func:`rows_from_tiles`: ``[T, H]`` to ``[T, 128, H/128]``."""
    t, h = rows.shape
    if hidden_dim_tp:
        return jnp.swapaxes(rows.reshape(t, h // PARTITIONS, PARTITIONS), 1, 2)
    if n == 1:
        return rows.reshape(t, PARTITIONS, h // PARTITIONS)
    if (h // PARTITIONS) % n == 0:
        return jnp.swapaxes(rows.reshape(t, n, PARTITIONS, h // PARTITIONS // n), 1, 2).reshape(t, PARTITIONS, h // PARTITIONS)
    pieces, start = [], 0
    for width in shard_widths(h // PARTITIONS, n):
        pieces.append(rows[:, start * PARTITIONS:(start + width) * PARTITIONS].reshape(t, PARTITIONS, width))
        start += width
    return jnp.concatenate(pieces, axis=2)


def to_kernel_order(y, n: int, hidden_dim_tp: bool = False):
    """Rows ``[T, H]`` -> the kernel output ``[128, T, H/128]``."""
    return jnp.swapaxes(tiles_from_rows(y, n, hidden_dim_tp), 0, 1)


def from_kernel_order(out, n: int, hidden_dim_tp: bool = False):
    """The kernel output ``[128, T, H/128]`` -> rows ``[T, H]``."""
    return rows_from_tiles(jnp.swapaxes(out, 0, 1), n, hidden_dim_tp)



def _rows(x):
    return x.reshape(-1, x.shape[-1])


def rms_statistics(x, hidden_actual: int, eps: float):
    """``rsqrt(sum(x^2) * (1/hidden_actual) + eps)`` per row of ``x [T, H]`` (wide dtype), shape ``[T, 1]``."""
    wide = x.dtype
    return jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) * jnp.asarray(1.0 / hidden_actual, wide) + eps)


def _rmsnorm_rows(x, gamma, eps, hidden_actual):
    wide = accumulation_dtype(x.dtype)
    xw = _rows(x).astype(wide)
    return ((xw * gamma.reshape(1, -1).astype(wide)) * rms_statistics(xw, hidden_actual, eps)).astype(x.dtype)


def _rmsnorm_layout(hidden_dim_tp, single_core_forced, lnc):
    return 1 if hidden_dim_tp or single_core_forced else lnc


def reference_rmsnorm_tkg(input, gamma, *, eps=1e-6, hidden_actual=None, hidden_dim_tp=False,
                          single_core_forced=False, shard_on_h=False, use_heap_memory=False, lnc=1):
    """JAX reference of ``rmsnorm_tkg``: ``[128, B*S, H/128]`` (order by the call's LNC degree)."""
    del shard_on_h, use_heap_memory  # same numbers and order as the default path
    y = _rmsnorm_rows(input, gamma, eps, hidden_actual or input.shape[-1])
    return (to_kernel_order(y, _rmsnorm_layout(hidden_dim_tp, single_core_forced, lnc), hidden_dim_tp),)


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


def reference_layernorm_tkg(input, gamma, beta=None, *, eps=1e-6, shard_on_h=False, use_heap_memory=False,
                            lnc=1):
    """JAX reference of ``layernorm_tkg``: ``[128, B*S, H/128]`` (order by the call's LNC degree)."""
    del shard_on_h, use_heap_memory
    return (to_kernel_order(layernorm_rows(_rows(input), gamma, beta, eps), lnc),)


# ------------------------------------------------------------------------------------------------------ VJPs
def _cotangent_rows(g, n, hidden_dim_tp=False):
    return from_kernel_order(g, n, hidden_dim_tp).astype(accumulation_dtype(g.dtype))


def _rmsnorm_tkg_vjp(kernel, operands, params, outs, cotangents):
    """``y = x g r``, ``r = (sum(x^2)/Ha + eps)^-1/2``: ``dx = r (dy g) - x r^3 sum(dy g x) / Ha``,
    ``dgamma = sum_rows(dy x r)``."""
    x, gamma = operands["input"], operands["gamma"]
    n = params["lnc"] if not (params["hidden_dim_tp"] or params["single_core_forced"]) else 1
    dy = _cotangent_rows(cotangents[0], n, params["hidden_dim_tp"])
    wide = accumulation_dtype(x.dtype)
    xw, gw = _rows(x).astype(wide), gamma.reshape(1, -1).astype(wide)
    hidden_actual = params["hidden_actual"] or x.shape[-1]
    r = rms_statistics(xw, hidden_actual, params["eps"])
    dyg = dy * gw
    dx = r * dyg - xw * (r ** 3) * jnp.sum(dyg * xw, axis=-1, keepdims=True) / hidden_actual
    dgamma = jnp.sum(dy * xw * r, axis=0, keepdims=True)
    return {"input": dx.reshape(x.shape), "gamma": dgamma}


def _layernorm_tkg_vjp(kernel, operands, params, outs, cotangents):
    """``xhat = (x - mu) r``: ``dx = r (dxhat - mean(dxhat) - xhat mean(dxhat xhat))`` with ``dxhat = dy gamma``;
    ``dgamma = sum_rows(dy xhat)``, ``dbeta = sum_rows(dy)``."""
    x, gamma, beta = operands["input"], operands["gamma"], operands["beta"]
    dy = _cotangent_rows(cotangents[0], params["lnc"])
    wide = accumulation_dtype(x.dtype)
    xw = _rows(x).astype(wide)
    mean, r = layer_statistics(xw, params["eps"])
    xhat = (xw - mean) * r
    dxhat = dy * gamma.reshape(1, -1).astype(wide)
    dx = r * (dxhat - jnp.mean(dxhat, axis=-1, keepdims=True)
              - xhat * jnp.mean(dxhat * xhat, axis=-1, keepdims=True))
    return {"input": dx.reshape(x.shape), "gamma": jnp.sum(dy * xhat, axis=0, keepdims=True),
            "beta": None if beta is None else jnp.sum(dy, axis=0, keepdims=True)}


# ----------------------------------------------------------------------------------------------------- specs
def _check_h(call: CallInfo) -> None:
    h = call.dims["H"]
    if h % PARTITIONS:
        raise ValueError(f"{call.function}: `input` [B, S, H] needs H % 128 == 0 (the output is [128, B*S, H/128]); "
                         f"got H={h}")


def _check_rmsnorm(call: CallInfo) -> None:
    _check_h(call)
    p, function = call.params, call.function
    if p["hidden_actual"] is not None and not 0 < p["hidden_actual"] <= call.dims["H"]:
        raise ValueError(f"{function}: hidden_actual must be in [1, H={call.dims['H']}]; got {p['hidden_actual']}")
    if p["shard_on_h"] and (p["hidden_dim_tp"] or p["single_core_forced"]):
        raise ValueError(f"{function}: shard_on_h cannot be combined with hidden_dim_tp or single_core_forced (the "
                         "kernel asserts it)")


def _sbuf_bytes(call: CallInfo, per_row_intermediates: int) -> int:
    rows, h1 = call.dims["B"] * call.dims["S"], call.dims["H"] // PARTITIONS
    itemsize = jnp.dtype(call.avals["input"].dtype).itemsize
    tile = min(rows, RMSNORM_BXS_TILE)
    staging = call.dims["H"] * itemsize if call.dims["H"] <= RMSNORM_CONTIGUOUS_LOAD_H else 0
    return rows * h1 * itemsize + per_row_intermediates * tile * h1 * 4 + staging + 2 * PARTITIONS * 4


def _shard_limits(call: CallInfo, n: int) -> list[str]:
    h1 = call.dims["H"] // PARTITIONS
    if n > 1 and h1 % n:
        return [f"H/128={h1} must be divisible by the {n} H shards at LNC={call.lnc}"]
    return []


def _rmsnorm_neuron_limits(call: CallInfo) -> list[str]:
    p = call.params
    n = 1 if p["hidden_dim_tp"] or p["single_core_forced"] else call.lnc
    unmet = _shard_limits(call, n)
    if p["shard_on_h"] and call.lnc != 2:
        unmet.append("shard_on_h needs LNC=2")
    used = _sbuf_bytes(call, 2)
    if used > SBUF_PARTITION_BYTES:
        unmet.append(f"SBUF capacity: about {used} bytes per partition for B*S={call.dims['B'] * call.dims['S']}, "
                     f"H={call.dims['H']} exceed {SBUF_PARTITION_BYTES}")
    return unmet


def _layernorm_neuron_limits(call: CallInfo) -> list[str]:
    unmet = _shard_limits(call, call.lnc)
    if call.params["shard_on_h"] and call.lnc != 2:
        unmet.append("shard_on_h needs LNC=2")
    rows, h1 = call.dims["B"] * call.dims["S"], call.dims["H"] // PARTITIONS
    used = (16 * rows * h1 + PARTITIONS) * 4  # the kernel sizes its SBUF manager so
    if used > SBUF_PARTITION_BYTES:
        unmet.append(f"SBUF capacity: (16*B*S*H/128 + 128)*4 = {used} bytes per partition exceed "
                     f"{SBUF_PARTITION_BYTES}")
    return unmet


def _outputs(call: CallInfo):
    """``out [128, B * S, H / 128]`` in the input's dtype."""
    dims = call.dims
    return [("out", (128, dims["B"] * dims["S"], dims["H"] // 128), call.avals["input"].dtype)]

_FOLD = (FoldPlan({"input": "B", "gamma": None, "beta": None}, outputs={"out": 1}),)


def _elements(call: CallInfo) -> int:
    return math.prod(call.avals["input"].shape)


RMSNORM_TKG_SPEC = KernelSpec(
    reference_takes_lnc=True,
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
    outputs=(),
    output_avals=_outputs,
    reference=reference_rmsnorm_tkg,
    check=_check_rmsnorm,
    neuron_limits=_rmsnorm_neuron_limits,
    fold_plans=_FOLD,
    neuron_split_dims=("B",),
    mac_count=lambda call: 3 * _elements(call),
    family="norm",
    catalog="1.19",
    support={"idiomatic": "rms_norm",
             "vjp": "JAX (hand-written from the RMSNorm formulas; no backward kernel)",
             "notes": "output [128, B*S, H/128] in the LNC-dependent order; H % 128 == 0; SBUF-input variant n/a; "
                      "device adapter jax_nkilib_kernels/norm.py"},
)

LAYERNORM_TKG_SPEC = KernelSpec(
    reference_takes_lnc=True,
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
    outputs=(),
    output_avals=_outputs,
    reference=reference_layernorm_tkg,
    check=_check_h,
    neuron_limits=_layernorm_neuron_limits,
    fold_plans=_FOLD,
    neuron_split_dims=("B",),
    mac_count=lambda call: 5 * _elements(call),
    family="norm",
    catalog="1.19",
    support={"idiomatic": "layer_norm",
             "vjp": "JAX (hand-written from the LayerNorm formulas; no backward kernel)",
             "notes": "output [128, B*S, H/128] in the LNC-dependent order; H % 128 == 0; one-pass variance as the "
                      "kernel; SBUF-input variant n/a; device adapter jax_nkilib_kernels/norm.py"},
)

rmsnorm_tkg = make_kernel(RMSNORM_TKG_SPEC, _rmsnorm_tkg_vjp)
layernorm_tkg = make_kernel(LAYERNORM_TKG_SPEC, _layernorm_tkg_vjp)
