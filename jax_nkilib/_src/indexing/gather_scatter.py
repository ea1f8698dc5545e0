"""``gather`` and ``scatter_add`` (catalog rows 79 and 80, docs-only): row gather and row scatter-add over a 2-D
table, each the other's reverse mode.

Sources: the NKI Library API reference 2.32 (aws-neuron-sdk ``nki/library/api/gather.rst`` and
``scatter-add.rst``, ``nkilib.experimental.misc``) and, for ``scatter_add``, the newer nki-library source
``src/nkilib_src/nkilib/experimental/misc/scatter_add.py`` and its torch reference ``scatter_add_torch.py`` (commit
``a8b0f4c``), which add the ``unique_indices`` flag. Both are HBM-in/HBM-out ``@nki.jit`` kernels: ``gather`` is bound
directly, ``scatter_add`` through the adapter ``jax_nkilib_kernels/misc.py``, which passes ``unique_indices`` only
when it is False so that the default call works with the 2.32 library too.

* ``gather(input [N, D], dim=0, index [K]) -> output [K, D]``: ``output[i, :] = input[index[i], :]`` (torch
  ``input[index]``), by indirect DMA; at LNC > 1 each core gathers ``K / LNC`` rows, so ``K % LNC == 0``.
* ``scatter_add(input [N, D], dim=0, index [K], src [K, D], unique_indices=True) -> output [N, D]``:
  ``output = input`` with ``output[index[i], j] += src[i, j]`` (torch ``input.scatter_add(0, index, src)``), written in
  place: ``output`` aliases ``input`` (the custom call's ``output_operand_aliases``). The kernel loads 128 index rows
  at a time, gathers the destination rows, adds and scatters them back, so with ``unique_indices=True`` (its default)
  the indices of each 128-row tile must be distinct: on the device a repeated index inside one tile keeps one of the
  contributions (the others are silently dropped). ``unique_indices=False`` processes one index per step, so
  repeats accumulate (embedding gradients). At LNC > 1 the cores split ``D``, so ``D % LNC == 0``. The 2.32 API
  reference has no ``unique_indices``: with a library that old, ``unique_indices=False`` fails to compile with an
  error saying so (never a silently different sum).

``dim`` must be 0 (the kernels' only mode). Tables are float32, bfloat16 or float16 (float64 off Neuron); indices
int32; ``src`` has the table's dtype. The references add in that dtype, as the kernel's SBUF add stores its sum.
Off Neuron every duplicate accumulates whatever ``unique_indices`` says: that is the contract the kernel meets when
its precondition holds, and ``jax_nkilib.config(runtime_checks=True)`` reports a violated precondition.

Out-of-range indices (negative or ``>= N``) are outside the kernels' contract (the API reference does not define
them); the references clamp them to ``[0, N - 1]`` (``gather`` reads, ``scatter_add`` adds into, the nearest row),
the same rows in both directions so the VJPs stay exact, and ``config(runtime_checks=True)`` reports them.

Reverse mode: ``gather``'s cotangent for ``input`` is ``scatter_add(zeros, index, d_output,
unique_indices=False)``; ``scatter_add``'s cotangent for ``input`` is ``d_output`` itself and for ``src``
``gather(d_output, index)``. On Neuron both directions are these kernels.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel
from ..framework.runtime_checks import check_all
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Output, Param

GATHER_MODULE = "nkilib.experimental.misc"
_DIM = Param("dim", 0, (0,), "the dimension gathered/scattered along (the kernels support only 0)")


def _rows(index, n: int):
    """``index`` clamped to the valid rows ``[0, n - 1]`` (the references' reading of an out-of-range index)."""
    return jnp.clip(index, 0, n - 1)


# ----------------------------------------------------------------------------------------------------- references
def reference_gather(input, index, *, dim=0):
    """``output[i, :] = input[clip(index[i]), :]``, in ``input``'s dtype."""
    del dim
    return (jnp.take(input, _rows(index, input.shape[0]), axis=0),)


def reference_scatter_add(input, index, src, *, dim=0, unique_indices=True):
    """``output = input``; ``output[clip(index[i]), :] += src[i, :]`` in ``input``'s dtype; duplicates accumulate."""
    del dim, unique_indices
    return (input.at[_rows(index, input.shape[0])].add(src.astype(input.dtype), mode="promise_in_bounds"),)


# ------------------------------------------------------------------------------------------------------- checks
def _check_src_dtype(call: CallInfo) -> None:
    """The table and ``src`` share a dtype (the kernel adds them in SBUF without a cast)."""
    src = call.avals.get("src")
    if src is not None and src.dtype != call.avals["input"].dtype:
        raise TypeError(
            f"{call.function}: `src` must have the dtype of `input` ({call.avals['input'].dtype}); got {src.dtype}"
        )


def _index_in_range(call: CallInfo, operands) -> None:
    n = call.dims["N"]
    index = operands["index"]
    check_all((index >= 0) & (index < n), f"{call.function}: index[{{index}}] = {{}} is outside [0, N={n})", index)


def _scatter_add_runtime_checks(call: CallInfo, operands) -> None:
    """Indices in range; with ``unique_indices`` also distinct within each tile of 128 (the kernel's precondition)."""
    _index_in_range(call, operands)
    if not call.params["unique_indices"]:
        return
    index, k = operands["index"], call.dims["K"]
    tiles = -(-k // PARTITIONS)
    # pad with distinct negative values that cannot collide with each other or with a valid row
    padded = jnp.concatenate([index, -1 - jnp.arange(tiles * PARTITIONS - k, dtype=index.dtype)])
    ordered = jnp.sort(padded.reshape(tiles, PARTITIONS), axis=1)
    repeated = jnp.concatenate([ordered[:, 1:] == ordered[:, :-1], jnp.zeros((tiles, 1), bool)], axis=1)
    check_all(
        ~repeated.reshape(-1),
        f"{call.function}: index {{}} repeats within one tile of {PARTITIONS} rows (at sorted slot {{index}}), "
        "which unique_indices=True does not allow: pass unique_indices=False",
        ordered.reshape(-1),
    )


def _gather_limits(call: CallInfo) -> list[str]:
    k, lnc = call.dims["K"], call.lnc
    return [] if k % lnc == 0 else [f"K={k} must be a multiple of the LNC degree {lnc} (the cores split the rows)"]


def _scatter_add_limits(call: CallInfo) -> list[str]:
    d, lnc = call.dims["D"], call.lnc
    return [] if d % lnc == 0 else [f"D={d} must be a multiple of the LNC degree {lnc} (the cores split D)"]


# ---------------------------------------------------------------------------------------------------------- VJPs
def _gather_vjp(kernel, operands, params, outs, cotangents):
    """``d input = scatter_add(zeros [N, D], index, d_output, unique_indices=False)``."""
    (d_output,) = cotangents
    if d_output is None:
        return {"input": None}
    table = operands["input"]
    zeros = jnp.zeros(table.shape, table.dtype)
    scatter_params = scatter_add.params(dim=params["dim"], unique_indices=False)
    (d_input,) = scatter_add.call({"input": zeros, "index": operands["index"], "src": d_output}, scatter_params)
    return {"input": d_input}


def _scatter_add_vjp(kernel, operands, params, outs, cotangents):
    """``d input = d_output``; ``d src = gather(d_output, index)``."""
    (d_output,) = cotangents
    if d_output is None:
        return {"input": None, "src": None}
    (d_src,) = gather.call({"input": d_output, "index": operands["index"]}, gather.params(dim=params["dim"]))
    return {"input": d_output, "src": d_src}


# --------------------------------------------------------------------------------------------------------- specs
_TABLE_NOTE = "table rows (float32, bfloat16 or float16 on Neuron)"

GATHER_SPEC = KernelSpec(
    name="gather",
    entry_point=f"{GATHER_MODULE}.gather:gather",
    operands=(
        Operand.of("input", "N, D", doc=_TABLE_NOTE),
        Operand.of("index", "K", dtypes=INT_DTYPES, doc="row indices into input, in [0, N)"),
    ),
    params=(_DIM,),
    outputs=(Output.of("output", "K, D", "input"),),
    reference=reference_gather,
    # a batch of index vectors over one table: one gather of every index (the output rows follow them)
    fold_plans=(FoldPlan({"input": None, "index": "K"}, ("K",)),),
    runtime_checks=_index_in_range,
    neuron_limits=_gather_limits,
    mac_count=lambda call: 0,
    family="indexing",
    catalog="3 (row 79)",
    support={
        "idiomatic": "embedding_lookup",
        "vjp": "the scatter_add kernel (unique_indices=False) into zeros",
        "notes": "docs-only kernel (2.32); K % LNC == 0 on Neuron; out-of-range indices: clamped off Neuron, "
        "undefined on the device",
    },
)

SCATTER_ADD_SPEC = KernelSpec(
    name="scatter_add",
    entry_point="jax_nkilib_kernels.misc:scatter_add",
    operands=(
        Operand.of("input", "N, D", doc=_TABLE_NOTE + ", updated in place"),
        Operand.of("index", "K", dtypes=INT_DTYPES, doc="destination rows, in [0, N)"),
        Operand.of("src", "K, D", doc="rows added into input (input's dtype)"),
    ),
    params=(
        _DIM,
        Param(
            "unique_indices",
            True,
            bool,
            "the indices of each 128-row tile are distinct (fast path); False: repeats accumulate",
        ),
    ),
    outputs=(Output.of("output", "N, D", "input"),),
    reference=reference_scatter_add,
    check=_check_src_dtype,
    runtime_checks=_scatter_add_runtime_checks,
    neuron_limits=_scatter_add_limits,
    mac_count=lambda call: call.dims["K"] * call.dims["D"],
    aliases={"input": "output"},
    family="indexing",
    catalog="3 (row 80)",
    support={
        "vjp": "d input = d output; d src = the gather kernel of d output",
        "notes": "docs-only kernel (2.32; unique_indices from the newer source, which False needs); output aliases "
        "input; D % LNC == 0 on Neuron; unique_indices=True needs distinct indices within each 128-row tile on the "
        "device; device adapter jax_nkilib_kernels/misc.py",
    },
)

gather = make_kernel(GATHER_SPEC, _gather_vjp)
scatter_add = make_kernel(SCATTER_ADD_SPEC, _scatter_add_vjp)
