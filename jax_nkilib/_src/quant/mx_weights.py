"""DeepSeek-style MXFP8 weights and the MLA column swizzle, as the MLA projection and indexer kernels take them
(``qkv_mla_mx``, ``mla_qkv_cte_kernel``, ``mla_vupmx_oproj_cte_kernel``, ``sparse_attention_indexer_mx_bf16score``;
layouts from the newer nki-library source and its torch references, ``core/utils/mx_torch_common.py``).

* **Weight words** ``[K / 4, N]`` (uint32 holding ``float8_e4m3fn_x4``): byte ``j`` of word ``[g, n]`` is the weight
  ``W[4 g + j, n]``, so the contraction axis K is the packed one.
* **Scales** (uint8 e8m0, value ``2**(s - 127)``): native ``[K / 32, N]``, one per 32 contraction rows of a column;
  or DeepSeek's compact checkpoint layout ``[ceil(K / 128), ceil(N / 128)]``, one per 128 x 128 block, which the
  kernels broadcast to the native blocks (:func:`native_scales`).
* **512-swizzle** (:func:`unswizzle_512`): a width ``D`` (``D % 512 == 0``) in the kernels' order holds the natural
  index ``512 t + 4 p + q`` at position ``q D / 4 + 128 t + p`` (``p < 128``, ``q < 4``).
* **Activation quantization** (:func:`quantize_activation`): the kernels MX-quantize an activation in-kernel
  (``nisa.quantize_mx``) along its contraction in blocks of 32. The instruction's block scale is "two times larger"
  than the OCP sample algorithm (the 2.32 ``nki.isa.quantize_mx`` reference), i.e. the alternative emax (7 for e4m3)
  that the ``matmul_mxfp8`` family models too: what the kernels compute as this library compiles them. Their torch
  references use the OCP rule (emax 8), which the kernels follow only when neuronx-cc runs with
  ``--enable-ocp-compliant-scale-computation`` (their library tests pass it for ``mla_qkv_cte`` and
  ``mla_vupmx_oproj_cte``); the library passes no compiler flags.
* **MX matmul** (:func:`mx_matmul`): the quantized activation contracted exactly with the decoded weight.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from . import mx

LANES = 4  # fp8 elements per x4 word
COMPACT_BLOCK = 128  # compact scales: one per 128 x 128 weight block
SWIZZLE_TILE = 512  # the swizzle permutes 512-column tiles (128 partitions x 4 lanes)
KERNEL_EMAX_OFFSET = mx.ALT_EMAX_OFFSET  # nisa.quantize_mx's default scale rule (module doc)
OCP_SCALE_FLAG_NOTE = (
    "the reference MX-quantizes activations with quantize_mx's default scale (the alternative emax, as this library "
    "compiles the kernel); with neuronx-cc's --enable-ocp-compliant-scale-computation (its torch reference's OCP "
    "rule, emax 8) the device results differ from it"
)


def compact_blocks(n: int) -> int:
    """Compact scale rows or columns covering ``n`` weight rows or columns: ``ceil(n / 128)``."""
    return -(-n // COMPACT_BLOCK)


def native_scales(compact_scales, rows: int, columns: int):
    """Native ``[rows / 32, columns]`` scales of a ``[rows, columns]`` weight from its compact block-128 scales."""
    per_block = COMPACT_BLOCK // mx.BLOCK_SIZE
    dense = jnp.repeat(jnp.repeat(compact_scales, per_block, axis=0), COMPACT_BLOCK, axis=1)
    return dense[: rows // mx.BLOCK_SIZE, :columns]


def decode_weight(words, scales, compact: bool = True):
    """float32 ``W [K, N]`` of x4 words ``[K / 4, N]`` and their scales (compact block-128, or native when
    ``compact`` is false); exact."""
    groups, columns = words.shape
    if compact:
        scales = native_scales(scales, LANES * groups, columns)
    lanes = mx.decode_x4_weight(words, scales)  # [K / 4, N, 4]: W[4 g + j, n] at [g, n, j]
    return jnp.swapaxes(lanes, -1, -2).reshape(LANES * groups, columns)


def unswizzle_512(stored):
    """Natural order of ``stored [..., D]`` (``D % 512 == 0``) from the kernels' 512-swizzled order (module doc)."""
    *lead, d = stored.shape
    tiles = stored.reshape(*lead, LANES, d // SWIZZLE_TILE, SWIZZLE_TILE // LANES)  # [q, t, p]
    return jnp.moveaxis(tiles, -3, -1).reshape(*lead, d)  # [t, p, q]


def swizzle_512(natural):
    """Inverse of :func:`unswizzle_512`: the kernels' stored order of ``natural [..., D]``."""
    *lead, d = natural.shape
    tiles = natural.reshape(*lead, d // SWIZZLE_TILE, SWIZZLE_TILE // LANES, LANES)  # [t, p, q]
    return jnp.moveaxis(tiles, -1, -3).reshape(*lead, d)  # [q, t, p]


def quantize_activation(x, axis: int = -1):
    """float32 MX round trip of an activation along its contraction ``axis`` with the kernels' rule (module doc)."""
    return mx.mx_round_trip(x, axis=axis, emax_offset=KERNEL_EMAX_OFFSET)


def mx_matmul(activation, weight, dtype=None, quantized: bool = False):
    """``quantize_activation(activation) @ weight`` over K (the last axis of ``activation [..., K]``, ``weight
    [K, N]``), computed and returned in ``dtype`` (default: ``activation``'s) at HIGHEST precision; ``quantized``:
    the activation holds MX values already (the kernel multiplies its bytes as they are)."""
    dtype = activation.dtype if dtype is None else dtype
    activation = activation if quantized else quantize_activation(activation)
    return jnp.matmul(activation.astype(dtype), weight.astype(dtype), precision=lax.Precision.HIGHEST)
