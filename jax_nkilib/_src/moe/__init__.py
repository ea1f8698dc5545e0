"""The mixture-of-experts kernels (layer 1)."""
