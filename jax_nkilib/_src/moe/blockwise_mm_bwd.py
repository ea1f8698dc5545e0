"""``blockwise_mm_bwd`` (catalog 1.23, row 28): the backward kernel of the blockwise MoE forward
(``nkilib/experimental/moe/bwd/blockwise_mm_backward.py``, enums and ``ClampLimits`` in ``moe_bwd_parameters.py``;
oracle ``test/integration/nkilib/experimental/moe/test_bwmm_bwd_common.py``).

Takes the forward's operands, its activation checkpoints (``gate_up_proj_act_checkpoint_T [N, 2, I, B]``: the gate
and up projections after bias and clamp; ``down_proj_act_checkpoint [N, B, H]``: the expert output before the
affinity) and the output cotangent ``dy [T, H]``; the forward it differentiates is ``POST_SCALE``
(``y[ids] += a * d``). Per block (``g, u`` from the checkpoint, ``e`` its expert):

* ``da[ids, e] += sum_H(dy[ids] * d)``, ``dd = a * dy[ids]``;
* ``dW_down[e] += (act(g) u)^T dd``, ``db_down[e] += sum_B dd``, ``dh = dd W_down[e]^T``;
* ``dg = dh * u * act'(g) * [lower_nl < g < upper_nl]``, ``du = dh * act(g) * [lower_l < u < upper_l]``
  (``ClampLimits``: non-linear = gate, linear = up);
* ``dW_gu[e] += x^T [dg, du]``, ``db_gu[e] += sum_B [dg, du]``, ``dx[ids] += [dg, du] W_gu[e]^T``.

Returns ``(dhidden [T, H], daffinities [T*E, 1], dW_gu [E, H, 2, I], dW_down [E, I, H])`` in the operands' dtypes,
plus ``(db_gu [E, 2, I], db_down [E, H])`` in ``compute_dtype`` with ``bias=True``. Sums in float32 (float64 for
float64 inputs). The affinity gradient of a (token, expert) pair that several slots hold (only the padding row
``T``) is the sum over them here; the kernel writes each slot's value there. ``shard_option``,
``affinity_option``, ``kernel_type_option`` and ``block_tile_size`` are accepted like the kernel (which reads none
of them: it always runs its dropless, affinity-on-H path). Not differentiable again (no higher-order VJP).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

import jax
import jax.numpy as jnp

from ..framework.activations import activation
from ..framework.common_types import ActFnType
from ..framework.compat import varying_like
from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, NEURON_FLOAT_DTYPES, CallInfo, KernelSpec, Operand, Param
from ..framework.spec import accumulation_dtype as wide_dtype
from .blockwise_math import block_token_ids, padded_rows
from .moe_cte_config import skip_mode

BLOCK_SIZES = (128, 256, 512, 1024)
DMA_TRANSPOSE = 32  # H and I per core must be multiples of it


class ShardOption(enum.Enum):
    AUTO = 0
    SHARD_ON_HIDDEN = 1
    SHARD_ON_INTERMEDIATE = 2
    BASELINE_LNC1 = 3


class AffinityOption(enum.Enum):
    AFFINITY_ON_H = 0
    AFFINITY_ON_I = 1


class KernelTypeOption(enum.Enum):
    DROPPING = 0
    DROPLESS = 1


@dataclasses.dataclass(frozen=True)
class ClampLimits:
    """Clamp limits of the forward: ``non_linear_*`` for the gate projection, ``linear_*`` for the up projection."""

    linear_clamp_upper_limit: float | None = None
    linear_clamp_lower_limit: float | None = None
    non_linear_clamp_upper_limit: float | None = None
    non_linear_clamp_lower_limit: float | None = None


CLAMP_FIELDS = tuple(field.name for field in dataclasses.fields(ClampLimits))


def clamp_limits(value: Any, where: str) -> tuple:
    """``value`` (``None``, a :class:`ClampLimits` or an object with its fields) as the tuple of its four limits."""
    if value is None:
        return (None,) * 4
    if isinstance(value, tuple) and len(value) == 4:
        limits = value
    elif all(hasattr(value, name) for name in CLAMP_FIELDS):
        limits = tuple(getattr(value, name) for name in CLAMP_FIELDS)
    else:
        raise TypeError(f"{where} must be a jax_nkilib.nki.ClampLimits or None; got {value!r}")
    if not all(v is None or isinstance(v, (int, float)) and not isinstance(v, bool) for v in limits):
        raise TypeError(f"{where}: every limit must be a float or None; got {limits}")
    return tuple(None if v is None else float(v) for v in limits)


def _masked(x, upper, lower):
    keep = jnp.ones(x.shape, bool)
    if upper is not None:
        keep &= x < upper
    if lower is not None:
        keep &= x > lower
    return keep.astype(x.dtype)


def _activation_and_slope(g, fn):
    return jax.jvp(lambda z: activation(z, fn), (g,), (jnp.ones_like(g),))


def reference_blockwise_mm_bwd(
    hidden_states,
    expert_affinities_masked,
    gate_up_proj_weight,
    down_proj_weight,
    gate_up_proj_act_checkpoint_T,
    down_proj_act_checkpoint,
    token_position_to_id,
    block_to_expert,
    output_hidden_states_grad,
    *,
    block_size,
    skip_dma,
    compute_dtype,
    is_tensor_update_accumulating,
    shard_option,
    affinity_option,
    kernel_type_option,
    clamp_limits,
    bias,
    activation_type,
    block_tile_size,
):
    """JAX reference of ``blockwise_mm_bwd`` (see the module docstring)."""
    del is_tensor_update_accumulating, shard_option, affinity_option, kernel_type_option, block_tile_size
    linear_upper, linear_lower, gate_upper, gate_lower = clamp_limits
    skip_token = skip_dma[0]
    rows, hidden = hidden_states.shape
    experts, _, _, inter = gate_up_proj_weight.shape
    wide = wide_dtype(hidden_states.dtype)
    affinities = expert_affinities_masked.reshape(rows, experts)
    x_rows, a_rows = padded_rows(hidden_states, affinities, skip_token)
    dy_rows, _ = padded_rows(output_hidden_states_grad, affinities, skip_token)
    ids = block_token_ids(token_position_to_id, block_size, rows, skip_token)
    block_expert = block_to_expert.reshape(-1).astype(jnp.int32)
    w_gu = gate_up_proj_weight.astype(wide).reshape(experts, hidden, 2 * inter)
    w_down = down_proj_weight.astype(wide)
    dot = lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST)  # noqa: E731

    def step(carry, xs):
        dx, da, dw_gu, dw_down, db_gu, db_down = carry
        block_ids, e, gate_up_t, down_act = xs
        valid = (e >= 0) & (e < experts)
        e = jnp.clip(e, 0, experts - 1)
        on = lambda v: jnp.where(valid, v, 0)  # noqa: E731
        x, dy = x_rows[block_ids].astype(wide), dy_rows[block_ids].astype(wide)
        a = a_rows[block_ids, e].astype(wide)[:, None]
        d = down_act.astype(wide)
        g, u = gate_up_t[0].T.astype(wide), gate_up_t[1].T.astype(wide)
        da = da.at[block_ids, e].add(on(jnp.sum(dy * d, axis=1)))
        dd = on(a * dy)
        act, slope = _activation_and_slope(g, activation_type)
        dw_down = dw_down.at[e].add(dot((act * u).T, dd))
        db_down = db_down.at[e].add(jnp.sum(dd, axis=0))
        dh = dot(dd, w_down[e].T)
        dg = dh * u * slope * _masked(g, gate_upper, gate_lower)
        du = dh * act * _masked(u, linear_upper, linear_lower)
        dgu = jnp.concatenate([dg, du], axis=1)  # [B, 2I]
        dw_gu = dw_gu.at[e].add(dot(x.T, dgu))
        db_gu = db_gu.at[e].add(jnp.sum(dgu, axis=0))
        dx = dx.at[block_ids].add(dot(dgu, w_gu[e].T))
        return (dx, da, dw_gu, dw_down, db_gu, db_down), None

    operands = (
        hidden_states,
        expert_affinities_masked,
        gate_up_proj_weight,
        down_proj_weight,
        gate_up_proj_act_checkpoint_T,
        down_proj_act_checkpoint,
        output_hidden_states_grad,
    )
    zeros = lambda *shape: varying_like(jnp.zeros(shape, wide), *operands)  # noqa: E731  (carries in shard_map)
    init = (
        zeros(x_rows.shape[0], hidden),
        zeros(a_rows.shape[0], experts),
        zeros(experts, hidden, 2 * inter),
        zeros(experts, inter, hidden),
        zeros(experts, 2 * inter),
        zeros(experts, hidden),
    )
    xs = (ids, block_expert, gate_up_proj_act_checkpoint_T, down_proj_act_checkpoint)
    (dx, da, dw_gu, dw_down, db_gu, db_down), _ = jax.lax.scan(step, init, xs)
    grads = (
        dx[:rows].astype(hidden_states.dtype),
        da[:rows].reshape(-1, 1).astype(expert_affinities_masked.dtype),
        dw_gu.reshape(gate_up_proj_weight.shape).astype(gate_up_proj_weight.dtype),
        dw_down.astype(down_proj_weight.dtype),
    )
    if not bias:
        return grads
    return grads + (db_gu.reshape(experts, 2, inter).astype(compute_dtype), db_down.astype(compute_dtype))


def _check(call: CallInfo) -> None:
    dims, p, function = call.dims, call.params, call.function
    if dims["TE"] != dims["T"] * dims["E"]:
        raise ValueError(
            f"{function}: expert_affinities_masked must be [T*E, 1] = [{dims['T'] * dims['E']}, 1] for "
            f"hidden_states [T={dims['T']}, H] and E={dims['E']} experts; got [{dims['TE']}, 1]"
        )
    if dims["NB"] != dims["N"] * p["block_size"] or p["block_size"] < 1:
        raise ValueError(
            f"{function}: token_position_to_id must be [N*B] = [{dims['N'] * p['block_size']}] for N={dims['N']} "
            f"blocks (block_to_expert [N, 1]) of block_size={p['block_size']}; got [{dims['NB']}]"
        )
    if dims["B"] != p["block_size"]:
        raise ValueError(
            f"{function}: the checkpoints' block dimension B={dims['B']} must equal block_size={p['block_size']}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    """``MOEBwdParameters.validate`` / ``validate_sharding``, and the activations the kernel differentiates."""
    unmet = []
    hidden, inter, lnc = call.dims["H"], call.dims["I"], call.lnc
    if call.params["block_size"] not in BLOCK_SIZES:
        unmet.append(f"block_size in {BLOCK_SIZES}")
    if hidden % (DMA_TRANSPOSE * lnc) or inter % (DMA_TRANSPOSE * lnc):
        unmet.append(f"H and I divisible by {DMA_TRANSPOSE} * LNC (H={hidden}, I={inter}; DMA transposes per core)")
    if call.params["activation_type"] not in (ActFnType.SiLU, ActFnType.Swish):
        unmet.append("activation_type SiLU or Swish (the kernel's derivatives)")
    if call.avals["hidden_states"].dtype not in NEURON_FLOAT_DTYPES:
        unmet.append("float32/bfloat16/float16 tensors")
    return unmet


def _output_avals(call: CallInfo):
    avals = call.avals
    outs = [
        ("hidden_states_grad", avals["hidden_states"].shape, avals["hidden_states"].dtype),
        (
            "expert_affinities_masked_grad",
            avals["expert_affinities_masked"].shape,
            avals["expert_affinities_masked"].dtype,
        ),
        ("gate_up_proj_weight_grad", avals["gate_up_proj_weight"].shape, avals["gate_up_proj_weight"].dtype),
        ("down_proj_weight_grad", avals["down_proj_weight"].shape, avals["down_proj_weight"].dtype),
    ]
    if call.params["bias"]:
        d = call.dims
        outs += [
            ("gate_and_up_proj_bias_grad", (d["E"], 2, d["I"]), call.params["compute_dtype"]),
            ("down_proj_bias_grad", (d["E"], d["H"]), call.params["compute_dtype"]),
        ]
    return outs


BLOCKWISE_MM_BWD_SPEC = KernelSpec(
    name="blockwise_mm_bwd",
    entry_point="jax_nkilib_kernels.moe_cte:blockwise_mm_bwd",
    operands=(
        Operand.of("hidden_states", "T, H", doc="the forward's hidden states (padding row included)"),
        Operand.of("expert_affinities_masked", "TE, 1", doc="[T*E, 1] affinities"),
        Operand.of("gate_up_proj_weight", "E, H, 2, I"),
        Operand.of("down_proj_weight", "E, I, H"),
        Operand.of("gate_up_proj_act_checkpoint_T", "N, 2, I, B", doc="gate/up after bias and clamp"),
        Operand.of("down_proj_act_checkpoint", "N, B, H", doc="expert output before the affinity"),
        Operand.of("token_position_to_id", "NB", dtypes=INT_DTYPES),
        Operand.of("block_to_expert", "N, 1", dtypes=INT_DTYPES),
        Operand.of("output_hidden_states_grad", "T, H", dtypes=FLOAT_DTYPES),
    ),
    params=(
        Param("block_size", None, int, "tokens per block (128, 256, 512 or 1024 on Neuron)", required=True),
        Param("skip_dma", None, tuple, "SkipMode(skip_token, skip_weight)", normalizer=skip_mode),
        Param("compute_dtype", "bfloat16", "dtype", "dtype of the bias gradients"),
        Param("is_tensor_update_accumulating", True, bool, "accumulate per-token gradients over blocks"),
        Param("shard_option", "SHARD_ON_HIDDEN", ShardOption, "accepted; the kernel does not read it"),
        Param("affinity_option", "AFFINITY_ON_H", AffinityOption, "accepted; the kernel does not read it"),
        Param("kernel_type_option", "DROPLESS", KernelTypeOption, "accepted; only DROPLESS runs"),
        Param("clamp_limits", None, tuple, "ClampLimits of the forward", normalizer=clamp_limits),
        Param("bias", False, bool, "also return the bias gradients"),
        Param("activation_type", "SiLU", ActFnType, "the forward's activation"),
        Param("block_tile_size", None, int, "accepted; the kernel does not read it"),
    ),
    outputs=(),
    output_avals=_output_avals,
    reference=reference_blockwise_mm_bwd,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: 6 * call.dims["N"] * call.dims["B"] * call.dims["H"] * call.dims["I"],
    family="moe",
    catalog="1.23",
    support={
        "idiomatic": "moe",
        "vjp": "none (it is a backward kernel)",
        "notes": "POST_SCALE forward only; block_size in 128/256/512/1024; H, I % (32 LNC) == 0; device adapter "
        "jax_nkilib_kernels/moe_cte.py",
    },
)

blockwise_mm_bwd = make_kernel(BLOCKWISE_MM_BWD_SPEC)
