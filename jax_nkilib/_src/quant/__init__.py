"""Quantization (layer 1 and shared numerics): FP8 and MX formats (``fp8``, ``mx``), the FP8 tile helpers
(``fp8_quantize``), ``quantize_block_mxfp8_kernel``, ``matmul_mxfp8`` and its backward, and ``QuantizedWeight``."""
