"""The fused transformer-block kernels (layer 1): ``attention_block_tkg``, built on the attention, projection, norm
and RoPE references it fuses."""
