"""The projection kernels around attention (layer 1): ``qkv`` (fused residual add, norm, QKV matmul, RoPE and
KV-cache write), ``output_projection_cte`` and ``output_projection_tkg``, with their references."""
