"""The MX operands of ``sparse_attention_indexer_mx_bf16score`` (``precision="MX"``), decoded to the float32 values
its projections multiply: the weights by :func:`..quant.mx_weights.decode_weight`, the query here (layouts from
the newer nki-library source: the kernel's docstring, the test helpers ``_quantize_weight_for_mx`` /
``_swizzle_and_quantize_x_for_mx`` and the torch reference's ``_dequant_swizzled_qr``).

* Weights ``wq_b [Q/4, H*D]``, ``wk [dim/4, D]``: ``float8_e4m3fn_x4`` words (uint32), lane ``j`` of word ``[g, n]``
  is ``W[4g + j, n]`` (contraction rows). Scales (uint8 e8m0, value ``2**(s - 127)``): native ``[K/32, N]``, one per
  32 contraction rows of a column; or, with ``compact_scales``, DeepSeek's checkpoint layout ``[K/128, ceil(N/128)]``,
  one per 128 x 128 block (broadcast to the native blocks in the kernel).
* The compressed query ``qr_qtz_hbm [St, 128, Q/512, 128]`` (uint32 x4 words, ``St = ceil(B*S / 128)`` row tiles,
  rows past ``B*S`` padding) with ``qr_scale_hbm`` of the same shape (uint8): lane ``h`` of word ``[t, j, c, s]`` is
  ``qr[128 t + s, 512 c + 4 j + h]``; the scale of that element is at row ``(i // 4) * 32 + i % 4`` (``i = j // 8``,
  the 4 scale rows of each 32-partition quadrant) and column ``[c, s]``: one scale per 32 consecutive ``qr``
  elements of a row.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..quant import mx
from ..quant.mx_weights import LANES

PARTITIONS = 128
QR_TILE = PARTITIONS * LANES  # 512 qr columns per word column block


def decode_qr(words, scales, rows: int):
    """float32 ``qr [rows, Q]`` of the swizzled ``qr_qtz_hbm`` words and ``qr_scale_hbm`` (module doc)."""
    tiles, _, blocks, _ = words.shape
    dense = mx.scales_from_quadrants(scales.reshape(tiles, PARTITIONS, blocks * PARTITIONS))  # [St, 16, Qt*128]
    dense = dense.reshape(tiles, PARTITIONS // mx.BLOCK_PARTITIONS, blocks, PARTITIONS)
    lanes = mx.decode_x4_weight(jnp.moveaxis(words, 1, 0), jnp.moveaxis(dense, 1, 0))  # [128 j, St, Qt, 128 s, 4 h]
    qr = jnp.transpose(lanes, (1, 3, 2, 0, 4))  # [St, s, Qt, j, h]: qr[128 t + s, 512 c + 4 j + h]
    return qr.reshape(tiles * PARTITIONS, blocks * QR_TILE)[:rows]
