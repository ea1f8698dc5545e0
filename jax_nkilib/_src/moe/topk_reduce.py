"""``topk_reduce`` (catalog 1.26, row 36; nki-library ``experimental/subkernels/topk_reduce.py`` on tag 2.29 and in
the 2.32 docs, ``experimental/collectives/`` on main; torch ref ``topk_reduce_torch.py``): the combine step of an
expert-parallel MoE, summing each token's expert outputs scattered over the rows of an ``all_to_all_v`` buffer.

``input [TK_pad, H + 2]`` (bfloat16 or float16): row ``j`` holds an expert output ``input[j, :H]`` and, in its last
two 16-bit columns, the raw bytes of an int32 ``p_j`` (little-endian: column ``H`` the low half). Row ``j`` belongs to
token ``p_j - token_base_index``; rows whose token is outside ``[0, T)`` (padding) are ignored. Output ``out [T, H]``
in the input dtype: ``out[t]`` = the sum of token ``t``'s first ``K`` rows in row order, added one by one in the
input dtype as the kernel's DMA accumulation does (a token with fewer rows sums those it has; with none, 0).

``token_base_index`` is the 2.32 keyword (default 1 there, token ids packed 1-based); tag 2.29 and main have no such
keyword and read ids 0-based, which is this binding's default 0. Reverse mode: ``d input[j, :H] = d out[t_j]`` for
the rows summed, 0 elsewhere and in the id columns.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, KernelSpec, Operand, Param, accumulation_dtype

ID_COLUMNS = 2  # the int32 token id, as two 16-bit columns
MAX_TOKENS = 128
MAX_TOP_K = 8


def packed_token_ids(input):
    """The int32 in the last two 16-bit columns of each row of ``input [N, H + 2]``."""
    return lax.bitcast_convert_type(input[:, -ID_COLUMNS:], jnp.int32)


def summed_rows(input, T, K, token_base_index):
    """``[T, N]`` float mask of the rows each token sums (its first ``K`` in row order)."""
    tokens = packed_token_ids(input) - jnp.int32(token_base_index)
    belongs = tokens[None, :] == jnp.arange(T, dtype=jnp.int32)[:, None]
    position = jnp.cumsum(belongs.astype(jnp.int32), axis=1)  # 1-based rank of the row within its token
    return belongs & (position <= K), position


def reference_topk_reduce(input, *, T, K, token_base_index=0):
    """JAX reference of ``topk_reduce``: ``(out [T, H],)``."""
    io, acc = input.dtype, accumulation_dtype(input.dtype)
    values = input[:, :-ID_COLUMNS].astype(acc)
    summed, position = summed_rows(input, T, K, token_base_index)
    out = None
    for k in range(1, K + 1):  # the kernel's k-th DMA: copy, then read-modify-write adds in the input dtype
        row = (summed & (position == k)).astype(acc)
        term = jnp.dot(row, values, precision=lax.Precision.HIGHEST)  # one row per token: exact
        out = term if out is None else (out + term).astype(io).astype(acc)
    return (out.astype(io),)


def _check(call: CallInfo) -> None:
    p, f = call.params, call.function
    if call.dims["W"] <= ID_COLUMNS:
        raise ValueError(
            f"{f}: `input` [TK_pad, H + 2] needs H >= 1 besides the 2 token-id columns; got width {call.dims['W']}"
        )
    for name in ("T", "K"):
        if p[name] < 1:
            raise ValueError(f"{f}: parameter `{name}` must be >= 1; got {p[name]}")


def _neuron_limits(call: CallInfo) -> list[str]:
    p, unmet, hidden = call.params, [], call.dims["W"] - ID_COLUMNS
    if p["T"] > MAX_TOKENS:
        unmet.append(f"T <= {MAX_TOKENS}; got T={p['T']}")
    if p["K"] > MAX_TOP_K:
        unmet.append(f"K <= {MAX_TOP_K}; got K={p['K']}")
    if hidden % call.lnc:
        unmet.append(f"H % LNC == 0 (the cores split H); got H={hidden} at LNC={call.lnc}")
    return unmet


TOPK_REDUCE_SPEC = KernelSpec(
    name="topk_reduce",
    entry_point="jax_nkilib_kernels.moe_tkg:topk_reduce",
    operands=(
        Operand.of(
            "input",
            "TK_pad, W",
            dtypes=(jnp.bfloat16, jnp.float16),
            doc="rows of expert outputs [TK_pad, H + 2], each with its int32 token id in the last 2 columns",
        ),
    ),
    params=(
        Param("T", None, int, "tokens (output rows)", required=True),
        Param("K", None, int, "rows summed per token (top-k)", required=True),
        Param("token_base_index", 0, int, "packed id of token 0 (2.32's keyword; 0 = 2.29/main behaviour)"),
    ),
    outputs=(),
    output_avals=lambda call: [("out", (call.params["T"], call.dims["W"] - ID_COLUMNS), call.avals["input"].dtype)],
    reference=reference_topk_reduce,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: call.params["T"] * call.params["K"] * (call.dims["W"] - ID_COLUMNS),
    family="moe",
    catalog="1.26",
    support={
        "vjp": "JAX (the reference differentiated: a gather of the output cotangent; no backward kernel)",
        "notes": "token ids packed as int32 in the 2 trailing 16-bit columns; bf16/fp16; T <= 128, K <= 8 on "
        "Neuron; device adapter jax_nkilib_kernels/moe_tkg.py (passes token_base_index where the library takes it)",
    },
)


topk_reduce = make_kernel(TOPK_REDUCE_SPEC, reference_vjp)
topk_reduce.__doc__ += "\nSemantics (from the module documentation):\n\n" + __doc__
