"""MX (OCP microscaling) fp8 formats as the NKI Library kernels store and compute them, in ``jnp`` (jittable).

Format: fp8 elements with one ``e8m0`` scale byte ``s`` per block of 32 elements; the value is ``element *
2**(s - 127)``. Elements are ``float8_e4m3fn`` (MXFP8's usual format: largest 448, ``emax`` 8, no inf, NaN =
0x7F/0xFF; the default here and attention_mxfp8_tkg's) or ``float8_e5m2`` (largest 57344, ``emax`` 15).

Block geometry: ``nisa.quantize_mx`` on a ``[P, F]`` tile makes blocks of 8 partitions x 4 free elements, with dense
scales ``[P // 8, F // 4]`` (:func:`scales_to_quadrants` gives the hardware's partition layout). Matmul operands are
swizzled first (:func:`swizzle_mx`), which makes every block 32 consecutive elements of one row along the
contraction axis; :func:`mx_round_trip` quantizes in that geometry directly.

Scale rule (nkilib ``quantize_to_mx``, the golden of ``nisa.quantize_mx``). With ``E`` the largest biased float32
exponent in the block (bits 23..30: 0 for zeros and subnormals, 255 for inf/NaN), the scale byte is
``clip(E - emax, 0, 255)`` and each element is ``fp8(clip(x * 2**(127 + emax - E), -max, max))``, rounded to
nearest even; for e4m3: byte ``clip(E - 8, 0, 255)``, element ``fp8(clip(x * 2**(135 - E), -448, 448))``.
Consequences for e4m3, kept as the references define them:

* the block's largest magnitude maps into [256, 512): a mantissa >= 1.75 saturates to 448 (i.e. to 1.75 * 2**e);
* blocks with ``E < 8`` (every |x| < 2**-119) store byte 0 but scale their elements by ``2**(135 - E)``, so
  :func:`dequantize_mx` (which multiplies by 2**-127) does not invert them;
* +-inf becomes +-448 with byte 247 (dequantized: +-448 * 2**120); NaN stays NaN; the other elements of such a
  block are scaled by 2**-120 (mostly to 0).

Dequantization is ``element * 2**(s - 127)``, exact; byte 255 decodes as 2**128 (no NaN code, as in the
references), and NaN elements stay NaN (the torch reference's manual cache decoder reads the NaN bytes as +-480;
this follows the format). XLA:CPU flushes subnormals, so exponents are handled as integers and subnormal results
are built bitwise: the helpers are exact on every backend.

x4 packing (``float8_e4m3fn_x4``): four bytes in one 32-bit word, element ``4w + j`` in byte ``j`` (bits
``8j..8j+7``, little-endian). Kernels pass such words as float32 bit patterns; nothing here does arithmetic on them.

The public helpers are jitted (their static arguments: ``axis``, ``dtype``, ``contraction``); shape errors are
``ValueError`` naming the helper.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

ELEMENT_DTYPE = jnp.float8_e4m3fn
FORMATS = {jnp.dtype(jnp.float8_e4m3fn): (448.0, 8), jnp.dtype(jnp.float8_e5m2): (57344.0, 15)}  # (max, emax)
SCALE_BIAS = 127
BLOCK_SIZE = 32  # elements per scale
BLOCK_PARTITIONS, BLOCK_FREE = 8, 4  # nisa.quantize_mx block: 8 partitions x 4 free elements
QUADRANT = 32  # partitions per SBUF quadrant; its 4 scale rows sit at its partitions 0..3
CONTRACTIONS = ("d_head", "block_len")

_U32, _I32 = jnp.uint32, jnp.int32


def _require(condition: bool, function: str, message: str) -> None:
    if not condition:
        raise ValueError(f"{function}: {message}")


def _pow2(k):
    """Exact float32 ``2**k`` for int32 ``k`` in [-126, 127] (built from its bits)."""
    return lax.bitcast_convert_type(((k + 127) << 23).astype(_I32), jnp.float32)


def _biased_exponent(x):
    """Bits 23..30 of float32 ``x`` as int32: 0 for zeros and subnormals, 255 for inf and NaN."""
    return ((lax.bitcast_convert_type(x, _U32) >> 23) & 0xFF).astype(_I32)


def _format(dtype, function: str) -> tuple[float, int]:
    _require(jnp.dtype(dtype) in FORMATS, function, f"the element format must be one of "
             f"{', '.join(str(d) for d in FORMATS)}; got {dtype}")
    return FORMATS[jnp.dtype(dtype)]


def _scale_bytes(block_exponent, dtype):
    return jnp.clip(block_exponent - FORMATS[jnp.dtype(dtype)][1], 0, 255).astype(jnp.uint8)


def _elements(x, block_exponent, dtype):
    """fp8 ``clip(x * 2**(127 + emax - E), +-max)`` for float32 ``x`` and its block's ``E`` (broadcastable int32)."""
    largest, emax = FORMATS[jnp.dtype(dtype)]
    bits = lax.bitcast_convert_type(x, _U32)
    biased = ((bits >> 23) & 0xFF).astype(_I32)
    fraction = (bits & 0x7FFFFF).astype(_I32)
    significand = jnp.where(biased == 0, fraction, fraction | 0x800000)  # |x| = significand * 2**exponent
    exponent = jnp.where(biased == 0, -149, biased - 150)
    # past these bounds the element is 0 or saturates whatever the exact shift; two factors keep 2**k normal
    shift = jnp.clip(exponent + 127 + emax - block_exponent, -200, 24)
    half = shift // 2
    magnitude = significand.astype(jnp.float32) * _pow2(half) * _pow2(shift - half)
    scaled = jnp.where((bits >> 31) == 1, -magnitude, magnitude)
    scaled = jnp.where(biased == 255, x, scaled)  # inf saturates below; NaN stays NaN
    return jnp.clip(scaled, -largest, largest).astype(dtype)


def _dequantize(elements, scales):
    """float32 ``elements * 2**(scales - 127)``, exact (subnormal results built bitwise); inf and NaN pass."""
    value = elements.astype(jnp.float32)  # exact: fp8 values are normal float32 numbers, 0, inf or NaN
    bits = lax.bitcast_convert_type(value, _U32)
    biased = ((bits >> 23) & 0xFF).astype(_I32)
    significand = ((bits & 0x7FFFFF) | 0x800000).astype(_I32)  # |value| = significand * 2**(biased - 150)
    shift = jnp.clip(biased - 150 + scales.astype(_I32) - SCALE_BIAS, -252, 252)
    half = shift // 2
    normal = lax.bitcast_convert_type(significand.astype(jnp.float32) * _pow2(half) * _pow2(shift - half), _U32)
    subnormal = (significand >> jnp.clip(-149 - shift, 0, 31)).astype(_U32)  # exact: fp8 has <= 4 significant bits
    sign = bits & 0x80000000
    out = jnp.where(shift >= -149, normal, subnormal) | sign
    out = jnp.where(biased == 0, sign, jnp.where(biased == 255, bits, out))
    return lax.bitcast_convert_type(out, jnp.float32)


def _tile_shape(x, function: str) -> tuple[int, int]:
    _require(x.ndim >= 2, function, f"expected a [..., P, F] array; got shape {x.shape}")
    p, f = x.shape[-2:]
    _require(p % BLOCK_PARTITIONS == 0 and f % BLOCK_FREE == 0, function,
             f"[..., P, F] needs P % 8 == 0 and F % 4 == 0 (blocks of 8 partitions x 4 free elements); got {x.shape}")
    return p, f


@functools.partial(jax.jit, static_argnames="dtype")
def quantize_mx(x, dtype=ELEMENT_DTYPE):
    """MX-quantize ``x [..., P, F]`` (any float dtype, read as float32) in ``nisa.quantize_mx`` blocks of 8
    partitions x 4 free elements (P % 8 == 0, F % 4 == 0).

    Returns ``(elements, scales)``: ``elements [..., P, F]`` of the fp8 ``dtype`` and ``scales [..., P // 8, F // 4]``
    uint8; the scale rule is the module's.
    """
    _format(dtype, "quantize_mx")
    x = jnp.asarray(x).astype(jnp.float32)
    p, f = _tile_shape(x, "quantize_mx")
    blocks = x.reshape(*x.shape[:-2], p // 8, 8, f // 4, 4)
    exponent = _biased_exponent(blocks).max(axis=(-3, -1), keepdims=True)
    return _elements(blocks, exponent, dtype).reshape(x.shape), _scale_bytes(exponent[..., 0, :, 0], dtype)


@jax.jit
def dequantize_mx(elements, scales):
    """float32 ``[..., P, F]`` from :func:`quantize_mx`'s ``elements [..., P, F]`` (fp8) and ``scales
    [..., P // 8, F // 4]`` (uint8): ``element * 2**(scale - 127)`` over each 8 x 4 block."""
    elements, scales = jnp.asarray(elements), jnp.asarray(scales)
    p, f = _tile_shape(elements, "dequantize_mx")
    _format(elements.dtype, "dequantize_mx")
    _require(scales.dtype == jnp.uint8, "dequantize_mx", f"scales must be uint8; got {scales.dtype}")
    _require(scales.shape == elements.shape[:-2] + (p // 8, f // 4), "dequantize_mx",
             f"scales must be [..., P // 8, F // 4] = {elements.shape[:-2] + (p // 8, f // 4)}; got {scales.shape}")
    blocks = elements.reshape(*elements.shape[:-2], p // 8, 8, f // 4, 4)
    return _dequantize(blocks, scales[..., :, None, :, None]).reshape(elements.shape)


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def mx_round_trip(x, axis: int = -1, dtype=ELEMENT_DTYPE):
    """float32 ``dequantize(quantize(x))`` with blocks of 32 consecutive elements along ``axis`` (zero-padded at
    its end): what a kernel's swizzle + ``nisa.quantize_mx`` does to a matmul operand whose contraction is ``axis``.
    """
    _format(dtype, "mx_round_trip")
    x = jnp.moveaxis(jnp.asarray(x).astype(jnp.float32), axis, -1)
    n = x.shape[-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % BLOCK_SIZE)])
    blocks = padded.reshape(*x.shape[:-1], -1, BLOCK_SIZE)
    exponent = _biased_exponent(blocks).max(axis=-1, keepdims=True)
    out = _dequantize(_elements(blocks, exponent, dtype), _scale_bytes(exponent, dtype)).reshape(padded.shape)
    return jnp.moveaxis(out[..., :n], -1, axis)


def _words(words, function: str):
    words = jnp.asarray(words)
    _require(words.dtype in (jnp.dtype(_U32), jnp.dtype(_I32), jnp.dtype(jnp.float32)), function,
             f"expected 32-bit words (uint32, int32 or float32 bit patterns); got {words.dtype}")
    return words if words.dtype == _U32 else lax.bitcast_convert_type(words, _U32)


@jax.jit
def pack_x4(elements):
    """uint32 words ``[..., n]`` from fp8 or uint8 bytes ``[..., 4n]``: element ``4w + j`` in byte ``j`` of word
    ``w`` (bits 8j..8j+7), the ``float8_e4m3fn_x4`` layout."""
    elements = jnp.asarray(elements)
    _require(elements.ndim >= 1 and elements.shape[-1] % 4 == 0 and elements.dtype.itemsize == 1, "pack_x4",
             f"expected 1-byte elements [..., 4n]; got {elements.dtype} {elements.shape}")
    codes = elements if elements.dtype == jnp.uint8 else lax.bitcast_convert_type(elements, jnp.uint8)
    codes = codes.reshape(*codes.shape[:-1], -1, 4).astype(_U32)
    return codes[..., 0] | (codes[..., 1] << 8) | (codes[..., 2] << 16) | (codes[..., 3] << 24)


@functools.partial(jax.jit, static_argnames="dtype")
def unpack_x4(words, dtype=ELEMENT_DTYPE):
    """Inverse of :func:`pack_x4`: bytes ``[..., 4n]`` as ``dtype`` (an fp8 type or uint8) from 32-bit words
    ``[..., n]`` (uint32, int32 or float32 bit patterns)."""
    words = _words(words, "unpack_x4")
    codes = jnp.stack([(words >> (8 * j)) & 0xFF for j in range(4)], axis=-1).astype(jnp.uint8)
    codes = codes.reshape(*words.shape[:-1], 4 * words.shape[-1])
    return codes if jnp.dtype(dtype) == jnp.uint8 else lax.bitcast_convert_type(codes, dtype)


@jax.jit
def swizzle_mx(x):
    """``[..., M, K]`` -> ``[..., K // 4, 4M]`` with ``out[g, 4m + j] = x[m, 4g + j]``: the ``nc_matmul_mx`` operand
    layout (contraction K on partitions in groups of 4 kept adjacent on the free axis), so that an 8 x 4 MX block is
    32 consecutive K of one row ``m``."""
    x = jnp.asarray(x)
    _require(x.ndim >= 2 and x.shape[-1] % 4 == 0, "swizzle_mx", f"expected [..., M, K] with K % 4 == 0; got {x.shape}")
    m, k = x.shape[-2:]
    return jnp.swapaxes(x.reshape(*x.shape[:-2], m, k // 4, 4), -3, -2).reshape(*x.shape[:-2], k // 4, 4 * m)


@jax.jit
def unswizzle_mx(y):
    """Inverse of :func:`swizzle_mx`: ``[..., G, 4M]`` -> ``[..., M, 4G]``."""
    y = jnp.asarray(y)
    _require(y.ndim >= 2 and y.shape[-1] % 4 == 0, "unswizzle_mx", f"expected [..., G, 4M]; got {y.shape}")
    g, m4 = y.shape[-2:]
    return jnp.swapaxes(y.reshape(*y.shape[:-2], g, m4 // 4, 4), -3, -2).reshape(*y.shape[:-2], m4 // 4, 4 * g)


@jax.jit
def scales_to_quadrants(scales):
    """Dense scales ``[..., P // 8, F]`` -> partition layout ``[..., P, F]`` (P % 32 == 0): the 4 scale rows of each
    32-partition quadrant at its partitions 0..3 and zeros elsewhere, where ``nisa.quantize_mx`` writes them."""
    scales = jnp.asarray(scales)
    _require(scales.ndim >= 2 and scales.shape[-2] % 4 == 0, "scales_to_quadrants",
             f"expected [..., P // 8, F] with P % 32 == 0; got {scales.shape}")
    rows, f = scales.shape[-2:]
    grouped = scales.reshape(*scales.shape[:-2], rows // 4, 4, f)
    padded = jnp.pad(grouped, [(0, 0)] * (grouped.ndim - 2) + [(0, QUADRANT - 4), (0, 0)])
    return padded.reshape(*scales.shape[:-2], rows * 8, f)


@jax.jit
def scales_from_quadrants(scales):
    """Inverse of :func:`scales_to_quadrants` (rows 4..31 of each quadrant are ignored)."""
    scales = jnp.asarray(scales)
    _require(scales.ndim >= 2 and scales.shape[-2] % QUADRANT == 0, "scales_from_quadrants",
             f"expected [..., P, F] with P % 32 == 0; got {scales.shape}")
    p, f = scales.shape[-2:]
    return scales.reshape(*scales.shape[:-2], p // QUADRANT, QUADRANT, f)[..., :4, :].reshape(
        *scales.shape[:-2], p // 8, f)


def _block_operand(x, contraction: str, function: str):
    _require(contraction in CONTRACTIONS, function, f"contraction must be one of {CONTRACTIONS}; got {contraction!r}")
    return x if contraction == "d_head" else jnp.swapaxes(x, -1, -2)


@functools.partial(jax.jit, static_argnames=("contraction", "dtype"))
def encode_mx_block(x, contraction: str = "d_head", dtype=ELEMENT_DTYPE):
    """Pack a ``[..., T, D]`` (tokens x head dims) block into MXFP8 words ``[..., C // 4, N + N // 4]`` float32.

    ``contraction="d_head"``: C = D, N = T (a K block: ``q . k`` contracts D); ``"block_len"``: C = T, N = D (a V
    block: ``p . v`` contracts the tokens; it is built from the transposed block). The operand ``[N, C]`` is swizzled
    to ``[C // 4, 4N]`` (:func:`swizzle_mx`) and quantized, so each scale covers 32 consecutive C of one N. Columns
    ``0..N-1`` hold the x4 element words; columns ``N..`` the scale bytes ``[C // 32, N]``, 4 per word (the scale
    of C-group ``r`` and index ``n`` in word ``n // 4``, byte ``n % 4``), in the quadrant partition layout. Needs
    C % 128 == 0 and N % 4 == 0. With T = D = 128 and e4m3 elements this is attention_mxfp8_tkg's cache block
    ``[32, 160]``: 128 data columns and 32 scale columns, scales valid in rows 0..3.
    """
    x = jnp.asarray(x)
    _require(x.ndim >= 2, "encode_mx_block", f"expected a [..., T, D] block; got shape {x.shape}")
    operand = _block_operand(x, contraction, "encode_mx_block")
    n, c = operand.shape[-2:]
    _require(c % (4 * QUADRANT) == 0 and n % 4 == 0, "encode_mx_block",
             f"contraction size {c} must be a multiple of 128 and the other size {n} of 4; got block {x.shape}")
    elements, scales = quantize_mx(swizzle_mx(operand), dtype)  # [C // 4, 4N], [C // 32, N]
    words = jnp.concatenate([pack_x4(elements), scales_to_quadrants(pack_x4(scales))], axis=-1)
    return lax.bitcast_convert_type(words, jnp.float32)


@functools.partial(jax.jit, static_argnames=("contraction", "dtype"))
def decode_mx_block(block, contraction: str = "d_head", dtype=ELEMENT_DTYPE):
    """float32 ``[..., T, D]`` from an :func:`encode_mx_block` block ``[..., C // 4, N + N // 4]`` (float32, uint32
    or int32 words); ``contraction`` and ``dtype`` as given to the encoder."""
    words = _words(block, "decode_mx_block")
    _block_operand(words, contraction, "decode_mx_block")
    _require(words.ndim >= 2 and words.shape[-1] % 5 == 0 and words.shape[-2] % QUADRANT == 0, "decode_mx_block",
             f"expected a [..., C // 4, N + N // 4] block with C % 128 == 0; got {words.shape}")
    n = words.shape[-1] * 4 // 5
    elements = unpack_x4(words[..., :n], dtype)  # [C // 4, 4N]
    scales = unpack_x4(scales_from_quadrants(words[..., n:]), jnp.uint8)  # [C // 32, N]
    operand = unswizzle_mx(dequantize_mx(elements, scales))  # [N, C]
    return _block_operand(operand, contraction, "decode_mx_block")
