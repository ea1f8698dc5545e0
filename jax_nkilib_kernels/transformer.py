"""Adapter for the NKI Library's fused decode attention block (``nkilib.experimental.transformer.attention_block_tkg``).

The library function takes about forty arguments with no defaults (absent tensors must be passed as ``None``), its
enums as the library's ``QuantizationType`` members and its replica group as an ``nki.collectives.ReplicaGroup``.
This adapter gives every optional tensor a ``None`` default, maps the enum names jax_nkilib passes to the library's
members, builds the replica group from the rank lists, pins ``out_in_sb=False`` (outputs in HBM) and leaves ``sbm``
to the kernel (auto-allocated). With ``update_cache=True`` the kernel writes the new tokens into ``K_cache`` and
``V_cache`` and returns them, so the custom call aliases them. Not yet run on Trainium by this project.
"""

import nki

from jax_nkilib_kernels._library import body, load

_library_attention_block_tkg = load("experimental.transformer.attention_block_tkg", "attention_block_tkg")
QuantizationType = load("core.utils.common_types", "QuantizationType")


def _replica_group(rank_lists):
    if rank_lists is None:
        return None
    from nki.collectives import ReplicaGroup

    return ReplicaGroup([list(ranks) for ranks in rank_lists])


@nki.jit
def attention_block_tkg(
    X,
    W_qkv,
    K_cache,
    V_cache,
    attention_mask,
    rmsnorm_X_gamma=None,
    bias_qkv=None,
    weight_dequant_scale_qkv=None,
    input_dequant_scale_qkv=None,
    rmsnorm_QK_pre_rope_W_Q=None,
    rmsnorm_QK_pre_rope_W_K=None,
    cos=None,
    sin=None,
    rmsnorm_QK_post_rope_W_Q=None,
    rmsnorm_QK_post_rope_W_K=None,
    active_blocks_table=None,
    sink=None,
    kv_cache_update_idx=None,
    W_out=None,
    bias_out=None,
    weight_dequant_scale_out=None,
    input_dequant_scale_out=None,
    k_scale=None,
    v_scale=None,
    X_hidden_dim_actual=None,
    rmsnorm_X_enabled=False,
    rmsnorm_X_eps=None,
    quantization_type_qkv="NONE",
    rmsnorm_QK_pre_rope_enabled=False,
    rmsnorm_QK_pre_rope_eps=1e-6,
    rope_contiguous_layout=True,
    rmsnorm_QK_post_rope_enabled=False,
    rmsnorm_QK_post_rope_eps=1e-6,
    K_cache_transposed=False,
    update_cache=False,
    quantization_type_out="NONE",
    transposed_out=False,
    out_in_sb=False,
    softmax_scale=None,
    enable_fa_s_prior_tiling=True,
    skip_attention=False,
    KVDP=1,
    KVDP_replica_group=None,
):
    """``(out, K_out, V_out)`` of the library kernel, every output in HBM."""
    return body(_library_attention_block_tkg)(
        X,
        X_hidden_dim_actual,
        rmsnorm_X_enabled,
        rmsnorm_X_eps,
        rmsnorm_X_gamma,
        W_qkv,
        bias_qkv,
        QuantizationType[quantization_type_qkv],
        weight_dequant_scale_qkv,
        input_dequant_scale_qkv,
        rmsnorm_QK_pre_rope_enabled,
        rmsnorm_QK_pre_rope_eps,
        rmsnorm_QK_pre_rope_W_Q,
        rmsnorm_QK_pre_rope_W_K,
        cos,
        sin,
        rope_contiguous_layout,
        rmsnorm_QK_post_rope_enabled,
        rmsnorm_QK_post_rope_eps,
        rmsnorm_QK_post_rope_W_Q,
        rmsnorm_QK_post_rope_W_K,
        K_cache_transposed,
        active_blocks_table,
        K_cache,
        V_cache,
        attention_mask,
        sink,
        update_cache,
        kv_cache_update_idx,
        W_out,
        bias_out,
        QuantizationType[quantization_type_out],
        weight_dequant_scale_out,
        input_dequant_scale_out,
        transposed_out,
        False,  # out_in_sb: outputs stay in HBM (the spec refuses True)
        softmax_scale=softmax_scale,
        enable_fa_s_prior_tiling=enable_fa_s_prior_tiling,
        k_scale=k_scale,
        v_scale=v_scale,
        skip_attention=skip_attention,
        KVDP=KVDP,
        KVDP_replica_group=_replica_group(KVDP_replica_group),
    )
