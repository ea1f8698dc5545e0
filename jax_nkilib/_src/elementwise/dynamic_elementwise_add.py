"""``dynamic_elementwise_add`` (catalog row 32, section 1.25): ``input_a + input_b`` over a run-time number of
128-row tiles.

Source: nki-library ``src/nkilib_src/nkilib/experimental/dynamic_shapes/dynamic_elementwise_add.py`` (``@nki.jit
dynamic_elementwise_add(input_a, input_b, num_m_tiles)``, the same at tag 2.29, on main and in the 2.32 API
reference), its torch reference ``dynamic_elementwise_add_torch.py`` (``input_a + input_b``, ignoring
``num_m_tiles``) and its tests (``num_m_tiles = M // 128`` there: every row written).

``dynamic_elementwise_add(input_a [M, H], input_b [M, H], num_m_tiles [1, 1] int32) -> result [M, H]`` in
``input_a``'s dtype: the kernel loads ``num_m_tiles`` into a register and runs that many iterations of a
``dynamic_range`` loop, each adding one 128-row tile, so a different count needs no recompilation.

Rows past the count: the kernel writes only rows ``[0, num_m_tiles * 128)`` of a freshly allocated output, so on
Neuron the rows from ``num_m_tiles * 128`` on hold whatever that HBM buffer held (undefined). The reference here
defines them as **zeros**; read only the first ``num_m_tiles * 128`` rows of a result. A count outside
``[0, M / 128]`` (documented as invalid; the kernel would read and write out of bounds for one above) is clamped to
that range here, and ``jax_nkilib.config(runtime_checks=True)`` reports it.

Dtypes: the API reference documents bfloat16 operands; other float dtypes run the reference only (on Neuron they fall
back, naming the limit). M % 128 == 0 always (the count is in 128-row tiles); H % 512 == 0 on Neuron.

Reverse mode: JAX math, ``d input_a = d input_b = dy`` on the written rows and 0 on the others (the reference's
constant zeros); ``num_m_tiles`` is an integer and gets no cotangent.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel
from ..framework.runtime_checks import check_all
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Output

H_TILE = 512  # the kernel's column tile


def written_rows(num_m_tiles, rows: int):
    """``[M, 1]`` mask of the rows the kernel writes: ``row < clip(num_m_tiles, 0, M/128) * 128``."""
    tiles = jnp.clip(num_m_tiles.reshape(()).astype(jnp.int32), 0, rows // PARTITIONS)
    return (jnp.arange(rows) < tiles * PARTITIONS)[:, None]


def reference_dynamic_elementwise_add(input_a, input_b, num_m_tiles):
    """JAX reference: ``input_a + input_b`` on the first ``num_m_tiles * 128`` rows, zeros on the rest."""
    total = input_a + input_b
    return (jnp.where(written_rows(num_m_tiles, input_a.shape[0]), total, jnp.zeros_like(total)),)


def _dynamic_add_vjp(kernel, operands, params, outs, cotangents):
    """The cotangent on the written rows, zero elsewhere, for both addends."""
    (dy,) = cotangents
    a = operands["input_a"]
    if dy is None:
        return {"input_a": None, "input_b": None}
    grad = jnp.where(written_rows(operands["num_m_tiles"], a.shape[0]), dy, jnp.zeros_like(dy)).astype(a.dtype)
    return {"input_a": grad, "input_b": grad}


def _check_dynamic_add(call: CallInfo) -> None:
    if call.avals["input_a"].dtype != call.avals["input_b"].dtype:
        raise TypeError(
            f"{call.function}: `input_a` and `input_b` must have the same dtype; got {call.avals['input_a'].dtype} "
            f"and {call.avals['input_b'].dtype}"
        )
    if call.dims["M"] % PARTITIONS:
        raise ValueError(
            f"{call.function}: argument `input_a` [M, H] must have M % {PARTITIONS} == 0 (num_m_tiles counts "
            f"{PARTITIONS}-row tiles); got M={call.dims['M']}"
        )


def _dynamic_add_limits(call: CallInfo) -> list[str]:
    unmet = []
    if call.dims["H"] % H_TILE:
        unmet.append(f"H={call.dims['H']} is not a multiple of the kernel's column tile {H_TILE}")
    if np.dtype(call.avals["input_a"].dtype) != np.dtype(jnp.bfloat16):
        unmet.append(f"dtype {call.avals['input_a'].dtype}: the kernel is documented for bfloat16 operands")
    return unmet


def _runtime_checks(call: CallInfo, operands) -> None:
    tiles, most = operands["num_m_tiles"].reshape(1), call.dims["M"] // PARTITIONS
    check_all(
        (tiles >= 0) & (tiles <= most),
        f"{call.function}: num_m_tiles = {{}} is outside [0, M/{PARTITIONS} = {most}] (clamped)",
        tiles,
    )


DYNAMIC_ELEMENTWISE_ADD_SPEC = KernelSpec(
    name="dynamic_elementwise_add",
    entry_point="nkilib.experimental.dynamic_shapes.dynamic_elementwise_add:dynamic_elementwise_add",
    operands=(
        Operand.of("input_a", "M, H", doc="first addend (bfloat16 on Neuron)"),
        Operand.of("input_b", "M, H", doc="second addend, input_a's shape and dtype"),
        Operand.of("num_m_tiles", "1, 1", dtypes=INT_DTYPES, doc="run-time count of 128-row tiles to add"),
    ),
    params=(),
    outputs=(Output.of("result", "M, H", "input_a"),),
    reference=reference_dynamic_elementwise_add,
    check=_check_dynamic_add,
    runtime_checks=_runtime_checks,
    neuron_limits=_dynamic_add_limits,
    # a vmapped pair of addends with one shared count: the batch joins the columns, which every row keeps
    fold_plans=(FoldPlan(axes={"input_a": "H", "input_b": "H", "num_m_tiles": None}, outputs=("H",)),),
    family="elementwise",
    catalog="1.25",
    support={
        "vjp": "JAX (the cotangent on the written rows)",
        "notes": f"rows past num_m_tiles*{PARTITIONS} are unwritten (undefined) on Neuron and zeros in the "
        f"reference; M % {PARTITIONS} == 0; Neuron: bfloat16, H % {H_TILE} == 0; vmap with a shared count "
        "folds the batch into H, with a batched count it runs lax.map",
    },
)


dynamic_elementwise_add = make_kernel(DYNAMIC_ELEMENTWISE_ADD_SPEC, _dynamic_add_vjp)
