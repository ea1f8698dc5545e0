"""Fused multi-kernel blocks of the NKI Library (``experimental/transformer``): they compose the attention, MLP,
projection and norm kernels, so they sit above those families."""
