"""The normalization kernels (layer 1): ``rmsnorm_tkg``, ``layernorm_tkg``, ``rmsnorm_quant_kernel`` (RMSNorm + FP8),
``rmsnorm_mx_quantize_tkg`` and ``rmsnorm_mx_prefill`` (RMSNorm + MXFP8), and the norm the projection and MLP kernels
fuse (``fused_norm``)."""
