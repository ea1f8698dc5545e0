"""``permute_a2av`` / ``unpermute_a2av`` (catalog rows 60-61, docs-only): the MoE training dispatch and combine over
an expert-parallel (EP) replica group with ``ncc.all_to_all_v``.

Sources: the NKI Library API reference (aws-neuron-sdk ``nki/library/api/permute-a2av.rst``,
``unpermute-a2av.rst``, nki-library 2.32) and, for the exact semantics, the 2.32 kernel sources
``experimental/collectives/a2av_train/{permute,unpermute}_a2av.py`` and their torch references
``*_torch.py`` (read in the public code index; absent from the local nki-library mirror).

Called inside ``jax.shard_map``: ``replica_group`` names the mesh axes whose devices are the EP ranks (``EP`` =
their number). On rank ``r``, with ``x_s``, ``idx_s [T, EP]``, ``c_s [EP]`` rank ``s``'s operands:

* ``permute_a2av(hidden_states [T, H], send_indices [T, EP], send_counts [1, EP]) -> (recv_data [EP*T, H],
  metadata [4, EP] uint32)``: rank ``s`` sends ``x_s[idx_s[i, r]]`` for ``i < c_s[r]`` to rank ``r``, which
  receives them at **fixed stride**: ``recv_data[s*T + i] = x_s[idx_s[i, r]]`` (as the torch reference places them;
  the rst's "packed at cumsum(recv_counts)" describes the send buffer). Rows ``s*T + i`` with ``i >= c_s[r]``
  are zero here (the kernel does not clear them: undefined on the device). ``metadata`` rows, in elements:
  ``c*H``, ``exclusive_cumsum(c)*H``, ``recv_counts*H`` (``recv_counts[s] = c_s[r]``, filled by the runtime) and
  zeros. Slots ``i >= c[d]`` of ``send_indices`` are ignored; an active slot outside ``[0, T)`` sends zeros here
  (undefined on the device).
* ``unpermute_a2av(output [EP*T, H], send_indices [T, EP], recv_counts [1, EP]) -> result [T, H]``: rank ``r``
  returns rows ``output[s*T + i]``, ``i < recv_counts[s]``, to rank ``s``, and scatter-adds what it gets back:
  ``result[idx[i, d]] += output_d[r*T + i]`` for ``i < recv_counts_d[r]`` (top-k > 1 accumulates); indices
  outside ``[0, T)`` (the sentinel ``T``) are skipped. The kernel reads every slot ``i < T`` of
  ``send_indices[:, d]``, so on the device slots past the count must hold the sentinel ``T``.

With ``recv_counts`` the dispatch's (``metadata[2] / H``) and the same ``send_indices``, ``unpermute_a2av`` is the
adjoint of ``permute_a2av``: ``sum_r <P(x)_r, y_r> == sum_s <x_s, U(y)_s>``. Reverse mode uses it both ways: the
VJP of ``permute_a2av`` binds ``unpermute_a2av``; the VJP of ``unpermute_a2av`` binds ``permute_a2av`` with every
slot sent (counts ``T``) and keeps rows ``i < recv_counts[s]``. Integer operands and ``metadata`` get no gradient.
On the device, reverse mode through ``permute_a2av`` therefore also needs the sentinel ``T`` past the counts.

Dtypes: ``hidden_states``/``output`` float32, bfloat16, float16 (float64 runs the reference only); indices int32;
counts int32 or uint32. ``unpermute_a2av`` accumulates in float32 here (the kernel adds in the data's dtype).
vmap: a vmapped ``output`` with the routing unbatched folds into ``H`` (one call); other batchings map the kernel
(``permute_a2av``'s metadata counts elements of ``H``, so it never folds).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..collectives.hbm_collectives import check_group, marking_varying, replica_group_axes
from ..framework.mesh_axes import lax_axis
from ..framework.primitive import Vjp, make_kernel
from ..framework.runtime_checks import check_all
from ..framework.spec import (
    FLOAT_DTYPES,
    INT_DTYPES,
    CallInfo,
    FoldPlan,
    KernelSpec,
    Operand,
    Output,
    Param,
    accumulation_dtype,
)

LIBRARY_MODULE = "nkilib.experimental.collectives.a2av_train"
COUNT_DTYPES = (jnp.dtype(jnp.int32), jnp.dtype(jnp.uint32))
METADATA_ROWS = 4


def exclusive_cumsum(counts):
    """``[0, c0, c0 + c1, ...]`` (the displacement of each block when the blocks are packed in order)."""
    return jnp.cumsum(counts) - counts


def _blocks_to(counts, rows: int):
    """``[EP, rows]`` mask of the slots ``i < counts[d]`` of each destination ``d``."""
    return jnp.arange(rows)[None, :] < counts.astype(jnp.int32)[:, None]


def _exchange(blocks, replica_group):
    """``[EP*T, ...]`` blocks of ``T`` rows, block ``d`` sent to rank ``d``; returns block ``s`` from rank ``s``."""
    return lax.all_to_all(blocks, lax_axis(replica_group), 0, 0, tiled=True)


# ------------------------------------------------------------------------------------------------------ references
def reference_permute_a2av(hidden_states, send_indices, send_counts, *, replica_group):
    tokens, hidden = hidden_states.shape
    ep = send_indices.shape[1]
    counts = send_counts.reshape(ep).astype(jnp.int32)
    sources = jnp.where((send_indices >= 0) & (send_indices < tokens), send_indices, tokens).T
    rows = jnp.take(hidden_states, sources, axis=0, mode="fill", fill_value=0)  # [EP, T, H]
    send = jnp.where(_blocks_to(counts, tokens)[..., None], rows, jnp.zeros((), hidden_states.dtype))
    recv_data = _exchange(send.reshape(ep * tokens, hidden), replica_group)
    recv_counts = _exchange(counts, replica_group)
    metadata = jnp.stack(
        [counts * hidden, exclusive_cumsum(counts) * hidden, recv_counts * hidden, jnp.zeros_like(counts)]
    )
    return recv_data, metadata.astype(jnp.uint32)


def reference_unpermute_a2av(output, send_indices, recv_counts, *, replica_group):
    tokens, ep = send_indices.shape
    hidden = output.shape[1]
    keep = _blocks_to(recv_counts.reshape(ep), tokens).reshape(ep * tokens, 1)
    back = _exchange(jnp.where(keep, output, jnp.zeros((), output.dtype)), replica_group)  # block d from rank d
    targets = send_indices.T.reshape(ep * tokens)
    targets = jnp.where((targets >= 0) & (targets < tokens), targets, tokens)  # outside [0, T): skipped
    wide = accumulation_dtype(output.dtype)
    result = jnp.zeros((tokens, hidden), wide).at[targets].add(back.astype(wide), mode="drop")
    return (result.astype(output.dtype),)


# ---------------------------------------------------------------------------------------------------------- checks
def _check_group(call: CallInfo) -> None:
    ep = check_group(call)
    if ep is not None and call.dims["EP"] != ep:
        raise ValueError(
            f"{call.function}: send_indices [T, EP] has EP={call.dims['EP']} columns, but the replica group "
            f"{call.params['replica_group']} has {ep} ranks (one column per destination rank)"
        )


def _check_unpermute(call: CallInfo) -> None:
    _check_group(call)
    rows, expected = call.dims["R"], call.dims["EP"] * call.dims["T"]
    if rows != expected:
        raise ValueError(
            f"{call.function}: output must be [EP*T, H] = [{expected}, H] (source s at rows [s*T, s*T + "
            f"recv_counts[s])) for send_indices [T={call.dims['T']}, EP={call.dims['EP']}]; got {rows} rows"
        )


def _check_counts(call: CallInfo, name: str, counts):
    tokens = call.dims["T"]
    check_all(
        (counts >= 0) & (counts <= tokens),
        f"{call.function}: {name}[0, {{index}}] = {{}} is outside [0, T={tokens}]",
        counts,
    )


def _permute_runtime_checks(call: CallInfo, operands) -> None:
    """Counts in ``[0, T]``; the active slots of ``send_indices`` (``i < send_counts[d]``) in ``[0, T)``."""
    counts = operands["send_counts"].reshape(-1).astype(jnp.int32)
    _check_counts(call, "send_counts", counts)
    indices, tokens = operands["send_indices"], call.dims["T"]
    active = jnp.arange(tokens)[:, None] < counts[None, :]
    check_all(
        ~active | ((indices >= 0) & (indices < tokens)),
        f"{call.function}: send_indices{{index}} = {{}} is an active slot (below send_counts) outside [0, T={tokens})",
        indices,
    )


def _unpermute_runtime_checks(call: CallInfo, operands) -> None:
    _check_counts(call, "recv_counts", operands["recv_counts"].reshape(-1).astype(jnp.int32))


def _metadata_limits(call: CallInfo, rows: int) -> list[str]:
    """A2AV metadata counts elements in uint32: every count and displacement times H must fit."""
    elements = rows * call.dims["H"]
    return [] if elements < 2**32 else [f"metadata in elements: {rows} rows x H={call.dims['H']} exceed uint32"]


# ------------------------------------------------------------------------------------------------------------- VJPs
def _permute_forward(kernel, operands, params):
    outs = kernel.call(operands, params)
    return outs, (operands["send_indices"], outs[1])


def _permute_backward(kernel, residuals, params, cotangents):
    """``P^T = U``: the cotangent of ``recv_data`` combined back with the dispatch's ``recv_counts``."""
    send_indices, metadata = residuals
    d_recv = cotangents[0]
    hidden = d_recv.shape[1]
    recv_counts = (metadata[2:3] // jnp.uint32(hidden)).astype(jnp.int32)
    operands = {"output": d_recv, "send_indices": send_indices, "recv_counts": recv_counts}
    return {"hidden_states": unpermute_a2av.call(operands, params)[0]}  # same params: the replica group


def _unpermute_forward(kernel, operands, params):
    return kernel.call(operands, params), (operands["send_indices"], operands["recv_counts"])


def _unpermute_backward(kernel, residuals, params, cotangents):
    """``U^T``: every slot of ``send_indices`` dispatched (counts ``T``), rows past ``recv_counts[s]`` dropped."""
    send_indices, recv_counts = residuals
    d_result = cotangents[0]
    tokens, ep = send_indices.shape
    every_slot = jnp.full((1, ep), tokens, jnp.int32)
    operands = {"hidden_states": d_result, "send_indices": send_indices, "send_counts": every_slot}
    rows = permute_a2av.call(operands, params)[0]
    keep = _blocks_to(recv_counts.reshape(ep), tokens).reshape(ep * tokens, 1)
    return {"output": jnp.where(keep, rows, jnp.zeros((), rows.dtype))}


# ----------------------------------------------------------------------------------------------------------- specs
GROUP = Param("replica_group", None, "axis", "mesh axis name(s) of the EP ranks", required=True)
SUPPORT = {
    "shard_map": "inside jax.shard_map only: replica_group names the mesh axes of the EP ranks",
}

PERMUTE_A2AV_SPEC = KernelSpec(
    name="permute_a2av",
    entry_point=f"{LIBRARY_MODULE}.permute_a2av:permute_a2av",
    operands=(
        Operand.of("hidden_states", "T, H", doc="local tokens"),
        Operand.of("send_indices", "T, EP", dtypes=INT_DTYPES, doc="source rows per destination rank (column)"),
        Operand.of("send_counts", "1, EP", dtypes=COUNT_DTYPES, doc="rows sent to each destination rank"),
    ),
    params=(GROUP,),
    outputs=(),
    output_avals=lambda call: [
        ("recv_data", (call.dims["EP"] * call.dims["T"], call.dims["H"]), call.avals["hidden_states"].dtype),
        ("metadata", (METADATA_ROWS, call.dims["EP"]), jnp.uint32),
    ],
    prepare=marking_varying(replica_group_axes),
    reference=reference_permute_a2av,
    check=_check_group,
    runtime_checks=_permute_runtime_checks,
    neuron_limits=lambda call: _metadata_limits(call, call.dims["EP"] * call.dims["T"]),
    has_collectives=True,
    family="moe",
    catalog="row 60",
    nondifferentiable_outputs=("metadata",),
    support={
        **SUPPORT,
        "vjp": "JAX rule binding unpermute_a2av (the adjoint)",
        "notes": "docs-only kernel (2.32); recv_data at fixed stride T per source (rows past the count: zero here, "
        "undefined on the device); metadata [4, EP] uint32 in elements",
    },
)

UNPERMUTE_A2AV_SPEC = KernelSpec(
    name="unpermute_a2av",
    entry_point=f"{LIBRARY_MODULE}.unpermute_a2av:unpermute_a2av",
    operands=(
        Operand.of("output", "R, H", dtypes=FLOAT_DTYPES, doc="expert output, source s at rows [s*T, s*T + count)"),
        Operand.of("send_indices", "T, EP", dtypes=INT_DTYPES, doc="the dispatch's routing table"),
        Operand.of("recv_counts", "1, EP", dtypes=COUNT_DTYPES, doc="the dispatch's receive counts"),
    ),
    params=(GROUP,),
    outputs=(Output.of("result", "T, H", "output"),),
    prepare=marking_varying(replica_group_axes),
    reference=reference_unpermute_a2av,
    check=_check_unpermute,
    runtime_checks=_unpermute_runtime_checks,
    neuron_limits=lambda call: _metadata_limits(call, call.dims["R"]),
    # rows move whole: a vmapped axis of `output` alone joins H (one kernel call for the batch)
    fold_plans=(FoldPlan({"output": "H", "send_indices": None, "recv_counts": None}, outputs={"result": "H"}),),
    has_collectives=True,
    family="moe",
    catalog="row 61",
    support={
        **SUPPORT,
        "vjp": "JAX rule binding permute_a2av (the adjoint)",
        "notes": "docs-only kernel (2.32); scatter-adds over all EP sources (top-k > 1); on the device slots of "
        "send_indices past the count must hold the sentinel T; LNC 2 splits EP over the cores",
    },
)

permute_a2av = make_kernel(PERMUTE_A2AV_SPEC, Vjp(_permute_forward, _permute_backward))
unpermute_a2av = make_kernel(UNPERMUTE_A2AV_SPEC, Vjp(_unpermute_forward, _unpermute_backward))
