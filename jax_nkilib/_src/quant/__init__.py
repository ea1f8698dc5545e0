"""Quantization formats shared by the NKI Library's quantized kernels (MX block scaling, FP8 packing)."""
