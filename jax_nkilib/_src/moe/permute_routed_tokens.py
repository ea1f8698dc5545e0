"""``permute_routed_tokens`` (catalog row 78, docs-only): the ``T*K`` routed copies of the tokens sorted by expert,
each row packed as ``[hidden_input row, affinity, token index]`` in ``hidden_input``'s dtype.

Sources: the NKI Library API reference (aws-neuron-sdk ``nki/library/api/permute-routed-tokens.rst``, nki-library
2.32) and, for the exact semantics, the kernel source ``experimental/subkernels/permute_routed_tokens.py``, its
torch reference ``permute_routed_tokens_torch.py`` and ``argsort_unstable_torch.py`` (the public code index).

``permute_routed_tokens(hidden_input [T, C], expert_index [T, K] int32, expert_affinities_masked [T, E] bfloat16)
-> output [T*K, C + n_concat]``: with ``order`` the kernel's ascending argsort of ``expert_index.reshape(T*K)``,
``token = order // K`` and ``e = expert_index.reshape(T*K)[order]``, row ``j`` is ``hidden_input[token[j]]``, then
the bits of the bfloat16 ``expert_affinities_masked[token[j], e[j]]``, then the bits of the int32 ``token[j]``,
reinterpreted as ``hidden_input``'s dtype (little-endian): ``n_concat = 1 + 2 = 3`` columns for bfloat16 (not 2 as
the catalog row says), ``2 + 4 = 6`` for fp8 (whose ``C`` columns may include packed scales).

Ties (one expert chosen by several tokens) are ordered as the kernel's ``argsort_unstable`` does it: ``max8`` passes
take the 8 largest remaining values (for equal values, the lowest indices first) and the ascending result is the
passes in reverse, each pass by value then index. With the stable descending rank ``q`` of each entry (equal values
by index), the order is ``(pass = q // 8)`` descending, then value, then index. So ``T*K`` must be a multiple of 8.
An expert id outside ``[0, E)`` gathers a zero affinity here (undefined on the device).

Not differentiable: the packed buffer's trailing columns are integer bit patterns (the public function stops
gradients; gather ``hidden_input`` by the token column in JAX to differentiate).
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..framework.hardware import PARTITIONS
from ..framework.primitive import Vjp, make_kernel
from ..framework.runtime_checks import check_all
from ..framework.spec import FP8_DTYPES, INT_DTYPES, CallInfo, KernelSpec, Operand

ARGSORT_PASS = 8  # argsort_unstable's max8 / nc_match_replace8 width
SUPPORTED_K = (1, 2, 4, 8)
HIDDEN_DTYPES = (jnp.dtype(jnp.bfloat16), *FP8_DTYPES)


def concat_columns(dtype) -> int:
    """Columns of ``dtype`` that hold one bfloat16 affinity and one int32 token index."""
    return (2 + 4) // jnp.dtype(dtype).itemsize


def argsort_unstable_ascending(values):
    """The ascending argsort of ``values [N]`` (``N % 8 == 0``) in the order ``argsort_unstable`` gives ties."""
    n = values.shape[0]
    position = jnp.arange(n, dtype=jnp.int32)
    descending = jnp.lexsort((position, ~values))  # ~v = -v - 1 orders descending without overflow
    rank = jnp.zeros(n, jnp.int32).at[descending].set(position)
    return jnp.lexsort((position, values, -(rank // ARGSORT_PASS)))


def _words(dtype):
    """The unsigned integer type of ``dtype``'s width (the packing works on words: no float op sees the bits)."""
    return {1: jnp.uint8, 2: jnp.uint16}[jnp.dtype(dtype).itemsize]


def words_of(x, word):
    """The bytes of ``x [N]`` as ``[N, itemsize(x) / itemsize(word)]`` words (least significant first)."""
    width = jnp.dtype(x.dtype).itemsize // jnp.dtype(word).itemsize
    return lax.bitcast_convert_type(x, word).reshape(x.shape[0], width)


def reference_permute_routed_tokens(hidden_input, expert_index, expert_affinities_masked):
    tokens, k = expert_index.shape
    experts = expert_affinities_masked.shape[1]
    flat = expert_index.reshape(tokens * k)
    order = argsort_unstable_ascending(flat)
    token = order // k
    expert = flat[order]
    inside = (expert >= 0) & (expert < experts)
    affinity = expert_affinities_masked[token, jnp.where(inside, expert, 0)]
    affinity = jnp.where(inside, affinity, jnp.zeros((), affinity.dtype))
    word = _words(hidden_input.dtype)
    rows = lax.bitcast_convert_type(hidden_input, word)[token]
    packed = jnp.concatenate([rows, words_of(affinity, word), words_of(token.astype(jnp.int32), word)], axis=1)
    return (lax.bitcast_convert_type(packed, hidden_input.dtype),)


def _output_avals(call: CallInfo):
    dtype = call.avals["hidden_input"].dtype
    rows = call.dims["T"] * call.dims["K"]
    return [("output", (rows, call.dims["C"] + concat_columns(dtype)), dtype)]


def _check(call: CallInfo) -> None:
    rows = call.dims["T"] * call.dims["K"]
    if rows % ARGSORT_PASS:
        raise ValueError(
            f"{call.function}: T*K={rows} (expert_index [T, K]) must be a multiple of {ARGSORT_PASS}: the "
            f"kernel's argsort sorts in passes of {ARGSORT_PASS} and defines no order otherwise"
        )


def _runtime_checks(call: CallInfo, operands) -> None:
    index, experts = operands["expert_index"], call.dims["E"]
    check_all(
        (index >= 0) & (index < experts),
        f"{call.function}: expert_index{{index}} = {{}} is outside [0, E={experts})",
        index,
    )


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet = []
    if call.dims["T"] * call.dims["K"] > PARTITIONS:
        unmet.append(f"T*K={call.dims['T'] * call.dims['K']} must be <= {PARTITIONS}")
    if call.dims["K"] not in SUPPORTED_K:
        unmet.append(f"K={call.dims['K']} must be one of {SUPPORTED_K}")
    return unmet


PERMUTE_ROUTED_TOKENS_SPEC = KernelSpec(
    name="permute_routed_tokens",
    entry_point="nkilib.experimental.subkernels.permute_routed_tokens:permute_routed_tokens",
    operands=(
        Operand.of("hidden_input", "T, C", dtypes=HIDDEN_DTYPES, doc="hidden states (fp8 rows may pack scales)"),
        Operand.of("expert_index", "T, K", dtypes=INT_DTYPES, doc="top-K expert ids per token"),
        Operand.of("expert_affinities_masked", "T, E", dtypes=(jnp.bfloat16,), doc="affinities, zero where not routed"),
    ),
    params=(),
    outputs=(),
    output_avals=_output_avals,
    reference=reference_permute_routed_tokens,
    check=_check,
    runtime_checks=_runtime_checks,
    neuron_limits=_neuron_limits,
    family="moe",
    catalog="row 78",
    nondifferentiable_outputs=("output",),
    support={
        "vjp": "none: a packed buffer with integer bit patterns (gradients stopped)",
        "notes": "docs-only kernel (2.32); output [T*K, C+3] (bf16) or [T*K, C+6] (fp8), rows sorted by expert "
        "with argsort_unstable's tie order; T*K % 8 == 0; T*K <= 128 and K in (1, 2, 4, 8) on Neuron",
    },
)

NO_GRADIENT = Vjp(lambda kernel, operands, params: (kernel.call(operands, params), None), lambda *_: {})
permute_routed_tokens = make_kernel(PERMUTE_ROUTED_TOKENS_SPEC, NO_GRADIENT)  # differentiable calls give zeros
