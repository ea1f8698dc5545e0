"""Mixture-of-experts kernels of the NKI Library (catalog rows 10-12, 17-20, 28, 29, 36, 60, 61, 69-78, 81)."""
