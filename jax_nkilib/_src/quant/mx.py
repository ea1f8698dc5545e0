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

from ..framework import compat
from ..framework.validation import require

ELEMENT_DTYPE = jnp.float8_e4m3fn
FORMATS = {jnp.dtype(jnp.float8_e4m3fn): (448.0, 8), jnp.dtype(jnp.float8_e5m2): (57344.0, 15)}  # (max, emax)
SCALE_BIAS = 127
BLOCK_SIZE = 32  # elements per scale
BLOCK_PARTITIONS, BLOCK_FREE = 8, 4  # nisa.quantize_mx block: 8 partitions x 4 free elements
QUADRANT = 32  # partitions per SBUF quadrant; its 4 scale rows sit at its partitions 0..3
CONTRACTIONS = ("d_head", "block_len")

_U32, _I32 = jnp.uint32, jnp.int32


def _pow2(k):
    """Exact float32 ``2**k`` for int32 ``k`` in [-126, 127] (built from its bits)."""
    return lax.bitcast_convert_type(((k + 127) << 23).astype(_I32), jnp.float32)


def _biased_exponent(x):
    """Bits 23..30 of float32 ``x`` as int32: 0 for zeros and subnormals, 255 for inf and NaN."""
    return ((lax.bitcast_convert_type(x, _U32) >> 23) & 0xFF).astype(_I32)


def _format(dtype, function: str) -> tuple[float, int]:
    require(
        jnp.dtype(dtype) in FORMATS,
        function,
        f"the element format must be one of {', '.join(str(d) for d in FORMATS)}; got {dtype}",
    )
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
    return compat.astype_float8(jnp.clip(scaled, -largest, largest), dtype)


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
    sign = bits & jnp.uint32(0x80000000)  # a Python int literal overflows int32 without jax_enable_x64
    out = jnp.where(shift >= -149, normal, subnormal) | sign
    out = jnp.where(biased == 0, sign, jnp.where(biased == 255, bits, out))
    return lax.bitcast_convert_type(out, jnp.float32)


def _tile_shape(x, function: str) -> tuple[int, int]:
    require(x.ndim >= 2, function, f"expected a [..., P, F] array; got shape {x.shape}")
    p, f = x.shape[-2:]
    require(
        p % BLOCK_PARTITIONS == 0 and f % BLOCK_FREE == 0,
        function,
        f"[..., P, F] needs P % 8 == 0 and F % 4 == 0 (blocks of 8 partitions x 4 free elements); got {x.shape}",
    )
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
    require(scales.dtype == jnp.uint8, "dequantize_mx", f"scales must be uint8; got {scales.dtype}")
    require(
        scales.shape == elements.shape[:-2] + (p // 8, f // 4),
        "dequantize_mx",
        f"scales must be [..., P // 8, F // 4] = {elements.shape[:-2] + (p // 8, f // 4)}; got {scales.shape}",
    )
    blocks = elements.reshape(*elements.shape[:-2], p // 8, 8, f // 4, 4)
    return _dequantize(blocks, scales[..., :, None, :, None]).reshape(elements.shape)


@functools.partial(jax.jit, static_argnames=("axis", "dtype", "emax_offset"))
def mx_round_trip(x, axis: int = -1, dtype=ELEMENT_DTYPE, emax_offset: int = 0):
    """float32 ``dequantize(quantize(x))`` with blocks of 32 consecutive elements along ``axis`` (zero-padded at
    its end): what a kernel's swizzle + ``nisa.quantize_mx`` does to a matmul operand whose contraction is ``axis``.
    The module's rule with emax minus ``emax_offset`` (0: OCP; :data:`ALT_EMAX_OFFSET`: the alternative emax).
    """
    _format(dtype, "mx_round_trip")
    x = jnp.moveaxis(jnp.asarray(x).astype(jnp.float32), axis, -1)
    n = x.shape[-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -n % BLOCK_SIZE)])
    blocks = padded.reshape(*x.shape[:-1], -1, BLOCK_SIZE)
    exponent = _biased_exponent(blocks).max(axis=-1, keepdims=True) + emax_offset
    out = _dequantize(_elements(blocks, exponent, dtype), _scale_bytes(exponent, dtype)).reshape(padded.shape)
    return jnp.moveaxis(out[..., :n], -1, axis)


def _words(words, function: str):
    words = jnp.asarray(words)
    require(
        words.dtype in (jnp.dtype(_U32), jnp.dtype(_I32), jnp.dtype(jnp.float32)),
        function,
        f"expected 32-bit words (uint32, int32 or float32 bit patterns); got {words.dtype}",
    )
    return words if words.dtype == _U32 else lax.bitcast_convert_type(words, _U32)


@jax.jit
def pack_x4(elements):
    """uint32 words ``[..., n]`` from fp8 or uint8 bytes ``[..., 4n]``: element ``4w + j`` in byte ``j`` of word
    ``w`` (bits 8j..8j+7), the ``float8_e4m3fn_x4`` layout."""
    elements = jnp.asarray(elements)
    require(
        elements.ndim >= 1 and elements.shape[-1] % 4 == 0 and elements.dtype.itemsize == 1,
        "pack_x4",
        f"expected 1-byte elements [..., 4n]; got {elements.dtype} {elements.shape}",
    )
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
    require(x.ndim >= 2 and x.shape[-1] % 4 == 0, "swizzle_mx", f"expected [..., M, K] with K % 4 == 0; got {x.shape}")
    m, k = x.shape[-2:]
    return jnp.swapaxes(x.reshape(*x.shape[:-2], m, k // 4, 4), -3, -2).reshape(*x.shape[:-2], k // 4, 4 * m)


@jax.jit
def unswizzle_mx(y):
    """Inverse of :func:`swizzle_mx`: ``[..., G, 4M]`` -> ``[..., M, 4G]``."""
    y = jnp.asarray(y)
    require(y.ndim >= 2 and y.shape[-1] % 4 == 0, "unswizzle_mx", f"expected [..., G, 4M]; got {y.shape}")
    g, m4 = y.shape[-2:]
    return jnp.swapaxes(y.reshape(*y.shape[:-2], g, m4 // 4, 4), -3, -2).reshape(*y.shape[:-2], m4 // 4, 4 * g)


@jax.jit
def scales_to_quadrants(scales):
    """Dense scales ``[..., P // 8, F]`` -> partition layout ``[..., P, F]`` (P % 32 == 0): the 4 scale rows of each
    32-partition quadrant at its partitions 0..3 and zeros elsewhere, where ``nisa.quantize_mx`` writes them."""
    scales = jnp.asarray(scales)
    require(
        scales.ndim >= 2 and scales.shape[-2] % 4 == 0,
        "scales_to_quadrants",
        f"expected [..., P // 8, F] with P % 32 == 0; got {scales.shape}",
    )
    rows, f = scales.shape[-2:]
    grouped = scales.reshape(*scales.shape[:-2], rows // 4, 4, f)
    padded = jnp.pad(grouped, [(0, 0)] * (grouped.ndim - 2) + [(0, QUADRANT - 4), (0, 0)])
    return padded.reshape(*scales.shape[:-2], rows * 8, f)


@jax.jit
def scales_from_quadrants(scales):
    """Inverse of :func:`scales_to_quadrants` (rows 4..31 of each quadrant are ignored)."""
    scales = jnp.asarray(scales)
    require(
        scales.ndim >= 2 and scales.shape[-2] % QUADRANT == 0,
        "scales_from_quadrants",
        f"expected [..., P, F] with P % 32 == 0; got {scales.shape}",
    )
    p, f = scales.shape[-2:]
    return scales.reshape(*scales.shape[:-2], p // QUADRANT, QUADRANT, f)[..., :4, :].reshape(
        *scales.shape[:-2], p // 8, f
    )


def _block_operand(x, contraction: str, function: str):
    require(contraction in CONTRACTIONS, function, f"contraction must be one of {CONTRACTIONS}; got {contraction!r}")
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
    require(x.ndim >= 2, "encode_mx_block", f"expected a [..., T, D] block; got shape {x.shape}")
    operand = _block_operand(x, contraction, "encode_mx_block")
    n, c = operand.shape[-2:]
    require(
        c % (4 * QUADRANT) == 0 and n % 4 == 0,
        "encode_mx_block",
        f"contraction size {c} must be a multiple of 128 and the other size {n} of 4; got block {x.shape}",
    )
    elements, scales = quantize_mx(swizzle_mx(operand), dtype)  # [C // 4, 4N], [C // 32, N]
    words = jnp.concatenate([pack_x4(elements), scales_to_quadrants(pack_x4(scales))], axis=-1)
    return lax.bitcast_convert_type(words, jnp.float32)


@functools.partial(jax.jit, static_argnames=("contraction", "dtype"))
def decode_mx_block(block, contraction: str = "d_head", dtype=ELEMENT_DTYPE):
    """float32 ``[..., T, D]`` from an :func:`encode_mx_block` block ``[..., C // 4, N + N // 4]`` (float32, uint32
    or int32 words); ``contraction`` and ``dtype`` as given to the encoder."""
    words = _words(block, "decode_mx_block")
    _block_operand(words, contraction, "decode_mx_block")
    require(
        words.ndim >= 2 and words.shape[-1] % 5 == 0 and words.shape[-2] % QUADRANT == 0,
        "decode_mx_block",
        f"expected a [..., C // 4, N + N // 4] block with C % 128 == 0; got {words.shape}",
    )
    n = words.shape[-1] * 4 // 5
    elements = unpack_x4(words[..., :n], dtype)  # [C // 4, 4N]
    scales = unpack_x4(scales_from_quadrants(words[..., n:]), jnp.uint8)  # [C // 32, N]
    operand = unswizzle_mx(dequantize_mx(elements, scales))  # [N, C]
    return _block_operand(operand, contraction, "decode_mx_block")


# ----------------------------------------------------------------------------- matmul_mxfp8-family operands (wrapX)
# The MXFP8 matmul kernels (matmul_mxfp8, mlp_forward/backward_mxfp8) quantize an operand ``[F, K]`` (K contracted)
# after the "wrapX" swizzle of their golden (``matmul_mxfp8_torch._swizzle``, the DGT load): K is cut into tiles of
# 512, then a remainder that is a multiple of 128 into tiles of 256 and 128 (any other remainder is one tile); in a
# tile of size T starting at k0, swizzled row ``k0/4 + p`` lane ``j`` holds K index ``k0 + j*(T/4) + p``. The
# swizzled operand ``[K/4, 4F]`` (element ``[r, 4f + j]``) is MX-quantized in 8 x 4 blocks, so one scale covers
# K indices {8g..8g+7 of the tile's rows} x {4 lanes} of one f: 4 runs of 8 consecutive K, T/4 apart.
# Their quantization uses the "alternative emax" (the neuronxcc default, ``--enable-mx-alternative-emax``; the
# goldens' ``_get_mx_max_exp``): emax 7 for e4m3 and 14 for e5m2, one less than the OCP rule above, so a block's
# largest magnitude maps into [128, 256) (e4m3) and never saturates; the scale byte is ``clip(E - 7, 0, 255)``.
# Pre-quantized operands are x4 words ``[K/4, F]`` (word ``[r, f]`` packs lanes j = 0..3 of swizzled row r, byte j)
# with scales ``[K/4, F]`` ("oversized": dense scale row c at row (c // 4) * 32 + c % 4) or, packed, ``[ceil(K /
# 2048) * 128, F]`` (dense row c = 16 t + i of K-tile t at row (t // 4) * 128 + 4 (t % 4) + (i // 4) * 32 + i % 4).
WRAP_TILE = 512
ALT_EMAX_OFFSET = 1  # the alternative emax is the format's emax minus this
PACKED_SCALE_GROUP = 2048  # K elements per 128-row group of packed scales


def wrapx_tiles(k: int) -> tuple[tuple[int, int], ...]:
    """``(start, size)`` of the wrapX swizzle tiles along a contraction of ``k`` (``k % 32 == 0``)."""
    require(k > 0 and k % BLOCK_SIZE == 0, "wrapx_tiles", f"the contraction must be a positive multiple of 32; got {k}")
    tiles, start = [], 0
    while k - start >= WRAP_TILE:
        tiles.append((start, WRAP_TILE))
        start += WRAP_TILE
    rest = k - start
    if rest % 128 == 0:  # 0, 128, 256 or 384: the DGT's 256 and 128 sub-tiles
        sizes = [size for size in (256, 128) if rest & size]
    else:
        sizes = [rest]
    for size in sizes:
        tiles.append((start, size))
        start += size
    return tuple(tiles)


@functools.cache
def wrapx_index(k: int):
    """numpy int ``[k // 4, 4]``: the K index that wrapX swizzled row ``r``, lane ``j`` holds."""
    import numpy as np

    index = np.zeros((k // 4, 4), np.int64)
    for start, size in wrapx_tiles(k):
        rows = np.arange(size // 4)
        index[start // 4 + rows] = start + np.arange(4)[None, :] * (size // 4) + rows[:, None]
    return index


def _quantize_blocks(blocks, dtype, emax_offset: int):
    """``(elements, scale bytes)`` of float32 ``blocks [..., n, 32]``, the module's rule with emax - offset."""
    exponent = _biased_exponent(blocks).max(axis=-1, keepdims=True) + emax_offset
    return _elements(blocks, exponent, dtype), _scale_bytes(exponent, dtype)


@functools.partial(jax.jit, static_argnames=("axis", "dtype"))
def mx_round_trip_wrapx(x, axis: int = -1, dtype=ELEMENT_DTYPE):
    """float32 ``dequantize(quantize(x))`` of a matmul_mxfp8-family operand contracted along ``axis``: wrapX blocks,
    alternative emax (see above). A contraction that is not a multiple of 32 is zero-padded at its end first (the
    kernels never see one: their loads need multiples of 128)."""
    import numpy as np

    _format(dtype, "mx_round_trip_wrapx")
    x = jnp.moveaxis(jnp.asarray(x).astype(jnp.float32), axis, -1)
    n = x.shape[-1]
    k = n + (-n % BLOCK_SIZE)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - n)])
    order = wrapx_index(k).reshape(k // BLOCK_SIZE, 8, 4).reshape(-1)  # each run of 32 is one MX block
    blocks = jnp.take(x, order, axis=-1).reshape(*x.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    elements, scales = _quantize_blocks(blocks, dtype, ALT_EMAX_OFFSET)
    values = _dequantize(elements, scales).reshape(x.shape)
    return jnp.moveaxis(jnp.take(values, np.argsort(order)[:n], axis=-1), -1, axis)


@jax.jit
def swizzle_wrapx(x):
    """``[..., F, K]`` -> wrapX swizzled ``[..., K // 4, 4F]``: ``out[r, 4f + j] = x[f, index[r, j]]``, the layout of
    a pre-swizzled bfloat16 operand (``*_is_swizzled=True``)."""
    x = jnp.asarray(x)
    require(x.ndim >= 2, "swizzle_wrapx", f"expected [..., F, K]; got {x.shape}")
    f, k = x.shape[-2:]
    gathered = jnp.take(x, wrapx_index(k).reshape(-1), axis=-1).reshape(*x.shape[:-1], k // 4, 4)  # [F, K/4, 4]
    return jnp.swapaxes(gathered, -3, -2).reshape(*x.shape[:-2], k // 4, 4 * f)


@jax.jit
def unswizzle_wrapx(y):
    """Inverse of :func:`swizzle_wrapx`: ``[..., K // 4, 4F]`` -> ``[..., F, K]``."""
    y = jnp.asarray(y)
    require(y.ndim >= 2 and y.shape[-1] % 4 == 0, "unswizzle_wrapx", f"expected [..., K // 4, 4F]; got {y.shape}")
    rows, f4 = y.shape[-2:]
    k = 4 * rows
    lanes = jnp.swapaxes(y.reshape(*y.shape[:-2], rows, f4 // 4, 4), -3, -2).reshape(*y.shape[:-2], f4 // 4, k)
    inverse = jnp.zeros(k, jnp.int32).at[wrapx_index(k).reshape(-1)].set(jnp.arange(k, dtype=jnp.int32))
    return jnp.take(lanes, inverse, axis=-1)


def matmul_scale_rows(k: int, packed: bool) -> int:
    """Rows of a pre-quantized operand's scales for contraction ``k``: ``k // 4``, or ``ceil(k / 2048) * 128``."""
    return -(-k // PACKED_SCALE_GROUP) * 128 if packed else k // 4


def _scale_row_index(k: int, packed: bool):
    """numpy int ``[k // 32]``: the scale row holding dense scale row ``c`` (see the layout note above)."""
    import numpy as np

    c = np.arange(k // BLOCK_SIZE)
    if not packed:
        return (c // 4) * QUADRANT + c % 4
    tile, row = c // 16, c % 16
    return (tile // 4) * 128 + 4 * (tile % 4) + (row // 4) * QUADRANT + row % 4


@functools.partial(jax.jit, static_argnames=("dtype", "packed"))
def quantize_matmul_operand(x, dtype=ELEMENT_DTYPE, packed: bool = False):
    """Pre-quantize a matmul_mxfp8-family operand ``[..., F, K]``: ``(words [..., K // 4, F] uint32, scales [...,
    rows, F] uint8)`` with rows from :func:`matmul_scale_rows`; unused scale rows are 0."""
    _format(dtype, "quantize_matmul_operand")
    x = jnp.asarray(x).astype(jnp.float32)
    f, k = x.shape[-2:]
    swizzled = swizzle_wrapx(x)  # [K/4, 4F]
    blocks = jnp.swapaxes(swizzled.reshape(*x.shape[:-2], k // 32, 8, f, 4), -3, -2)  # [K/32, F, 8, 4]
    elements, scales = _quantize_blocks(blocks.reshape(*blocks.shape[:-2], 32), dtype, ALT_EMAX_OFFSET)
    elements = jnp.swapaxes(elements.reshape(blocks.shape), -3, -2).reshape(swizzled.shape)
    words = pack_x4(elements)  # [K/4, F]
    dense = scales[..., 0]  # [K/32, F]
    out = jnp.zeros((*x.shape[:-2], matmul_scale_rows(k, packed), f), jnp.uint8)
    return words, out.at[..., _scale_row_index(k, packed), :].set(dense)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_matmul_operand(words, scales, dtype=ELEMENT_DTYPE):
    """float32 ``[..., F, K]`` of a pre-quantized operand: x4 ``words [..., K // 4, F]`` (uint32, int32 or float32
    bit patterns) and ``scales [..., rows, F]`` (uint8), packed or not as their row count says."""
    words = _words(words, "dequantize_matmul_operand")
    scales = jnp.asarray(scales)
    rows, f = words.shape[-2:]
    k = 4 * rows
    packed = scales.shape[-2] != k // 4
    require(
        scales.shape[-2] == matmul_scale_rows(k, packed) and scales.shape[-1] == f,
        "dequantize_matmul_operand",
        f"scales must be [K/4, F] = {(k // 4, f)} or packed [ceil(K/2048)*128, F] = "
        f"{(matmul_scale_rows(k, True), f)}; got {scales.shape}",
    )
    dense = jnp.take(scales, _scale_row_index(k, packed), axis=-2)  # [K/32, F]
    elements = unpack_x4(words, dtype)  # [K/4, 4F]
    return unswizzle_wrapx(dequantize_mx(elements, dense))


# ------------------------------------------------------------------ plain layout: blocks of consecutive elements
@functools.partial(jax.jit, static_argnames=("axis", "dtype", "block", "emax_offset"))
def quantize_mx_along(
    x, axis: int = -1, dtype=ELEMENT_DTYPE, block: int = BLOCK_SIZE, emax_offset: int = ALT_EMAX_OFFSET
):
    """MX-quantize ``x`` in blocks of ``block`` consecutive elements along ``axis`` (its size a multiple of
    ``block``): ``(elements, scales)``, the fp8 ``elements`` of ``x``'s shape and uint8 ``scales`` of ``x``'s shape
    with ``axis`` divided by ``block``. The module's rule with emax minus ``emax_offset`` (default: the alternative
    emax of the matmul_mxfp8 family, the quantize kernel's ``1x32`` blocks; 0 gives the OCP rule)."""
    _format(dtype, "quantize_mx_along")
    x = jnp.moveaxis(jnp.asarray(x).astype(jnp.float32), axis, -1)
    n = x.shape[-1]
    require(
        block > 0 and n % block == 0,
        "quantize_mx_along",
        f"the quantized axis (size {n}) must be a multiple of the block size {block}",
    )
    elements, scales = _quantize_blocks(x.reshape(*x.shape[:-1], n // block, block), dtype, emax_offset)
    return jnp.moveaxis(elements.reshape(x.shape), -1, axis), jnp.moveaxis(scales[..., 0], -1, axis)


@functools.partial(jax.jit, static_argnames="axis")
def dequantize_mx_along(elements, scales, axis: int = -1):
    """float32 inverse of :func:`quantize_mx_along`: ``element * 2**(scale - 127)``, one scale per block of
    consecutive elements along ``axis`` (the block size is the ratio of the two sizes along ``axis``)."""
    elements, scales = jnp.asarray(elements), jnp.asarray(scales)
    _format(elements.dtype, "dequantize_mx_along")
    require(scales.dtype == jnp.uint8, "dequantize_mx_along", f"scales must be uint8; got {scales.dtype}")
    e, s = jnp.moveaxis(elements, axis, -1), jnp.moveaxis(scales, axis, -1)
    require(
        e.shape[:-1] == s.shape[:-1] and s.shape[-1] > 0 and e.shape[-1] % s.shape[-1] == 0,
        "dequantize_mx_along",
        f"scales {scales.shape} must be the elements' shape {elements.shape} with the "
        f"axis {axis} divided by the block size",
    )
    blocks = e.reshape(*s.shape, e.shape[-1] // s.shape[-1])
    return jnp.moveaxis(_dequantize(blocks, s[..., None]).reshape(e.shape), -1, axis)


# ------------------------------------------------------------------ x4 weight words with dense block scales (MLP TKG)
# MXFP4 ``float4_e2m1fn_x4``: four e2m1 codes in one 16-bit word, element ``j`` in bits ``4j..4j+3`` (sign bit 3;
# magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; largest 6, emax 2). MXFP8 x4 words are 32-bit (see :func:`pack_x4`).
FP4_DTYPE = jnp.float4_e2m1fn
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
X4_WORD_DTYPES = {
    jnp.dtype(jnp.float8_e4m3fn): (jnp.dtype(_U32), jnp.dtype(_I32)),
    jnp.dtype(jnp.float8_e5m2): (jnp.dtype(_U32), jnp.dtype(_I32)),
    jnp.dtype(FP4_DTYPE): (jnp.dtype(jnp.uint16),),
}


@jax.jit
def unpack_fp4_x4(words):
    """float32 ``[..., n, 4]`` e2m1 values from uint16 ``float4_e2m1fn_x4`` words ``[..., n]`` (exact)."""
    words = jnp.asarray(words).astype(_U32)
    codes = jnp.stack([(words >> (4 * j)) & 0xF for j in range(4)], axis=-1)
    magnitude = jnp.asarray(_FP4_MAGNITUDES, jnp.float32)[(codes & 7).astype(_I32)]
    return jnp.where((codes & 8) != 0, -magnitude, magnitude)


@jax.jit
def pack_fp4_x4(values):
    """Inverse of :func:`unpack_fp4_x4`: uint16 words ``[..., n]`` from e2m1-representable values ``[..., n, 4]``
    (other values are rounded to nearest even by the ``float4_e2m1fn`` cast)."""
    values = jnp.asarray(values).astype(jnp.float32).astype(FP4_DTYPE).astype(jnp.float32)
    magnitude = jnp.abs(values)
    codes = jnp.argmax(magnitude[..., None] == jnp.asarray(_FP4_MAGNITUDES, jnp.float32), axis=-1).astype(_U32)
    codes = codes | jnp.where(jnp.signbit(values), 8, 0).astype(_U32)
    return functools.reduce(lambda a, b: a | b, [codes[..., j] << (4 * j) for j in range(4)]).astype(jnp.uint16)


@functools.partial(jax.jit, static_argnames="dtype")
def decode_x4_weight(words, scales, dtype=ELEMENT_DTYPE):
    """float32 ``[P, ..., 4]`` of MX x4 weight words ``[P, ...]`` (partitions first; 32-bit for fp8 ``dtype``,
    uint16 for ``float4_e2m1fn``) with dense uint8 scales ``[P // 8, ...]``: lane ``j`` of word ``[p, *f]`` times
    ``2**(scales[p // 8, *f] - 127)`` (one scale per 8 partitions x 4 lanes), exact."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.dtype(FP4_DTYPE):
        elements = unpack_fp4_x4(words)
    else:
        _format(dtype, "decode_x4_weight")
        words = _words(words, "decode_x4_weight")
        elements = unpack_x4(words, dtype).reshape(*words.shape, 4).astype(jnp.float32)
    scales = jnp.repeat(jnp.asarray(scales), BLOCK_PARTITIONS, axis=0)
    return _dequantize(elements, scales[..., None])
