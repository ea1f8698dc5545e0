"""``gen_mask_tkg_hbm`` (catalog 1.4): the decode attention mask, in the kernel's tiled HBM order.

Inputs: ``pos_ids_hbm [1, bs * s_active]`` position ids (row ``b``'s queries at ``b * s_active + i``),
``start_pos_hbm [1, bs * s_active]`` optional sliding-window starts, ``active_mask [s_active, bs, q_head, s_active]``
optional visibility of active key ``j`` for query ``i`` (``active_mask[j, b, h, i]``).

Mask (the torch reference's): cache slot ``k`` is visible to query ``i`` of row ``b`` when ``k < pos_ids[b, 0]`` (the
row's cache length), or with ``start_pos_hbm`` when ``k`` lies in ``[start, pos)`` (wrapping around when
``start > pos``); ``active_mask``, if given, overrides the last ``s_active`` slots. The ``[bs, q_head, s_active,
s_prior]`` result is stored as ``[s_prior, bs, q_head, s_active]`` float32 (1 = visible) in the tile-major order the
kernel writes: output row ``f * 128 + p`` holds the slot at SBUF position ``(p, f)`` of the attention kernel's K
tiles. For a flat cache (``block_len=0``, strided MM1) that is slot ``p * (s_prior / 128) + f``.

Block KV cache (``block_len > 0``): the attention kernel puts 128 blocks of ``L`` slots per fold on the partitions,
so slot ``k = fold * 128 * L + p * L + o`` (``o < L``) sits at ``(p, fold * L + o)`` and output row
``(fold * L + o) * 128 + p`` holds it. ``L`` is the kernel's *resized* block length (its
``resize_cache_block_len_for_attention_tkg_kernel``, :func:`resized_block_len`): ``L = gcd(block_len, s_prior /
(n * 128))`` with ``n`` the programs ``s_prior`` is split over, and with flash-attention tiling
(``enable_fa_s_prior_tiling`` and ``s_prior / n > 8192``) ``L`` also divides ``64`` and ``(s_prior / n mod 8192) /
128``. ``n`` is 1 at LNC=1; at LNC=2 it is 2 when ``s_prior >= 256`` and the batch is not split instead (the batch
is split when ``bs`` is even, and ``bs * q_head * s_active > 128`` or ``s_prior <= 256``; ``attention_tkg`` with
``fuse_rope`` never splits the batch, but ``gen_mask_tkg_hbm``, which has no such flag, resizes as without it). So
``L`` depends on the LNC degree (``jax_nkilib.config(lnc=...)``) and the shapes: build a block mask and consume it
(``attention_tkg`` with ``active_blocks_table``) under the same LNC and shapes. ``s_prior`` must be a multiple of
``block_len`` and of ``n * 128``.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel
from ..framework.spec import INT_DTYPES, CallInfo, KernelSpec, Operand, Output, Param
from .checks import require_params

FA_TILE = 8192  # the kernels' flash-attention s_prior tile (and threshold)
_POSITIONS = INT_DTYPES + (jnp.float32,)
_MASK_VALUES = (jnp.uint8, jnp.int32, jnp.float32, jnp.bool_)


def natural_mask(pos_ids, start_pos, active_mask, *, bs, q_head, s_active, s_ctx, batch_start=0):
    """The visibility mask ``[bs, q_head, s_active, s_ctx]`` float32 of the kernels' torch references.

    Slot ``k`` is visible to query ``i`` of row ``b`` when ``k < pos_ids[0, b * s_active]`` (the row's cache
    length), or with ``start_pos`` when ``k`` lies in ``[start, pos)`` of that query (wrapping around when
    ``start > pos``). ``active_mask [s_active, bs_full, q_head, s_active]`` (from row ``batch_start``) overrides the
    last ``s_active`` slots.
    """
    slots = jnp.arange(s_ctx, dtype=jnp.float32)[None, None, :]
    ends = pos_ids[0, : bs * s_active].astype(jnp.float32).reshape(bs, s_active, 1)
    if start_pos is None:
        visible = jnp.broadcast_to(slots < ends[:, :1], (bs, s_active, s_ctx))
    else:
        starts = start_pos[0, : bs * s_active].astype(jnp.float32).reshape(bs, s_active, 1)
        visible = jnp.where(starts <= ends, (slots >= starts) & (slots < ends), (slots >= starts) | (slots < ends))
    mask = jnp.broadcast_to(visible[:, None].astype(jnp.float32), (bs, q_head, s_active, s_ctx))
    if active_mask is not None:
        rows = active_mask[:, batch_start : batch_start + bs].astype(jnp.float32)
        mask = mask.at[..., s_ctx - s_active :].set(jnp.transpose(rows, (1, 2, 3, 0)))  # [bs, q_head, i, j]
    return mask


def kernel_tiles(mask, n_tiles: int, *, block_len: int = 0, strided_mm1: bool = True):
    """``[bs, q_head, s_active, n_tiles * 128]`` to the kernels' SBUF order ``[128, n_tiles, bs, q_head, s_active]``.

    Slot ``k`` goes to ``(p, f) = (k // n_tiles, k % n_tiles)`` (strided MM1), ``(k % 128, k // 128)`` (not
    strided), or, for a block cache, ``k = fold * block_len * 128 + p * block_len + offset`` to
    ``(p, fold * block_len + offset)``.
    """
    bs, q_head, s_active, _ = mask.shape
    if block_len > 0:
        folded = mask.reshape(bs, q_head, s_active, n_tiles // block_len, PARTITIONS, block_len)
        return jnp.transpose(folded, (4, 3, 5, 0, 1, 2)).reshape(PARTITIONS, n_tiles, bs, q_head, s_active)
    if strided_mm1:
        return jnp.transpose(mask.reshape(bs, q_head, s_active, PARTITIONS, n_tiles), (3, 4, 0, 1, 2))
    return jnp.transpose(mask.reshape(bs, q_head, s_active, n_tiles, PARTITIONS), (4, 3, 0, 1, 2))


def sprior_programs(*, lnc: int, bs: int, q_head: int, s_active: int, s_prior: int, fuse_rope: bool = False) -> int:
    """How many programs the TKG kernels split ``s_prior`` over: 2 at LNC=2 unless the batch is split instead."""
    if lnc < 2:
        return 1
    batch_split = not fuse_rope and bs % 2 == 0 and (bs * q_head * s_active > PARTITIONS or s_prior <= 2 * PARTITIONS)
    return lnc if not batch_split and s_prior >= 2 * PARTITIONS else 1


def resized_block_len(
    s_prior: int,
    block_len: int,
    *,
    lnc: int,
    bs: int,
    q_head: int,
    s_active: int,
    enable_fa_s_prior_tiling: bool = True,
    fuse_rope: bool = False,
    function: str = "",
) -> int:
    """The block length ``L`` the TKG kernels use for a block cache (see the module docstring); ``ValueError`` when
    ``s_prior`` is not a multiple of ``block_len`` and of the ``n * 128`` slots the kernel needs."""
    programs = sprior_programs(lnc=lnc, bs=bs, q_head=q_head, s_active=s_active, s_prior=s_prior, fuse_rope=fuse_rope)
    if s_prior % block_len or s_prior % (programs * PARTITIONS):
        raise ValueError(
            f"{function}: a block KV cache needs s_prior={s_prior} to be a multiple of block_len="
            f"{block_len} and of {programs * PARTITIONS} (128 per program it is split over at LNC={lnc})"
        )
    divisor = s_prior // (programs * PARTITIONS)
    per_program = s_prior // programs
    if enable_fa_s_prior_tiling and per_program > FA_TILE:  # each flash-attention tile holds whole folds
        divisor = math.gcd(divisor, FA_TILE // PARTITIONS, (per_program % FA_TILE) // PARTITIONS)
    return math.gcd(block_len, divisor)


def block_order(mask, block_len: int):
    """Natural ``[bs, q_head, s_active, s_prior]`` to the block-cache tile-major rows ``[s_prior, bs, q_head,
    s_active]`` for the resized block length ``block_len`` (row ``(fold * L + o) * 128 + p`` <- slot ``fold * 128 * L
    + p * L + o``)."""
    bs, q_head, s_active, s_prior = mask.shape
    tiles = kernel_tiles(mask, s_prior // PARTITIONS, block_len=block_len)  # [128, n_tiles, ...]
    return jnp.swapaxes(tiles, 0, 1).reshape(s_prior, bs, q_head, s_active)


def natural_order(rows, block_len: int):
    """Inverse of :func:`block_order`: block-cache rows ``[s_prior, bs, q_head, s_active]`` to natural
    ``[bs, q_head, s_active, s_prior]``."""
    s_prior, bs, q_head, s_active = rows.shape
    folded = rows.reshape(s_prior // (block_len * PARTITIONS), block_len, PARTITIONS, bs, q_head, s_active)
    return jnp.transpose(folded, (3, 4, 5, 0, 2, 1)).reshape(bs, q_head, s_active, s_prior)


def reference_gen_mask_tkg_hbm(
    pos_ids_hbm,
    start_pos_hbm=None,
    active_mask=None,
    *,
    bs,
    q_head,
    s_active,
    s_prior,
    block_len=0,
    enable_fa_s_prior_tiling=True,
    lnc=1,
):
    """JAX reference of ``gen_mask_tkg_hbm``: ``[s_prior, bs, q_head, s_active]`` float32 in tile-major order."""
    mask = natural_mask(pos_ids_hbm, start_pos_hbm, active_mask, bs=bs, q_head=q_head, s_active=s_active, s_ctx=s_prior)
    if block_len:
        resized = resized_block_len(
            s_prior,
            block_len,
            lnc=lnc,
            bs=bs,
            q_head=q_head,
            s_active=s_active,
            enable_fa_s_prior_tiling=enable_fa_s_prior_tiling,
        )
        return (block_order(mask, resized),)
    tiled = jnp.swapaxes(kernel_tiles(mask, s_prior // PARTITIONS), 0, 1)  # tile-major rows: t * 128 + p
    return (tiled.reshape(s_prior, bs, q_head, s_active),)


def _check_hbm(call: CallInfo) -> None:
    p, dims, function = call.params, call.dims, call.function
    require_params(call, ("bs", "q_head", "s_active", "s_prior"), positive=True)
    if dims["BS"] != p["bs"] * p["s_active"]:
        raise ValueError(
            f"{function}: `pos_ids_hbm` must be [1, bs * s_active] = [1, {p['bs'] * p['s_active']}]; "
            f"got [1, {dims['BS']}]"
        )
    if p["s_prior"] % PARTITIONS or p["s_prior"] < p["s_active"]:
        raise ValueError(
            f"{function}: s_prior must be a multiple of {PARTITIONS} and at least s_active; got s_prior={p['s_prior']}"
        )
    if p["block_len"] < 0:
        raise ValueError(f"{function}: block_len must be 0 (flat cache) or positive; got {p['block_len']}")
    if p["block_len"]:
        resized_block_len(
            p["s_prior"],
            p["block_len"],
            lnc=call.lnc,
            bs=p["bs"],
            q_head=p["q_head"],
            s_active=p["s_active"],
            enable_fa_s_prior_tiling=p["enable_fa_s_prior_tiling"],
            function=function,
        )
    active = call.avals.get("active_mask")
    if active is not None and tuple(active.shape) != (p["s_active"], p["bs"], p["q_head"], p["s_active"]):
        raise ValueError(
            f"{function}: `active_mask` must be [s_active, bs, q_head, s_active] = "
            f"{(p['s_active'], p['bs'], p['q_head'], p['s_active'])}; got {tuple(active.shape)}"
        )


GEN_MASK_TKG_HBM_SPEC = KernelSpec(
    reference_takes_lnc=True,
    name="gen_mask_tkg_hbm",
    entry_point="nkilib.core.attention.gen_mask_tkg:gen_mask_tkg_hbm",
    operands=(
        Operand.of("pos_ids_hbm", "1, BS", dtypes=_POSITIONS),
        Operand.of("start_pos_hbm", "1, BS", dtypes=_POSITIONS, optional=True),
        Operand.of("active_mask", "s_a, b, h, s_a", dtypes=_MASK_VALUES, optional=True),
    ),
    params=(
        *(Param(name, None, int, required=True) for name in ("bs", "q_head", "s_active", "s_prior")),
        Param("block_len", 0, int),
        Param("enable_fa_s_prior_tiling", True, bool),
    ),
    outputs=(Output.of("mask", "s_prior, bs, q_head, s_active", "float32"),),
    reference=reference_gen_mask_tkg_hbm,
    check=_check_hbm,
    family="attention",
    catalog="1.4",
    support={
        "idiomatic": "",
        "vjp": "not differentiable (a mask)",
        "notes": "flat and block KV caches; output rows in the kernel's tile-major order; the block order uses "
        "the kernel's resized block length, which depends on the LNC degree",
    },
)

gen_mask_tkg_hbm = make_kernel(GEN_MASK_TKG_HBM_SPEC)


# ------------------------------------------------------------------------------------------------ gen_mask_tkg
def reference_gen_mask_tkg(
    pos_ids,
    start_pos=None,
    active_mask=None,
    *,
    bs,
    q_head,
    s_active,
    is_s_prior_sharded,
    s_prior_per_shard,
    n_sprior_tile,
    s_prior_offset=0,
    block_len=0,
    strided_mm1=True,
    is_batch_sharded=False,
    batch_offset=0,
    n_sprior_tile_total=0,
):
    """JAX reference of the ``gen_mask_tkg`` subkernel on program 0: ``[128, n_sprior_tile, bs, q_head, s_active]``.

    ``block_len`` is used as given: the subkernel does not resize it (its callers pass the already resized length
    :func:`resized_block_len`). With ``block_len > 0`` the block placement applies whatever ``strided_mm1`` (newer
    library versions assert ``strided_mm1=False`` there; the device adapter passes False).
    """
    del is_s_prior_sharded, is_batch_sharded, n_sprior_tile_total  # program 0: no shard offsets (checked)
    mask = natural_mask(
        pos_ids,
        start_pos,
        active_mask,
        bs=bs,
        q_head=q_head,
        s_active=s_active,
        s_ctx=s_prior_per_shard,
        batch_start=batch_offset,
    )
    window = mask[..., s_prior_offset : s_prior_offset + n_sprior_tile * PARTITIONS]
    return (kernel_tiles(window, n_sprior_tile, block_len=block_len, strided_mm1=strided_mm1),)


def _check_subkernel(call: CallInfo) -> None:
    p, dims, function = call.params, call.dims, call.function
    require_params(call, ("bs", "q_head", "s_active", "s_prior_per_shard", "n_sprior_tile"), positive=True)
    if dims["BS"] < p["bs"] * p["s_active"]:
        raise ValueError(
            f"{function}: `pos_ids` must have at least bs * s_active = {p['bs'] * p['s_active']} "
            f"columns; got {dims['BS']}"
        )
    end = p["s_prior_offset"] + p["n_sprior_tile"] * PARTITIONS
    if end > p["s_prior_per_shard"] or p["s_prior_offset"] < 0:
        raise ValueError(
            f"{function}: the tile window [{p['s_prior_offset']}, {end}) exceeds s_prior_per_shard="
            f"{p['s_prior_per_shard']}"
        )
    if p["block_len"] and p["n_sprior_tile"] % p["block_len"]:
        raise ValueError(
            f"{function}: n_sprior_tile={p['n_sprior_tile']} must be a multiple of block_len={p['block_len']}"
        )
    if p["n_sprior_tile_total"] not in (0, p["n_sprior_tile"]):
        raise ValueError(
            f"{function}: a flash-attention-tiled strided layout (n_sprior_tile_total="
            f"{p['n_sprior_tile_total']} != n_sprior_tile) is not bound yet"
        )
    if call.lnc > 1 and (p["is_s_prior_sharded"] or p["is_batch_sharded"]):
        raise ValueError(
            f"{function}: with LNC={call.lnc} each program writes its own SBUF shard of the mask, which "
            "a single JAX output cannot represent; bind it at LNC=1"
        )


GEN_MASK_TKG_SPEC = KernelSpec(
    name="gen_mask_tkg",
    entry_point="jax_nkilib_kernels.attention:gen_mask_tkg",
    operands=(
        Operand.of("pos_ids", "P, BS", dtypes=_POSITIONS),
        Operand.of("start_pos", "P, BS", dtypes=_POSITIONS, optional=True),
        Operand.of("active_mask", "s_a, b_full, h, s_a", dtypes=_MASK_VALUES, optional=True),
    ),
    params=(
        Param("bs", None, int),
        Param("q_head", None, int),
        Param("s_active", None, int),
        Param("is_s_prior_sharded", False, bool),
        Param("s_prior_per_shard", None, int),
        Param("n_sprior_tile", None, int, "tiles of 128 slots in the output (the shape of the kernel's mask_out)"),
        Param("s_prior_offset", 0, int),
        Param("block_len", 0, int),
        Param("strided_mm1", True, bool),
        Param("is_batch_sharded", False, bool),
        Param("batch_offset", 0, int),
        Param("n_sprior_tile_total", 0, int),
    ),
    outputs=(Output.of("mask_out", "128, n_sprior_tile, bs, q_head, s_active", "float32"),),
    reference=reference_gen_mask_tkg,
    check=_check_subkernel,
    family="attention",
    catalog="1.4",
    support={
        "idiomatic": "",
        "vjp": "not differentiable (a mask)",
        "notes": "SBUF subkernel bound through an HBM adapter; program 0 / LNC=1 semantics; mask_out's shape "
        "is the n_sprior_tile param",
    },
)

gen_mask_tkg = make_kernel(GEN_MASK_TKG_SPEC)
