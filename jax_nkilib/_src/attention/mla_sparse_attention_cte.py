"""``mla_sparse_attention_cte_kernel`` (catalog row 51, docs-only in 2.32): DeepSeek-V3.2 sparse latent attention.

Source: the 2.32 API reference (aws-neuron-sdk ``nki/library/api/mla-sparse-attention-cte.rst``) and the newer
nki-library torch reference ``mla_sparse_attention_cte_torch_ref`` (``experimental/mla/deepseek``), whose 2.32
signature ``(q_lift_hbm, q_pe_hbm, c_kv_hbm, k_pe_hbm, topk_indices_hbm, softmax_scale, topk_tiled=False)`` this
binds (a later revision adds ``dense``/``q_pos_offset``/``precision``; not bound).

Layouts: ``q_lift_hbm [B, S, H, L]`` (per-head absorbed query latents), ``q_pe_hbm [B, S, H, R]`` (rotated),
``c_kv_hbm [B, S_kv, L]`` (latent KV), ``k_pe_hbm [B, S_kv, R]`` (rotated, shared by the heads),
``topk_indices_hbm [B, S, K]`` int32 (flat; the partition-tiled ``topk_tiled=True`` layout is not bound).
Output ``[B, S, H * L]``.

Math, per query ``s`` (at position ``s``) and head ``h``, over its ``K`` gathered rows ``j = idx[b, s, k]``::

    logit_k = softmax_scale * (q_lift[s, h] . c_kv[j] + q_pe[s, h] . k_pe[j]),   -inf where j > s
    a[s, h] = sum_k softmax(logit)_k c_kv[j]                                     # [L]

A repeated index counts once per occurrence (a gather). Each head's ``L`` output columns are in MX 4-pack order: the
natural latent ``l = 4 g + u`` is stored at column ``u * (L / 4) + g`` of the head's block (the order the o_proj
kernel loads). The reference computes in float32 (float64 for float64 inputs) from the inputs' values and returns
``q_lift_hbm``'s dtype (the kernel: bfloat16 in, bfloat16 out). Indices must lie in ``[0, S_kv)`` and every query
needs one index ``<= s`` (else its row is NaN); the reference clamps out-of-range indices, the kernel's reads of them
are undefined. Reverse mode differentiates the reference (no backward kernel); the indices get no cotangent.

Neuron limits (2.32 reference): bfloat16, ``B == 1``, ``L == 512``, ``K % 128 == 0``, ``H <= 128``, ``S``
divisible by the LNC degree (the kernel splits the queries over the cores).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import FLOAT_DTYPES, INT_DTYPES, CallInfo, KernelSpec, Operand, Param
from .checks import require_same_dtype

H_PACK = 4  # latents per MX word: the output's 4-pack column order
KERNEL_LATENT = 512  # L = 128 partitions x 4
KERNEL_TOPK_MULTIPLE = 128
KERNEL_MAX_HEADS = 128


def to_mx_pack_columns(latent):
    """``[..., H, L]`` -> ``[..., H * L]`` with each head's latent ``l = 4 g + u`` at column ``u * (L / 4) + g``."""
    *lead, heads, size = latent.shape
    packed = latent.reshape(*lead, heads, size // H_PACK, H_PACK)
    return jnp.swapaxes(packed, -1, -2).reshape(*lead, heads * size)


def from_mx_pack_columns(out, heads):
    """The inverse of :func:`to_mx_pack_columns`: ``[..., H * L]`` -> ``[..., H, L]`` in natural latent order."""
    *lead, width = out.shape
    size = width // heads
    packed = out.reshape(*lead, heads, H_PACK, size // H_PACK)
    return jnp.swapaxes(packed, -1, -2).reshape(*lead, heads, size)


def reference_mla_sparse_attention_cte(
    q_lift_hbm, q_pe_hbm, c_kv_hbm, k_pe_hbm, topk_indices_hbm, softmax_scale, topk_tiled=False
):
    """JAX reference: ``(out [B, S, H * L],)`` (see the module doc)."""
    del topk_tiled  # only the flat layout is bound
    compute = jnp.promote_types(q_lift_hbm.dtype, jnp.float32)
    q, q_pe, c_kv, k_pe = (a.astype(compute) for a in (q_lift_hbm, q_pe_hbm, c_kv_hbm, k_pe_hbm))
    idx = topk_indices_hbm
    gather = jax.vmap(lambda rows, i: rows[i])  # per batch: [S_kv, d] at [S, K] -> [S, K, d]
    c_rows, pe_rows = gather(c_kv, idx), gather(k_pe, idx)
    logits = jnp.einsum("bshl,bskl->bshk", q, c_rows) + jnp.einsum("bshr,bskr->bshk", q_pe, pe_rows)
    future = idx > jnp.arange(idx.shape[1], dtype=idx.dtype)[:, None]  # [B, S, K]
    logits = jnp.where(future[:, :, None, :], -jnp.inf, logits * softmax_scale)
    latent = jnp.einsum("bshk,bskl->bshl", jax.nn.softmax(logits, axis=-1), c_rows)
    return (to_mx_pack_columns(latent).astype(q_lift_hbm.dtype),)


def _check(call: CallInfo) -> None:
    function, dims, params = call.function, call.dims, call.params
    require_same_dtype(
        call, ("q_lift_hbm", "q_pe_hbm", "c_kv_hbm", "k_pe_hbm"), "q_lift_hbm, q_pe_hbm, c_kv_hbm, k_pe_hbm"
    )
    if dims["L"] % H_PACK:
        raise ValueError(
            f"{function}: q_lift_hbm [B, S, H, L] needs L % {H_PACK} == 0 (the output's MX 4-pack columns); "
            f"got L={dims['L']}"
        )
    if params["topk_tiled"]:
        raise ValueError(
            f"{function}: parameter `topk_tiled=True` (the partition-tiled index layout) is not bound; pass "
            "topk_indices_hbm flat as [B, S, K] int32 with topk_tiled=False"
        )
    if not params["softmax_scale"] > 0:
        raise ValueError(f"{function}: parameter `softmax_scale` must be positive; got {params['softmax_scale']}")


def _output_avals(call: CallInfo):
    dims = call.dims
    return (("out", (dims["B"], dims["S"], dims["H"] * dims["L"]), call.avals["q_lift_hbm"].dtype),)


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    if call.avals["q_lift_hbm"].dtype != jnp.bfloat16:
        unmet.append(
            f"q_lift_hbm, q_pe_hbm, c_kv_hbm and k_pe_hbm must be bfloat16; got {call.avals['q_lift_hbm'].dtype}"
        )
    if dims["B"] != 1:
        unmet.append(f"B={dims['B']} must be 1")
    if dims["L"] != KERNEL_LATENT:
        unmet.append(f"L={dims['L']} (kv_lora_rank) must be {KERNEL_LATENT}")
    if dims["K"] % KERNEL_TOPK_MULTIPLE:
        unmet.append(f"K={dims['K']} top-k indices must be a multiple of {KERNEL_TOPK_MULTIPLE}")
    if dims["H"] > KERNEL_MAX_HEADS:
        unmet.append(f"H={dims['H']} heads exceed {KERNEL_MAX_HEADS}")
    if dims["S"] % call.lnc:
        unmet.append(f"S={dims['S']} must be divisible by the LNC degree {call.lnc} (the cores split the queries)")
    return unmet


MLA_SPARSE_ATTENTION_CTE_SPEC = KernelSpec(
    name="mla_sparse_attention_cte_kernel",
    entry_point="nkilib.experimental.mla.deepseek.mla_sparse_attention_cte:mla_sparse_attention_cte_kernel",
    operands=(
        Operand.of("q_lift_hbm", "B, S, H, L", dtypes=FLOAT_DTYPES, doc="per-head absorbed query latents"),
        Operand.of("q_pe_hbm", "B, S, H, R", dtypes=FLOAT_DTYPES, doc="rotated query RoPE parts"),
        Operand.of("c_kv_hbm", "B, S_kv, L", dtypes=FLOAT_DTYPES, doc="latent KV cache"),
        Operand.of("k_pe_hbm", "B, S_kv, R", dtypes=FLOAT_DTYPES, doc="rotated key RoPE parts"),
        Operand.of("topk_indices_hbm", "B, S, K", dtypes=INT_DTYPES, doc="cache rows each query attends"),
    ),
    params=(
        Param("softmax_scale", None, float, "positive scale of the logits", required=True),
        Param("topk_tiled", False, bool, "partition-tiled index layout (not bound: must be False)"),
    ),
    outputs=(),
    output_avals=_output_avals,
    reference=reference_mla_sparse_attention_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: (
        2 * call.dims["B"] * call.dims["S"] * call.dims["H"] * call.dims["K"] * (2 * call.dims["L"] + call.dims["R"])
    ),
    family="mla",
    catalog="row 51, section 3",
    support={
        "idiomatic": "mla_attention (sparse top-k path)",
        "vjp": "JAX (differentiates the reference; no backward kernel)",
        "notes": "docs-only (2.32) + newer torch reference; output [B, S, H*L] in MX 4-pack column order; flat "
        f"indices only; Neuron: bf16, B == 1, L == {KERNEL_LATENT}, K % {KERNEL_TOPK_MULTIPLE} == 0, "
        f"H <= {KERNEL_MAX_HEADS}, S % LNC == 0",
    },
)

mla_sparse_attention_cte_kernel = make_kernel(MLA_SPARSE_ATTENTION_CTE_SPEC, reference_vjp)
