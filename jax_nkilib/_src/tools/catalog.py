"""Every kernel of the NKI Library catalog (``nkilib_catalog.md``, summary table), for the support matrix.

Each entry: catalog row, public function names, module family, the project issue that plans its binding
(``None`` where no issue covers it yet), and for a kernel that its issue left unbound, the reason.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
    row: int
    names: tuple[str, ...]
    family: str
    issue: int | None
    reason: str = ""


def _entries(rows):
    return tuple(CatalogEntry(row, tuple(names.split()), family, *rest) for row, names, family, *rest in rows)


_MX_MOE_DOCS = (
    "docs-only (absent from the local nki-library mirror), and no source defines its MXFP8 numerics: the newer "
    "torch references (experimental/moe_mxfp8/fwd/blockwise_mm_forward_mxfp8_torch.py, "
    "bwd/blockwise_mm_backward_mxfp8_torch.py) delegate to the bfloat16 MoE goldens (_generate_fwd_golden, "
    "blockwise_mm_bwd_torch_ref), stating that the quantization arguments are ignored, and their tests accept the "
    "kernel within a loose three-metric check (allclose with atol 50% of the golden's abs-max, cosine >= 0.99, "
    "normalized distance <= 0.70); the quantization lives only inside the kernels' generic_matmul_mxfp8_api calls, "
    "which the sources describe inconsistently (docstrings: activations stay bfloat16, only weights are MXFP8; the "
    "forward's gate/up phase quantizes the gathered hidden tile, with a wrapX or 1x32 swizzle chosen by load path "
    "and config; the backward sets a quant_scheme per phase), and the API changed after 2.32 (one config "
    "dataclass, gate_up [E, I_TP, 2, H] instead of [E, 2, I_TP, H], the forward's scaled-intermediate checkpoint "
    "dropped): binding it would guess the numerics"
)


CATALOG = _entries(
    [
        (1, "attention_cte", "attention", 3),
        (2, "attention_bwd", "attention", 3),
        (3, "attention_tkg", "attention", 3),
        (4, "gen_mask_tkg gen_mask_tkg_hbm", "attention", 3),
        (5, "cumsum", "scan", 16),
        (6, "RoPE", "rope", 2),
        (7, "rope_hf", "rope", 2),
        (8, "cascaded_max", "reduce", 14),
        (9, "mlp", "mlp", 4),
        (10, "moe_cte", "moe", 14),
        (11, "moe_tkg", "moe", 14),
        (12, "moe_block_tkg", "moe", 14),
        (13, "output_projection_cte", "projection", 4),
        (14, "output_projection_tkg", "projection", 4),
        (15, "qkv", "qkv", 4),
        (16, "rmsnorm_quant_kernel", "norm", 4),
        (17, "router_topk", "moe", 14),
        (18, "topk rotational_topk", "topk", 14),
        (19, "find_nonzero_indices", "moe", 14),
        (20, "indexed_flatten", "moe", 14),
        (21, "rmsnorm_tkg", "norm", 4),
        (22, "layernorm_tkg", "norm", 4),
        (23, "rmsnorm_mx_quantize_tkg", "norm", 4),
        (24, "attention_block_tkg", "transformer", 15),
        (25, "transformer_tkg", "transformer", 15),
        (26, "cross_entropy_forward", "loss", 16),
        (27, "cross_entropy_backward", "loss", 16),
        (28, "blockwise_mm_bwd", "moe", 14),
        (29, "blockwise_mm_baseline_shard_hidden", "moe", 14),
        (30, "conv1d", "conv", 17),
        (31, "depthwise_conv1d_implicit_gemm", "conv", 17),
        (32, "dynamic_elementwise_add", "elementwise", 16),
        (33, "fine_grained_allgather", "collectives", 5),
        (34, "allgather_compute_matmul", "collectives", 5),
        (35, "allgather_sb2sb allgather_sb2sb_tiled", "collectives", 5),
        (36, "topk_reduce", "moe", 14),
        (37, "find_nonzero_indices_with_count", "moe", 17),
        (38, "mxfp_load_performance_wrapper", "quant", 17),
        (39, "linear_scan", "scan", 17),
        (40, "selective_scan", "scan", 17),
        (41, "ssd", "scan", 17),
        (42, "ring_attention_spmd_fwd", "parallel", 5),
        (43, "ring_attention_spmd_bwd", "parallel", 5),
        (44, "ring_attention_unpermute", "parallel", 5),
        (45, "attention_segmented_cte", "attention", 3),
        (46, "attention_kv_parallel_segmented_cte", "attention", 3),
        (47, "attention_mxfp8_tkg", "attention", 3),
        (48, "swa_fused_cte", "attention", 3),
        (49, "qkv_mla_mx qkv_mla_mx_deepseek_v4", "mla", 17),
        (50, "mla_qkv_cte_kernel", "mla", 17),
        (51, "mla_sparse_attention_cte_kernel", "mla", 17),
        (52, "mla_vupmx_oproj_cte_kernel", "mla", 17),
        (53, "sparse_attention_indexer_mx_bf16score", "attention", 17),
        (54, "ms_deformable_attention", "attention", 17),
        (55, "ms_deformable_attention_bwd", "attention", 17),
        (56, "conv3d", "conv", 17),
        (57, "conv3d_temporal_unroll", "conv", 17),
        (
            58,
            "conv3d_transpose",
            "conv",
            17,
            "docs-only, and its source is in neither the mirror nor the public code index: the API reference does not "
            "say how the embedded conv3d core rounds the bias and activation, nor whether a padding above "
            "dilation * (K - 1) is accepted, and it takes an SbufManager (sbm); binding it would guess the numerics "
            "(jax_nkilib.conv runs lhs_dilation as lax)",
        ),
        (
            59,
            "all_reduce_hbm_kernel all_gather_hbm_kernel reduce_scatter_hbm_kernel all_to_all_hbm_kernel "
            "rank_id_kernel dma_copy_rank_id_kernel",
            "collectives",
            5,
        ),
        (60, "permute_a2av", "moe", 14),
        (61, "unpermute_a2av", "moe", 14),
        (62, "attn_q_batch_shard", "collectives", 5),
        (
            63,
            "add_scalar_kernel sub_scalar_kernel mul_scalar_kernel div_scalar_kernel add_tensor_kernel "
            "sub_tensor_kernel mul_tensor_kernel div_tensor_kernel addcdiv_kernel addcmul_kernel lerp_kernel "
            "sqrt_kernel",
            "foreach",
            16,
        ),
        (64, "l1_norm_kernel l2_norm_kernel linf_norm_kernel", "foreach", 16),
        (65, "matmul_mxfp8", "quant", 4),
        (66, "matmul_mxfp8_backward", "quant", 4),
        (67, "mlp_forward_mxfp8_nki", "mlp", 4),
        (68, "mlp_backward_mxfp8_nki", "mlp", 4),
        (69, "mx_moe_block_tkg_wrapper", "moe", 14),
        (
            70,
            "bwmm_shard_on_block",
            "moe",
            14,
            "docs-only (v2), and no source defines the trailing E columns of its accumulating [T, 2, H+E] output: "
            "in the newer public experimental/moe/moe_cte/bwmm_shard_on_block_v2.py, bwmm_output_initialization "
            "copies expert_affinities_masked rows into output[:, shard, H:H+E] only when the module flag "
            "FUSE_AFFINITY_INTO_OUTPUT is set, and it is False, so nothing writes those columns (uninitialized HBM; "
            "slot 1 is shard 1's partial sum, or unwritten with non_overlapping_shards); its torch reference "
            "(bwmm_shard_on_block_torch_ref -> core/moe/moe_cte/moe_cte_torch.py, BWMMFunc.SHARD_ON_BLOCK_V2) "
            "returns only [T+1, H], and test/integration/nkilib/experimental/moe/moe_cte/test_moe_cte_v2.py checks "
            "only output[:T, 0, :H] (test_moe_cte_common._shard_on_block_output_validator)",
        ),
        (71, "blockwise_mm_fwd_mxfp8", "moe", 14, _MX_MOE_DOCS),
        (72, "blockwise_mm_bwd_mxfp8", "moe", 14, _MX_MOE_DOCS),
        (73, "rmsnorm_router_topk_a2av", "moe", 14),
        (74, "rmsnorm_router_topk_tkg", "moe", 14),
        (75, "build_all2all_dispatch_metadata", "moe", 14),
        (76, "build_all_to_all_v_metadata", "moe", 14),
        (77, "argsort_unstable", "sort", 14),
        (78, "permute_routed_tokens", "moe", 14),
        (79, "gather", "indexing", 16),
        (80, "scatter_add", "indexing", 16),
        (81, "gpsimd_topk", "topk", 14),
        (82, "adam_kernel adamw_kernel", "optimizer", 16),
        (83, "pad", "elementwise", 16),
        (84, "quantize_block_mxfp8_kernel", "quant", 4),
        (
            85,
            "get_rng_state_gpsimd set_rng_state_gpsimd generate_random",
            "rng",
            16,
            "the kernels read and advance the GPSIMD engine's hidden RNG state, which needs an ordered "
            "effect, and the framework's primitives have none (no effectful abstract evaluation, no token threading "
            "in the reference or Neuron lowerings, no refusal under vmap); the Neuron custom call cannot take JAX's "
            "ordering token, so ordering get/set/generate on the device would rest on an optimization-barrier chain "
            "that neuronx-cc is not known to honour, and an off-Neuron reference needs state outside the program "
            "(a host callback, per device under shard_map)",
        ),
        (86, "static_quantization row_quantization pre_combine_dequant_scales", "quant", 4),
        (87, "rmsnorm_mx_prefill", "norm", 4),
    ]
)
