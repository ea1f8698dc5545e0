"""``ring_attention_unpermute`` (catalog row 44, section 3; nki-library
``experimental/attention/ring_attention_unpermute.py``): striped ring-attention output back to contiguous order.
Called inside ``jax.shard_map``; ``replica_groups`` names the mesh axes of the ring.

Layout: ``x [bs, S, d]`` per rank, holding the striped tokens at global positions ``rank + k * num_workers``;
the output ``[bs, S, d]`` (``x``'s dtype) holds this rank's contiguous chunk, positions ``[rank * S, (rank + 1) *
S)``. Requires ``S % num_workers == 0``. A pure permutation (its VJP is the inverse permutation, in JAX).
The kernel all-gathers and copies with strided DMAs; this reference exchanges only the needed chunks
(one ``all_to_all``, ``O(S)`` memory per device).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.mesh_axes import lax_axis
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from .ring_checks import needs_trn2, require_ring
from .ring_math import unpermute_striped

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def reference_ring_attention_unpermute(x, *, replica_groups, num_workers):
    """JAX reference (inside ``shard_map`` over ``replica_groups``); see the module docstring."""
    return (unpermute_striped(x, lax_axis(replica_groups), num_workers),)


def _check(call: CallInfo) -> None:
    require_ring(call, "replica_groups", "num_workers")
    seq, workers = call.dims["S"], call.params["num_workers"]
    if seq % workers:
        raise ValueError(
            f"{call.function}: x [bs, S, d] needs S (tokens per rank) to be a multiple of "
            f"num_workers={workers}; got S={seq}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    dtype, unmet = jnp.dtype(call.avals["x"].dtype), needs_trn2(call)
    if dtype not in KERNEL_DTYPES:
        unmet.append(f"x has dtype {dtype}; the kernel takes bfloat16 or float16")
    return unmet


RING_ATTENTION_UNPERMUTE_SPEC = KernelSpec(
    name="ring_attention_unpermute",
    entry_point="nkilib.experimental.attention.ring_attention_unpermute:ring_attention_unpermute",
    operands=(Operand.of("x", "bs, S, d"),),
    params=(Param("replica_groups", None, "axis"), Param("num_workers", 1, int)),
    outputs=(),
    output_avals=lambda call: [("out_x", call.avals["x"].shape, call.avals["x"].dtype)],
    reference=reference_ring_attention_unpermute,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(FoldPlan({"x": "bs"}, outputs={"out_x": 0}),),
    has_collectives=True,
    family="parallel",
    catalog="row 44, section 3",
    support={
        "idiomatic": "",
        "vjp": "JAX (the inverse permutation, through the reference's all_to_all)",
        "shard_map": "inside jax.shard_map only: replica_groups names the ring's mesh axes (collectives)",
        "notes": "Trn2+; bfloat16/float16 on Neuron; S % num_workers == 0",
    },
)

ring_attention_unpermute = make_kernel(RING_ATTENTION_UNPERMUTE_SPEC, vjp=reference_vjp)
