"""Fused multi-kernel blocks of the NKI Library (``experimental/transformer``): ``attention_block_tkg`` and
``transformer_tkg`` compose the attention, MLP, projection, norm and RoPE kernels, so they sit above those families."""
