"""``ring_attention_spmd_bwd`` (catalog row 43, section 3; nki-library
``experimental/attention/ring_attention_bwd.py``):
the backward of ring attention over ``num_workers`` ranks. Called inside ``jax.shard_map``; ``replica_groups``
names the mesh axes of the ring.

Layouts (per rank, ``S`` = this rank's tokens): ``q_ref, k_ref, v_ref, o_ref, dy_ref [B, N, D, S]`` (note: ``v``
too is sequence-last here), ``lse_ref [B, N, 128, S/128]`` (``lse_ref[b, n, r, t]`` is the log-sum-exp of query
``t * 128 + r``, as ``ring_attention_spmd_fwd(training=True)`` returns it), ``bound_min``/``bound_max [B*N, S]``
float32 (sequence packing, striped causal only). Outputs ``dq, dk, dv [B, N, D, S]``, always **float32**.

Math: with ``P = exp(scale * q K^T - lse)`` over the visible keys of every rank (positions, striping and packing:
see :mod:`.ring_math`) and ``D = rowsum(dy * o)``: ``dv = P^T dy``, ``dS = P * (dy V^T - D)``,
``dq = scale * dS K``, ``dk = scale * dS^T q``, each rank's ``dk``/``dv`` summed over the queries of every rank.
``scale = softmax_scale or 1/sqrt(D)`` (pass 1.0 for a causal forward, whose ``q`` was pre-scaled). ``S % 128 == 0``
(the lse layout). ``striped_attention`` and the bounds require causal masking; the bounds also require striping.
``mixed_precision`` selects the kernel's float32 accumulators; this reference always accumulates in float32 (float64
for float64 inputs). ``lnc_size`` is the kernel's work split over logical cores: on Neuron it must equal the LNC
degree; it does not change the math.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.mesh_axes import lax_axis
from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Output, Param
from .attention_bwd import LSE_TILE, lse_rows
from .checks import MAX_HEAD_DIM
from .ring_checks import needs_trn2, require_ring
from .ring_math import ring_backward


def reference_ring_attention_spmd_bwd(
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    dy_ref,
    lse_ref,
    bound_min=None,
    bound_max=None,
    *,
    use_causal_mask=False,
    mixed_precision=True,
    softmax_scale=None,
    num_workers=1,
    lnc_size=1,
    replica_groups=None,
    striped_attention=False,
):
    """JAX reference (inside ``shard_map`` over ``replica_groups``); see the module docstring."""
    del mixed_precision, lnc_size  # precision and work split of the kernel only
    b, n, d, seq = q_ref.shape
    rows = lambda x: jnp.swapaxes(x, 2, 3).reshape(b * n, seq, d)  # noqa: E731
    lse = lse_rows(lse_ref).reshape(b * n, seq).astype(jnp.promote_types(q_ref.dtype, jnp.float32))
    grads = ring_backward(
        rows(q_ref),
        rows(k_ref),
        rows(v_ref),
        rows(o_ref),
        rows(dy_ref),
        lse,
        axes=lax_axis(replica_groups),
        nw=num_workers,
        scale=softmax_scale or 1.0 / d**0.5,
        causal=use_causal_mask,
        striped=striped_attention,
        bounds=None if bound_min is None else (bound_min, bound_max),
    )
    return tuple(jnp.swapaxes(g.reshape(b, n, seq, d), 2, 3).astype(jnp.float32) for g in grads)


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    require_ring(call, "replica_groups", "num_workers")
    if p["striped_attention"] and not p["use_causal_mask"]:
        raise ValueError(f"{function}: striped_attention=True requires use_causal_mask=True")
    if (avals.get("bound_min") is None) != (avals.get("bound_max") is None):
        raise ValueError(f"{function}: give both bound_min and bound_max [B*N, S], or neither")
    if avals.get("bound_min") is not None:
        if not (p["use_causal_mask"] and p["striped_attention"]):
            raise ValueError(
                f"{function}: bound_min/bound_max (sequence packing) require use_causal_mask=True and "
                "striped_attention=True"
            )
        if dims["BN"] != dims["B"] * dims["N"]:
            raise ValueError(
                f"{function}: bound_min/bound_max must be [B*N, S] = [{dims['B'] * dims['N']}, "
                f"{dims['S']}]; got {dims['BN']} rows"
            )
    names = ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref")
    if len({avals[name].dtype for name in names}) > 1:
        raise TypeError(
            f"{function}: q_ref, k_ref, v_ref, o_ref and dy_ref must share one dtype; got "
            f"{[str(avals[name].dtype) for name in names]}"
        )
    if p["lnc_size"] not in (1, 2):
        raise ValueError(f"{function}: lnc_size must be 1 or 2; got {p['lnc_size']}")


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet = needs_trn2(call)
    if call.dims["D"] > MAX_HEAD_DIM:
        unmet.append(f"head dim D={call.dims['D']} exceeds {MAX_HEAD_DIM}")
    if call.params["lnc_size"] != call.lnc:
        unmet.append(
            f"lnc_size={call.params['lnc_size']} must equal the LNC degree {call.lnc} (the kernel splits "
            "its work over lnc_size cores of the launch grid)"
        )
    return unmet


_LAYOUT = "B, N, D, S"
RING_ATTENTION_SPMD_BWD_SPEC = KernelSpec(
    name="ring_attention_spmd_bwd",
    entry_point="nkilib.experimental.attention.ring_attention_bwd:ring_attention_spmd_bwd",
    operands=(
        Operand.of("q_ref", _LAYOUT),
        Operand.of("k_ref", _LAYOUT),
        Operand.of("v_ref", _LAYOUT),
        Operand.of("o_ref", _LAYOUT),
        Operand.of("dy_ref", _LAYOUT),
        Operand.of("lse_ref", "B, N, 128, S/128", dtypes=(jnp.float32, jnp.bfloat16, jnp.float64)),
        Operand.of("bound_min", "BN, S", dtypes=(jnp.float32,), optional=True),
        Operand.of("bound_max", "BN, S", dtypes=(jnp.float32,), optional=True),
    ),
    params=(
        Param("use_causal_mask", False, bool),
        Param("mixed_precision", True, bool),
        Param("softmax_scale", None, float),
        Param("num_workers", 1, int),
        Param("lnc_size", 1, int),
        Param("replica_groups", None, "axis"),
        Param("striped_attention", False, bool),
    ),
    outputs=(
        Output.of("dq", _LAYOUT, "float32"),
        Output.of("dk", _LAYOUT, "float32"),
        Output.of("dv", _LAYOUT, "float32"),
    ),
    reference=reference_ring_attention_spmd_bwd,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                **dict.fromkeys(("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "lse_ref"), "B"),
                "bound_min": "BN",
                "bound_max": "BN",
            },
            outputs=("B", "B", "B"),
        ),
    ),
    has_collectives=True,
    mac_count=lambda call: (
        4 * call.dims["B"] * call.dims["N"] * call.dims["S"] ** 2 * call.params["num_workers"] * call.dims["D"]
    ),
    family="parallel",
    catalog="row 43, section 3",
    support={
        "idiomatic": "",
        "vjp": "not differentiable (it is the backward of ring_attention_spmd_fwd)",
        "shard_map": "inside jax.shard_map only: replica_groups names the ring's mesh axes (collectives)",
        "notes": f"Trn2+; S % {LSE_TILE} == 0; float32 gradients; lnc_size must equal the LNC degree on Neuron",
    },
)

ring_attention_spmd_bwd = make_kernel(RING_ATTENTION_SPMD_BWD_SPEC)
