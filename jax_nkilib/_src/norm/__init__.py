"""Normalization and FP8 quantization kernels: ``rmsnorm_quant_kernel``, ``rmsnorm_tkg``, ``layernorm_tkg`` (layer 1)
and ``rms_norm``, ``layer_norm``, ``quantize_fp8``, ``dequantize_fp8`` (layer 2)."""
