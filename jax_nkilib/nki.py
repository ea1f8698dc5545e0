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
from jax_nkilib._src.rope import RoPE, rope_hf

__all__ = [
    "ActFnType", "attention_bwd", "attention_cte", "attention_kv_parallel_segmented_cte", "attention_mxfp8_tkg",
    "attention_segmented_cte", "attention_tkg", "DtypeMode", "gen_mask_tkg", "gen_mask_tkg_hbm",
    "MLPGateUpWeightLayout", "NormType", "QKVOutputLayout", "QKVWeightLayout", "QuantizationType", "RoPE",
    "rope_hf", "swa_fused_cte"
]
