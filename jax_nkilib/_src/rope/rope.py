"""Rotary position embeddings: the ``RoPE`` and ``rope_hf`` NKI kernels (layer 1; ``jax_nkilib.rope`` is in ``ops``).

Math. A rotary embedding rotates pairs ``(a, b)`` of a head vector by a per-position angle given as ``(cos, sin)``::

    a' = a * cos - b * sin
    b' = b * cos + a * sin

``RoPE`` (catalog 1.6) takes ``x_in [d_head, B, n_heads, S]`` and ``cos, sin [d_head/2, B, S]``. With
``contiguous_layout=True`` the pairs are ``(x[i], x[i + d_head/2])`` (the halves layout); with ``False`` they are
``(x[2i], x[2i+1])`` (interleaved). ``rope_hf`` (catalog 1.7) takes the HuggingFace layout ``q [B, Hq, S, D]``,
``k [B, Hk, S, D]`` and full-width tables ``cos, sin [(B), S_rope, D]`` (or ``rope_cache = cos ‖ sin`` of width
``2D``), uses their first ``S`` positions, and rotates halves with position-wise ``cos``/``sin`` per half::

    forward:  y1 = x1*cos1 - x2*sin1,  y2 = x2*cos2 + x1*sin2
    backward: y1 = x1*cos1 + x2*sin2,  y2 = x2*cos2 - x1*sin1   (the transpose of forward, for gradients)

Dtype policy (the kernels'): outputs have the input's dtype; each product and each sum is computed in float32 (or
float64 for float64 inputs) and rounded to the input dtype, as the kernels' SBUF buffers do. ``rope_hf`` first
casts the tables to ``q``'s dtype (its SBUF table tiles have ``q``'s dtype); ``RoPE`` keeps the tables' dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..framework.primitive import make_kernel
from ..framework.spec import (
    FOLLOW_LNC,
    CallInfo,
    FoldPlan,
    KernelSpec,
    Operand,
    Output,
    Param,
    accumulation_dtype,
)

ROPE_SBUF_BYTES = 73728 * 2  # the kernel's documented SBUF cap: B * n_heads * S <= 73728 elements of bf16
ROPE_HEAD_SIZES = (64, 128)
ROPE_HF_SEQ_TILE = 128


def _rotate_pairs(a, b, cos_a, sin_a, cos_b, sin_b, out_dtype, transpose=False):
    """``(a*cos_a - b*sin_a, b*cos_b + a*sin_b)`` (or its transpose), rounding each product and sum to out_dtype."""
    compute = accumulation_dtype(out_dtype)
    a, b = a.astype(compute), b.astype(compute)
    cos_a, sin_a, cos_b, sin_b = (t.astype(compute) for t in (cos_a, sin_a, cos_b, sin_b))

    def rounded(value):
        return value.astype(out_dtype).astype(compute)

    if transpose:
        first = rounded(a * cos_a) + rounded(b * sin_b)
        second = rounded(b * cos_b) - rounded(a * sin_a)
    else:
        first = rounded(a * cos_a) - rounded(b * sin_a)
        second = rounded(b * cos_b) + rounded(a * sin_b)
    return first.astype(out_dtype), second.astype(out_dtype)


# ------------------------------------------------------------------------------------------------------- RoPE
def reference_rope(x_in, cos, sin, *, lnc_shard=False, contiguous_layout=True, relayout_in_sbuf=False):
    """JAX reference of the ``RoPE`` kernel (the LNC and relayout flags do not change the result)."""
    del lnc_shard, relayout_in_sbuf
    c, s = cos[:, :, None, :], sin[:, :, None, :]  # [d_head/2, B, 1, S]: a unit heads axis
    half = x_in.shape[0] // 2
    stride = 1 if contiguous_layout else 2
    a = jax.lax.slice_in_dim(x_in, 0, None if stride == 2 else half, stride, axis=0)
    b = jax.lax.slice_in_dim(x_in, half if stride == 1 else 1, None, stride, axis=0)
    first, second = _rotate_pairs(a, b, c, s, c, s, x_in.dtype)
    if contiguous_layout:
        out = jnp.concatenate([first, second], axis=0)
    else:
        out = jnp.stack([first, second], axis=1).reshape(x_in.shape)
    return (out,)


def _rope_check(call: CallInfo) -> None:
    cos, sin = call.avals["cos"], call.avals["sin"]
    if cos.dtype != sin.dtype:
        raise TypeError(
            f"{call.function}: arguments `cos` and `sin` must have the same dtype; got {cos.dtype} and {sin.dtype}"
        )


def _rope_neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    if dims["d_head"] not in ROPE_HEAD_SIZES:
        unmet.append(f"d_head must be 64 or 128, got {dims['d_head']}")
    programs = call.lnc if call.params["lnc_shard"] else 1
    if call.params["lnc_shard"] and dims["S"] % programs:
        unmet.append(f"with lnc_shard, S={dims['S']} must be divisible by the LNC degree {programs}")
    itemsize = jnp.dtype(call.avals["x_in"].dtype).itemsize
    per_program = dims["B"] * dims["n_heads"] * (dims["S"] // programs)
    if per_program * itemsize > ROPE_SBUF_BYTES:
        unmet.append(
            f"SBUF capacity: B*n_heads*S per program = {per_program} elements of {itemsize} bytes exceeds "
            f"{ROPE_SBUF_BYTES // itemsize}"
        )
    return unmet


def _rope_vjp(kernel, operands, params, outs, cotangents):
    """dx is the kernel applied with -sin (the rotation's transpose); dcos, dsin by JAX math on the reference."""
    (g,) = cotangents
    x, cos, sin = operands["x_in"], operands["cos"], operands["sin"]
    (dx,) = kernel.call({"x_in": g, "cos": cos, "sin": -sin}, params)
    _, table_vjp = jax.vjp(lambda c, s: kernel.reference({"x_in": x, "cos": c, "sin": s}, params)[0], cos, sin)
    dcos, dsin = table_vjp(g)
    return {"x_in": dx, "cos": dcos, "sin": dsin}


ROPE_SPEC = KernelSpec(
    name="RoPE",
    entry_point="nkilib.core.embeddings.rope:RoPE",
    operands=(
        Operand.of("x_in", "d_head, B, n_heads, S", doc="input embeddings"),
        Operand.of("cos", "d_head/2, B, S", doc="cosine of the rotation angle per pair and position"),
        Operand.of("sin", "d_head/2, B, S", doc="sine of the rotation angle per pair and position"),
    ),
    params=(
        Param("lnc_shard", FOLLOW_LNC, bool, "split S across the logical cores (default: LNC degree > 1)"),
        Param("contiguous_layout", True, bool, "pairs are halves (True) or interleaved even/odd (False)"),
        Param("relayout_in_sbuf", False, bool, "relayout with an SBUF matmul (small inputs; no numeric effect)"),
    ),
    outputs=(Output.of("x_out", "d_head, B, n_heads, S", "x_in"),),
    reference=reference_rope,
    check=_rope_check,
    neuron_limits=_rope_neuron_limits,
    fold_plans=(
        FoldPlan({"x_in": "n_heads", "cos": None, "sin": None}, outputs=("n_heads",)),  # tables shared: fold into heads
        FoldPlan({"x_in": "B", "cos": "B", "sin": "B"}, outputs=("B",)),  # fold into the batch axis
    ),
    neuron_split_dims=("n_heads", "B", "S"),
    mac_count=lambda call: 2 * math.prod(call.avals["x_in"].shape),
    family="rope",
    catalog="1.6",
    support={
        "idiomatic": "rope",
        "vjp": "kernel for dx (RoPE with -sin); JAX for dcos, dsin",
        "notes": f"Neuron: d_head {' or '.join(map(str, ROPE_HEAD_SIZES))}; B*n_heads*S per program <= "
        f"{ROPE_SBUF_BYTES // 2} bf16 ({ROPE_SBUF_BYTES // 4} f32)",
    },
)

RoPE = make_kernel(ROPE_SPEC, vjp=_rope_vjp)


# ---------------------------------------------------------------------------------------------------- rope_hf
def _rope_hf_tables(q, cos, sin, rope_cache):
    if rope_cache is not None:
        width = q.shape[-1]
        cos, sin = rope_cache[..., :width], rope_cache[..., width:]
    return cos, sin


def _rotate_half(x, cos, sin, backward):
    seq, half = x.shape[2], x.shape[3] // 2
    cos, sin = cos[..., :seq, :], sin[..., :seq, :]
    cos, sin = (t[None, None] if t.ndim == 2 else t[:, None] for t in (cos, sin))
    first, second = _rotate_pairs(
        x[..., :half],
        x[..., half:],
        cos[..., :half],
        sin[..., :half],
        cos[..., half:],
        sin[..., half:],
        x.dtype,
        transpose=backward,
    )
    return jnp.concatenate([first, second], axis=-1)


def reference_rope_hf(q, k, cos=None, sin=None, rope_cache=None, *, backward=False):
    """JAX reference of the ``rope_hf`` kernel: ``(q_out, k_out)``."""
    cos, sin = _rope_hf_tables(q, cos, sin, rope_cache)
    cos, sin = cos.astype(q.dtype), sin.astype(q.dtype)  # the kernel's table tiles have q's dtype
    return _rotate_half(q, cos, sin, backward), _rotate_half(k, cos, sin, backward)


def _rope_hf_check(call: CallInfo) -> None:
    avals, function = call.avals, call.function
    has_cos, has_sin, has_cache = (avals.get(n) is not None for n in ("cos", "sin", "rope_cache"))
    if has_cache and (has_cos or has_sin):
        raise ValueError(f"{function}: give either `cos` and `sin` or `rope_cache`, not both")
    if not has_cache and not (has_cos and has_sin):
        missing = "`sin`" if has_cos else "`cos`" if has_sin else "`cos` and `sin` (or `rope_cache`)"
        raise ValueError(
            f"{function}: missing {missing}; rope_hf needs cos and sin [(B), S_rope, D] or rope_cache "
            "[(B), S_rope, 2*D]"
        )
    if has_cos and (avals["cos"].shape != avals["sin"].shape or avals["cos"].dtype != avals["sin"].dtype):
        raise ValueError(
            f"{function}: `cos` and `sin` must have the same shape and dtype; got "
            f"{avals['cos'].shape} {avals['cos'].dtype} and {avals['sin'].shape} {avals['sin'].dtype}"
        )
    if avals["q"].dtype != avals["k"].dtype:
        raise TypeError(
            f"{function}: `q` and `k` must have the same dtype; got {avals['q'].dtype} and {avals['k'].dtype}"
        )
    if call.dims["D"] % 2:
        raise ValueError(f"{function}: head_dim D must be even (halves are rotated); got D={call.dims['D']}")
    if call.dims["S_rope"] < call.dims["S"]:
        raise ValueError(
            f"{function}: the tables have S_rope={call.dims['S_rope']} positions, fewer than the "
            f"sequence length S={call.dims['S']} of `q` and `k`"
        )


def _rope_hf_neuron_limits(call: CallInfo) -> list[str]:
    tile = ROPE_HF_SEQ_TILE * call.lnc
    if call.dims["S"] % tile:
        return [f"S={call.dims['S']} must be a multiple of 128 * LNC = {tile}"]
    return []


def _rope_hf_vjp(kernel, operands, params, outs, cotangents):
    """dq, dk by the kernel with the opposite ``backward`` flag; table gradients by JAX math on the reference."""
    g_q, g_k = cotangents
    flipped = dict(params, backward=not params["backward"])
    dq, dk = kernel.call(dict(operands, q=g_q, k=g_k), flipped)
    tables = {name: operands[name] for name in ("cos", "sin", "rope_cache") if operands[name] is not None}

    _, table_vjp = jax.vjp(lambda values: kernel.reference(dict(operands, **values), params), tables)
    (table_grads,) = table_vjp((g_q, g_k))
    return {"q": dq, "k": dk, **table_grads}


def _tables_have_batch(call: CallInfo) -> bool:
    table = call.avals.get("rope_cache") if call.avals.get("rope_cache") is not None else call.avals["cos"]
    return table.ndim == 3


_TABLE_LAYOUTS = ("B, S_rope, D", "S_rope, D")
ROPE_HF_SPEC = KernelSpec(
    name="rope_hf",
    entry_point="jax_nkilib_kernels.rope:rope_hf",
    operands=(
        Operand.of("q", "B, Hq, S, D", doc="queries, HuggingFace layout"),
        Operand.of("k", "B, Hk, S, D", doc="keys, HuggingFace layout"),
        Operand.of("cos", *_TABLE_LAYOUTS, optional=True, doc="cosine table (first S positions used)"),
        Operand.of("sin", *_TABLE_LAYOUTS, optional=True, doc="sine table (first S positions used)"),
        Operand.of("rope_cache", "B, S_rope, 2*D", "S_rope, 2*D", optional=True, doc="packed cos ‖ sin table"),
    ),
    params=(Param("backward", False, bool, "apply the transposed rotation (the gradient)"),),
    outputs=(Output.of("q_out", "B, Hq, S, D", "q"), Output.of("k_out", "B, Hk, S, D", "k")),
    reference=reference_rope_hf,
    check=_rope_hf_check,
    neuron_limits=_rope_hf_neuron_limits,
    fold_plans=(
        FoldPlan({"q": "Hq", "k": "Hk"}, outputs=("Hq", "Hk")),  # tables shared: fold into heads
        FoldPlan(
            dict.fromkeys(("q", "k", "cos", "sin", "rope_cache"), "B"), outputs=("B", "B"), when=_tables_have_batch
        ),
    ),
    mac_count=lambda call: 2 * (math.prod(call.avals["q"].shape) + math.prod(call.avals["k"].shape)),
    family="rope",
    catalog="1.7",
    support={
        "idiomatic": "",
        "vjp": "kernel for dq, dk (rope_hf backward flag); JAX for the tables",
        "notes": f"Neuron: S % ({ROPE_HF_SEQ_TILE}*LNC) == 0; device adapter jax_nkilib_kernels/rope.py",
    },
)

rope_hf = make_kernel(ROPE_HF_SPEC, vjp=_rope_hf_vjp)
