"""Data-movement and elementwise kernels (layer 1): ``dynamic_elementwise_add`` and ``pad``."""
