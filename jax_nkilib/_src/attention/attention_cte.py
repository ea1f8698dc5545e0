"""``attention_cte`` (catalog 1.1): the NKI prefill (context-encoding) attention kernel.

``o = softmax(scale * q k^T + mask [‖ sink]) v`` per batch row, heads folded into the batch: ``B`` query rows and
``B_kv`` key/value rows with ``B % B_kv == 0`` (query row ``b`` uses KV row ``b // (B / B_kv)``: grouped-query
attention, like ``repeat_interleave`` on K/V).

Layouts: ``q [B, Sq, d]`` (``tp_q=True``) or ``[B, d, Sq]``; ``k [B_kv, d, Sk]`` (``tp_k=False``) or
``[B_kv, Sk, d]``; ``v [B_kv, Sk, d]``; ``o [B, Sq, d]`` (``tp_out=False``) or ``[B, d, Sq]``. Prefix caching:
``k_prior``/``v_prior`` like ``k``/``v`` with ``S_prior`` slots, of which the first ``prior_used_len`` (an int32
``(1,)`` runtime value) are prepended to the keys. ``sink [B, 1]``: one extra softmax logit per row (not scaled).
Context parallelism: ``cp_offset`` (int32 ``(1, 1)``, runtime) and ``global_cp_deg``: query row ``i`` has position
``cp_offset + i`` (or ``cp_offset + i * global_cp_deg`` with ``cp_strided_q_slicing``). Sequence packing:
``bound_min``/``bound_max [Sq, 1]``. Masks: see ``masks.py``. ``cache_softmax=True`` also returns
``neg_max = -rowmax`` and ``recip = 1/rowsum`` as ``[B, 128, Sq/128]`` in ``softmax_dtype`` (non-differentiable).

Contract (checked on every platform): ``scale`` must be finite, and 1.0 with a sliding window, context parallelism
or prefix caching (pre-scale ``q``); ``sliding_window`` in ``[0, 2**31 - 1]``; a sliding window and context
parallelism need ``causal_mask``; sequence packing excludes prefix caching and context parallelism;
``cache_softmax`` needs ``Sq % 128 == 0``.

Numerics: scores and softmax in float32, probabilities rounded to the input dtype for the ``P v`` matmul, output
in ``q``'s dtype. Rows with no allowed key and no sink give 0 (``neg_max = recip = 0``). A NaN in a query row, in a
key or value it sees, or in its sink makes the row's output and statistics NaN (never 0). Prior slots at or past
``prior_used_len`` do not influence the result here, whatever they hold; the kernel loads every prior slot and masks
their scores (to -3.4e38), so on Neuron their values meet zero probabilities in the ``P v`` matmul and a NaN or inf
there would reach the output (per the kernel's source, not verified on Trainium). ``prior_used_len`` is used as the
kernel uses it: slots ``j < prior_used_len`` are valid (a negative length hides the prior, one past ``S_prior``
shows all of it). ``mm_out_dtype`` is the
kernel's matmul accumulator dtype on Trn3 and does not change this reference.

Reverse mode: when the call is one ``attention_bwd`` can differentiate (no prefix caching or context parallelism,
``Sq == Sk`` if causal, ``Sq % 128 == 0``, not float64) the forward runs with ``cache_softmax=True`` and the backward is
``attention_bwd``, so on Neuron both directions are kernels; otherwise the backward is the blockwise JAX backward.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import Vjp, make_kernel
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..framework.validation import static_float, static_int
from .attention_bwd import LSE_TILE, attention_bwd, lse_tiles
from .blockwise import attention_backward, attention_forward, group_queries, log_sum_exp, ungroup_queries
from .checks import MAX_HEAD_DIM, head_dim_limit, require_same_dtype
from .masks import MaskRule

MAX_BATCH = 512
MAX_SEQ = 131072
MAX_CP_DEGREE = 32


def _canonical(q, k, v, k_prior, v_prior, tp_q, tp_k):
    """q [B, Sq, d]; keys and values [B_kv, S_prior + Sk, d] (prior slots first)."""
    q = q if tp_q else jnp.swapaxes(q, 1, 2)
    k, k_prior = ((x if tp_k or x is None else jnp.swapaxes(x, 1, 2)) for x in (k, k_prior))
    if k_prior is not None:
        k, v = jnp.concatenate([k_prior, k], axis=1), jnp.concatenate([v_prior, v], axis=1)
    return q, k, v


def _rule(
    q,
    k,
    k_prior,
    prior_used_len,
    cp_offset,
    bound_min,
    bound_max,
    *,
    causal_mask,
    sliding_window,
    global_cp_deg,
    cp_strided_q_slicing,
    tp_q,
    tp_k,
) -> MaskRule:
    seq_q = q.shape[1] if tp_q else q.shape[2]
    seq_k = k.shape[1] if tp_k else k.shape[2]
    n_prior = 0 if k_prior is None else (k_prior.shape[1] if tp_k else k_prior.shape[2])
    return MaskRule(
        n_queries=seq_q,
        n_active=seq_k,
        n_prior=n_prior,
        prior_used=None if prior_used_len is None else prior_used_len.reshape(()),
        q_base=0 if cp_offset is None else cp_offset.reshape(()),
        q_stride=global_cp_deg if (cp_offset is not None and cp_strided_q_slicing) else 1,
        causal=causal_mask,
        window=sliding_window or 0,
        bound_min=None if bound_min is None else bound_min.reshape(-1),
        bound_max=None if bound_max is None else bound_max.reshape(-1),
    )


_MASK_FLAGS = ("causal_mask", "sliding_window", "global_cp_deg", "cp_strided_q_slicing", "tp_q", "tp_k")


def _forward(operands, params):
    """Blockwise forward on the kernel's operands: ``(o [B, Sq, d] f32, row_max [B, Sq], row_sum [B, Sq])``."""
    q, k, v = _canonical(
        operands["q"],
        operands["k"],
        operands["v"],
        operands["k_prior"],
        operands["v_prior"],
        params["tp_q"],
        params["tp_k"],
    )
    rule = _rule(
        operands["q"],
        operands["k"],
        operands["k_prior"],
        operands["prior_used_len"],
        operands["cp_offset"],
        operands["bound_min"],
        operands["bound_max"],
        **{flag: params[flag] for flag in _MASK_FLAGS},
    )
    n_kv = k.shape[0]
    sink = None if operands["sink"] is None else group_queries(operands["sink"], n_kv)
    out, row_max, row_sum = attention_forward(group_queries(q, n_kv), k, v, rule, params["scale"], sink)
    return ungroup_queries(out), ungroup_queries(row_max), ungroup_queries(row_sum), rule


def reference_attention_cte(
    q,
    k,
    v,
    k_prior=None,
    v_prior=None,
    prior_used_len=None,
    sink=None,
    cp_offset=None,
    bound_min=None,
    bound_max=None,
    **params,
):
    """JAX reference of ``attention_cte`` (blockwise online softmax, no ``[Sq, Sk]`` matrix)."""
    operands = dict(
        q=q,
        k=k,
        v=v,
        k_prior=k_prior,
        v_prior=v_prior,
        prior_used_len=prior_used_len,
        sink=sink,
        cp_offset=cp_offset,
        bound_min=bound_min,
        bound_max=bound_max,
    )
    out, row_max, row_sum, _ = _forward(operands, params)
    out = out.astype(q.dtype)
    out = jnp.swapaxes(out, 1, 2) if params["tp_out"] else out
    if not params["cache_softmax"]:
        return (out,)
    empty = row_sum == 0
    # a NaN row has a NaN row sum (XLA's vectorised max reductions need not propagate NaN into row_max)
    neg_max = jnp.where(empty, 0.0, jnp.where(jnp.isnan(row_sum), jnp.nan, -row_max))
    recip = jnp.where(empty, 0.0, 1.0 / jnp.where(empty, 1.0, row_sum))
    dtype = params["softmax_dtype"]
    return out, lse_tiles(neg_max).astype(dtype), lse_tiles(recip).astype(dtype)


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    present = {name for name, aval in avals.items() if aval is not None}
    prefix = {"k_prior", "v_prior", "prior_used_len"} & present
    if prefix and len(prefix) != 3:
        raise ValueError(
            f"{function}: prefix caching needs k_prior, v_prior and prior_used_len together; got only "
            f"{', '.join(sorted(prefix))}"
        )
    cp = p["global_cp_deg"] is not None
    if cp != ("cp_offset" in present):
        raise ValueError(f"{function}: context parallelism needs both cp_offset (1, 1) and global_cp_deg")
    if cp and not 1 <= p["global_cp_deg"] <= MAX_CP_DEGREE:
        raise ValueError(f"{function}: global_cp_deg must be in [1, {MAX_CP_DEGREE}]; got {p['global_cp_deg']}")
    if ("bound_min" in present) != ("bound_max" in present):
        raise ValueError(f"{function}: give both bound_min and bound_max, or neither")
    if "bound_min" in present and (prefix or cp):
        raise ValueError(
            f"{function}: sequence packing (bound_min/bound_max) excludes prefix caching and context parallelism"
        )
    static_float(function, "scale", p["scale"])
    window = static_int(function, "sliding_window", p["sliding_window"] or 0)
    if (window or cp) and not p["causal_mask"]:
        raise ValueError(f"{function}: sliding_window and context parallelism require causal_mask=True")
    if (window or cp or prefix) and p["scale"] != 1.0:
        raise ValueError(
            f"{function}: scale must be 1.0 with a sliding window, context parallelism or prefix "
            f"caching (pre-scale q instead); got scale={p['scale']}"
        )
    if dims["B"] % dims["B_kv"]:
        raise ValueError(
            f"{function}: the query batch B={dims['B']} must be a multiple of the KV batch B_kv={dims['B_kv']}"
        )
    require_same_dtype(call, ("q", "k", "v", "k_prior", "v_prior"), "q, k, v (and k_prior, v_prior)")
    if p["cache_softmax"] and dims["Sq"] % LSE_TILE:
        raise ValueError(f"{function}: cache_softmax needs Sq to be a multiple of {LSE_TILE}; got Sq={dims['Sq']}")
    for name in ("softmax_dtype", "mm_out_dtype"):
        if p[name] not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
            raise TypeError(f"{function}: {name} must be float32 or bfloat16; got {p[name]}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, head_dim_limit(call)
    if dims["B"] > MAX_BATCH:
        unmet.append(f"batch B={dims['B']} exceeds {MAX_BATCH}")
    seq_k = dims["Sk"] + dims.get("S_prior", 0)
    if max(dims["Sq"], seq_k) > MAX_SEQ:
        unmet.append(f"sequence lengths Sq={dims['Sq']}, Sk={seq_k} exceed {MAX_SEQ}")
    if call.params["mm_out_dtype"] == jnp.dtype(jnp.bfloat16):
        unmet.append("mm_out_dtype=bfloat16 needs Trn3 (gen4); this lowering targets Trn1/Trn2")
    return unmet


# ------------------------------------------------------------------------------------------------ reverse mode
def bwd_kernel_applies(operands, params) -> bool:
    """Whether ``attention_bwd`` can differentiate this call (see the module docstring)."""
    seq_q = operands["q"].shape[1 if params["tp_q"] else 2]
    seq_k = operands["k"].shape[1 if params["tp_k"] else 2]
    return (
        operands["k_prior"] is None
        and operands["cp_offset"] is None
        and seq_q % LSE_TILE == 0
        and (seq_q == seq_k or not params["causal_mask"])
        and params["scale"] != 0.0
        and operands["q"].dtype != jnp.float64
    )  # float64 (CPU only) keeps float64 statistics


def _to_bwd_layout(x, seq_axis):
    """A [B, ., .] tensor with the sequence at ``seq_axis`` to attention_bwd's [1, B, d, S]."""
    return (x if seq_axis == 2 else jnp.swapaxes(x, 1, 2))[None]


def _forward_with_statistics(kernel, operands, params):
    applies = bwd_kernel_applies(operands, params)
    outs = kernel.call(operands, dict(params, cache_softmax=True) if applies else params)
    user_outs = outs if params["cache_softmax"] or not applies else outs[:1]
    return user_outs, (operands, outs, applies)


def _backward(kernel, residuals, params, cotangents):
    operands, outs, applies = residuals
    dy = cotangents[0]
    if applies:
        return _kernel_backward(operands, params, outs, dy)
    return _blockwise_backward(operands, params, outs[0], dy)


def _kernel_backward(operands, params, outs, dy):
    out, neg_max, recip = outs[:3]
    tp_q, tp_k, tp_out = params["tp_q"], params["tp_k"], params["tp_out"]
    lse = -(neg_max.astype(jnp.float32) + jnp.log(recip.astype(jnp.float32)))
    sink = operands["sink"]
    bounds = [
        None if operands[n] is None else operands[n].reshape(-1).astype(jnp.float32) for n in ("bound_min", "bound_max")
    ]
    grads = attention_bwd(
        _to_bwd_layout(operands["q"], 2 if not tp_q else 1),
        _to_bwd_layout(operands["k"], 1 if tp_k else 2),
        _to_bwd_layout(operands["v"], 1),
        _to_bwd_layout(out, 2 if tp_out else 1),
        _to_bwd_layout(dy.astype(out.dtype), 2 if tp_out else 1),
        lse[None],
        None if sink is None else sink.reshape(1, -1).astype(operands["q"].dtype),
        *bounds,
        use_causal_mask=params["causal_mask"],
        mixed_precision=True,
        softmax_scale=params["scale"],
        sliding_window=params["sliding_window"],
    )
    dq, dk, dv = grads[0][0], grads[1][0], grads[2][0]  # [B, d, S]
    result = {
        "q": dq if not tp_q else jnp.swapaxes(dq, 1, 2),
        "k": jnp.swapaxes(dk, 1, 2) if tp_k else dk,
        "v": jnp.swapaxes(dv, 1, 2),
    }
    if sink is not None:
        result["sink"] = grads[3].reshape(sink.shape)
    return result


def _blockwise_backward(operands, params, out, dy):
    """The JAX backward for calls attention_bwd cannot take (prefix caching, context parallelism, ...)."""
    q, k, v = _canonical(
        operands["q"],
        operands["k"],
        operands["v"],
        operands["k_prior"],
        operands["v_prior"],
        params["tp_q"],
        params["tp_k"],
    )
    _, row_max, row_sum, rule = _forward(operands, params)
    n_kv = k.shape[0]
    out = jnp.swapaxes(out, 1, 2) if params["tp_out"] else out
    dy = jnp.swapaxes(dy, 1, 2) if params["tp_out"] else dy
    sink = None if operands["sink"] is None else group_queries(operands["sink"], n_kv)
    lse = group_queries(log_sum_exp(row_max, row_sum), n_kv)
    dq, dk, dv, dsink = attention_backward(
        group_queries(q, n_kv),
        k,
        v,
        group_queries(out, n_kv),
        group_queries(dy, n_kv),
        lse,
        rule,
        params["scale"],
        sink,
    )
    dq = ungroup_queries(dq)
    n_prior = rule.n_prior
    dk_prior, dk = dk[:, :n_prior], dk[:, n_prior:]
    dv_prior, dv = dv[:, :n_prior], dv[:, n_prior:]
    to_k_layout = (lambda x: x) if params["tp_k"] else (lambda x: jnp.swapaxes(x, 1, 2))
    result = {"q": dq if params["tp_q"] else jnp.swapaxes(dq, 1, 2), "k": to_k_layout(dk), "v": dv}
    if n_prior:
        result.update(k_prior=to_k_layout(dk_prior), v_prior=dv_prior)
    if operands["sink"] is not None:
        result["sink"] = ungroup_queries(dsink)
    return result


def _outputs(call: CallInfo):
    """``o`` ``[B, Sq, d]`` (``[B, d, Sq]`` with ``tp_out``) in q's dtype, and with ``cache_softmax`` the softmax
    statistics ``neg_max`` and ``recip`` ``[B, 128, Sq/128]`` in ``softmax_dtype``."""
    p = call.params
    out = [("o", call.shape("B, d, Sq" if p["tp_out"] else "B, Sq, d"), call.avals["q"].dtype)]
    if p["cache_softmax"]:
        out += [(name, call.shape("B, 128, Sq/128"), p["softmax_dtype"]) for name in ("neg_max", "recip")]
    return out


ATTENTION_CTE_SPEC = KernelSpec(
    name="attention_cte",
    entry_point="nkilib.core.attention.attention_cte:attention_cte",
    operands=(
        Operand.switched("q", "tp_q", {True: "B, Sq, d", False: "B, d, Sq"}),
        Operand.switched("k", "tp_k", {False: "B_kv, d, Sk", True: "B_kv, Sk, d"}),
        Operand.of("v", "B_kv, Sk, d"),
        Operand.switched("k_prior", "tp_k", {False: "B_kv, d, S_prior", True: "B_kv, S_prior, d"}, optional=True),
        Operand.of("v_prior", "B_kv, S_prior, d", optional=True),
        Operand.of("prior_used_len", "1", dtypes=INT_DTYPES, optional=True),
        Operand.of("sink", "B, 1", optional=True),
        Operand.of("cp_offset", "1, 1", dtypes=INT_DTYPES, optional=True),
        Operand.of("bound_min", "Sq, 1", dtypes=INT_DTYPES + (jnp.float32,), optional=True),
        Operand.of("bound_max", "Sq, 1", dtypes=INT_DTYPES + (jnp.float32,), optional=True),
    ),
    params=(
        Param("scale", 1.0, float),
        Param("causal_mask", True, bool),
        Param("sliding_window", None, int),
        Param("tp_q", True, bool),
        Param("tp_k", False, bool),
        Param("tp_out", False, bool),
        Param("cache_softmax", False, bool),
        Param("softmax_dtype", jnp.float32, "dtype"),
        Param("mm_out_dtype", jnp.float32, "dtype"),
        Param("global_cp_deg", None, int),
        Param("cp_strided_q_slicing", False, bool),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_attention_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                "q": "B",
                "k": "B_kv",
                "v": "B_kv",
                "k_prior": "B_kv",
                "v_prior": "B_kv",
                "sink": "B",
                "prior_used_len": None,
                "cp_offset": None,
                "bound_min": None,
                "bound_max": None,
            },
            outputs={"o": 0, "neg_max": 0, "recip": 0},
        ),
    ),
    mac_count=lambda call: (
        2 * call.dims["B"] * call.dims["Sq"] * (call.dims["Sk"] + call.dims.get("S_prior", 0)) * call.dims["d"]
    ),
    nondifferentiable_outputs=("neg_max", "recip"),
    family="attention",
    catalog="1.1",
    support={
        "idiomatic": "attention, dot_product_attention",
        "vjp": "attention_bwd kernel (forward with cache_softmax); blockwise JAX for prefix caching and CP",
        "notes": f"Neuron: d <= {MAX_HEAD_DIM}, B <= {MAX_BATCH}, S <= {MAX_SEQ}; "
        "scale 1.0 with SWA/CP/prefix (checked everywhere)",
    },
)

attention_cte = make_kernel(ATTENTION_CTE_SPEC, vjp=Vjp(_forward_with_statistics, _backward))
