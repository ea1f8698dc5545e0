"""``attention_bwd`` (catalog 1.2): the NKI FlashAttention backward kernel.

Layouts: ``q_ref, o_ref, dy_ref [bs, H, d, Sq]``, ``k_ref, v_ref [bs, H_kv, d, Sk]`` (``H % H_kv == 0``: query head
``h`` uses KV head ``h // (H / H_kv)``), ``lse_ref [bs, H, 128, Sq/128]`` with ``lse_ref[b, h, r, t]`` the row
log-sum-exp of query ``t * 128 + r``, ``sinks_ref [bs, H]`` or ``[bs, H, n_sinks]`` (extra softmax logits),
``bound_min``/``bound_max [Sq]`` float32 (sequence packing: key ``j`` allowed for query ``i`` when
``bound_min[i] <= j < bound_max[i]``).

Math: with ``S = softmax_scale * q^T k`` (masked), ``P = exp(S - lse)`` and ``D = rowsum(dy * o)``:
``dv = P^T dy``, ``dS = P * (dy v^T - D)``, ``dq = softmax_scale * dS k``, ``dk = softmax_scale * dS^T q`` (summed
over the query heads of each KV head), ``dsinks = -sum_rows exp(sink - lse) * D``. ``softmax_scale`` defaults to
``1/sqrt(d)``; a given one must be finite. Causal masking requires ``Sq == Sk``; a sliding window (an int in
``[0, 2**31 - 1]``, 0 or ``None`` for none, as ``attention_cte`` takes it) requires causal masking. Outputs have their
inputs' layouts and dtypes; ``dsinks`` is returned only with ``sinks_ref``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..framework.primitive import make_kernel
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..framework.validation import static_float, static_int
from .blockwise import attention_backward
from .checks import MAX_HEAD_DIM, head_dim_limit, require_same_dtype
from .masks import MaskRule

LSE_TILE = 128
BWD_K_TILE = 512


def _to_engine(x, n_kv):
    """[bs, H, d, S] -> [bs * H_kv, H / H_kv, S, d]."""
    bs, heads, d, seq = x.shape
    return jnp.swapaxes(x, 2, 3).reshape(bs * n_kv, heads // n_kv, seq, d)


def _from_engine(x, bs):
    """[bs * H_kv, G, S, d] -> [bs, H_kv * G, d, S]."""
    n, groups, seq, d = x.shape
    return jnp.swapaxes(x.reshape(bs, (n // bs) * groups, seq, d), 2, 3)


def lse_rows(lse_ref):
    """[bs, H, 128, Sq/128] -> [bs, H, Sq]."""
    bs, heads, tile, groups = lse_ref.shape
    return jnp.swapaxes(lse_ref, 2, 3).reshape(bs, heads, tile * groups)


def lse_tiles(lse):
    """[..., Sq] -> [..., 128, Sq/128] (inverse of :func:`lse_rows`)."""
    *lead, seq = lse.shape
    return jnp.swapaxes(lse.reshape(*lead, seq // LSE_TILE, LSE_TILE), -1, -2)


def reference_attention_bwd(
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    dy_ref,
    lse_ref,
    sinks_ref=None,
    bound_min=None,
    bound_max=None,
    *,
    use_causal_mask=False,
    mixed_precision=False,
    softmax_scale=None,
    sliding_window=None,
):
    """JAX reference of ``attention_bwd`` (blockwise; ``mixed_precision`` does not change the reference)."""
    del mixed_precision
    bs, heads, d, seq_q = q_ref.shape
    n_kv, seq_k = k_ref.shape[1], k_ref.shape[3]
    scale = softmax_scale or 1.0 / math.sqrt(d)
    rule = MaskRule(
        n_queries=seq_q,
        n_active=seq_k,
        causal=use_causal_mask,
        window=sliding_window or 0,
        bound_min=bound_min,
        bound_max=bound_max,
    )
    sinks = None
    if sinks_ref is not None:
        sinks = sinks_ref.reshape(bs * n_kv, heads // n_kv, -1)
    to_engine = lambda x, n: _to_engine(x, n)  # noqa: E731
    lse = lse_rows(lse_ref).reshape(bs * n_kv, heads // n_kv, seq_q)
    dq, dk, dv, dsinks = attention_backward(
        to_engine(q_ref, n_kv),
        to_engine(k_ref, n_kv)[:, 0],
        to_engine(v_ref, n_kv)[:, 0],
        to_engine(o_ref, n_kv),
        to_engine(dy_ref, n_kv),
        lse,
        rule,
        scale,
        sinks,
    )
    outs = (
        _from_engine(dq, bs).astype(q_ref.dtype),
        _from_engine(dk[:, None], bs).astype(k_ref.dtype),
        _from_engine(dv[:, None], bs).astype(v_ref.dtype),
    )
    if sinks_ref is not None:
        outs += (dsinks.reshape(sinks_ref.shape).astype(sinks_ref.dtype),)
    return outs


def _check(call: CallInfo) -> None:
    avals, dims, params, function = call.avals, call.dims, call.params, call.function
    if dims["H"] % dims["H_kv"]:
        raise ValueError(f"{function}: query heads H={dims['H']} must be a multiple of KV heads H_kv={dims['H_kv']}")
    require_same_dtype(call, ("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref"), "q_ref, k_ref, v_ref, o_ref and dy_ref")
    if params["use_causal_mask"] and dims["Sq"] != dims["Sk"]:
        raise ValueError(f"{function}: causal masking requires Sq == Sk; got Sq={dims['Sq']}, Sk={dims['Sk']}")
    if params["softmax_scale"] is not None:
        static_float(function, "softmax_scale", params["softmax_scale"])
    if static_int(function, "sliding_window", params["sliding_window"] or 0) > 0 and not params["use_causal_mask"]:
        raise ValueError(f"{function}: sliding_window requires use_causal_mask=True")
    if (avals.get("bound_min") is None) != (avals.get("bound_max") is None):
        raise ValueError(f"{function}: give both bound_min and bound_max, or neither")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, head_dim_limit(call)
    tile = min(BWD_K_TILE, dims["Sk"])
    if dims["Sk"] % tile:
        unmet.append(f"Sk={dims['Sk']} must be a multiple of {BWD_K_TILE} (or at most {BWD_K_TILE})")
    return unmet


_Q_LAYOUT = "bs, H, d, Sq"
_KV_LAYOUT = "bs, H_kv, d, Sk"


def _outputs(call: CallInfo):
    """``dq, dk, dv`` (and ``dsinks`` when ``sinks_ref`` is given) like their operands."""
    pairs = (("dq", "q_ref"), ("dk", "k_ref"), ("dv", "v_ref"), ("dsinks", "sinks_ref"))
    return [
        (name, call.avals[operand].shape, call.avals[operand].dtype)
        for name, operand in pairs
        if call.avals.get(operand) is not None
    ]


ATTENTION_BWD_SPEC = KernelSpec(
    name="attention_bwd",
    entry_point="nkilib.core.attention.attention_bwd:attention_bwd",
    operands=(
        Operand.of("q_ref", _Q_LAYOUT),
        Operand.of("k_ref", _KV_LAYOUT),
        Operand.of("v_ref", _KV_LAYOUT),
        Operand.of("o_ref", _Q_LAYOUT),
        Operand.of("dy_ref", _Q_LAYOUT),
        Operand.of("lse_ref", "bs, H, 128, Sq/128", dtypes=(jnp.float32, jnp.float64)),
        Operand.of("sinks_ref", "bs, H", "bs, H, n_sinks", optional=True),
        Operand.of("bound_min", "Sq", dtypes=(jnp.float32,), optional=True),
        Operand.of("bound_max", "Sq", dtypes=(jnp.float32,), optional=True),
    ),
    params=(
        Param("use_causal_mask", False, bool),
        Param("mixed_precision", False, bool),
        Param("softmax_scale", None, float),
        Param("sliding_window", None, int),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_attention_bwd,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                **dict.fromkeys(("q_ref", "k_ref", "v_ref", "o_ref", "dy_ref", "lse_ref", "sinks_ref"), "bs"),
                "bound_min": None,
                "bound_max": None,
            },
            outputs=dict.fromkeys(("dq", "dk", "dv", "dsinks"), 0),
        ),
    ),
    neuron_split_dims=("bs",),
    mac_count=lambda call: 4 * call.dims["bs"] * call.dims["H"] * call.dims["Sq"] * call.dims["Sk"] * call.dims["d"],
    family="attention",
    catalog="1.2",
    support={
        "idiomatic": "",
        "vjp": "not differentiable (it is the backward of attention_cte)",
        "notes": f"Neuron: d <= {MAX_HEAD_DIM}; Sk a multiple of {BWD_K_TILE} (or <= {BWD_K_TILE}); "
        f"Sq a multiple of {LSE_TILE} (lse layout)",
    },
)

attention_bwd = make_kernel(ATTENTION_BWD_SPEC)
