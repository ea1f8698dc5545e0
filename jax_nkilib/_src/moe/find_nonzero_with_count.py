"""``find_nonzero_indices_with_count`` (catalog row 37): the nonzero positions of one row, with their count in the
last slot (an ``experimental/benchmark`` kernel of the MoE routing path).

Source: nki-library ``src/nkilib_src/nkilib/experimental/benchmark/find_nonzero_indices_with_count.py`` (tag 2.29,
unchanged on main; ``@nki.jit``, HBM in and out) and its test's golden ``golden_output_validator``.

``find_nonzero_indices_with_count(input_tensor [1, T]) -> output [1, T + 1] int32``: ``output[0, :n]`` are the
positions ``t`` with ``input_tensor[0, t] != 0`` in increasing order, ``output[0, n:T]`` are ``-1``, and
``output[0, T] = n``. The kernel runs one GpSimd ``nonzero_with_count`` on partition 0, so it needs no LNC split.
Neuron limits: float32 or int32 input (the kernel asserts it); its two ``[128, T]`` SBUF tiles must fit a partition.
The output is integer: no operand gets a cotangent. vmap runs ``lax.map`` (the leading axis is fixed to 1).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.hardware import SBUF_PARTITION_BYTES
from ..framework.primitive import make_kernel, zero_cotangents
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, CallInfo, KernelSpec, Operand

PADDING_VALUE = -1
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.int32))


def reference_find_nonzero_indices_with_count(input_tensor):
    """``(output [1, T + 1] int32,)``: nonzero positions ascending, ``-1`` padding, the count last."""
    row = input_tensor[0] != 0
    tokens = row.shape[0]
    count = jnp.sum(row, dtype=jnp.int32)
    order = jnp.argsort(jnp.logical_not(row), stable=True).astype(jnp.int32)  # nonzero positions first, in order
    indices = jnp.where(jnp.arange(tokens) < count, order, PADDING_VALUE)
    return (jnp.concatenate([indices, count[None]])[None, :],)


def _output(call: CallInfo):
    return (("output", (1, call.dims["T"] + 1), jnp.int32),)


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet, dtype = [], jnp.dtype(call.avals["input_tensor"].dtype)
    if dtype not in KERNEL_DTYPES:
        unmet.append(f"input_tensor must be float32 or int32; got {dtype}")
    used = (2 * call.dims["T"] + 1) * 4  # the [128, T] input tile and the [128, T + 1] int32 result, per partition
    if used > SBUF_PARTITION_BYTES:
        unmet.append(f"SBUF capacity: T={call.dims['T']} needs {used} bytes per partition > {SBUF_PARTITION_BYTES}")
    return unmet


FIND_NONZERO_INDICES_WITH_COUNT_SPEC = KernelSpec(
    name="find_nonzero_indices_with_count",
    entry_point="nkilib.experimental.benchmark.find_nonzero_indices_with_count:find_nonzero_indices_with_count",
    operands=(Operand.of("input_tensor", "1, T", dtypes=FLOAT_DTYPES + INT_DTYPES, doc="one row; nonzeros found"),),
    params=(),
    outputs=(),
    output_avals=_output,
    reference=reference_find_nonzero_indices_with_count,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: call.dims["T"],
    nondifferentiable_outputs=("output",),
    family="moe",
    catalog="row 37",
    support={
        "idiomatic": "",
        "vjp": "none (integer output)",
        "notes": "benchmark kernel; [1, T] -> [1, T+1] int32 (positions, -1 padding, count last); Neuron: float32 "
        "or int32 input; vmap via lax.map",
    },
)

# zero gradients: the outputs are indices
find_nonzero_indices_with_count = make_kernel(FIND_NONZERO_INDICES_WITH_COUNT_SPEC, zero_cotangents)
