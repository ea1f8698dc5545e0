"""Kernel-native API: one function per NKI Library kernel, with the kernel's name, argument order, layouts, flags
and semantics (see ``nkilib_catalog.md``). Outputs are returned instead of passed in."""

from jax_nkilib._src.attention.attention_bwd import attention_bwd
from jax_nkilib._src.attention.attention_cte import attention_cte
from jax_nkilib._src.attention.attention_kv_parallel import attention_kv_parallel_segmented_cte
from jax_nkilib._src.attention.attention_mxfp8_tkg import attention_mxfp8_tkg
from jax_nkilib._src.attention.attention_segmented_cte import attention_segmented_cte
from jax_nkilib._src.attention.attention_tkg import attention_tkg
from jax_nkilib._src.attention.gen_mask_tkg import gen_mask_tkg, gen_mask_tkg_hbm
from jax_nkilib._src.attention.mla_qkv_cte import mla_qkv_cte_kernel
from jax_nkilib._src.attention.mla_sparse_attention_cte import mla_sparse_attention_cte_kernel
from jax_nkilib._src.attention.mla_vupmx_oproj_cte import mla_vupmx_oproj_cte_kernel
from jax_nkilib._src.attention.ms_deformable_attention import ms_deformable_attention, ms_deformable_attention_bwd
from jax_nkilib._src.attention.qkv_mla_mx import qkv_mla_mx, qkv_mla_mx_deepseek_v4
from jax_nkilib._src.attention.ring_attention_bwd import ring_attention_spmd_bwd
from jax_nkilib._src.attention.ring_attention_fwd import ring_attention_spmd_fwd
from jax_nkilib._src.attention.ring_attention_unpermute import ring_attention_unpermute
from jax_nkilib._src.attention.sparse_attention_indexer import sparse_attention_indexer_mx_bf16score
from jax_nkilib._src.attention.swa_fused_cte import swa_fused_cte
from jax_nkilib._src.collectives.allgather import (
    allgather_compute_matmul,
    allgather_sb2sb,
    allgather_sb2sb_tiled,
    fine_grained_allgather,
)
from jax_nkilib._src.collectives.attn_q_batch_shard import AttnQBatchShardLayout, attn_q_batch_shard
from jax_nkilib._src.collectives.hbm_collectives import (
    all_gather_hbm_kernel,
    all_reduce_hbm_kernel,
    all_to_all_hbm_kernel,
    dma_copy_rank_id_kernel,
    rank_id_kernel,
    reduce_scatter_hbm_kernel,
)
from jax_nkilib._src.conv.conv1d import conv1d
from jax_nkilib._src.conv.conv3d import conv3d, conv3d_temporal_unroll
from jax_nkilib._src.conv.conv3d import should_use_temporal_unroll as should_use_temporal_unroll
from jax_nkilib._src.conv.depthwise_conv1d import depthwise_conv1d_implicit_gemm
from jax_nkilib._src.elementwise.dynamic_elementwise_add import dynamic_elementwise_add
from jax_nkilib._src.elementwise.pad import pad
from jax_nkilib._src.framework.common_types import (
    ActFnType,
    DtypeMode,
    ExpertAffinityScaleMode,
    MLPGateUpWeightLayout,
    NormType,
    QKVOutputLayout,
    QKVWeightLayout,
    QuantizationType,
    RouterActFnType,
)
from jax_nkilib._src.indexing.gather_scatter import gather, scatter_add
from jax_nkilib._src.loss.cross_entropy import cross_entropy_backward, cross_entropy_forward
from jax_nkilib._src.mlp.mlp import mlp
from jax_nkilib._src.mlp.mlp_backward_mxfp8 import mlp_backward_mxfp8_nki
from jax_nkilib._src.mlp.mlp_forward_mxfp8 import mlp_forward_mxfp8_nki
from jax_nkilib._src.moe.a2av import permute_a2av, unpermute_a2av
from jax_nkilib._src.moe.blockwise_mm_bwd import (
    AffinityOption,
    ClampLimits,
    KernelTypeOption,
    ShardOption,
    blockwise_mm_bwd,
)
from jax_nkilib._src.moe.bwmm_shard_on_h import blockwise_mm_baseline_shard_hidden
from jax_nkilib._src.moe.cascaded_max import cascaded_max
from jax_nkilib._src.moe.dispatch_metadata import build_all2all_dispatch_metadata, build_all_to_all_v_metadata
from jax_nkilib._src.moe.find_nonzero_with_count import find_nonzero_indices_with_count
from jax_nkilib._src.moe.moe_block_tkg import moe_block_tkg
from jax_nkilib._src.moe.moe_cte import moe_cte
from jax_nkilib._src.moe.moe_cte_config import (
    BlockShardStrategy,
    MoECTEImplementation,
    MoECTESpec,
    ShardOnBlockConfig,
    ShardOnIConfig,
    SkipMode,
)
from jax_nkilib._src.moe.moe_tkg import moe_tkg
from jax_nkilib._src.moe.mx_moe_block_tkg_wrapper import mx_moe_block_tkg_wrapper
from jax_nkilib._src.moe.permute_routed_tokens import permute_routed_tokens
from jax_nkilib._src.moe.rmsnorm_router_topk import rmsnorm_router_topk_a2av, rmsnorm_router_topk_tkg
from jax_nkilib._src.moe.router_topk import router_topk
from jax_nkilib._src.moe.subkernels import argsort_unstable, find_nonzero_indices, indexed_flatten
from jax_nkilib._src.moe.topk import (
    GpsimdTopkConfig,
    RotationalTopkConfig,
    SupportedTopkMethods,
    gpsimd_topk,
    rotational_topk,
    topk,
)
from jax_nkilib._src.moe.topk_reduce import topk_reduce
from jax_nkilib._src.norm.layernorm_tkg import layernorm_tkg
from jax_nkilib._src.norm.rmsnorm_mx_prefill import rmsnorm_mx_prefill
from jax_nkilib._src.norm.rmsnorm_mx_quantize_tkg import rmsnorm_mx_quantize_tkg
from jax_nkilib._src.norm.rmsnorm_quant import rmsnorm_quant_kernel
from jax_nkilib._src.norm.rmsnorm_tkg import rmsnorm_tkg
from jax_nkilib._src.optim.foreach import (
    add_scalar_kernel,
    add_tensor_kernel,
    addcdiv_kernel,
    addcmul_kernel,
    div_scalar_kernel,
    div_tensor_kernel,
    l1_norm_kernel,
    l2_norm_kernel,
    lerp_kernel,
    linf_norm_kernel,
    mul_scalar_kernel,
    mul_tensor_kernel,
    sqrt_kernel,
    sub_scalar_kernel,
    sub_tensor_kernel,
)
from jax_nkilib._src.optim.fused_adam import adam_kernel, adamw_kernel
from jax_nkilib._src.projection.output_projection_cte import output_projection_cte
from jax_nkilib._src.projection.output_projection_tkg import output_projection_tkg
from jax_nkilib._src.projection.qkv import qkv
from jax_nkilib._src.quant.fp8_quantize import pre_combine_dequant_scales, row_quantization, static_quantization
from jax_nkilib._src.quant.matmul_mxfp8 import matmul_mxfp8, matmul_mxfp8_backward
from jax_nkilib._src.quant.mxfp_load import mxfp_load_performance_wrapper
from jax_nkilib._src.quant.quantize_block_mxfp8 import quantize_block_mxfp8_kernel
from jax_nkilib._src.rope.rope import RoPE, rope_hf
from jax_nkilib._src.scan.cumsum import cumsum
from jax_nkilib._src.scan.linear_scan import linear_scan
from jax_nkilib._src.scan.selective_scan import selective_scan
from jax_nkilib._src.scan.ssd import ssd
from jax_nkilib._src.transformer.attention_block_tkg import attention_block_tkg
from jax_nkilib._src.transformer.transformer_tkg import transformer_tkg

__all__ = [
    "adam_kernel",
    "adamw_kernel",
    "add_scalar_kernel",
    "sub_scalar_kernel",
    "mul_scalar_kernel",
    "div_scalar_kernel",
    "add_tensor_kernel",
    "sub_tensor_kernel",
    "mul_tensor_kernel",
    "div_tensor_kernel",
    "addcdiv_kernel",
    "addcmul_kernel",
    "lerp_kernel",
    "sqrt_kernel",
    "l1_norm_kernel",
    "l2_norm_kernel",
    "linf_norm_kernel",
    "ActFnType",
    "AffinityOption",
    "all_gather_hbm_kernel",
    "all_reduce_hbm_kernel",
    "all_to_all_hbm_kernel",
    "allgather_compute_matmul",
    "allgather_sb2sb",
    "allgather_sb2sb_tiled",
    "argsort_unstable",
    "attention_block_tkg",
    "attention_bwd",
    "attention_cte",
    "attention_kv_parallel_segmented_cte",
    "attention_mxfp8_tkg",
    "mla_qkv_cte_kernel",
    "mla_sparse_attention_cte_kernel",
    "qkv_mla_mx",
    "qkv_mla_mx_deepseek_v4",
    "mla_vupmx_oproj_cte_kernel",
    "sparse_attention_indexer_mx_bf16score",
    "attention_segmented_cte",
    "attention_tkg",
    "attn_q_batch_shard",
    "blockwise_mm_baseline_shard_hidden",
    "blockwise_mm_bwd",
    "BlockShardStrategy",
    "ClampLimits",
    "cumsum",
    "conv1d",
    "conv3d",
    "conv3d_temporal_unroll",
    "depthwise_conv1d_implicit_gemm",
    "linear_scan",
    "selective_scan",
    "ssd",
    "build_all2all_dispatch_metadata",
    "build_all_to_all_v_metadata",
    "AttnQBatchShardLayout",
    "cascaded_max",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "dma_copy_rank_id_kernel",
    "DtypeMode",
    "dynamic_elementwise_add",
    "ExpertAffinityScaleMode",
    "fine_grained_allgather",
    "find_nonzero_indices",
    "find_nonzero_indices_with_count",
    "gather",
    "gen_mask_tkg",
    "gen_mask_tkg_hbm",
    "KernelTypeOption",
    "gpsimd_topk",
    "GpsimdTopkConfig",
    "indexed_flatten",
    "layernorm_tkg",
    "matmul_mxfp8",
    "matmul_mxfp8_backward",
    "mlp",
    "ms_deformable_attention",
    "ms_deformable_attention_bwd",
    "mlp_backward_mxfp8_nki",
    "mlp_forward_mxfp8_nki",
    "mxfp_load_performance_wrapper",
    "MoECTEImplementation",
    "MoECTESpec",
    "moe_cte",
    "moe_block_tkg",
    "moe_tkg",
    "mx_moe_block_tkg_wrapper",
    "MLPGateUpWeightLayout",
    "NormType",
    "output_projection_cte",
    "output_projection_tkg",
    "pad",
    "permute_a2av",
    "permute_routed_tokens",
    "pre_combine_dequant_scales",
    "qkv",
    "QKVOutputLayout",
    "QKVWeightLayout",
    "QuantizationType",
    "quantize_block_mxfp8_kernel",
    "rank_id_kernel",
    "reduce_scatter_hbm_kernel",
    "ring_attention_spmd_bwd",
    "ring_attention_spmd_fwd",
    "ring_attention_unpermute",
    "rmsnorm_mx_prefill",
    "rmsnorm_mx_quantize_tkg",
    "rmsnorm_quant_kernel",
    "rmsnorm_router_topk_a2av",
    "rmsnorm_router_topk_tkg",
    "rmsnorm_tkg",
    "RoPE",
    "rope_hf",
    "rotational_topk",
    "RotationalTopkConfig",
    "router_topk",
    "RouterActFnType",
    "row_quantization",
    "scatter_add",
    "ShardOnBlockConfig",
    "ShardOnIConfig",
    "ShardOption",
    "SkipMode",
    "static_quantization",
    "SupportedTopkMethods",
    "swa_fused_cte",
    "unpermute_a2av",
    "topk_reduce",
    "topk",
    "transformer_tkg",
]
