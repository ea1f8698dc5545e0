"""``attention_tkg`` (catalog 1.3): the NKI decode (token-generation) attention subkernel.

Layouts (those of the kernel's tests and torch reference; its docstring disagrees, see the catalog): ``q
[B, H, s_a, d]``, ``k_active, v_active [B, 1, s_a, d]`` (one KV head per batch row: fold KV heads into ``B``),
``k_prior [B_cache, 1, d, S_full]`` (``tp_k_prior=False``) or ``[B_cache, 1, S_full, d]``, ``v_prior
[B_cache, 1, S_full, d]`` with ``B_cache >= B`` (rows past ``B`` are an unused buffer), ``mask [S_prior, B, H, s_a]``
(nonzero = attend), or ``[s_a, B, H, s_a]`` with ``use_pos_id``. ``S_prior`` = ``curr_sprior`` slots of the cache are
used. Outputs ``out [B, H, d, s_a]`` and, with ``fuse_rope``, ``k_out [B, 1, d, s_a]`` (the rotated active keys;
the kernel writes ``k_out`` only then, so without ``fuse_rope`` the function returns ``out`` alone).

Semantics (the torch reference's): the last ``s_a`` of the ``S_prior`` cache slots *are* the active tokens: the
kernel reads ``k_active``/``v_active`` there, whatever the cache holds (the cache itself is not updated). Scores
are ``q . k`` with **no 1/sqrt(d) scaling** unless ``fuse_rope``, which first rotates ``q`` and ``k_active`` (halves
RoPE with angles ``rope_pos_ids[b, i] * inv_freqs[j]``) and scales ``q`` by ``1/sqrt(d)``. ``sink [H, 1]`` adds
one softmax logit per head. With ``use_pos_id`` the mask is built in-kernel: slot ``s`` of the prior is visible
when ``s < rope_pos_ids[b, 0]`` (or, with ``start_pos_ids``, inside the per-query window ``[start, pos)``, which
wraps around when ``start > pos``), and the active tail is causal.

Numerics: float32 scores and softmax; probabilities rounded to the input dtype for ``P v``; rows that see nothing
give 0. A NaN in a query, in a key or value it sees, or in its sink makes its output NaN (never 0).

Slots no query of a row sees (stale cache memory past the row's length) do not influence the result here: their keys
and values are zeroed before the products. The kernel loads every one of the ``curr_sprior`` slots and masks only
the scores (masked scores are ``-inf``, ``nisa.tensor_copy_predicated``), so on Neuron their values still meet a
zero probability in the ``P v`` matmul: with IEEE arithmetic a NaN or inf there would reach the output (not verified
on Trainium). Position ids are compared with slot indices as numbers (``slot < rope_pos_ids[b, 0]``), as the kernel
does: a negative id shows no cache slot and an id past the cache shows all of them. A block-table entry that is not
a block of the pools (``>= N_blocks``, or negative for int32) makes the kernel's indirect K/V block loads fail
(they use ``oob_mode.error``); here that row's output is NaN, and ``jax_nkilib.config(runtime_checks=True)`` with
``jax.experimental.checkify`` reports it. The kernel never writes the cache.

Block KV cache: ``k_prior``/``v_prior`` are block pools ``[n_blocks_total, block_len, d]`` and
``active_blocks_table [B, n_blocks]`` lists each row's blocks in order (row ``b``'s flat cache is the concatenation
of its blocks, ``full_sprior = n_blocks * block_len``); it needs ``tp_k_prior=True`` (the kernel asserts it). With
``use_pos_id`` the mask is generated in-kernel and ``curr_sprior <= full_sprior``. A *given* mask must cover the
whole table (``S_prior = n_blocks * block_len``, as the kernel asserts) and, since the kernel asserts non-strided
MM1 for a block cache, needs ``strided_mm1=False``; its rows are in the kernel's block-cache tile-major order, the
one ``gen_mask_tkg_hbm(..., block_len=block_len)`` writes: row ``(fold * L + o) * 128 + p`` is slot ``fold * 128 *
L + p * L + o`` of the flat cache, where ``L`` is the kernel's resized block length (``gcd(block_len, S_prior /
(n * 128))``, ``n`` the programs ``S_prior`` is split over at the current LNC, further limited by flash-attention
tiling; see ``masks_tkg``). ``L`` depends on the LNC degree and on ``B``, ``H``, ``s_a`` (at LNC=2), so build the
mask under the same LNC and shapes; ``S_prior`` must be a multiple of ``n * 128``. The resize does not change which
slots a block holds: the block table and pools keep their meaning. With ``use_pos_id`` the device adapter passes
``strided_mm1=False`` for a block cache (the flag does not change the result). SBUF placement flags (``qk_in_sb``,
``k_out_in_sb``, ``out_in_sb``) cannot apply to a JAX call and raise ``ValueError``. The config fields that the shapes
determine (``bs``, ``q_head``, ``s_active``, ``full_sprior``, ``d_head``, and ``curr_sprior`` without
``use_pos_id``) may be given and must then match. Reverse mode differentiates this reference (there is no backward
kernel).
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.runtime_checks import check_all
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from .checks import head_dim_limit
from .gen_mask_tkg import natural_order, resized_block_len

SPRIOR_TILE = 128
POSITION_DTYPES = INT_DTYPES + (jnp.float32,)
MASK_DTYPES = (jnp.uint8, jnp.int8, jnp.int32, jnp.bool_, jnp.float32, jnp.bfloat16)


def _rotate_half(x, cos, sin):
    """Halves RoPE on the last axis: x * [cos, cos] + [-x2, x1] * [sin, sin]."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def _visible(mask, rope_pos_ids, start_pos_ids, *, use_pos_id, batch, heads, s_active, s_prior, block_len):
    """Boolean [B, H, s_a, S_prior]: may active query i of row b attend to cache slot s? (``block_len``: the resized
    block length of a given block-cache mask, else 0.)"""
    if not use_pos_id:
        return (natural_order(mask, block_len) if block_len else jnp.transpose(mask, (1, 2, 3, 0))) != 0
    slot = jnp.arange(s_prior)[None, None, :]
    ends = rope_pos_ids.astype(jnp.float32)[:, :, None]  # [B, s_a, 1]
    if start_pos_ids is None:
        prior = slot < ends[:, :1]  # slot < cache length of the row (its first position id)
    else:
        starts = start_pos_ids.astype(jnp.float32)[:, :, None]
        prior = jnp.where(starts <= ends, (slot >= starts) & (slot < ends), (slot >= starts) | (slot < ends))
    causal_tail = jnp.arange(s_active)[None, :] <= jnp.arange(s_active)[:, None]  # [i, j]: j <= i
    prior = jnp.broadcast_to(prior, (batch, s_active, s_prior)).at[:, :, s_prior - s_active :].set(causal_tail[None])
    return jnp.broadcast_to(prior[:, None], (batch, heads, s_active, s_prior))


def reference_attention_tkg(
    q,
    k_active,
    v_active,
    k_prior,
    v_prior,
    mask,
    inv_freqs=None,
    rope_pos_ids=None,
    start_pos_ids=None,
    sink=None,
    active_blocks_table=None,
    lnc=1,
    **cfg,
):
    """JAX reference of ``attention_tkg``: ``(out [B, H, d, s_a],)``, and ``k_out [B, 1, d, s_a]`` with fuse_rope."""
    batch, heads, s_active, d = q.shape
    s_prior = mask.shape[0] if not cfg["use_pos_id"] else cfg["curr_sprior"]
    mask_block_len = 0
    table_ok = None
    if active_blocks_table is not None:  # gather each row's blocks into a flat [B, 1, S_full, d] cache
        entry_ok = valid_block_entries(active_blocks_table, k_prior.shape[0])
        table_ok = jnp.all(entry_ok, axis=1)  # rows whose every block exists (the kernel loads them all)
        table = jnp.where(entry_ok, active_blocks_table, 0)
        k_prior, v_prior = (pool[table].reshape(batch, 1, -1, d) for pool in (k_prior, v_prior))
        if not cfg["use_pos_id"]:
            mask_block_len = resized_block_len(
                s_prior,
                cfg["block_len"],
                lnc=lnc,
                bs=batch,
                q_head=heads,
                s_active=s_active,
                fuse_rope=cfg["fuse_rope"],
                enable_fa_s_prior_tiling=cfg["enable_fa_s_prior_tiling"],
            )
    acc = jnp.promote_types(q.dtype, jnp.float32)
    queries, keys = q.astype(acc), k_active[:, 0].astype(acc)  # [B, H, s_a, d], [B, s_a, d]
    if cfg["fuse_rope"]:
        angles = rope_pos_ids.astype(acc)[:, :, None] * inv_freqs.astype(acc)[:, 0][None, None, :]
        cos, sin = jnp.cos(angles), jnp.sin(angles)  # [B, s_a, d/2]
        queries = _rotate_half(queries, cos[:, None], sin[:, None]) / math.sqrt(d)
        keys = _rotate_half(keys, cos, sin)
    cache_k = k_prior[:batch, 0]
    cache_k = (cache_k if cfg["tp_k_prior"] else jnp.swapaxes(cache_k, 1, 2))[:, :s_prior].astype(acc)
    cache_v = v_prior[:batch, 0, :s_prior].astype(acc)
    cache_k = cache_k.at[:, s_prior - s_active :].set(keys)
    cache_v = cache_v.at[:, s_prior - s_active :].set(v_active[:, 0].astype(acc))
    visible = _visible(
        mask,
        rope_pos_ids,
        start_pos_ids,
        use_pos_id=cfg["use_pos_id"],
        batch=batch,
        heads=heads,
        s_active=s_active,
        s_prior=s_prior,
        block_len=mask_block_len,
    )
    # slots no query of a row sees (stale cache memory past its length) must not reach it as 0 * NaN
    seen = jnp.any(visible, axis=(1, 2))[..., None]  # [B, S_prior, 1]
    cache_k, cache_v = jnp.where(seen, cache_k, 0.0), jnp.where(seen, cache_v, 0.0)
    scores = jnp.where(visible, jnp.einsum("bhid,bsd->bhis", queries, cache_k), -jnp.inf)
    row_max = scores.max(-1)
    if sink is not None:
        row_max = jnp.maximum(row_max, sink.astype(acc)[None, :, :])
    safe_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(scores - safe_max[..., None])
    total = weights.sum(-1)
    if sink is not None:
        total = total + jnp.exp(sink.astype(acc)[None, :, :] - safe_max)
    probs = weights / jnp.where(total == 0, 1.0, total)[..., None]  # a NaN total (e.g. a NaN sink) stays NaN
    out = jnp.einsum("bhis,bsd->bhdi", probs.astype(v_active.dtype).astype(acc), cache_v)
    if table_ok is not None:  # the kernel fails on a block index past the pools (oob_mode.error): NaN rows here
        out = jnp.where(table_ok[:, None, None, None], out, jnp.nan)
    out = out.astype(q.dtype)
    if not cfg["fuse_rope"]:
        return (out,)
    return out, jnp.swapaxes(keys, 1, 2)[:, None].astype(k_active.dtype)


def valid_block_entries(table, n_blocks: int):
    """Boolean like ``table``: which entries name one of the ``n_blocks`` blocks of the pools (int32 or uint32)."""
    return (table >= 0) & (table < n_blocks) if table.dtype != jnp.uint32 else table < jnp.uint32(n_blocks)


def _check(call: CallInfo) -> None:
    avals, dims, p, function = call.avals, call.dims, call.params, call.function
    present = {name for name, aval in avals.items() if aval is not None}
    block = "active_blocks_table" in present
    for name in ("k_prior", "v_prior"):
        if avals[name].ndim != (3 if block else 4):
            what = (
                f"a block KV cache needs `{name}` as a pool [N_blocks, blk, d] (active_blocks_table is given)"
                if block
                else f"`{name}` must be a flat cache of rank 4 (a rank-3 block pool [N_blocks, blk, d] "
                "needs active_blocks_table and block_len)"
            )
            raise ValueError(f"{function}: {what}; got shape {tuple(avals[name].shape)}")
    if block != bool(p["block_len"]) or (block and dims.get("blk") != p["block_len"]):
        raise ValueError(
            f"{function}: a block KV cache needs active_blocks_table and block_len equal to the pools' "
            f"block axis; got block_len={p['block_len']}, pools {tuple(avals['k_prior'].shape)}"
        )
    if block and not p["tp_k_prior"]:
        raise ValueError(f"{function}: a block KV cache needs tp_k_prior=True (pools [N_blocks, blk, d])")
    if block:
        dims = dict(dims, B_cache=dims["B"], S_full=dims["n_blocks"] * p["block_len"])
    if block and not p["use_pos_id"]:
        if p["strided_mm1"]:
            raise ValueError(
                f"{function}: a block KV cache with a given mask needs strided_mm1=False (the kernel "
                "asserts it; the mask is in the non-strided block order)"
            )
        if dims["S_prior"] != dims["S_full"]:
            raise ValueError(
                f"{function}: with a block KV cache the mask must cover all n_blocks * block_len = "
                f"{dims['S_full']} slots of the table (the kernel asserts it); got S_prior="
                f"{dims['S_prior']}"
            )
        resized_block_len(
            dims["S_prior"],
            p["block_len"],
            lnc=call.lnc,
            bs=dims["B"],
            q_head=dims["H"],
            s_active=dims["s_a"],
            enable_fa_s_prior_tiling=p["enable_fa_s_prior_tiling"],
            fuse_rope=p["fuse_rope"],
            function=function,
        )
    for flag in ("qk_in_sb", "k_out_in_sb", "out_in_sb"):
        if p[flag]:
            raise ValueError(
                f"{function}: `{flag}` places tensors in SBUF, which a JAX call cannot do; the device "
                "adapter handles SBUF placement"
            )
    if dims["B_cache"] < dims["B"]:
        raise ValueError(f"{function}: the cache batch B_cache={dims['B_cache']} is smaller than B={dims['B']}")
    if p["use_pos_id"]:
        if p["curr_sprior"] is None:
            raise ValueError(f"{function}: with use_pos_id the mask is [s_a, B, H, s_a], so give curr_sprior")
        s_prior = p["curr_sprior"]
    else:
        s_prior = dims["S_prior"]
        if p["curr_sprior"] not in (None, s_prior):
            raise ValueError(f"{function}: curr_sprior={p['curr_sprior']} does not match the mask's S_prior={s_prior}")
    if not dims["s_a"] <= s_prior <= dims["S_full"]:
        raise ValueError(
            f"{function}: need s_active <= curr_sprior <= full_sprior; got s_active={dims['s_a']}, "
            f"curr_sprior={s_prior}, full_sprior={dims['S_full']}"
        )
    if p["fuse_rope"] and not {"inv_freqs", "rope_pos_ids"} <= present:
        raise ValueError(f"{function}: fuse_rope needs inv_freqs [d/2, 1] and rope_pos_ids [B, s_a]")
    if p["use_pos_id"] and "rope_pos_ids" not in present:
        raise ValueError(f"{function}: use_pos_id needs rope_pos_ids [B, s_a]")
    if "start_pos_ids" in present and not p["use_pos_id"]:
        raise ValueError(f"{function}: start_pos_ids (sliding window) needs use_pos_id=True")


def _runtime_checks(call: CallInfo, operands) -> None:
    table = operands["active_blocks_table"]
    if table is not None:
        n_blocks = call.avals["k_prior"].shape[0]
        check_all(
            valid_block_entries(table, n_blocks),
            f"{call.function}: active_blocks_table entry (row, block) "
            f"{{index}} is {{}}, not a block of the pools (0 <= block < {n_blocks}); that row's output is NaN",
            table,
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, head_dim_limit(call)
    s_prior = call.params["curr_sprior"] if call.params["use_pos_id"] else dims["S_prior"]
    if s_prior % SPRIOR_TILE:
        unmet.append(f"curr_sprior={s_prior} must be a multiple of {SPRIOR_TILE}")
    return unmet


def _outputs(call: CallInfo):
    """``out [B, H, d, s_a]``, and with ``fuse_rope`` the rotated ``k_out [B, 1, d, s_a]``."""
    out = [("out", call.shape("B, H, d, s_a"), call.avals["q"].dtype)]
    if call.params["fuse_rope"]:
        out.append(("k_out", call.shape("B, 1, d, s_a"), call.avals["k_active"].dtype))
    return out


ATTENTION_TKG_SPEC = KernelSpec(
    reference_takes_lnc=True,
    name="attention_tkg",
    entry_point="jax_nkilib_kernels.attention:attention_tkg",
    operands=(
        Operand.of("q", "B, H, s_a, d"),
        Operand.of("k_active", "B, 1, s_a, d"),
        Operand.of("v_active", "B, 1, s_a, d"),
        Operand.switched(
            "k_prior",
            "tp_k_prior",
            {False: "B_cache, 1, d, S_full", True: ("B_cache, 1, S_full, d", "N_blocks, blk, d")},
        ),
        Operand.of("v_prior", "B_cache, 1, S_full, d", "N_blocks, blk, d"),
        Operand.switched(
            "mask", "use_pos_id", {False: "S_prior, B, H, s_a", True: "s_a, B, H, s_a"}, dtypes=MASK_DTYPES
        ),
        Operand.of("inv_freqs", "d/2, 1", optional=True),
        Operand.of("rope_pos_ids", "B, s_a", dtypes=POSITION_DTYPES, optional=True),
        Operand.of("start_pos_ids", "B, s_a", dtypes=POSITION_DTYPES, optional=True),
        Operand.of("sink", "H, 1", optional=True),
        Operand.of("active_blocks_table", "B, n_blocks", dtypes=(jnp.uint32, jnp.int32), optional=True),
    ),
    params=(
        Param("curr_sprior", None, int, "cache slots used; required with use_pos_id, else the mask's S_prior"),
        Param("block_len", 0, int),
        Param("tp_k_prior", False, bool),
        Param("strided_mm1", True, bool),
        Param("use_pos_id", False, bool),
        Param("fuse_rope", False, bool),
        Param("use_gpsimd_sb2sb", True, bool),
        Param("qk_in_sb", False, bool),
        Param("k_out_in_sb", False, bool),
        Param("out_in_sb", False, bool),
        Param("enable_fa_s_prior_tiling", True, bool),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_attention_tkg,
    check=_check,
    runtime_checks=_runtime_checks,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                "q": "B",
                "k_active": "B",
                "v_active": "B",
                "k_prior": "B_cache",
                "v_prior": "B_cache",
                "mask": "B",
                "rope_pos_ids": "B",
                "start_pos_ids": "B",
                "inv_freqs": None,
                "sink": None,
                "active_blocks_table": None,
            },
            outputs={"out": 0, "k_out": 0},
            when=lambda call: call.dims.get("B_cache") == call.dims["B"],
        ),
        FoldPlan(
            {
                "q": "B",
                "k_active": "B",
                "v_active": "B",
                "k_prior": None,
                "v_prior": None,
                "mask": "B",
                "rope_pos_ids": "B",
                "start_pos_ids": "B",
                "inv_freqs": None,
                "sink": None,
                "active_blocks_table": "B",
            },
            outputs={"out": 0, "k_out": 0},
            # a given block mask's order depends on B at LNC > 1: fold only where it cannot change
            when=lambda call: (
                call.avals.get("active_blocks_table") is not None and (call.params["use_pos_id"] or call.lnc == 1)
            ),
        ),
    ),
    derived_params=(
        ("bs", "B"),
        ("q_head", "H"),
        ("s_active", "s_a"),
        ("d_head", "d"),
        ("full_sprior", lambda call: call.dims.get("S_full") or call.dims["n_blocks"] * call.params["block_len"]),
    ),
    mac_count=lambda call: (
        2
        * call.dims["B"]
        * call.dims["H"]
        * call.dims["s_a"]
        * call.dims["d"]
        * call.dims.get("S_full", call.dims.get("n_blocks", 0) * call.params["block_len"])
    ),
    family="attention",
    catalog="1.3",
    support={
        "idiomatic": "decode_attention",
        "vjp": "JAX (differentiates the reference; no backward kernel)",
        "notes": "flat and block KV caches (a given block-cache mask is in the kernel's block order, which "
        "depends on the LNC degree); no 1/sqrt(d) unless fuse_rope; device adapter jax_nkilib_kernels/attention.py",
    },
)

attention_tkg = make_kernel(ATTENTION_TKG_SPEC, vjp=reference_vjp)
