"""``cascaded_max`` (catalog row 8, section 1.8): the maximum of each row and its index.

Source: nki-library ``src/nkilib_src/nkilib/core/max/cascaded_max.py`` (an HBM-in/HBM-out ``@nki.jit`` kernel) and
its torch reference ``cascaded_max_torch.py`` (``torch.max(x, -1, keepdim=True)``, indices as int32).

Layouts: ``input_tensor [B, S, V]`` or ``[R, V]`` -> ``(max_values [B, S, 1] (or [R, 1]) in the input's dtype,
max_indices [..., 1] uint32)`` (the kernel's ``nl.uint32`` index dtype). The index is the position of the maximum
along ``V``; with ties this reference gives the lowest such position (the kernel's choice on ties is not
documented). Reverse mode: the value's cotangent goes to the maximum's position (``jnp.max``'s rule); the index
carries none. Neuron limits: at most 128 rows per core (``ceil(B*S / LNC) <= 128``; the kernel splits rows over the
LNC cores and runs on one core when ``B*S == 1``), ``128 <= V <= 16384`` (its stages fold ``V`` in 128-wide chunks;
the library's tests rule out ``V > 2**14``).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import NEURON_FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand

MAX_VOCAB = 2**14  # the library's test filter: larger vocabularies are invalid


def reference_cascaded_max(input_tensor):
    """``(max_values, max_indices uint32)`` with a trailing axis of 1."""
    values = jnp.max(input_tensor, axis=-1, keepdims=True)
    indices = jnp.argmax(input_tensor, axis=-1, keepdims=True)
    return values, indices.astype(jnp.uint32)


def _vjp(kernel, operands, params, outs, cotangents):
    return pull_back(
        lambda named: (jnp.max(named["input_tensor"], axis=-1, keepdims=True),),
        operands,
        ["input_tensor"],
        cotangents[:1],
    )


def _rows(call: CallInfo) -> int:
    return math.prod(call.avals["input_tensor"].shape[:-1])


def _neuron_limits(call: CallInfo) -> list[str]:
    rows, unmet = _rows(call), []
    per_core = rows if rows == 1 else -(-rows // call.lnc)
    if per_core > PARTITIONS:
        unmet.append(f"B*S={rows} gives {per_core} rows per core at LNC={call.lnc}; at most {PARTITIONS}")
    if not PARTITIONS <= call.dims["V"] <= MAX_VOCAB:
        unmet.append(f"V={call.dims['V']} must be in [{PARTITIONS}, {MAX_VOCAB}]")
    if np.dtype(call.avals["input_tensor"].dtype) not in NEURON_FLOAT_DTYPES:
        unmet.append(f"dtype {call.avals['input_tensor'].dtype} is not a Neuron dtype")
    return unmet


def _outputs(call: CallInfo):
    shape = tuple(call.avals["input_tensor"].shape[:-1]) + (1,)
    return [("max_values", shape, call.avals["input_tensor"].dtype), ("max_indices", shape, jnp.uint32)]


_OUT_AXES = {"max_values": 0, "max_indices": 0}

CASCADED_MAX_SPEC = KernelSpec(
    name="cascaded_max",
    entry_point="nkilib.core.max.cascaded_max:cascaded_max",
    operands=(Operand.of("input_tensor", "B, S, V", "R, V", doc="values; the maximum along the last axis"),),
    params=(),
    outputs=(),
    output_avals=_outputs,
    reference=reference_cascaded_max,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan({"input_tensor": "B"}, outputs=_OUT_AXES, when=lambda call: call.avals["input_tensor"].ndim == 3),
        FoldPlan({"input_tensor": "R"}, outputs=_OUT_AXES, when=lambda call: call.avals["input_tensor"].ndim == 2),
    ),
    mac_count=lambda call: int(np.prod(call.avals["input_tensor"].shape)),
    nondifferentiable_outputs=("max_indices",),
    family="reduce",
    catalog="1.8",
    support={
        "idiomatic": "argmax",
        "vjp": "JAX (the value like jnp.max; the index carries no gradient)",
        "notes": f"uint32 indices; Neuron: ceil(B*S/LNC) <= {PARTITIONS}, V >= {PARTITIONS}; ties: index unspecified",
    },
)

cascaded_max = make_kernel(CASCADED_MAX_SPEC, _vjp)
