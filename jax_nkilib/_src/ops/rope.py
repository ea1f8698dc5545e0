"""``jax_nkilib.rope``: rotary position embeddings in JAX's ``[..., seq, heads, head_dim]`` layout, through the
``RoPE`` kernel (see :mod:`jax_nkilib._src.rope.rope` for the math and dtype policy)."""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..framework.config import current_lnc
from ..framework.validation import check_operand_layouts, static_bool
from ..rope.rope import RoPE
from ..sharding import auto

X_LAYOUT = "..., seq, heads, head_dim"
TABLE_LAYOUTS = ("seq, head_dim/2", "batch, seq, head_dim/2")


def _rope_argument_errors(x, cos, sin) -> None:
    where = "jax_nkilib.rope"
    head_dim = check_operand_layouts(where, {"x": X_LAYOUT}, x=x)["head_dim"]
    auto.leading(x.ndim - 3, where)
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim (last axis of `x`) must be even; got {head_dim}")
    check_operand_layouts(where, {"x": X_LAYOUT, "cos": TABLE_LAYOUTS, "sin": TABLE_LAYOUTS}, x=x, cos=cos, sin=sin)
    if cos.shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(
            f"{where}: `cos` and `sin` must have the same shape and dtype; got {tuple(cos.shape)} "
            f"{cos.dtype} and {tuple(sin.shape)} {sin.dtype}"
        )
    if cos.ndim == 3 and cos.shape[0] != 1:
        lead = tuple(x.shape[:-3])
        try:
            fits = lead and jnp.broadcast_shapes(cos.shape[:1], lead) == lead
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"{where}: the batch axis of `cos` ({cos.shape[0]}) does not broadcast against the "
                f"leading axes {lead} of `x`"
            )


ROPE_SHARDING = auto.register_rule(
    auto.ShardingRule("jax_nkilib.rope", free={**auto.LEADING, "s": "sequence", "n": "heads"})
)


def rope(x, cos, sin, *, interleaved: bool = False):
    """Apply rotary position embeddings to ``x [..., seq, heads, head_dim]``.

    ``cos`` and ``sin`` are ``[seq, head_dim/2]`` (shared by every batch element) or ``[batch, seq, head_dim/2]``
    (broadcast against the leading axes of ``x``). Pairs are the halves ``(x[i], x[i + head_dim/2])``, or with
    ``interleaved=True`` the neighbours ``(x[2i], x[2i+1])``; each pair is rotated as
    ``(a cos - b sin, b cos + a sin)``. ``interleaved`` is a static bool. Differentiable in ``x``, ``cos`` and
    ``sin``; the output has ``x``'s shape and dtype (a batched table must broadcast to ``x``'s leading axes without
    adding any); an empty ``x`` is returned as it is, without a kernel call.

    It is the NKI ``RoPE`` kernel, which gets ``x`` as ``[head_dim, batch, heads, seq]`` by one transpose each way
    and the tables as ``[head_dim/2, batch, seq]`` by one transpose each; shared tables (``[seq, head_dim/2]`` or a
    batch of 1) go in as ``[head_dim/2, 1, seq]``, the batch folded into the kernel's heads, with no broadcast. Its
    ``lnc_shard`` splits ``seq`` over the logical cores when their number divides it, else one core rotates every
    position (a decode step's single one).
    """
    _rope_argument_errors(x, cos, sin)
    interleaved = static_bool("jax_nkilib.rope", "interleaved", interleaved)
    x, cos, sin = jnp.asarray(x), jnp.asarray(cos), jnp.asarray(sin)
    if x.size == 0:  # nothing to rotate
        return x
    lead_dims = auto.leading(x.ndim - 3)
    table_dims = ("_" if cos.shape[0] == 1 else lead_dims[-1:]) + "s_" if cos.ndim == 3 else "s_"
    sharded = auto.plan(
        ROPE_SHARDING,
        [
            auto.ShardedArgument("x", x, lead_dims + "snd"),
            auto.ShardedArgument("cos", cos, table_dims),
            auto.ShardedArgument("sin", sin, table_dims),
        ],
    )
    if sharded:
        return sharded.run(lambda x, cos, sin, axes: rope(x, cos, sin, interleaved=interleaved), lead_dims + "snd")
    *lead, seq, heads, head_dim = x.shape
    batch = math.prod(lead)
    table_shape = (batch, seq, head_dim // 2)
    if cos.ndim == 3 and cos.shape[0] == 1:  # one table for every batch element
        cos, sin = cos[0], sin[0]
    x_in = jnp.transpose(x.reshape(batch, seq, heads, head_dim), (3, 0, 2, 1))  # [d_head, B, n_heads, S]
    if cos.ndim == 2:  # shared tables: the batch folds into the kernel's heads, so the tables need no broadcast
        x_in = x_in.reshape(head_dim, 1, batch * heads, seq)
        cos, sin = (t.T.reshape(head_dim // 2, 1, seq) for t in (cos, sin))  # [d_head/2, 1, S]
    else:
        cos, sin = (jnp.broadcast_to(t, (*lead, seq, head_dim // 2)).reshape(table_shape) for t in (cos, sin))
        cos, sin = (jnp.transpose(table, (2, 0, 1)) for table in (cos, sin))  # [d_head/2, B, S]
    lnc = current_lnc()  # the kernel splits S over the cores only when they divide it (a decode step's S=1 does not)
    params = RoPE.params(contiguous_layout=not interleaved, lnc_shard=lnc > 1 and seq % lnc == 0)
    (out,) = RoPE.call({"x_in": x_in, "cos": cos, "sin": sin}, params)
    return jnp.transpose(out.reshape(head_dim, batch, heads, seq), (1, 3, 2, 0)).reshape(x.shape)
