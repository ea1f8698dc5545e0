"""``mla_vupmx_oproj_cte_kernel`` (catalog row 52, docs-only in 2.32): DeepSeek-V3.2 MX V-up + MX output projection.

Kernel B of the split sparse-MLA prefill: it consumes ``mla_sparse_attention_cte_kernel``'s output directly.
Source: the 2.32 API reference (aws-neuron-sdk ``nki/library/api/mla-vup-oproj-cte.rst``), whose signature
``(out_attn_hbm, wuv_qtz_hbm, wuv_scale_hbm, wo_qtz_hbm, wo_scale_hbm)`` this binds, and the newer nki-library source
``experimental/mla/deepseek/mla_vup_oproj_cte.py`` with its torch reference ``mla_vup_oproj_cte_torch.py``
(``mla_vupmx_oproj_cte_torch_ref``), ``mla_validate_params.py`` and ``core/utils/mx_torch_common.py`` (public code
index), which define the MX operands the rst leaves open. Later revisions add ``compact_scales=True`` (``False``:
native block-32 scales ``[K // 32, N]``) and ``precision`` (a bf16 path); neither is in 2.32 and neither is bound.

Layouts (``H`` heads, ``L`` latent = kv_lora_rank, ``d_v`` value head dim, ``HID`` hidden size; ``H = 4 rows(W_o) /
d_v``, ``L = (H L) / H``):

* ``out_attn_hbm [B, S, H * L]``: the latent attention output in MX 4-pack column order (natural latent ``l = 4 g +
  u`` of head ``h`` at column ``h L + u (L / 4) + g``), exactly what ``mla_sparse_attention_cte_kernel`` returns;
* ``wuv_qtz_hbm [H L / 4, d_v]`` and ``wo_qtz_hbm [H d_v / 4, HID]``: ``float8_e4m3fn_x4`` words held as uint32: the
  natural weight ``W [K, N]`` (``W_uv`` stacks the heads' ``[L, d_v]`` blocks along K; ``W_o`` contracts ``h d_v +
  j``) has ``W[4 r + q, n]`` = byte ``q`` of word ``[r, n]``;
* ``wuv_scale_hbm [H L / 128, ceil(d_v / 128)]`` and ``wo_scale_hbm [H d_v / 128, ceil(HID / 128)]``: uint8 e8m0
  "compact block-128" scales, one per 128 x 128 block of ``W``: ``W[k, n] = fp8 * 2**(scale[k // 128, n // 128] -
  127)``.

Math (the torch reference's MX pipeline), per batch ``b`` and query ``s``::

    a[h, l]   = bf16(out_attn) de-permuted to natural latent order           # [H, L]
    v[h, j]   = bf16( sum_l mx(a[h])[l] W_uv[h L + l, j] )                    # V-up per head, fp32 accumulate
    out[n]    = bf16( sum_k mx(v.flat)[k] W_o[k, n] )                         # o_proj over H d_v

where ``mx`` is an MXFP8 (e4m3) round trip in blocks of 32 consecutive contraction elements with
``nisa.quantize_mx``'s default scale, the alternative emax 7 (:func:`..quant.mx_weights.quantize_activation`: the
instruction on the kernel's transposed tiles). Inputs of
any float dtype are read through bfloat16 (the kernel's only input dtype); the output is bfloat16 (the kernel's).
Weight element bytes are decoded as ``float8_e4m3fn`` (NaN codes stay NaN; the torch reference's manual decoder
reads them as +-480). The output is piecewise constant in ``out_attn_hbm`` (bf16 and MXFP8 roundings) and the words
and scales are integers, so reverse mode gives zero cotangents. Off Neuron any ``B``, ``S``, ``HID`` and ``d_v``
work, with ``L % 32 == 0`` (whole MX blocks per head) and ``H L``, ``H d_v`` multiples of 128 (whole scale rows).

Neuron (the kernel's asserts and tests): target trn3 (``nc_matmul_mx``; its tests exclude trn1/trn2), bfloat16,
``B == 1``, ``L == 512``, ``d_v == 128``, ``H`` in {4, 8, 16, 24, 32, 64, 96, 128} (a multiple of 4 up to 128 whose
512-tile counts ``H`` and ``H / 4`` divide into its staging chunks of 8), ``HID % 512 == 0``, ``S`` divisible by
the LNC degree (the cores split the queries), and per core ``S / LNC <= 128`` or (``H == 4`` and ``S / LNC % 128 ==
0``): its multi-s-batch loop is marked broken for more heads. Where it differs from its torch reference: that uses the
OCP scale rule (emax 8), which the kernel follows only under ``--enable-ocp-compliant-scale-computation`` (its
library tests pass it; this library passes no compiler flags), and where W_o does not fit one K-slab
(:func:`w_o_k_slabs`: e.g. ``H = 16``, ``HID = 7168``) it
adds the slabs' fp32 PSUM partials in a bfloat16 accumulator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.platform import is_trn3
from ..framework.primitive import make_kernel, zero_cotangents
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand
from ..quant.mx_weights import COMPACT_BLOCK, OCP_SCALE_FLAG_NOTE, compact_blocks, decode_weight, quantize_activation
from .mla_sparse_attention_cte import H_PACK, from_mx_pack_columns

WORD_DTYPES = (jnp.dtype(jnp.uint32),)
SCALE_DTYPES = (jnp.dtype(jnp.uint8),)
KERNEL_LATENT = 512
KERNEL_D_V = 128
KERNEL_HEADS = (4, 8, 16, 24, 32, 64, 96, 128)
KERNEL_HID_MULTIPLE = 512
KERNEL_S_TILE = 128
_HIGHEST = jax.lax.Precision.HIGHEST


def head_count(wuv_qtz_hbm, wo_qtz_hbm) -> int:
    """``H = 4 rows(W_o) / d_v``: the kernel takes no head count (its L is fixed at 512)."""
    return 4 * wo_qtz_hbm.shape[0] // wuv_qtz_hbm.shape[1]


def reference_mla_vupmx_oproj_cte(out_attn_hbm, wuv_qtz_hbm, wuv_scale_hbm, wo_qtz_hbm, wo_scale_hbm):
    """JAX reference: ``(out [B, S, HID] bfloat16,)`` (see the module doc)."""
    heads, d_v = head_count(wuv_qtz_hbm, wo_qtz_hbm), wuv_qtz_hbm.shape[1]
    batch, seq, width = out_attn_hbm.shape
    latent = from_mx_pack_columns(out_attn_hbm.astype(jnp.bfloat16).astype(jnp.float32), heads)  # [B, S, H, L]
    w_uv = decode_weight(wuv_qtz_hbm, wuv_scale_hbm).reshape(heads, width // heads, d_v)
    w_o = decode_weight(wo_qtz_hbm, wo_scale_hbm)  # [H d_v, HID]
    v = jnp.einsum("bshl,hlj->bshj", quantize_activation(latent), w_uv, precision=_HIGHEST)
    v = v.astype(jnp.bfloat16).astype(jnp.float32).reshape(batch, seq, heads * d_v)
    out = jnp.einsum("bsk,kn->bsn", quantize_activation(v), w_o, precision=_HIGHEST)
    return (out.astype(jnp.bfloat16),)


def _check(call: CallInfo) -> None:
    function, dims = call.function, call.dims
    d_v, words_o = dims["d_v"], dims["G_o"]
    if (4 * words_o) % d_v:
        raise ValueError(
            f"{function}: wo_qtz_hbm must be [H * d_v / 4, HID] x4 words; its {words_o} rows are not a whole number "
            f"of heads for d_v={d_v} (wuv_qtz_hbm [H * L / 4, d_v])"
        )
    heads = 4 * words_o // d_v
    if dims["HL"] % heads or (dims["HL"] // heads) % 32:
        raise ValueError(
            f"{function}: out_attn_hbm [B, S, H * L] needs L % 32 == 0 (the MX blocks of each head's latent); got "
            f"H * L = {dims['HL']} for H={heads} (from wo_qtz_hbm and d_v)"
        )
    if (4 * words_o) % COMPACT_BLOCK:
        raise ValueError(
            f"{function}: wo_qtz_hbm [H * d_v / 4, HID] needs H * d_v % {COMPACT_BLOCK} == 0 (compact block-128 "
            f"scales); got H * d_v = {4 * words_o}"
        )
    for name, size, want in (
        ("wuv_scale_hbm", dims["dv_blocks"], compact_blocks(d_v)),
        ("wo_scale_hbm", dims["HID_blocks"], compact_blocks(dims["HID"])),
    ):
        if size != want:
            raise ValueError(
                f"{function}: {name} must have {want} columns (ceil of the weight's N / {COMPACT_BLOCK}: compact "
                f"block-128 scales); got {size}"
            )
    if dims["Ko_blocks"] * COMPACT_BLOCK != 4 * words_o:
        raise ValueError(
            f"{function}: wo_scale_hbm must be [H * d_v / {COMPACT_BLOCK}, ceil(HID / {COMPACT_BLOCK})] = "
            f"[{4 * words_o // COMPACT_BLOCK}, {compact_blocks(dims['HID'])}]; got {dims['Ko_blocks']} rows"
        )


def _output_avals(call: CallInfo):
    dims = call.dims
    return (("out", (dims["B"], dims["S"], dims["HID"]), jnp.bfloat16),)


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    heads = 4 * dims["G_o"] // dims["d_v"]
    if not is_trn3(call.target):
        unmet.append(
            f"Neuron platform target trn3 (nc_matmul_mx; the kernel's tests exclude trn1/trn2); got {call.target}"
        )
    if call.avals["out_attn_hbm"].dtype != jnp.bfloat16:
        unmet.append(f"out_attn_hbm must be bfloat16; got {call.avals['out_attn_hbm'].dtype}")
    if dims["B"] != 1:
        unmet.append(f"B={dims['B']} must be 1")
    if dims["HL"] != KERNEL_LATENT * heads:
        unmet.append(f"L={dims['HL'] // heads} (kv_lora_rank) must be {KERNEL_LATENT}")
    if dims["d_v"] != KERNEL_D_V:
        unmet.append(f"d_v={dims['d_v']} must be {KERNEL_D_V}")
    if heads not in KERNEL_HEADS:
        unmet.append(f"H={heads} heads must be one of {KERNEL_HEADS}")
    if dims["HID"] % KERNEL_HID_MULTIPLE:
        unmet.append(f"HID={dims['HID']} must be a multiple of {KERNEL_HID_MULTIPLE}")
    if dims["S"] % call.lnc:
        unmet.append(f"S={dims['S']} must be divisible by the LNC degree {call.lnc} (the cores split the queries)")
    else:
        per_core = dims["S"] // call.lnc
        if per_core > KERNEL_S_TILE and (heads != 4 or per_core % KERNEL_S_TILE):
            unmet.append(
                f"S / LNC = {per_core} queries per core exceed {KERNEL_S_TILE}: supported only with H == 4 and a "
                f"multiple of {KERNEL_S_TILE} (the kernel's multi-s-batch loop is marked broken otherwise)"
            )
    return unmet


def w_o_k_slabs(heads: int, hid: int) -> int:
    """How many K-slabs the kernel splits W_o's ``H d_v / 512`` MX tiles into: the largest slab of at most 8 tiles
    that divides them and whose fp8x4 words + scales (5 bytes per element) for ``hid`` columns fit 70 KiB."""
    tiles = max(heads // H_PACK, 1)
    slab = min(8, tiles)
    while slab > 1 and (tiles % slab or slab * hid * 5 > 70 * 1024):
        slab -= 1
    return tiles // slab


def _neuron_notes(call: CallInfo) -> list[str]:
    notes = [OCP_SCALE_FLAG_NOTE]
    slabs = w_o_k_slabs(4 * call.dims["G_o"] // call.dims["d_v"], call.dims["HID"])
    if slabs > 1:
        notes.append(f"the kernel adds the fp32 partial sums of its {slabs} W_o K-slabs in a bfloat16 accumulator")
    return notes


def _mac_count(call: CallInfo) -> int:
    dims = call.dims
    return dims["B"] * dims["S"] * (dims["HL"] * dims["d_v"] + 4 * dims["G_o"] * dims["HID"])


MLA_VUPMX_OPROJ_CTE_SPEC = KernelSpec(
    name="mla_vupmx_oproj_cte_kernel",
    entry_point="nkilib.experimental.mla.deepseek.mla_vup_oproj_cte:mla_vupmx_oproj_cte_kernel",
    operands=(
        Operand.of("out_attn_hbm", "B, S, HL", dtypes=FLOAT_DTYPES, doc="latent attention output, MX 4-pack columns"),
        Operand.of(
            "wuv_qtz_hbm",
            f"HL/{H_PACK}, d_v",
            dtypes=WORD_DTYPES,
            doc="V-up weight, float8_e4m3fn_x4 words",
            device_dtype=lambda params, dtype: "float8_e4m3fn_x4",
        ),
        Operand.of("wuv_scale_hbm", f"HL/{COMPACT_BLOCK}, dv_blocks", dtypes=SCALE_DTYPES, doc="compact block-128"),
        Operand.of(
            "wo_qtz_hbm",
            "G_o, HID",
            dtypes=WORD_DTYPES,
            doc="o_proj weight [H d_v / 4, HID], float8_e4m3fn_x4 words",
            device_dtype=lambda params, dtype: "float8_e4m3fn_x4",
        ),
        Operand.of("wo_scale_hbm", "Ko_blocks, HID_blocks", dtypes=SCALE_DTYPES, doc="compact block-128"),
    ),
    params=(),
    outputs=(),
    output_avals=_output_avals,
    reference=reference_mla_vupmx_oproj_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    neuron_notes=_neuron_notes,
    fold_plans=(
        FoldPlan(
            {
                "out_attn_hbm": "B",
                "wuv_qtz_hbm": None,
                "wuv_scale_hbm": None,
                "wo_qtz_hbm": None,
                "wo_scale_hbm": None,
            },
            outputs={"out": 0},
        ),
    ),
    mac_count=_mac_count,
    family="mla",
    catalog="row 52, section 3",
    support={
        "idiomatic": "",
        "vjp": "zero cotangents (out_attn is bf16/MXFP8-rounded; weights are x4 words and uint8 scales)",
        "notes": "docs-only (2.32) + newer torch reference; takes mla_sparse_attention_cte_kernel's output directly; "
        "uint32 float8_e4m3fn_x4 weight words with compact block-128 scales; Neuron: trn3, bf16, B == 1, "
        f"L == {KERNEL_LATENT}, d_v == {KERNEL_D_V}, H in {KERNEL_HEADS}, HID % {KERNEL_HID_MULTIPLE} == 0, "
        f"S % LNC == 0, S / LNC <= {KERNEL_S_TILE} unless H == 4",
    },
)

# zero gradients: out_attn_hbm passes through bf16 and MXFP8 rounding; words and scales are integers
mla_vupmx_oproj_cte_kernel = make_kernel(MLA_VUPMX_OPROJ_CTE_SPEC, zero_cotangents)
