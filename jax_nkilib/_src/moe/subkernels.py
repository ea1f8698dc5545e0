"""The MoE index subkernels: ``find_nonzero_indices`` (row 19) and ``indexed_flatten`` (row 20) of section 1.19, and
the docs-only ``argsort_unstable`` (row 77).

Sources: nki-library ``src/nkilib_src/nkilib/core/subkernels/find_nonzero_indices.py`` and ``indexed_flatten.py``
(HBM-in/HBM-out ``@nki.jit`` kernels) with their torch references ``*_torch.py``. Both kernels split their work over
the two cores of LNC=2 and have no single-core path (they call ``nl.num_programs(0)`` and exchange halves with
``sendrecv``): their Neuron limits (``neuron_limits``, evaluated on the call's LNC degree, a primitive parameter that
abstract evaluation sees) require LNC=2, and at LNC=1 the call lowers to this reference with a
``NeuronFallbackWarning`` (or raises under ``jax_nkilib.config(on_unsupported="error")``).

``find_nonzero_indices(input_tensor [T, C], col_start_id [1] int32 (optional), n_cols=None, chunk_size=None,
index_dtype=int32) -> (indices [C_out, T], nonzero_counts [C_out] int32)``: for each column ``c`` of the ``C_out``
processed ones (all ``C``, or ``n_cols`` from ``col_start_id``, a run-time value), ``indices[c]`` lists the rows
``t`` with ``input_tensor[t, c] != 0`` in increasing order, then ``-1``; ``nonzero_counts[c]`` counts them. The
kernel uses ``col_start_id`` only together with ``n_cols`` (alone it is ignored); here giving one without the other
is an error. ``chunk_size`` only tiles T (no numeric effect). A ``col_start_id`` past ``C - n_cols`` is clamped
here; the kernel would read out of bounds.

``indexed_flatten(input_tensor [E, T] int32, row_offsets [N] int32, row_offsets_start [1] int32 (optional),
f_len, output_len, padding_val=-1) -> flattened_array [output_len] int32``: row ``e``, cut into ``T/f_len`` blocks
of ``f_len``, is written at output blocks ``row_offsets[start + e] + p`` (``start`` = ``row_offsets_start`` or 0);
blocks outside ``[0, output_len/f_len)`` are skipped. Exactly as the kernel computes it: core 0 writes rows
``[0, ceil(E/2))`` and core 1 the rest, each into its own copy filled with ``padding_val`` (a later row of the same
core overwrites an earlier one), and the result is the **elementwise maximum of the two copies**: where rows of
both cores overlap the larger value wins, and a written value below ``padding_val`` is replaced by ``padding_val``
unless both copies hold values there (the torch reference, a plain overwrite, agrees when written values are
``>= padding_val`` and rows of different cores do not overlap, the kernel's intended use: token ids >= 0, -1 pad).

``argsort_unstable(data [1, N] or [N] float32/int32, descending=False, output_in_sbuf=False) -> indices (data's
shape) uint32`` (docs-only: nki-library 2.32 ``experimental/subkernels/argsort_unstable.py``, read from the NKI
Library API reference and the newer source in the public code index): the permutation that sorts ``data``
ascending (or descending); equal values may come in any order (here: their original order). The kernel compares in
float32 and marks sorted slots with -inf, so ``-inf`` data and int32 values that collide in float32 are not sorted
faithfully there. Neuron limit: ``N % 8 == 0``. ``output_in_sbuf=True`` (an SBUF result) is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, zero_cotangents
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param

LNC_REQUIRED = 2
DMA_BLOCK_MULTIPLE = 16  # indexed_flatten: (T / f_len) % 16 == 0 for its DMAs


def _lnc_limit(call: CallInfo) -> list[str]:
    if call.lnc != LNC_REQUIRED:
        return [f"the kernel requires LNC=2 (two cores, no single-core path); got LNC={call.lnc}"]
    return []


# ------------------------------------------------------------------------------------------ find_nonzero_indices
def reference_find_nonzero_indices(input_tensor, col_start_id=None, *, n_cols, chunk_size, index_dtype):
    """``(indices [C_out, T], nonzero_counts [C_out] int32)``."""
    del chunk_size  # tiles T only
    columns = input_tensor.T  # [C, T]
    if col_start_id is not None:
        columns = jax.lax.dynamic_slice_in_dim(columns, col_start_id.reshape(()).astype(jnp.int32), n_cols, axis=0)
    nonzero = columns != 0
    tokens = columns.shape[1]
    order = jnp.argsort(jnp.logical_not(nonzero), axis=1, stable=True)  # nonzero rows first, in increasing order
    counts = jnp.sum(nonzero, axis=1, dtype=jnp.int32)
    indices = jnp.where(jnp.arange(tokens)[None, :] < counts[:, None], order, -1)
    return indices.astype(index_dtype), counts


def _check_find_nonzero(call: CallInfo) -> None:
    p, function = call.params, call.function
    given = call.avals.get("col_start_id") is not None
    if given != (p["n_cols"] is not None):
        raise ValueError(
            f"{function}: give `col_start_id` and `n_cols` together (the kernel ignores one without the other)"
        )
    if given and not 1 <= p["n_cols"] <= call.dims["C"]:
        raise ValueError(f"{function}: n_cols must be in [1, C={call.dims['C']}]; got {p['n_cols']}")
    if np.dtype(p["index_dtype"]) != np.dtype(jnp.int32):
        raise TypeError(
            f"{function}: index_dtype must be int32 (the -1 padding needs a signed type); got {p['index_dtype']}"
        )
    if p["chunk_size"] is not None and p["chunk_size"] < 1:
        raise ValueError(f"{function}: chunk_size must be >= 1; got {p['chunk_size']}")


def _find_nonzero_outputs(call: CallInfo):
    columns = call.params["n_cols"] if call.avals.get("col_start_id") is not None else call.dims["C"]
    return [
        ("indices", (columns, call.dims["T"]), call.params["index_dtype"]),
        ("nonzero_counts", (columns,), jnp.int32),
    ]


def _find_nonzero_limits(call: CallInfo) -> list[str]:
    unmet = _lnc_limit(call)
    tokens, chunk = call.dims["T"], call.params["chunk_size"] or call.dims["T"]
    columns = _find_nonzero_outputs(call)[1][1][0]
    if columns % 2:
        unmet.append(f"the {columns} columns must split evenly over the two cores")
    if tokens % chunk or chunk % PARTITIONS:
        unmet.append(f"chunk_size={chunk} must divide T={tokens} and be a multiple of {PARTITIONS}")
    return unmet


FIND_NONZERO_INDICES_SPEC = KernelSpec(
    name="find_nonzero_indices",
    entry_point="nkilib.core.subkernels.find_nonzero_indices:find_nonzero_indices",
    operands=(
        Operand.of(
            "input_tensor", "T, C", dtypes=FLOAT_DTYPES + INT_DTYPES, doc="nonzero entries are found per column"
        ),
        Operand.of("col_start_id", "1", dtypes=INT_DTYPES, optional=True, doc="first column processed (run time)"),
    ),
    params=(
        Param("n_cols", None, int, "columns processed from col_start_id"),
        Param("chunk_size", None, int, "T tile of the kernel (no numeric effect; default T)"),
        Param("index_dtype", jnp.int32, "dtype", "dtype of `indices` (int32)"),
    ),
    outputs=(),
    output_avals=_find_nonzero_outputs,
    reference=reference_find_nonzero_indices,
    check=_check_find_nonzero,
    neuron_limits=_find_nonzero_limits,
    fold_plans=(
        FoldPlan(
            {"input_tensor": "C", "col_start_id": None},
            outputs={"indices": 0, "nonzero_counts": 0},
            when=lambda call: call.avals.get("col_start_id") is None,
        ),
    ),
    mac_count=lambda call: call.dims["T"] * call.dims["C"],
    nondifferentiable_outputs=("indices", "nonzero_counts"),
    family="moe",
    catalog="1.19",
    support={
        "vjp": "none (index outputs: zero gradients)",
        "notes": "requires LNC=2 on Neuron (falls back at LNC=1); C_out even; T % 128 == 0",
    },
)

# zero gradients (these three subkernels): their outputs are indices
find_nonzero_indices = make_kernel(FIND_NONZERO_INDICES_SPEC, zero_cotangents)


# ----------------------------------------------------------------------------------------------- indexed_flatten
def _core_copy(blocks, offsets, rows: range, num_blocks: int, padding_val):
    """One core's output ``[num_blocks, f_len]``: ``padding_val``, then ``rows`` written in order (the last write of
    a block wins), blocks outside ``[0, num_blocks)`` skipped."""
    per_row = blocks.shape[1]
    out = jnp.full((num_blocks, blocks.shape[2]), padding_val, blocks.dtype)
    if not rows:
        return out
    row_ids = jnp.arange(rows.start, rows.stop, dtype=jnp.int32)
    targets = offsets[rows.start : rows.stop, None] + jnp.arange(per_row, dtype=jnp.int32)[None, :]  # [rows, per_row]
    targets = jnp.where((targets >= 0) & (targets < num_blocks), targets, num_blocks)  # out of range: dropped
    writer = (
        jnp.full((num_blocks,), -1, jnp.int32)
        .at[targets.reshape(-1)]
        .max(jnp.broadcast_to(row_ids[:, None], targets.shape).reshape(-1), mode="drop")
    )
    written = writer >= 0
    row = jnp.where(written, writer, 0)
    part = jnp.clip(jnp.arange(num_blocks, dtype=jnp.int32) - offsets[row], 0, per_row - 1)
    return jnp.where(written[:, None], blocks[row, part], out)


def reference_indexed_flatten(input_tensor, row_offsets, row_offsets_start=None, *, f_len, output_len, padding_val):
    """``flattened_array [output_len]``: the two cores' copies merged by an elementwise maximum."""
    rows, tokens = input_tensor.shape
    start = 0 if row_offsets_start is None else row_offsets_start.reshape(()).astype(jnp.int32)
    offsets = jax.lax.dynamic_slice_in_dim(row_offsets.astype(jnp.int32), start, rows)
    blocks = input_tensor.reshape(rows, tokens // f_len, f_len)
    num_blocks = output_len // f_len
    first = -(-rows // 2)
    copies = [_core_copy(blocks, offsets, part, num_blocks, padding_val) for part in (range(first), range(first, rows))]
    return (jnp.maximum(copies[0], copies[1]).reshape(output_len),)


def _check_indexed_flatten(call: CallInfo) -> None:
    p, dims, function = call.params, call.dims, call.function
    if p["f_len"] < 1 or dims["T"] % p["f_len"]:
        raise ValueError(f"{function}: f_len must be >= 1 and divide T={dims['T']}; got {p['f_len']}")
    if p["output_len"] < 1 or p["output_len"] % p["f_len"]:
        raise ValueError(f"{function}: output_len must be a positive multiple of f_len; got {p['output_len']}")
    given = call.avals.get("row_offsets_start") is not None
    if (dims["N"] < dims["E"]) if given else (dims["N"] != dims["E"]):
        need = "N >= E" if given else "N == E (no row_offsets_start)"
        raise ValueError(f"{function}: `row_offsets` [N] needs {need}; got N={dims['N']}, E={dims['E']}")


def _indexed_flatten_limits(call: CallInfo) -> list[str]:
    unmet = _lnc_limit(call)
    p, dims = call.params, call.dims
    if p["output_len"] % PARTITIONS:
        unmet.append(f"output_len={p['output_len']} must be a multiple of {PARTITIONS}")
    if (dims["T"] // p["f_len"]) % DMA_BLOCK_MULTIPLE:
        unmet.append(f"T/f_len={dims['T'] // p['f_len']} must be a multiple of {DMA_BLOCK_MULTIPLE}")
    return unmet


INDEXED_FLATTEN_SPEC = KernelSpec(
    name="indexed_flatten",
    entry_point="nkilib.core.subkernels.indexed_flatten:indexed_flatten",
    operands=(
        Operand.of("input_tensor", "E, T", dtypes=INT_DTYPES, doc="rows to place"),
        Operand.of("row_offsets", "N", dtypes=INT_DTYPES, doc="output block offset of each row (run time)"),
        Operand.of("row_offsets_start", "1", dtypes=INT_DTYPES, optional=True, doc="first offset used (run time)"),
    ),
    params=(
        Param("f_len", None, int, "elements per block", required=True),
        Param("output_len", None, int, "length of the output", required=True),
        Param("padding_val", -1, int, "value of unwritten positions"),
    ),
    outputs=(),
    output_avals=lambda call: [("flattened_array", (call.params["output_len"],), jnp.int32)],
    reference=reference_indexed_flatten,
    check=_check_indexed_flatten,
    neuron_limits=_indexed_flatten_limits,
    mac_count=lambda call: call.dims["E"] * call.dims["T"],
    nondifferentiable_outputs=("flattened_array",),
    family="moe",
    catalog="1.19",
    support={
        "vjp": "none (integer data: zero gradients)",
        "notes": "requires LNC=2 on Neuron (falls back at LNC=1); output = max of the two cores' copies; "
        f"output_len % {PARTITIONS} == 0, (T/f_len) % {DMA_BLOCK_MULTIPLE} == 0",
    },
)

indexed_flatten = make_kernel(INDEXED_FLATTEN_SPEC, zero_cotangents)


# ---------------------------------------------------------------------------------------------- argsort_unstable
ARGSORT_PASS = 8  # max8 + nc_match_replace8: 8 elements per pass


def reference_argsort_unstable(data, *, descending, output_in_sbuf):
    """The sorting permutation as uint32 (ties: original order here; the kernel's order on ties is arbitrary)."""
    del output_in_sbuf  # checked: HBM output only
    return (jnp.argsort(data, axis=-1, stable=True, descending=descending).astype(jnp.uint32),)


def _check_argsort(call: CallInfo) -> None:
    if call.params["output_in_sbuf"]:
        raise ValueError(
            f"{call.function}: output_in_sbuf=True returns an SBUF tensor, which cannot be a JAX array; leave it False"
        )


def _argsort_limits(call: CallInfo) -> list[str]:
    n = call.dims["N"]
    if n < ARGSORT_PASS or n % ARGSORT_PASS:
        return [f"N={n} must be a positive multiple of {ARGSORT_PASS}"]
    return []


def _argsort_notes(call: CallInfo) -> list[str]:
    notes = ["the kernel compares in float32 (int32 data past 2**24 can tie) and marks sorted slots with -inf"]
    return notes


ARGSORT_UNSTABLE_SPEC = KernelSpec(
    name="argsort_unstable",
    entry_point="nkilib.experimental.subkernels.argsort_unstable:argsort_unstable",
    operands=(
        Operand.of(
            "data", "1, N", "N", dtypes=(jnp.dtype(jnp.float32),) + INT_DTYPES, doc="values to sort (finite, > -inf)"
        ),
    ),
    params=(
        Param("descending", False, bool, "indices of the descending order (default ascending)"),
        Param("output_in_sbuf", False, bool, "not supported: an SBUF output is no JAX array"),
    ),
    outputs=(),
    output_avals=lambda call: [("indices", tuple(call.avals["data"].shape), jnp.uint32)],
    reference=reference_argsort_unstable,
    check=_check_argsort,
    neuron_limits=_argsort_limits,
    neuron_notes=_argsort_notes,
    mac_count=lambda call: call.dims["N"] * call.dims["N"] // ARGSORT_PASS,
    nondifferentiable_outputs=("indices",),
    family="sort",
    catalog="3",
    support={
        "vjp": "none (index output: zero gradients)",
        "notes": f"docs-only (2.32); N % {ARGSORT_PASS} == 0 on Neuron; ties in any order; -inf data not "
        "supported by the kernel (its sorted-slot marker)",
    },
)

argsort_unstable = make_kernel(ARGSORT_UNSTABLE_SPEC, zero_cotangents)
