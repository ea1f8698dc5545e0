"""The math of ``rmsnorm_mx_prefill`` (catalog row 87) in ``jnp``, following its torch reference
(``rmsnorm_mx_prefill_torch.py``: ``rmsnorm_mx_prefill_torch_ref``, ``reference_mx_dequant``,
``decode_packed_output``, ``swizzle_h_index``).

Names: ``T = B*S`` tokens, ``H`` hidden (a multiple of 512), ``n512 = H/512``, ``E`` experts, ``cd`` the compute
dtype (``router_weights``' dtype with a router, else ``hidden_states``' dtype).

Norm (float32, float64 for float64 inputs)::

    x    = hidden (natural H order; de-interleaved when hidden_interleaved)      [+ residual, rounded to hidden's dtype]
    r    = rsqrt(sum_h x^2 / unpadded_hidden_size + eps)
    norm = x * r * gamma
    y    = cd(norm)                                         # what is quantized and routed

Packed row (bytes, ``[T, H + scale_region]``): bytes ``0..H-1`` are the float8_e4m3fn elements of ``y`` in natural H
order; one e8m0 scale per 32 consecutive H (block ``b = 16 k + g`` of H512 tile ``k``) with the "alternative emax"
of the reference (scale ``clip(E - 7, 0, 255)``, ``E`` the block's largest float32 biased exponent; elements
``fp8(clip(y * 2**(134 - E), +-448))``; see :mod:`.mx`). The scale of block ``(k, g)`` sits at byte ``H + (k // 4) *
128 + (g // 4) * 32 + (k % 4) * 4 + g % 4`` with ``pack_scales`` (4 H512 tiles folded per 128 bytes,
``scale_region = ceil(n512 / 4) * 128``), else at ``H + k * 128 + (g // 4) * 32 + g % 4`` (``scale_region = n512 *
128``). The other scale bytes are never written by the kernel (undefined); here they are 0.

Router weights: SIGMOID / SOFTMAX take rows in the kernel's swizzle order (row ``s = 128 t + p``, ``t = 4 k + q``,
holds natural row ``k*512 + 4 p + q``); NOAUX_TC takes those rows partition-major (row ``p * H/128 + t`` holds
swizzled row ``128 t + p``), the layout its kernel loads contiguously. SIGMOID / SOFTMAX::

    logits = y @ W_natural (+ router_bias)                    # float32 accumulation
    expert_index = the top_k logits' experts, descending; equal logits: the lower expert first
    affinity = sigmoid(top logits) or softmax over the top_k logits, float32, stored bfloat16 in a dense [T, E]
               (zero outside the selected experts)

NOAUX_TC (group-limited, DeepSeek-V3 style; ``router_bias`` selects only; float32 throughout)::

    scores  = sigmoid(y @ W_natural);  choice = scores + router_bias
    group g score = sum of the 2 largest choice values of its E/n_group experts (a missing second value is -30000)
    keep the topk_group best groups; masked = choice - 30000 outside them
    selected = the top_k experts by masked (equal values: the lower index first)
    affinity = scores * onehot(selected) * (routed_scaling_factor / (sum of the selected scores + 1e-20)), dense [T, E]

``pack_affinities``: the affinities' bytes (bfloat16, float32 for NOAUX_TC) follow the scale region in the row, which
is zero-padded to a multiple of 4 bytes; the row is then returned viewed as the affinity dtype (little-endian).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.hardware import PARTITIONS
from ..framework.spec import accumulation_dtype
from ..quant import mx

P = PARTITIONS
H_BLOCK = 512  # hidden elements per H512 tile (128 partitions x 4 lanes)
Q_WIDTH = 4
SCALES_PER_TILE = H_BLOCK // mx.BLOCK_SIZE  # 16 MX blocks per H512 tile
TILES_PER_FOLD = 4  # H512 tiles folded into one 128-byte scale block when pack_scales
ELEMENT_DTYPE = jnp.float8_e4m3fn
AFFINITY_DTYPE = jnp.bfloat16
NOAUX_AFFINITY_DTYPE = jnp.float32
NOAUX_SENTINEL = 30000.0  # the kernel's finite "-inf" for masked groups and experts


def scale_region(h: int, pack_scales: bool) -> int:
    """Bytes of scales per packed row."""
    tiles = h // H_BLOCK
    return -(-tiles // TILES_PER_FOLD) * P if pack_scales else tiles * P


def packed_row_bytes(h: int, pack_scales: bool, affinity_bytes: int = 0) -> int:
    """Bytes per packed row: ``H + scale_region``, plus the affinity bytes, rounded up to a multiple of 4."""
    row = h + scale_region(h, pack_scales)
    if affinity_bytes:
        row = -(-(row + affinity_bytes) // Q_WIDTH) * Q_WIDTH
    return row


@functools.cache
def scale_columns(h: int, pack_scales: bool) -> np.ndarray:
    """numpy int ``[H // 32]``: the scale-region byte of MX block ``b`` (the 32 hidden values ``32 b .. 32 b + 31``)."""
    block = np.arange(h // mx.BLOCK_SIZE)
    tile, g = block // SCALES_PER_TILE, block % SCALES_PER_TILE
    within = (g // 4) * mx.QUADRANT + g % 4
    if pack_scales:
        return (tile // TILES_PER_FOLD) * P + (tile % TILES_PER_FOLD) * Q_WIDTH + within
    return tile * P + within


@functools.cache
def swizzle_h_index(h: int) -> np.ndarray:
    """numpy int ``[H]``: the natural hidden index held by swizzled router-weight row ``s`` (``W_perm = W[index]``)."""
    tile = np.arange(h // H_BLOCK).reshape(-1, 1, 1)
    q = np.arange(Q_WIDTH).reshape(1, -1, 1)
    p = np.arange(P).reshape(1, 1, -1)
    return (tile * H_BLOCK + Q_WIDTH * p + q).reshape(-1)


@functools.cache
def router_h_index(h: int, partition_major: bool) -> np.ndarray:
    """numpy int ``[H]``: the natural hidden index held by router-weight row ``r`` (NOAUX_TC: ``partition_major``)."""
    index = swizzle_h_index(h)
    if not partition_major:
        return index
    tiles = h // P
    return index.reshape(tiles, P).T.reshape(-1)  # row p * tiles + t holds swizzled row 128 t + p


def deinterleave(x):
    """``[..., H]`` in the 4-way interleaved order (``stored[q H/4 + p] = natural[4 p + q]``) -> natural order."""
    h = x.shape[-1]
    return jnp.swapaxes(x.reshape(*x.shape[:-1], Q_WIDTH, h // Q_WIDTH), -1, -2).reshape(x.shape)


def interleave(x):
    """Inverse of :func:`deinterleave`."""
    h = x.shape[-1]
    return jnp.swapaxes(x.reshape(*x.shape[:-1], h // Q_WIDTH, Q_WIDTH), -1, -2).reshape(x.shape)


def prenorm_sum(hidden_states, residual, *, rounded: bool):
    """``[T, H]`` in the inputs' H order: ``hidden (+ residual)``; the sum rounded to hidden's dtype if ``rounded``."""
    t = hidden_states.shape[0] * hidden_states.shape[1]
    wide = accumulation_dtype(hidden_states.dtype)
    x = hidden_states.reshape(t, -1).astype(wide)
    if residual is not None:
        x = x + residual.reshape(t, -1).astype(wide)
        if rounded:
            x = x.astype(hidden_states.dtype).astype(wide)
    return x


def normalized(x, gamma, *, eps: float, unpadded_hidden_size: int | None, hidden_interleaved: bool):
    """``x * rsqrt(sum x^2 / unpadded_hidden_size + eps) * gamma`` in natural H order (``x`` from
    :func:`prenorm_sum`)."""
    natural = deinterleave(x) if hidden_interleaved else x
    count = unpadded_hidden_size or x.shape[-1]
    ss = jnp.sum(natural * natural, axis=-1, keepdims=True)
    inv_rms = jax.lax.rsqrt(ss / jnp.asarray(count, x.dtype) + jnp.asarray(eps, x.dtype))
    return natural * inv_rms * gamma.reshape(1, -1).astype(x.dtype)


def quantized_row_bytes(y, pack_scales: bool):
    """uint8 ``[T, H + scale_region]``: the fp8 elements of ``y [T, H]`` and their scales (see the module doc)."""
    t, h = y.shape
    elements, scales = mx.quantize_mx_along(
        y, axis=-1, dtype=ELEMENT_DTYPE, block=mx.BLOCK_SIZE, emax_offset=mx.ALT_EMAX_OFFSET
    )
    region = jnp.zeros((t, scale_region(h, pack_scales)), jnp.uint8)
    region = region.at[:, scale_columns(h, pack_scales)].set(scales)
    return jnp.concatenate([jax.lax.bitcast_convert_type(elements, jnp.uint8), region], axis=-1)


def router_logits(y, router_weights, *, partition_major: bool):
    """float32 (float64 for float64 ``y``) ``y @ W_natural`` of the compute-dtype activations ``y [T, H]``."""
    natural = jnp.take(router_weights, np.argsort(router_h_index(y.shape[-1], partition_major)), axis=0)
    wide = accumulation_dtype(y.dtype)
    return jnp.matmul(y.astype(wide), natural.astype(wide), precision=jax.lax.Precision.HIGHEST)


def _scatter(index, values, experts: int):
    """Dense ``[T, E]`` with ``values [T, k]`` at ``index [T, k]`` (distinct per row), zero elsewhere."""
    return jnp.sum(jax.nn.one_hot(index, experts, dtype=values.dtype) * values[..., None], axis=-2)


def router_topk(y, router_weights, router_bias, *, top_k: int, softmax: bool):
    """``(expert_index [T, top_k] int32, affinities [T, E] float32)``: SIGMOID / SOFTMAX (module doc)."""
    logits = router_logits(y, router_weights, partition_major=False)
    if router_bias is not None:
        logits = logits + router_bias.reshape(1, -1).astype(logits.dtype)
    top, index = jax.lax.top_k(logits, top_k)  # equal values: the lower index first
    weights = jax.nn.softmax(top, axis=-1) if softmax else jax.nn.sigmoid(top)
    return index.astype(jnp.int32), _scatter(index, weights, logits.shape[-1])


def router_noaux_tc(
    y, router_weights, router_bias, *, top_k: int, n_group: int, topk_group: int, routed_scaling_factor: float
):
    """float32 affinities ``[T, E]``: NOAUX_TC (module doc)."""
    logits = router_logits(y, router_weights, partition_major=True)
    t, e = logits.shape
    scores = jax.nn.sigmoid(logits)
    choice = scores + router_bias.reshape(1, -1).astype(scores.dtype)
    groups = choice.reshape(t, n_group, e // n_group)
    if groups.shape[-1] < 2:
        groups = jnp.pad(groups, ((0, 0), (0, 0), (0, 1)), constant_values=-NOAUX_SENTINEL)
    group_score = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [T, n_group]
    _, kept = jax.lax.top_k(group_score, topk_group)
    group_mask = jnp.sum(jax.nn.one_hot(kept, n_group, dtype=scores.dtype), axis=-2)  # [T, n_group]
    expert_mask = jnp.repeat(group_mask, e // n_group, axis=-1)
    masked = choice + (expert_mask - 1) * NOAUX_SENTINEL
    _, selected = jax.lax.top_k(masked, top_k)
    gathered = _scatter(selected, jnp.take_along_axis(scores, selected, axis=-1), e)
    scale = (1.0 / (jnp.sum(gathered, axis=-1, keepdims=True) + 1e-20)) * routed_scaling_factor
    return gathered * scale


def with_affinities(row_bytes, affinities):
    """The packed row with ``affinities [T, E]`` (in their dtype) appended, padded to a multiple of 4 bytes, viewed
    as that dtype ``[T, R / itemsize]``."""
    t, size = row_bytes.shape[0], affinities.dtype.itemsize
    tail = jax.lax.bitcast_convert_type(affinities, jnp.uint8).reshape(t, -1)
    row = jnp.concatenate([row_bytes, tail], axis=-1)
    row = jnp.pad(row, ((0, 0), (0, -row.shape[-1] % Q_WIDTH)))
    return jax.lax.bitcast_convert_type(row.reshape(t, -1, size), affinities.dtype)
