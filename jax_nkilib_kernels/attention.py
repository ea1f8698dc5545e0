"""Adapters for the NKI Library's attention subkernels (``nkilib.core.attention``).

``attention_cte`` and ``attention_bwd`` are HBM-in/HBM-out ``@nki.jit`` kernels and need no adapter.
``attention_tkg`` and ``gen_mask_tkg`` are subkernels. ``attention_tkg`` takes its outputs, an ``AttnTKGConfig``
and an SBUF manager, and (without ``fuse_rope``) wants ``q``/``k_active`` already in SBUF. Its adapter builds the
config from the shapes,
stages ``q``/``k_active`` in SBUF in the kernel's ``[d, B*H*s_a]`` / ``[d, B*s_a]`` layouts, allocates the HBM
outputs and calls the library; ``gen_mask_tkg`` writes its mask into SBUF, which the adapter stores to HBM. For a block
KV cache both pass ``strided_mm1=False``, which the library asserts there (it does not change their results). Not yet
run on Trainium by this project: check them on a trn2 instance.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from jax_nkilib_kernels._library import load

_library_attention_tkg = load("core.attention.attention_tkg", "attention_tkg")
AttnTKGConfig = load("core.attention.attention_tkg_utils", "AttnTKGConfig")
_library_gen_mask_tkg = load("core.attention.gen_mask_tkg", "gen_mask_tkg")
SbufManager = load("core.utils.allocator", "SbufManager")
Logger = load("core.utils.logging", "Logger")
# SBUF the adapters hand the subkernels: the whole partition minus 16 KiB left for compiler-allocated tiles, as the
# library's own test_attention_tkg.py builds its SbufManager(0, total_available_sbuf_size - 16 * 1024, Logger("SBM"))
SBUF_RESERVED_FOR_COMPILER = 16 * 1024


def _sbuf_manager(name):
    return SbufManager(0, nl.tile_size.total_available_sbuf_size - SBUF_RESERVED_FOR_COMPILER, Logger(name))


@nki.jit
def attention_tkg(
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
    curr_sprior=None,
    block_len=0,
    tp_k_prior=False,
    strided_mm1=True,
    use_pos_id=False,
    fuse_rope=False,
    use_gpsimd_sb2sb=True,
    qk_in_sb=False,
    k_out_in_sb=False,
    out_in_sb=False,
    enable_fa_s_prior_tiling=True,
):
    """``out [B, H, d, s_a]`` (and ``k_out [B, 1, d, s_a]`` with fuse_rope) for q [B, H, s_a, d]."""
    batch, heads, s_active, d_head = q.shape
    # a block cache's flat length is its blocks per row times the block length
    full_sprior = active_blocks_table.shape[1] * block_len if active_blocks_table is not None else v_prior.shape[2]
    cfg = AttnTKGConfig(
        bs=batch,
        q_head=heads,
        s_active=s_active,
        curr_sprior=curr_sprior if use_pos_id else mask.shape[0],
        full_sprior=full_sprior,
        d_head=d_head,
        block_len=block_len,
        tp_k_prior=tp_k_prior,
        strided_mm1=strided_mm1 and active_blocks_table is None,
        use_pos_id=use_pos_id,
        fuse_rope=fuse_rope,
        use_gpsimd_sb2sb=use_gpsimd_sb2sb,
        qk_in_sb=not fuse_rope,
        k_out_in_sb=False,
        out_in_sb=False,
        enable_fa_s_prior_tiling=enable_fa_s_prior_tiling,
    )
    out = nl.ndarray((batch, heads, d_head, s_active), dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = None  # the kernel writes the rotated keys only with fuse_rope
    if fuse_rope:
        k_out = nl.ndarray((batch, 1, d_head, s_active), dtype=k_active.dtype, buffer=nl.shared_hbm)
    sbm = _sbuf_manager("attention_tkg")
    if not fuse_rope:  # the kernel asserts q and k in SBUF, [d, B*H*s_a] and [d, B*s_a]
        q_sb = nl.ndarray((d_head, batch * heads * s_active), dtype=q.dtype, buffer=nl.sbuf)
        k_sb = nl.ndarray((d_head, batch * s_active), dtype=k_active.dtype, buffer=nl.sbuf)
        nisa.dma_copy(
            dst=q_sb,
            src=q.reshape((batch * heads * s_active, d_head)).ap(
                pattern=[[1, d_head], [d_head, batch * heads * s_active]], offset=0
            ),
        )
        nisa.dma_copy(
            dst=k_sb,
            src=k_active.reshape((batch * s_active, d_head)).ap(
                pattern=[[1, d_head], [d_head, batch * s_active]], offset=0
            ),
        )
        q, k_active = q_sb, k_sb
    _library_attention_tkg(
        q,
        k_active,
        v_active,
        k_prior,
        v_prior,
        mask,
        out,
        cfg,
        sbm,
        inv_freqs=inv_freqs,
        rope_pos_ids=rope_pos_ids,
        start_pos_ids=start_pos_ids,
        sink=sink,
        active_blocks_table=active_blocks_table,
        k_out=k_out,
    )
    return (out, k_out) if fuse_rope else out


@nki.jit
def gen_mask_tkg(
    pos_ids,
    start_pos=None,
    active_mask=None,
    bs=None,
    q_head=None,
    s_active=None,
    is_s_prior_sharded=False,
    s_prior_per_shard=None,
    n_sprior_tile=None,
    s_prior_offset=0,
    block_len=0,
    strided_mm1=True,
    is_batch_sharded=False,
    batch_offset=0,
    n_sprior_tile_total=0,
):
    """``mask_out [128, n_sprior_tile, bs, q_head, s_active]`` in HBM from the SBUF subkernel ``gen_mask_tkg``."""
    p_max = pos_ids.shape[0]
    pos_sb = nl.ndarray(pos_ids.shape, dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=pos_sb, src=pos_ids)
    start_sb = None
    if start_pos is not None:
        start_sb = nl.ndarray(start_pos.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=start_sb, src=start_pos)
    mask_sb = nl.ndarray((p_max, n_sprior_tile, bs, q_head, s_active), dtype=nl.float32, buffer=nl.sbuf)
    sbm = _sbuf_manager("gen_mask_tkg")
    _library_gen_mask_tkg(
        pos_sb,
        mask_sb,
        bs,
        q_head,
        s_active,
        is_s_prior_sharded,
        s_prior_per_shard,
        start_pos=start_sb,
        s_prior_offset=s_prior_offset,
        block_len=block_len,
        strided_mm1=strided_mm1 and not block_len,
        active_mask=active_mask,
        sbm=sbm,
        is_batch_sharded=is_batch_sharded,
        batch_offset=batch_offset,
        n_sprior_tile_total=n_sprior_tile_total,
    )
    mask_out = nl.ndarray((p_max, n_sprior_tile, bs, q_head, s_active), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=mask_out, src=mask_sb)
    return mask_out
