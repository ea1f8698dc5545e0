"""``ring_attention_spmd_fwd`` (catalog row 42, section 3; nki-library
``experimental/attention/ring_attention_fwd.py``):
context-parallel attention over a ring of ``num_workers`` ranks. Called inside ``jax.shard_map``;
``replica_groups`` names the mesh axes of the ring (the kernel gets them as rank lists).

Layouts (per rank, ``S`` = this rank's tokens): ``q [b, h, S, d]`` (``tp_q=True``) or ``[b, h, d, S]`` (default);
``k`` likewise with ``tp_k``; ``v [b, h, S, d]``; ``bound_min``/``bound_max [b*h, S, 1]`` float32 (sequence
packing). Outputs ``o [b, h, S, d]`` in ``q``'s dtype and, with ``training=True``, ``lse [b, h, 128, S/128]`` in
``lse_dtype`` (``lse[b, h, r, t]`` is the log-sum-exp of query ``t * 128 + r``). MHA only (same heads in q, k, v).

Math: ``o = softmax(scale * q K^T) V`` over the keys of every rank of the group (positions, striping and packing:
see :mod:`.ring_math`). ``scale = softmax_scale or 1/sqrt(d)`` without causal masking; **with
``use_causal_mask=True`` the kernel uses scale 1.0** (the caller pre-scales ``q``), so a causal call must leave
``softmax_scale`` at ``None`` or 1.0 (checked: another value would be silently ignored). ``striped_input`` and
the bounds require causal masking; the bounds also require ``striped_input``. ``training`` needs ``S % 128 == 0``.
Rows that see no key (packing) give ``o = 0`` and ``lse = 0``.

Numerics: scores and softmax in float32, probabilities rounded to the input dtype before ``P V``, output in ``q``'s
dtype. The kernel merges its per-step partial outputs in bfloat16 SBUF tiles; this reference keeps them in float32.

Reverse mode: when ``S % 128 == 0`` and the inputs are not float64 the forward runs with ``training=True`` and the
backward is :func:`ring_attention_spmd_bwd` (gradients come back float32 and are cast to the inputs' dtypes), so
training on Neuron runs kernels both ways; otherwise the backward is the same math in JAX.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..framework.mesh_axes import lax_axis
from ..framework.primitive import Vjp, make_kernel
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from .attention_bwd import LSE_TILE, lse_tiles
from .checks import MAX_HEAD_DIM, head_dim_limit
from .ring_attention_bwd import ring_attention_spmd_bwd
from .ring_checks import needs_trn2, require_ring
from .ring_math import ring_backward, ring_forward

MAX_TESTED_SEQ = 16384  # the kernel's docstring: tested up to 16k tokens per rank


def effective_scale(softmax_scale, causal: bool, d: int) -> float:
    """The scale the kernel applies: 1.0 with causal masking, else ``softmax_scale or 1/sqrt(d)``."""
    return 1.0 if causal else (softmax_scale or 1.0 / math.sqrt(d))


def _rows(x, transposed_seq_last: bool):
    """``[b, h, S, d]`` (or ``[b, h, d, S]`` when ``transposed_seq_last``) -> ``[b*h, S, d]``."""
    x = jnp.swapaxes(x, 2, 3) if transposed_seq_last else x
    return x.reshape(-1, *x.shape[2:])


def _unrows(x, b: int, h: int, transposed_seq_last: bool):
    """Inverse of :func:`_rows`."""
    x = x.reshape(b, h, *x.shape[1:])
    return jnp.swapaxes(x, 2, 3) if transposed_seq_last else x


def _bounds(bound_min, bound_max):
    return None if bound_min is None else (bound_min[..., 0], bound_max[..., 0])


def _forward_math(q, k, v, bound_min, bound_max, params):
    """``(o [b*h, S, d]`` accumulation dtype, ``lse [b*h, S])`` for the kernel's operands."""
    d = q.shape[3] if params["tp_q"] else q.shape[2]
    return ring_forward(
        _rows(q, not params["tp_q"]),
        _rows(k, not params["tp_k"]),
        _rows(v, False),
        axes=lax_axis(params["replica_groups"]),
        nw=params["num_workers"],
        scale=effective_scale(params["softmax_scale"], params["use_causal_mask"], d),
        causal=params["use_causal_mask"],
        striped=params["striped_input"],
        bounds=_bounds(bound_min, bound_max),
    )


def reference_ring_attention_spmd_fwd(q, k, v, bound_min=None, bound_max=None, **params):
    """JAX reference (inside ``shard_map`` over ``replica_groups``); see the module docstring."""
    out, lse = _forward_math(q, k, v, bound_min, bound_max, params)
    b, h = q.shape[:2]
    out = out.astype(q.dtype).reshape(b, h, *out.shape[1:])
    if not params["training"]:
        return (out,)
    return out, lse_tiles(lse).reshape(b, h, LSE_TILE, -1).astype(params["lse_dtype"])


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    require_ring(call, "replica_groups", "num_workers")
    causal = p["use_causal_mask"]
    if causal and p["softmax_scale"] not in (None, 1.0):
        raise ValueError(
            f"{function}: with use_causal_mask=True the kernel applies scale 1.0 and ignores "
            f"softmax_scale={p['softmax_scale']}: pre-scale q and pass softmax_scale=None or 1.0"
        )
    if p["striped_input"] and not causal:
        raise ValueError(f"{function}: striped_input=True requires use_causal_mask=True")
    if (avals.get("bound_min") is None) != (avals.get("bound_max") is None):
        raise ValueError(f"{function}: give both bound_min and bound_max [b*h, S, 1], or neither")
    if avals.get("bound_min") is not None:
        if not (causal and p["striped_input"]):
            raise ValueError(
                f"{function}: bound_min/bound_max (sequence packing) require use_causal_mask=True and "
                "striped_input=True"
            )
        if dims["bh"] != dims["b"] * dims["h"]:
            raise ValueError(
                f"{function}: bound_min/bound_max must be [b*h, S, 1] = [{dims['b'] * dims['h']}, "
                f"{dims['S']}, 1]; got {dims['bh']} rows"
            )
    if len({avals[name].dtype for name in ("q", "k", "v")}) > 1:
        raise TypeError(
            f"{function}: q, k and v must share one dtype; got {[str(avals[name].dtype) for name in ('q', 'k', 'v')]}"
        )
    if p["training"] and dims["S"] % LSE_TILE:
        raise ValueError(
            f"{function}: training=True (the lse output [b, h, 128, S/128]) needs S to be a multiple "
            f"of {LSE_TILE}; got S={dims['S']}"
        )
    if p["lse_dtype"] not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{function}: lse_dtype must be float32 or bfloat16; got {p['lse_dtype']}")


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet = head_dim_limit(call) + needs_trn2(call)
    if call.dims["S"] > MAX_TESTED_SEQ:
        unmet.append(f"S={call.dims['S']} tokens per rank exceeds the kernel's tested {MAX_TESTED_SEQ}")
    return unmet


# ------------------------------------------------------------------------------------------------ reverse mode
def bwd_kernel_applies(operands, params) -> bool:
    """Whether the VJP can bind ``ring_attention_spmd_bwd`` (its lse layout needs ``S % 128 == 0``)."""
    seq = operands["v"].shape[2]
    return seq % LSE_TILE == 0 and operands["q"].dtype != jnp.float64  # float64 (CPU) keeps float64 statistics


def _forward_with_lse(kernel, operands, params):
    applies = bwd_kernel_applies(operands, params)
    outs = kernel.call(operands, dict(params, training=True) if applies else params)
    user_outs = outs if params["training"] or not applies else outs[:1]
    return user_outs, (operands, outs, applies)


def _to_bwd_layout(x, seq_last: bool):
    """``[b, h, S, d]`` (or already ``[b, h, d, S]``) -> the backward kernel's ``[B, N, D, S]`` (and back: the
    swap is its own inverse)."""
    return x if seq_last else jnp.swapaxes(x, 2, 3)


def _backward(kernel, residuals, params, cotangents):
    operands, outs, applies = residuals
    q, k, v = operands["q"], operands["k"], operands["v"]
    tp_q, tp_k, causal = params["tp_q"], params["tp_k"], params["use_causal_mask"]
    d = q.shape[3] if tp_q else q.shape[2]
    scale = effective_scale(params["softmax_scale"], causal, d)
    dy = cotangents[0].astype(q.dtype)
    if applies:
        bounds = [None if operands[n] is None else operands[n][..., 0] for n in ("bound_min", "bound_max")]
        dq, dk, dv = ring_attention_spmd_bwd(
            _to_bwd_layout(q, not tp_q),
            _to_bwd_layout(k, not tp_k),
            _to_bwd_layout(v, False),
            _to_bwd_layout(outs[0], False),
            _to_bwd_layout(dy, False),
            outs[1],
            *bounds,
            use_causal_mask=causal,
            mixed_precision=True,
            softmax_scale=scale,
            num_workers=params["num_workers"],
            lnc_size=params["lnc"],
            replica_groups=params["replica_groups"],
            striped_attention=params["striped_input"],
        )
        return {"q": _to_bwd_layout(dq, not tp_q), "k": _to_bwd_layout(dk, not tp_k), "v": _to_bwd_layout(dv, False)}
    # float64, or S % 128 != 0: the same math in JAX, from a recomputed forward's statistics
    out, lse = _forward_math(q, k, v, operands["bound_min"], operands["bound_max"], params)
    dq, dk, dv = ring_backward(
        _rows(q, not tp_q),
        _rows(k, not tp_k),
        _rows(v, False),
        out,
        _rows(dy, False),
        lse,
        axes=lax_axis(params["replica_groups"]),
        nw=params["num_workers"],
        scale=scale,
        causal=causal,
        striped=params["striped_input"],
        bounds=_bounds(operands["bound_min"], operands["bound_max"]),
    )
    b, h = q.shape[:2]
    return {"q": _unrows(dq, b, h, not tp_q), "k": _unrows(dk, b, h, not tp_k), "v": _unrows(dv, b, h, False)}


def _outputs(call: CallInfo):
    """``o [b, h, S, d]`` in q's dtype and, with ``training``, ``lse [b, h, 128, S/128]`` in ``lse_dtype``."""
    out = [("o", call.shape("b, h, S, d"), call.avals["q"].dtype)]
    if call.params["training"]:
        out.append(("lse", call.shape("b, h, 128, S/128"), call.params["lse_dtype"]))
    return out


RING_ATTENTION_SPMD_FWD_SPEC = KernelSpec(
    name="ring_attention_spmd_fwd",
    entry_point="nkilib.experimental.attention.ring_attention_fwd:ring_attention_spmd_fwd",
    operands=(
        Operand.switched("q", "tp_q", {False: "b, h, d, S", True: "b, h, S, d"}),
        Operand.switched("k", "tp_k", {False: "b, h, d, S", True: "b, h, S, d"}),
        Operand.of("v", "b, h, S, d"),
        Operand.of("bound_min", "bh, S, 1", dtypes=(jnp.float32,), optional=True),
        Operand.of("bound_max", "bh, S, 1", dtypes=(jnp.float32,), optional=True),
    ),
    params=(
        Param("replica_groups", None, "axis"),
        Param("num_workers", 1, int),
        Param("softmax_scale", None, float),
        Param("use_causal_mask", False, bool),
        Param("striped_input", False, bool),
        Param("training", False, bool),
        Param("lse_dtype", jnp.float32, "dtype"),
        Param("tp_q", False, bool),
        Param("tp_k", False, bool),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_ring_attention_spmd_fwd,
    check=_check,
    neuron_limits=_neuron_limits,
    # a vmapped axis folds into the batch (and the bounds' b*h rows, whose major part is b)
    fold_plans=(
        FoldPlan({"q": "b", "k": "b", "v": "b", "bound_min": "bh", "bound_max": "bh"}, outputs={"o": 0, "lse": 0}),
    ),
    has_collectives=True,
    mac_count=lambda call: (
        2 * call.dims["b"] * call.dims["h"] * call.dims["S"] ** 2 * call.params["num_workers"] * call.dims["d"]
    ),
    nondifferentiable_outputs=("lse",),
    family="parallel",
    catalog="row 42, section 3",
    support={
        "idiomatic": "",
        "vjp": f"ring_attention_spmd_bwd kernel (forward with training=True) when S % {LSE_TILE} == 0; JAX otherwise",
        "shard_map": "inside jax.shard_map only: replica_groups names the ring's mesh axes (collectives)",
        "notes": "Trn2+; MHA only; causal needs pre-scaled q (softmax_scale None/1.0); striped causal, "
        f"sequence packing; d <= {MAX_HEAD_DIM}",
    },
)

ring_attention_spmd_fwd = make_kernel(RING_ATTENTION_SPMD_FWD_SPEC, vjp=Vjp(_forward_with_lse, _backward))
