"""``mla_qkv_cte_kernel`` (catalog row 50, docs-only in 2.32): DeepSeek-V3.2 MLA QKV projection for prefill, from the
packed MX activation to the absorbed latents that ``mla_sparse_attention_cte_kernel`` consumes.

Source: the 2.32 API reference (aws-neuron-sdk ``nki/library/api/mla-qkv-cte.rst``) and the newer nki-library
sources in the public code index: ``experimental/mla/deepseek/mla_qkv_cte.py``, its validator
``mla_validate_params.py`` and its torch reference ``mla_qkv_cte_torch.py`` (``mla_qkv_cte_torch_ref``). This binds
the 2.32 signature ``(x_hbm_mx, wqkv_a_hbm, wqkv_a_scale_hbm, wq_b_hbm, wq_b_scale_hbm, q_norm_gamma_hbm,
kv_norm_gamma_hbm, wuk_hbm, cos_cache_hbm, sin_cache_hbm, n_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank,
qk_lora_rank, norm_eps=1e-6, qr_qtz_hbm=None, qr_scale_hbm=None) -> (q_lift, q_pe, c_kv, k_pe)`` with the torch
reference of that revision. ``qr_qtz_hbm`` / ``qr_scale_hbm`` (optional destination buffers of the indexer's qr
export, which the reference does not model) are not bound: the kernel runs without the export. A later revision
adds ``compact_scales`` and ``precision`` (BF16 mode), always returns the export, and reads compact ``wqkv_a``
scales in the natural column order (this revision reads them in the weight's swizzled column order); not bound.

Operands (``T = B*S`` tokens, ``Q = qk_lora_rank``, ``L = kv_lora_rank``, ``R = qk_rope_head_dim``, ``D =
qk_nope_head_dim``, ``N = n_heads``, ``Na = Q + L + R``, ``Nb = N (D + R)``):

* ``x_hbm_mx [B, S, H + ceil(H/2048)*128]`` float8_e4m3fn: ``rmsnorm_mx_prefill``'s packed row with
  ``pack_scales=True`` (fp8 elements in natural H order, then the e8m0 scale bytes; layout in
  :mod:`..norm.rmsnorm_mx_prefill_reference`), ``H % 512 == 0``;
* ``wqkv_a_hbm [H/4, Na]`` uint32 float8_e4m3fn_x4 words (element ``4w + j`` in byte ``j``) with compact block-128
  scales ``wqkv_a_scale_hbm [H/128, ceil(Na/128)]`` uint8 (one per 128 rows x 128 stored columns); columns ``[qr |
  kv | k_pe]``, the ``qr`` and ``kv`` blocks (``Q, L`` multiples of 512) in the MLA column swizzle: within a block of
  width ``W``, natural column ``512 t + 4 p + q`` sits at column ``q W/4 + 128 t + p``;
* ``wq_b_hbm [Q/4, Nb]`` uint32 x4 words with ``wq_b_scale_hbm [Q/128, ceil(Nb/128)]`` uint8, columns natural
  (head-major, each head ``[nope | rope]``);
* ``q_norm_gamma_hbm [1, Q]``, ``kv_norm_gamma_hbm [1, L]``, ``wuk_hbm [D, N L]`` (head ``h`` owns columns
  ``h L .. h L + L - 1``), ``cos_cache_hbm`` / ``sin_cache_hbm [B, S, R]`` (their first ``R/2`` columns are used).

Math (the torch reference's, with the kernel's MX rule: ``mx(v)`` = dequantize(quantize(v)) in blocks of 32
consecutive contraction elements with ``nisa.quantize_mx``'s default scale ``clip(E - 7, 0, 255)``, see
:mod:`..quant.mx_weights`)::

    x      = decode(x_hbm_mx)                                         # [T, H], natural order
    fused  = x @ W_a                                                  # W_a: words x 2**(scale_a - 127)
    qr, kv = unswizzle(fused[:, :Q]), unswizzle(fused[:, Q:Q+L]);  k_pe = fused[:, Q+L:]
    qr     = rms_norm(qr) * q_norm_gamma                              # x / sqrt(mean(x^2) + eps)
    q      = (mx(qr) @ W_b).reshape(T, N, D + R);  q_nope, q_pe = q[..., :D], q[..., D:]
    q_lift = cd(q_nope) @ W_uk[h]  per head h                         # [T, N, L]
    q_pe   = rope(q_pe);  k_pe = rope(k_pe)                           # interleaved pairs (2j, 2j + 1), angle j
    c_kv   = rms_norm(kv) * kv_norm_gamma

``rope`` rotates pair ``(x[2j], x[2j+1])`` by ``(cos[j], sin[j])``: ``(x0 cos - x1 sin, x0 sin + x1 cos)``.
Dtype policy: the float operands share one compute dtype ``cd`` (the kernel: bfloat16), ``q_nope`` is rounded to it
before the absorption (the kernel runs that matmul in bfloat16), everything else is float32 (float64 for float64
operands), and the four outputs are returned in ``cd``.

Where the kernel differs from its torch reference, this follows the kernel in two points: ``x`` is the packed bytes
as they are (the torch reference decodes and MX-quantizes it again, with emax 8, which turns an alternative-emax
code 240 into 224), and ``qr`` is quantized with ``nisa.quantize_mx``'s default scale (the torch reference's OCP
rule holds on the device only under ``--enable-ocp-compliant-scale-computation``, which the library's tests of
this kernel pass). Not modelled: the kernel quantizes ``qr`` from bf16 (here float32) and holds ``norm_eps`` in
bf16.

Reverse mode differentiates the reference in ``kv_norm_gamma_hbm``, ``wuk_hbm``, ``cos_cache_hbm`` and
``sin_cache_hbm`` (no quantization follows them: exact); ``q_norm_gamma_hbm`` gets a zero cotangent (it feeds the
MX-quantized ``qr``, piecewise constant in it: zero is its derivative almost everywhere), and the packed row, the
weight words and the scales get none. There is no backward kernel.
Neuron limits (else the reference runs, with a ``NeuronFallbackWarning``): platform target trn3 (MX matmuls; the
library's tests exclude Trn1 and Trn2), bfloat16 float operands, ``B == 1`` (the newer kernel views ``x_hbm_mx`` as
``[S, row]`` and its tests use batch 1 only; the 2.32 kernel source is not in the index), ``qk_nope_head_dim ==
128``, ``n_heads`` even (the validator's asserts). The kernel splits ``S`` over the LNC cores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.platform import is_trn3
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Output, Param, accumulation_dtype
from ..norm import rmsnorm_mx_prefill_reference as packed_rows
from ..quant import mx
from ..quant.mx_weights import (
    COMPACT_BLOCK,
    LANES,
    OCP_SCALE_FLAG_NOTE,
    SWIZZLE_TILE,
    compact_blocks,
    decode_weight,
    mx_matmul,
    unswizzle_512,
)
from ..rope.pairs import rotate_pairs
from .checks import require_same_dtype

KERNEL_NOPE = 128
PACKED_X_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
WORD_DTYPES = (jnp.dtype(jnp.uint32),)
FLOAT_OPERANDS = ("q_norm_gamma_hbm", "kv_norm_gamma_hbm", "wuk_hbm", "cos_cache_hbm", "sin_cache_hbm")
# the float operands no MX quantization follows (q_norm_gamma_hbm feeds the MX-quantized qr: piecewise constant)
DIFFERENTIABLE = ("kv_norm_gamma_hbm", "wuk_hbm", "cos_cache_hbm", "sin_cache_hbm")


# ------------------------------------------------------------------------------------------------ the reference's math
def decode_packed_x(x_hbm_mx, hidden: int):
    """float32 ``[T, H]`` of the packed rows ``[B, S, H + region]``: element ``h`` times its block's scale."""
    rows = x_hbm_mx.reshape(-1, x_hbm_mx.shape[-1])
    region = jax.lax.bitcast_convert_type(rows[:, hidden:], jnp.uint8)
    scales = jnp.take(region, packed_rows.scale_columns(hidden, True), axis=-1)
    return mx.dequantize_mx_along(rows[:, :hidden], scales, axis=-1)


def rms_norm(x, gamma, eps: float):
    """``x / sqrt(mean(x^2) + eps) * gamma`` over the last axis, in ``x``'s dtype."""
    mean_square = jnp.mean(x * x, axis=-1, keepdims=True)
    return x / jnp.sqrt(mean_square + jnp.asarray(eps, x.dtype)) * gamma.reshape(-1).astype(x.dtype)


def reference_mla_qkv_cte(
    x_hbm_mx,
    wqkv_a_hbm,
    wqkv_a_scale_hbm,
    wq_b_hbm,
    wq_b_scale_hbm,
    q_norm_gamma_hbm,
    kv_norm_gamma_hbm,
    wuk_hbm,
    cos_cache_hbm,
    sin_cache_hbm,
    n_heads,
    qk_nope_head_dim,
    qk_rope_head_dim,
    kv_lora_rank,
    qk_lora_rank,
    norm_eps=1e-6,
):
    """JAX reference: ``(q_lift [B, S, N, L], q_pe [B, S, N, R], c_kv [B, S, L], k_pe [B, S, R])`` (module doc)."""
    cd = wuk_hbm.dtype
    wide = accumulation_dtype(cd)
    batch, seq = x_hbm_mx.shape[:2]
    hidden = wqkv_a_hbm.shape[0] * LANES
    heads, nope, rope, latent, q_rank = n_heads, qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank, qk_lora_rank

    fused = mx_matmul(
        decode_packed_x(x_hbm_mx, hidden), decode_weight(wqkv_a_hbm, wqkv_a_scale_hbm), wide, quantized=True
    )
    qr = unswizzle_512(fused[:, :q_rank])
    kv = unswizzle_512(fused[:, q_rank : q_rank + latent])
    k_pe = fused[:, q_rank + latent :]

    qr = rms_norm(qr, q_norm_gamma_hbm, norm_eps)
    q = mx_matmul(qr, decode_weight(wq_b_hbm, wq_b_scale_hbm), wide).reshape(batch, seq, heads, nope + rope)
    q_nope, q_pe = q[..., :nope], q[..., nope:]

    half = rope // 2
    cos = cos_cache_hbm[..., :half].astype(wide)[:, :, None, :]  # [B, S, 1, R/2]
    sin = sin_cache_hbm[..., :half].astype(wide)[:, :, None, :]
    q_pe = rotate_pairs(q_pe, cos, sin, interleaved=True)
    k_pe = rotate_pairs(k_pe.reshape(batch, seq, 1, rope), cos, sin, interleaved=True)[:, :, 0]

    w_uk = wuk_hbm.reshape(nope, heads, latent).astype(wide)
    q_lift = jnp.einsum("bshd,dhl->bshl", q_nope.astype(cd).astype(wide), w_uk, precision=jax.lax.Precision.HIGHEST)
    c_kv = rms_norm(kv, kv_norm_gamma_hbm, norm_eps).reshape(batch, seq, latent)
    return tuple(a.astype(cd) for a in (q_lift, q_pe, c_kv, k_pe))


# ------------------------------------------------------------------------------------------------ validation
def _expect(call: CallInfo, operand: str, expected: tuple[int, ...], layout: str) -> None:
    got = tuple(call.avals[operand].shape)
    if got != expected:
        raise ValueError(f"{call.function}: argument `{operand}` must be {layout} = {list(expected)}; got {list(got)}")


def _check(call: CallInfo) -> None:
    function, dims, p = call.function, call.dims, call.params
    for name in ("n_heads", "qk_nope_head_dim", "qk_rope_head_dim", "kv_lora_rank", "qk_lora_rank"):
        if p[name] <= 0:
            raise ValueError(f"{function}: parameter `{name}` must be positive; got {p[name]}")
    for name in ("kv_lora_rank", "qk_lora_rank"):
        if p[name] % SWIZZLE_TILE:
            raise ValueError(
                f"{function}: parameter `{name}` must be a multiple of {SWIZZLE_TILE} (the MLA column swizzle "
                f"permutes 512-column tiles); got {p[name]}"
            )
    if p["qk_rope_head_dim"] % 2:
        raise ValueError(f"{function}: parameter `qk_rope_head_dim` must be even (interleaved RoPE pairs)")
    if not p["norm_eps"] >= 0:
        raise ValueError(f"{function}: parameter `norm_eps` must be >= 0; got {p['norm_eps']}")
    require_same_dtype(call, FLOAT_OPERANDS, ", ".join(FLOAT_OPERANDS))

    hidden = dims["H4"] * LANES
    if hidden % SWIZZLE_TILE:
        raise ValueError(
            f"{function}: argument `wqkv_a_hbm` [H/4, Na] needs H % 512 == 0 (the packed MX row's H512 tiles); "
            f"got H = 4 * {dims['H4']} = {hidden}"
        )
    heads, nope, rope = p["n_heads"], p["qk_nope_head_dim"], p["qk_rope_head_dim"]
    latent, q_rank = p["kv_lora_rank"], p["qk_lora_rank"]
    fused, q_out = q_rank + latent + rope, heads * (nope + rope)
    row = packed_rows.packed_row_bytes(hidden, pack_scales=True)
    _expect(call, "x_hbm_mx", (dims["B"], dims["S"], row), "[B, S, H + ceil(H/2048)*128] (pack_scales=True rows)")
    _expect(call, "wqkv_a_hbm", (hidden // LANES, fused), "[H/4, qk_lora_rank + kv_lora_rank + qk_rope_head_dim]")
    _expect(call, "wqkv_a_scale_hbm", (hidden // COMPACT_BLOCK, compact_blocks(fused)), "[H/128, ceil(Na/128)]")
    _expect(call, "wq_b_hbm", (q_rank // LANES, q_out), "[qk_lora_rank/4, n_heads*(nope + rope)]")
    _expect(
        call, "wq_b_scale_hbm", (q_rank // COMPACT_BLOCK, compact_blocks(q_out)), "[qk_lora_rank/128, ceil(Nb/128)]"
    )
    _expect(call, "q_norm_gamma_hbm", (1, q_rank), "[1, qk_lora_rank]")
    _expect(call, "kv_norm_gamma_hbm", (1, latent), "[1, kv_lora_rank]")
    _expect(call, "wuk_hbm", (nope, heads * latent), "[qk_nope_head_dim, n_heads*kv_lora_rank]")
    _expect(call, "cos_cache_hbm", (dims["B"], dims["S"], rope), "[B, S, qk_rope_head_dim]")


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet, p = [], call.params
    if not is_trn3(call.target):
        unmet.append(f"Neuron platform target trn3 (the MX matmuls are Trainium3's); the target is {call.target}")
    dtype = call.avals["wuk_hbm"].dtype
    if dtype != jnp.bfloat16:
        unmet.append(f"{', '.join(FLOAT_OPERANDS)} must be bfloat16; got {dtype}")
    if call.dims["B"] != 1:
        unmet.append(f"B={call.dims['B']} must be 1 (the kernel views x_hbm_mx as [S, row])")
    if p["qk_nope_head_dim"] != KERNEL_NOPE:
        unmet.append(f"qk_nope_head_dim={p['qk_nope_head_dim']} must be {KERNEL_NOPE} (the bf16 absorption)")
    if p["n_heads"] % 2:
        unmet.append(f"n_heads={p['n_heads']} must be even (the kernel's head-group loop)")
    return unmet


def _vjp(kernel, operands, params, outs, cotangents):
    """The reference's derivative in :data:`DIFFERENTIABLE`; the other operands get no cotangent (zero)."""
    return pull_back(lambda named: kernel.reference(named, params), operands, DIFFERENTIABLE, cotangents)


def _mac_count(call: CallInfo) -> int:
    p, tokens = call.params, call.dims["B"] * call.dims["S"]
    hidden, heads, latent = call.dims["H4"] * LANES, p["n_heads"], p["kv_lora_rank"]
    fused = p["qk_lora_rank"] + latent + p["qk_rope_head_dim"]
    q_out = heads * (p["qk_nope_head_dim"] + p["qk_rope_head_dim"])
    return tokens * (hidden * fused + p["qk_lora_rank"] * q_out + heads * p["qk_nope_head_dim"] * latent)


MLA_QKV_CTE_SPEC = KernelSpec(
    name="mla_qkv_cte_kernel",
    entry_point="nkilib.experimental.mla.deepseek.mla_qkv_cte:mla_qkv_cte_kernel",
    operands=(
        Operand.of("x_hbm_mx", "B, S, X", dtypes=(PACKED_X_DTYPE,), doc="rmsnorm_mx_prefill packed MX rows"),
        Operand.of("wqkv_a_hbm", "H4, Na", dtypes=WORD_DTYPES, doc="[H/4, Q+L+R] fp8 x4 words, qr/kv swizzled"),
        Operand.of("wqkv_a_scale_hbm", "H128, Na128", dtypes=(jnp.uint8,), doc="compact block-128 e8m0 scales"),
        Operand.of("wq_b_hbm", "Q4, Nb", dtypes=WORD_DTYPES, doc="[Q/4, N(D+R)] fp8 x4 words"),
        Operand.of("wq_b_scale_hbm", "Q128, Nb128", dtypes=(jnp.uint8,), doc="compact block-128 e8m0 scales"),
        Operand.of("q_norm_gamma_hbm", "1, Q", dtypes=FLOAT_DTYPES, doc="RMS norm gain of qr"),
        Operand.of("kv_norm_gamma_hbm", "1, L", dtypes=FLOAT_DTYPES, doc="RMS norm gain of the KV latent"),
        Operand.of("wuk_hbm", "D, NL", dtypes=FLOAT_DTYPES, doc="absorption weight W_uk, head-major columns"),
        Operand.of("cos_cache_hbm", "B, S, R", dtypes=FLOAT_DTYPES, doc="RoPE cosines (first R/2 used)"),
        Operand.of("sin_cache_hbm", "B, S, R", dtypes=FLOAT_DTYPES, doc="RoPE sines (first R/2 used)"),
    ),
    params=(
        Param("n_heads", None, int, "attention heads N", required=True),
        Param("qk_nope_head_dim", None, int, "non-RoPE query/key head dim D (kernel: 128)", required=True),
        Param("qk_rope_head_dim", None, int, "RoPE head dim R (even)", required=True),
        Param("kv_lora_rank", None, int, "KV latent rank L (multiple of 512)", required=True),
        Param("qk_lora_rank", None, int, "query LoRA rank Q (multiple of 512)", required=True),
        Param("norm_eps", 1e-6, float, "RMS norm epsilon"),
    ),
    outputs=(
        Output.of("q_lift", "B, S, n_heads, kv_lora_rank", "wuk_hbm"),
        Output.of("q_pe", "B, S, n_heads, qk_rope_head_dim", "wuk_hbm"),
        Output.of("c_kv", "B, S, kv_lora_rank", "wuk_hbm"),
        Output.of("k_pe", "B, S, qk_rope_head_dim", "wuk_hbm"),
    ),
    reference=reference_mla_qkv_cte,
    check=_check,
    neuron_limits=_neuron_limits,
    neuron_notes=lambda call: [OCP_SCALE_FLAG_NOTE],
    fold_plans=(
        FoldPlan(
            {"x_hbm_mx": "B", "cos_cache_hbm": "B", "sin_cache_hbm": "B"}
            | {name: None for name in ("wqkv_a_hbm", "wqkv_a_scale_hbm", "wq_b_hbm", "wq_b_scale_hbm")}
            | {name: None for name in ("q_norm_gamma_hbm", "kv_norm_gamma_hbm", "wuk_hbm")},
            outputs=("B", "B", "B", "B"),
        ),
    ),
    mac_count=_mac_count,
    family="mla",
    catalog="row 50, section 3",
    support={
        "idiomatic": "",
        "vjp": "JAX (the reference's derivative in kv_norm_gamma, W_uk, cos, sin; zero for q_norm_gamma and the "
        "quantized operands)",
        "notes": "docs-only (2.32) + newer torch reference; packed MX rows of rmsnorm_mx_prefill (pack_scales=True), "
        "fp8 x4 weights with compact block-128 scales; outputs (q_lift, q_pe, c_kv, k_pe), the qr export not bound; "
        f"Neuron (trn3): bf16, B == 1, qk_nope_head_dim == {KERNEL_NOPE}, even n_heads",
    },
)

mla_qkv_cte_kernel = make_kernel(MLA_QKV_CTE_SPEC, vjp=_vjp)
