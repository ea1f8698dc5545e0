"""``gen_mask_tkg_hbm`` (catalog 1.4): the decode attention mask, in the kernel's tiled HBM order (flat cache).

Inputs: ``pos_ids_hbm [1, bs * s_active]`` position ids (row ``b``'s queries at ``b * s_active + i``),
``start_pos_hbm [1, bs * s_active]`` optional sliding-window starts, ``active_mask [s_active, bs, q_head, s_active]``
optional visibility of active key ``j`` for query ``i`` (``active_mask[j, b, h, i]``).

Mask (the torch reference's): cache slot ``k`` is visible to query ``i`` of row ``b`` when ``k < pos_ids[b, 0]`` (the
row's cache length), or with ``start_pos_hbm`` when ``k`` lies in ``[start, pos)`` (wrapping around when
``start > pos``); ``active_mask``, if given, overrides the last ``s_active`` slots. The ``[bs, q_head, s_active,
s_prior]`` result is stored in the layout the strided attention kernel loads: output row ``t * 128 + p`` holds slot
``p * (s_prior / 128) + t``, as ``[s_prior, bs, q_head, s_active]`` float32 (1 = visible).

``s_prior`` must be a multiple of 128. The block KV cache layout (``block_len > 0``) is not bound yet.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.primitive import make_kernel
from ..framework.spec import INT_DTYPES, CallInfo, KernelSpec, Operand, Output, Param

P_MAX = 128
_POSITIONS = INT_DTYPES + (jnp.float32,)


def reference_gen_mask_tkg_hbm(pos_ids_hbm, start_pos_hbm=None, active_mask=None, *, bs, q_head, s_active, s_prior,
                               block_len=0, enable_fa_s_prior_tiling=True, fuse_rope=False):
    """JAX reference of ``gen_mask_tkg_hbm`` for a flat cache: ``[s_prior, bs, q_head, s_active]`` float32."""
    del block_len, enable_fa_s_prior_tiling, fuse_rope  # flat cache only; no effect on the mask values
    slots = jnp.arange(s_prior, dtype=jnp.float32)[None, None, :]
    ends = pos_ids_hbm[0, : bs * s_active].astype(jnp.float32).reshape(bs, s_active, 1)
    if start_pos_hbm is None:
        visible = jnp.broadcast_to(slots < ends[:, :1], (bs, s_active, s_prior))
    else:
        starts = start_pos_hbm[0, : bs * s_active].astype(jnp.float32).reshape(bs, s_active, 1)
        visible = jnp.where(starts <= ends, (slots >= starts) & (slots < ends), (slots >= starts) | (slots < ends))
    mask = jnp.broadcast_to(visible[:, None].astype(jnp.float32), (bs, q_head, s_active, s_prior))
    if active_mask is not None:
        tail = jnp.transpose(active_mask[:, :bs].astype(jnp.float32), (1, 2, 3, 0))  # [bs, q_head, i, j]
        mask = mask.at[..., s_prior - s_active:].set(tail)
    tiles = s_prior // P_MAX  # slot p * tiles + t goes to row t * 128 + p
    tiled = jnp.transpose(mask.reshape(bs, q_head, s_active, P_MAX, tiles), (4, 3, 0, 1, 2))
    return (tiled.reshape(s_prior, bs, q_head, s_active),)


def _check(call: CallInfo) -> None:
    p, dims, function = call.params, call.dims, call.function
    for name in ("bs", "q_head", "s_active", "s_prior"):
        if p[name] is None or p[name] <= 0:
            raise ValueError(f"{function}: `{name}` is required and must be positive; got {p[name]!r}")
    if dims["BS"] != p["bs"] * p["s_active"]:
        raise ValueError(f"{function}: `pos_ids_hbm` must be [1, bs * s_active] = [1, {p['bs'] * p['s_active']}]; "
                         f"got [1, {dims['BS']}]")
    if p["s_prior"] % P_MAX or p["s_prior"] < p["s_active"]:
        raise ValueError(f"{function}: s_prior must be a multiple of {P_MAX} and at least s_active; got "
                         f"s_prior={p['s_prior']}")
    if p["block_len"]:
        raise ValueError(f"{function}: the block KV cache mask (block_len > 0) is not bound yet in jax_nkilib")
    active = call.avals.get("active_mask")
    if active is not None and tuple(active.shape) != (p["s_active"], p["bs"], p["q_head"], p["s_active"]):
        raise ValueError(f"{function}: `active_mask` must be [s_active, bs, q_head, s_active] = "
                         f"{(p['s_active'], p['bs'], p['q_head'], p['s_active'])}; got {tuple(active.shape)}")


GEN_MASK_TKG_HBM_SPEC = KernelSpec(
    name="gen_mask_tkg_hbm",
    entry_point="nkilib.core.attention.gen_mask_tkg:gen_mask_tkg_hbm",
    operands=(
        Operand.of("pos_ids_hbm", "1, BS", dtypes=_POSITIONS),
        Operand.of("start_pos_hbm", "1, BS", dtypes=_POSITIONS, optional=True),
        Operand.of("active_mask", "s_a, b, h, s_a", dtypes=(jnp.uint8, jnp.int32, jnp.float32, jnp.bool_),
                   optional=True),
    ),
    params=(
        Param("bs", None, int), Param("q_head", None, int), Param("s_active", None, int), Param("s_prior", None, int),
        Param("block_len", 0, int), Param("enable_fa_s_prior_tiling", True, bool), Param("fuse_rope", False, bool),
    ),
    outputs=(Output.of("mask", "s_prior, bs, q_head, s_active", "float32"),),
    reference=reference_gen_mask_tkg_hbm,
    check=_check,
    family="attention",
    catalog="1.4",
    support={"idiomatic": "", "vjp": "not differentiable (a mask)",
             "notes": "flat cache; output rows in the strided kernel's tiled order; block_len > 0 not bound yet"},
)

gen_mask_tkg_hbm = make_kernel(GEN_MASK_TKG_HBM_SPEC)
