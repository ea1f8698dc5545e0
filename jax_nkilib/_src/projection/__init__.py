"""Projections around attention: ``qkv`` (fused residual add, norm, QKV matmul, RoPE and KV-cache write),
``output_projection_cte`` and ``output_projection_tkg`` (layer 1), and ``qkv_projection`` / ``output_projection``
(layer 2)."""
