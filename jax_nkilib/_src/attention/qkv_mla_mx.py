"""``qkv_mla_mx`` and ``qkv_mla_mx_deepseek_v4`` (catalog row 49, docs-only in 2.32): DeepSeek MLA QKV projections
for context encoding with MXFP8 weights.

Source: the 2.32 API reference (aws-neuron-sdk ``nki/library/api/qkv-cte-mla.rst``), whose signatures this binds
unchanged, and the newer nki-library source that defines what the reference leaves open:
``experimental/qkv/qkv_cte_mla.py`` (kernels), ``qkv_cte_mla_utils.py`` (``_validate_mla_inputs``,
``_validate_mla_v4_inputs``), ``qkv_cte_mla_torch.py`` (``qkv_mla_mx_torch_ref``,
``qkv_mla_mx_deepseek_v4_torch_ref``), ``core/utils/mx_torch_common.py`` (``quantize_to_mx``, ``mx_matmul``) and the
test input builder ``build_qkv_mla_input`` (``test/.../core/qkv/test_qkv_common.py``). The rst omits the input and
output swizzles and the weight word layout; the source and torch reference define them (:mod:`..quant.mx_weights`).

Operands (``x_hbm`` along H and the first projection's ``qr``/``kv`` columns in the 512-swizzled order; weights
``float8_e4m3fn_x4`` words as uint32 ``[K / 4, N]`` with compact uint8 scales ``[K / 128, ceil(N / 128)]``, see
:mod:`..quant.mx_weights`)::

    x_hbm [B, S, H]; cos_cache_hbm, sin_cache_hbm [B, S, R]      (R = qk_rope_head_dim; first R / 2 entries read)
    v32: wqkv_a [H/4, QR + KVR + R], wq_b [QR/4, n_heads * (dn + R)], wkv_b [KVR/4, n_heads * (dn + dv)],
         q_norm_gamma [1, QR], kv_norm_gamma [1, KVR]
    v4:  wqkv [H/4, QR + KVR + R], wq_b [QR/4, n_heads * head_dim], q_norm_gamma [1, QR], kv_norm_gamma [1, KVR + R]

Math (``mxmm`` = :func:`..quant.mx_weights.mx_matmul`, activations MX-quantized along K; ``norm`` = RMSNorm with
``norm_eps``; ``rope`` = halves rotation; float32 between stages, float64 for float64 inputs)::

    a = mxmm(unswizzle(x), Wa)                              # [B, S, QR + KVR + R]
    qr = unswizzle(a[:QR])
    v32: kv = unswizzle(a[QR:QR+KVR]); k_pe = rope(a[QR+KVR:])
         q = mxmm(norm(qr) * gq, Wq_b) -> [.., n_heads, dn + R], rope on q[..., dn:]
         kvo = mxmm(norm(kv) * gkv, Wkv_b) -> [.., n_heads, dn + dv]
         k = [kvo[..., :dn], k_pe broadcast to the heads]; v = kvo[..., dn:]          -> (q, k, v)
    v4:  q = mxmm(norm(qr) * gq, Wq_b) -> [.., n_heads, head_dim]; q = norm(q) (no gain); rope on q[..., -R:]
         kv = norm(a[QR:]) * gkv (not swizzled); rope on kv[..., KVR:]                  -> (q, kv)

Outputs are bfloat16 whatever the input dtype (the kernels' and the torch references' output dtype). These are
inference kernels: MX quantization has no useful derivative, so they have no VJP (``jax.grad`` raises).

Neuron limits (the kernels' validators): bfloat16 x, gammas and caches; ``B == 1`` (the Neuron lowering runs one
kernel call per batch row); H, QR (and in v32 KVR) multiples of 512; v32 ``n_heads`` in {1, 2, 3, 8} with H at most
10240 / 16384 / 9216 / 7168; v4 ``n_heads <= 8``, ``H <= 16384``, ``head_dim <= 512``, ``QR <= 2048``,
``KVR <= 1024``. The kernels split S over the LNC cores (any S, any LNC). The activations' MX scale rule is
``nisa.quantize_mx``'s default (the alternative emax 7, :mod:`..quant.mx_weights`), what the kernels compute as
compiled here and in nki-library's own tests of them; the torch references use the OCP rule (emax 8), which the
kernels follow only under neuronx-cc's ``--enable-ocp-compliant-scale-computation`` (most bfloat16 outputs then
differ, by up to a few percent of their range).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype
from ..framework.validation import require
from ..quant.mx_weights import (
    OCP_SCALE_FLAG_NOTE,
    SWIZZLE_TILE,
    compact_blocks,
    decode_weight,
    mx_matmul,
    unswizzle_512,
)
from .qkv_mla_mx_math import rms_norm, rope_halves

MODULE = "nkilib.experimental.qkv.qkv_cte_mla"
OUTPUT_DTYPE = jnp.bfloat16
WORDS = (jnp.uint32,)  # float8_e4m3fn_x4 words
SCALES = (jnp.uint8,)
V32_MAX_H = {1: 10240, 2: 16384, 3: 9216, 8: 7168}  # validated n_heads -> largest H (_validate_mla_inputs)
V4_MAX = {"n_heads": 8, "H": 16384, "head_dim": 512, "qk_lora_rank": 2048, "kv_lora_rank": 1024}
_BF16_OPERANDS = ("x_hbm", "q_norm_gamma_hbm", "kv_norm_gamma_hbm", "cos_cache_hbm", "sin_cache_hbm")
_ROWS = ("x_hbm", "cos_cache_hbm", "sin_cache_hbm")  # the operands with a batch axis B


def _fold_into_batch(operands, outputs):
    """vmap over the hidden states (and caches) with shared weights: the vmapped axis joins B."""
    axes = {operand.name: ("B" if operand.name in _ROWS else None) for operand in operands}
    return (FoldPlan(axes=axes, outputs=dict.fromkeys(outputs, 0)),)


def _words(name, layout, doc):
    return Operand.of(name, layout, dtypes=WORDS, doc=doc, device_dtype=lambda params, dtype: "float8_e4m3fn_x4")


def _scales(name, layout, doc):
    return Operand.of(name, layout, dtypes=SCALES, doc=doc)


def _dim_params(*names):
    return tuple(Param(name, None, int, doc, required=True) for name, doc in names)


_NORM_EPS = Param("norm_eps", 1e-6, float, "RMSNorm epsilon (positive)")
_ROPE_DOC = ("qk_rope_head_dim", "R: the rotated part of each head (even)")
_RANK_DOCS = (("kv_lora_rank", "KVR: latent KV width"), ("qk_lora_rank", "QR: latent Q width"))
_HIDDEN = (Operand.of("x_hbm", "B, S, H", dtypes=FLOAT_DTYPES, doc="hidden states, H in the 512-swizzled order"),)
_CACHES = (
    Operand.of("cos_cache_hbm", "B, S, R", dtypes=FLOAT_DTYPES, doc="RoPE cosines (first R/2 entries read)"),
    Operand.of("sin_cache_hbm", "B, S, R", dtypes=FLOAT_DTYPES, doc="RoPE sines (first R/2 entries read)"),
)


# ------------------------------------------------------------------------------------------------ references
def _first_projection(x_hbm, wqkv, wqkv_scale):
    wide = accumulation_dtype(x_hbm.dtype)
    x = unswizzle_512(x_hbm.astype(wide))
    return mx_matmul(x, decode_weight(wqkv, wqkv_scale)), wide


def _second_projection(latent, gamma, eps, words, scales, heads):
    out = mx_matmul(rms_norm(latent, gamma.reshape(-1).astype(latent.dtype), eps), decode_weight(words, scales))
    return out.reshape(*out.shape[:-1], heads, -1)


def _rope_tail(x, cos, sin, rope_dim):
    """``x`` with RoPE on its last ``rope_dim`` entries."""
    return jnp.concatenate([x[..., :-rope_dim], rope_halves(x[..., -rope_dim:], cos, sin)], axis=-1)


def reference_qkv_mla_mx(
    x_hbm,
    wqkv_a_hbm,
    wqkv_a_scale_hbm,
    wq_b_hbm,
    wq_b_scale_hbm,
    q_norm_gamma_hbm,
    wkv_b_hbm,
    wkv_b_scale_hbm,
    kv_norm_gamma_hbm,
    cos_cache_hbm,
    sin_cache_hbm,
    *,
    n_heads,
    qk_nope_head_dim,
    qk_rope_head_dim,
    v_head_dim,
    kv_lora_rank,
    qk_lora_rank,
    norm_eps=1e-6,
):
    """JAX reference of ``qkv_mla_mx``: ``(q, k, v)`` bfloat16 (see the module doc)."""
    a, wide = _first_projection(x_hbm, wqkv_a_hbm, wqkv_a_scale_hbm)
    qr = unswizzle_512(a[..., :qk_lora_rank])
    kv = unswizzle_512(a[..., qk_lora_rank : qk_lora_rank + kv_lora_rank])
    cos, sin = cos_cache_hbm.astype(wide), sin_cache_hbm.astype(wide)
    k_pe = rope_halves(a[..., qk_lora_rank + kv_lora_rank :], cos, sin)[:, :, None, :]  # [B, S, 1, R]
    q = _second_projection(qr, q_norm_gamma_hbm, norm_eps, wq_b_hbm, wq_b_scale_hbm, n_heads)
    q = _rope_tail(q, cos[:, :, None, :], sin[:, :, None, :], qk_rope_head_dim)
    kvo = _second_projection(kv, kv_norm_gamma_hbm, norm_eps, wkv_b_hbm, wkv_b_scale_hbm, n_heads)
    k_nope, v = kvo[..., :qk_nope_head_dim], kvo[..., qk_nope_head_dim:]
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_pe, (*k_nope.shape[:-1], qk_rope_head_dim))], axis=-1)
    del v_head_dim  # the split above is by qk_nope_head_dim; the checks tie v_head_dim to wkv_b's width
    return q.astype(OUTPUT_DTYPE), k.astype(OUTPUT_DTYPE), v.astype(OUTPUT_DTYPE)


def reference_qkv_mla_mx_deepseek_v4(
    x_hbm,
    wqkv_hbm,
    wqkv_scale_hbm,
    wq_b_hbm,
    wq_b_scale_hbm,
    q_norm_gamma_hbm,
    kv_norm_gamma_hbm,
    cos_cache_hbm,
    sin_cache_hbm,
    *,
    n_heads,
    head_dim,
    qk_rope_head_dim,
    kv_lora_rank,
    qk_lora_rank,
    norm_eps=1e-6,
):
    """JAX reference of ``qkv_mla_mx_deepseek_v4``: ``(q, kv)`` bfloat16 (see the module doc)."""
    del head_dim, kv_lora_rank  # the checks tie them to wq_b's and kv_norm_gamma's widths
    a, wide = _first_projection(x_hbm, wqkv_hbm, wqkv_scale_hbm)
    qr = unswizzle_512(a[..., :qk_lora_rank])
    cos, sin = cos_cache_hbm.astype(wide), sin_cache_hbm.astype(wide)
    q = _second_projection(qr, q_norm_gamma_hbm, norm_eps, wq_b_hbm, wq_b_scale_hbm, n_heads)
    q = _rope_tail(rms_norm(q, None, norm_eps), cos[:, :, None, :], sin[:, :, None, :], qk_rope_head_dim)
    kv = rms_norm(a[..., qk_lora_rank:], kv_norm_gamma_hbm.reshape(-1).astype(wide), norm_eps)
    kv = _rope_tail(kv, cos, sin, qk_rope_head_dim)
    return q.astype(OUTPUT_DTYPE), kv.astype(OUTPUT_DTYPE)


# ------------------------------------------------------------------------------------------------ checks
def _require(call: CallInfo, condition: bool, message: str) -> None:
    require(condition, call.function, message)


def _require_width(call: CallInfo, operand: str, expected: int, layout: str, formula: str) -> None:
    shape = tuple(call.avals[operand].shape)
    _require(
        call,
        shape[-1] == expected,
        f"argument `{operand}` must have layout {layout} with {formula} = {expected}; got shape {shape}",
    )


def _require_positive(call: CallInfo, *names: str) -> None:
    for name in names:
        _require(call, call.params[name] > 0, f"parameter `{name}` must be positive; got {call.params[name]}")


def _require_swizzled(call: CallInfo, where: str, size: int) -> None:
    _require(call, size % SWIZZLE_TILE == 0, f"{where} must be a multiple of {SWIZZLE_TILE} (512-swizzled); got {size}")


def _check_common(call: CallInfo, first: tuple[str, str], second_width: int, second_formula: str) -> None:
    """Checks shared by both entry points: the params against the shapes, divisibility, the compact scale widths.
    ``first``: the names of the first projection's words and scales."""
    dims, p = call.dims, call.params
    rope, qr = p["qk_rope_head_dim"], p["qk_lora_rank"]
    _require_positive(call, "n_heads", "qk_rope_head_dim", "kv_lora_rank", "qk_lora_rank")
    _require(call, rope % 2 == 0, f"parameter `qk_rope_head_dim` must be even (RoPE halves); got {rope}")
    _require(call, p["norm_eps"] > 0, f"parameter `norm_eps` must be positive; got {p['norm_eps']}")
    _require_swizzled(call, "argument `x_hbm` [B, S, H]: H", dims["H"])
    _require_swizzled(call, "parameter `qk_lora_rank`", qr)
    _require(call, dims["R"] == rope, f"argument `cos_cache_hbm` [B, S, R] needs R = qk_rope_head_dim = {rope}")
    _require(call, dims["QR"] == qr, f"argument `q_norm_gamma_hbm` [1, QR] needs QR = qk_lora_rank = {qr}")
    width = qr + p["kv_lora_rank"] + rope
    words, scales = first
    _require_width(call, words, width, "[H/4, A]", "A = qk_lora_rank + kv_lora_rank + qk_rope_head_dim")
    _require_width(call, scales, compact_blocks(width), "[H/128, ceil(A/128)]", "ceil(A/128)")
    _require_width(call, "wq_b_hbm", second_width, "[QR/4, NQ]", f"NQ = {second_formula}")
    _require_width(call, "wq_b_scale_hbm", compact_blocks(second_width), "[QR/128, ceil(NQ/128)]", "ceil(NQ/128)")


def _check_v32(call: CallInfo) -> None:
    p = call.params
    _require_positive(call, "qk_nope_head_dim", "v_head_dim")
    heads, nope, rope, kvr = p["n_heads"], p["qk_nope_head_dim"], p["qk_rope_head_dim"], p["kv_lora_rank"]
    _check_common(call, ("wqkv_a_hbm", "wqkv_a_scale_hbm"), heads * (nope + rope), "n_heads * (qk_nope_head_dim + R)")
    _require_swizzled(call, "parameter `kv_lora_rank`", kvr)
    _require(call, call.dims["KVR"] == kvr, f"argument `kv_norm_gamma_hbm` [1, KVR] needs KVR = kv_lora_rank = {kvr}")
    kv_width = heads * (nope + p["v_head_dim"])
    _require_width(call, "wkv_b_hbm", kv_width, "[KVR/4, NKV]", "NKV = n_heads * (qk_nope_head_dim + v_head_dim)")
    _require_width(call, "wkv_b_scale_hbm", compact_blocks(kv_width), "[KVR/128, ceil(NKV/128)]", "ceil(NKV/128)")


def _check_v4(call: CallInfo) -> None:
    p = call.params
    heads, head_dim, rope = p["n_heads"], p["head_dim"], p["qk_rope_head_dim"]
    _require(call, head_dim > rope, f"parameter `head_dim` ({head_dim}) must exceed qk_rope_head_dim ({rope})")
    _check_common(call, ("wqkv_hbm", "wqkv_scale_hbm"), heads * head_dim, "n_heads * head_dim")
    kv_dim = p["kv_lora_rank"] + rope
    _require(
        call,
        call.dims["KVD"] == kv_dim,
        f"argument `kv_norm_gamma_hbm` [1, KVD] needs KVD = kv_lora_rank + qk_rope_head_dim = {kv_dim}",
    )


# ------------------------------------------------------------------------------------------------ outputs, limits
def _outputs_v32(call: CallInfo):
    b, s, p = call.dims["B"], call.dims["S"], call.params
    qk = (b, s, p["n_heads"], p["qk_nope_head_dim"] + p["qk_rope_head_dim"])
    return (
        ("q", qk, OUTPUT_DTYPE),
        ("k", qk, OUTPUT_DTYPE),
        ("v", (b, s, p["n_heads"], p["v_head_dim"]), OUTPUT_DTYPE),
    )


def _outputs_v4(call: CallInfo):
    b, s, p = call.dims["B"], call.dims["S"], call.params
    kv_dim = p["kv_lora_rank"] + p["qk_rope_head_dim"]
    return (("q", (b, s, p["n_heads"], p["head_dim"]), OUTPUT_DTYPE), ("kv", (b, s, kv_dim), OUTPUT_DTYPE))


def _common_limits(call: CallInfo) -> list[str]:
    unmet = [
        f"{name} must be bfloat16; got {call.avals[name].dtype}"
        for name in _BF16_OPERANDS
        if call.avals[name].dtype != jnp.bfloat16
    ]
    if call.dims["B"] != 1:
        unmet.append(f"B={call.dims['B']} must be 1 (the kernel processes one context)")
    return unmet


def _limits_v32(call: CallInfo) -> list[str]:
    unmet, heads, h = _common_limits(call), call.params["n_heads"], call.dims["H"]
    if heads not in V32_MAX_H:
        unmet.append(f"n_heads={heads} must be one of {sorted(V32_MAX_H)} (the kernel's validated set; SBUF)")
    elif h > V32_MAX_H[heads]:
        unmet.append(f"H={h} exceeds {V32_MAX_H[heads]}, the largest validated H for n_heads={heads}")
    return unmet


def _limits_v4(call: CallInfo) -> list[str]:
    unmet = _common_limits(call)
    sizes = dict(call.params, H=call.dims["H"])
    unmet += [
        f"{name}={sizes[name]} exceeds {most} (the kernel's validated range)"
        for name, most in V4_MAX.items()
        if sizes[name] > most
    ]
    return unmet


def _neuron_notes(call: CallInfo) -> list[str]:
    return [
        "the kernel keeps the first projection and the normalized latents in bfloat16 (bfloat16 PSUM and SBUF "
        "tiles) before MX-quantizing them; the reference keeps them in float32, as the torch reference does",
        OCP_SCALE_FLAG_NOTE,
    ]


def _macs(call: CallInfo, widths) -> int:
    tokens, h = call.dims["B"] * call.dims["S"], call.dims["H"]
    first, *second = widths
    return tokens * (h * first + sum(k * n for k, n in second))


def _support(flavour: str, outputs: str) -> dict[str, str]:
    return {
        "idiomatic": "",
        "vjp": "none (MX-quantized inference projection)",
        "notes": f"docs-only (2.32) + newer source and torch reference; {flavour}; outputs {outputs} bfloat16; "
        "x_hbm and the first projection's latent columns 512-swizzled; float8_e4m3fn_x4 weights as uint32 words "
        "with compact block-128 uint8 scales; Neuron: bfloat16, B == 1 (split per batch row); not used by "
        "jax_nkilib.mla_attention (its projections take float weights, in XLA)",
    }


_V32_DIMS = _dim_params(
    ("n_heads", "attention heads"),
    ("qk_nope_head_dim", "dn: the unrotated part of each q/k head"),
    _ROPE_DOC,
    ("v_head_dim", "dv: value head width"),
    *_RANK_DOCS,
)
_V4_DIMS = _dim_params(
    ("n_heads", "attention heads"), ("head_dim", "q head width (nope + rope)"), _ROPE_DOC, *_RANK_DOCS
)

_V32_OPERANDS = (
    *_HIDDEN,
    _words("wqkv_a_hbm", "H/4, A", "first projection [H, QR + KVR + R]; QR and KVR columns 512-swizzled"),
    _scales("wqkv_a_scale_hbm", "H/128, AB", "compact block-128 scales of wqkv_a"),
    _words("wq_b_hbm", "QR/4, NQ", "second Q projection [QR, n_heads * (dn + R)]"),
    _scales("wq_b_scale_hbm", "QR/128, NQB", "compact block-128 scales of wq_b"),
    Operand.of("q_norm_gamma_hbm", "1, QR", dtypes=FLOAT_DTYPES, doc="RMSNorm gain of qr"),
    _words("wkv_b_hbm", "KVR/4, NKV", "second KV projection [KVR, n_heads * (dn + dv)]"),
    _scales("wkv_b_scale_hbm", "KVR/128, NKVB", "compact block-128 scales of wkv_b"),
    Operand.of("kv_norm_gamma_hbm", "1, KVR", dtypes=FLOAT_DTYPES, doc="RMSNorm gain of the kv latent"),
    *_CACHES,
)
_V4_OPERANDS = (
    *_HIDDEN,
    _words("wqkv_hbm", "H/4, A", "fused first projection [H, QR + KVR + R]; QR columns 512-swizzled"),
    _scales("wqkv_scale_hbm", "H/128, AB", "compact block-128 scales of wqkv"),
    _words("wq_b_hbm", "QR/4, NQ", "second Q projection [QR, n_heads * head_dim]"),
    _scales("wq_b_scale_hbm", "QR/128, NQB", "compact block-128 scales of wq_b"),
    Operand.of("q_norm_gamma_hbm", "1, QR", dtypes=FLOAT_DTYPES, doc="RMSNorm gain of qr"),
    Operand.of("kv_norm_gamma_hbm", "1, KVD", dtypes=FLOAT_DTYPES, doc="RMSNorm gain of kv [1, KVR + R]"),
    *_CACHES,
)

QKV_MLA_MX_SPEC = KernelSpec(
    name="qkv_mla_mx",
    entry_point=f"{MODULE}:qkv_mla_mx",
    operands=_V32_OPERANDS,
    params=(*_V32_DIMS, _NORM_EPS),
    outputs=(),
    output_avals=_outputs_v32,
    reference=reference_qkv_mla_mx,
    check=_check_v32,
    neuron_limits=_limits_v32,
    neuron_notes=_neuron_notes,
    neuron_split_dims=("B",),
    fold_plans=_fold_into_batch(_V32_OPERANDS, ("q", "k", "v")),
    mac_count=lambda call: _macs(
        call,
        (
            call.params["qk_lora_rank"] + call.params["kv_lora_rank"] + call.params["qk_rope_head_dim"],
            (call.params["qk_lora_rank"], call.avals["wq_b_hbm"].shape[1]),
            (call.params["kv_lora_rank"], call.avals["wkv_b_hbm"].shape[1]),
        ),
    ),
    family="mla",
    catalog="row 49, section 3",
    support=_support("DeepSeek-V3.2 MLA q/k/v", "(q, k, v)"),
)

QKV_MLA_MX_DEEPSEEK_V4_SPEC = KernelSpec(
    name="qkv_mla_mx_deepseek_v4",
    entry_point=f"{MODULE}:qkv_mla_mx_deepseek_v4",
    operands=_V4_OPERANDS,
    params=(*_V4_DIMS, _NORM_EPS),
    outputs=(),
    output_avals=_outputs_v4,
    reference=reference_qkv_mla_mx_deepseek_v4,
    check=_check_v4,
    neuron_limits=_limits_v4,
    neuron_notes=_neuron_notes,
    neuron_split_dims=("B",),
    fold_plans=_fold_into_batch(_V4_OPERANDS, ("q", "kv")),
    mac_count=lambda call: _macs(
        call,
        (
            call.params["qk_lora_rank"] + call.params["kv_lora_rank"] + call.params["qk_rope_head_dim"],
            (call.params["qk_lora_rank"], call.avals["wq_b_hbm"].shape[1]),
        ),
    ),
    family="mla",
    catalog="row 49, section 3",
    support=_support("DeepSeek-V4 MLA q and kv latent", "(q, kv)"),
)

qkv_mla_mx = make_kernel(QKV_MLA_MX_SPEC)
qkv_mla_mx_deepseek_v4 = make_kernel(QKV_MLA_MX_DEEPSEEK_V4_SPEC)
