"""Kernel-native API: one function per NKI Library kernel, with the kernel's name, argument order, layouts, flags
and semantics (see ``nkilib_catalog.md``). Outputs are returned instead of passed in."""

from jax_nkilib._src.attention.bwd import attention_bwd
from jax_nkilib._src.attention.cte import attention_cte
from jax_nkilib._src.attention.kv_parallel import attention_kv_parallel_segmented_cte
from jax_nkilib._src.attention.masks_tkg import gen_mask_tkg, gen_mask_tkg_hbm
from jax_nkilib._src.attention.mxfp8_tkg import attention_mxfp8_tkg
from jax_nkilib._src.attention.segmented import attention_segmented_cte
from jax_nkilib._src.attention.swa_fused import swa_fused_cte
from jax_nkilib._src.attention.tkg import attention_tkg
from jax_nkilib._src.common_types import (ActFnType, DtypeMode, MLPGateUpWeightLayout, NormType, QKVOutputLayout,
                                           QKVWeightLayout, QuantizationType)
from jax_nkilib._src.mlp.kernel import mlp
from jax_nkilib._src.mlp_mxfp8.backward import mlp_backward_mxfp8_nki
from jax_nkilib._src.mlp_mxfp8.forward import mlp_forward_mxfp8_nki
from jax_nkilib._src.norm.rmsnorm_quant import rmsnorm_quant_kernel
from jax_nkilib._src.norm.tkg import layernorm_tkg, rmsnorm_tkg
from jax_nkilib._src.projection.output_cte import output_projection_cte
from jax_nkilib._src.projection.output_tkg import output_projection_tkg
from jax_nkilib._src.projection.qkv import qkv
from jax_nkilib._src.quant.matmul_mxfp8 import matmul_mxfp8, matmul_mxfp8_backward
from jax_nkilib._src.quant.quantize_mxfp8 import quantize_block_mxfp8_kernel
from jax_nkilib._src.quant.rmsnorm_mx import rmsnorm_mx_quantize_tkg
from jax_nkilib._src.rope import RoPE, rope_hf

__all__ = [
    "ActFnType", "attention_bwd", "attention_cte", "attention_kv_parallel_segmented_cte", "attention_mxfp8_tkg",
    "attention_segmented_cte", "attention_tkg", "DtypeMode", "gen_mask_tkg", "gen_mask_tkg_hbm", "layernorm_tkg",
    "matmul_mxfp8", "matmul_mxfp8_backward", "mlp", "mlp_backward_mxfp8_nki", "mlp_forward_mxfp8_nki",
    "MLPGateUpWeightLayout", "NormType", "output_projection_cte", "output_projection_tkg", "qkv", "QKVOutputLayout",
    "QKVWeightLayout", "QuantizationType", "quantize_block_mxfp8_kernel", "rmsnorm_mx_quantize_tkg",
    "rmsnorm_quant_kernel", "rmsnorm_tkg", "RoPE", "rope_hf", "swa_fused_cte"
]
