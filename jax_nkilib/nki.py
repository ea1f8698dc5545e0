"""Kernel-native API: one function per NKI Library kernel, with the kernel's name, argument order, layouts, flags
and semantics (see ``nkilib_catalog.md``). Outputs are returned instead of passed in."""

from jax_nkilib._src.attention.bwd import attention_bwd
from jax_nkilib._src.attention.cte import attention_cte
from jax_nkilib._src.attention.masks_tkg import gen_mask_tkg, gen_mask_tkg_hbm
from jax_nkilib._src.attention.segmented import attention_segmented_cte
from jax_nkilib._src.attention.tkg import attention_tkg
from jax_nkilib._src.rope import RoPE, rope_hf

__all__ = ["RoPE", "attention_bwd", "attention_cte", "attention_segmented_cte", "attention_tkg", "gen_mask_tkg",
           "gen_mask_tkg_hbm", "rope_hf"]
