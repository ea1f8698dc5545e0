"""Mixture-of-experts kernels (blockwise MoE forward/backward, routing metadata, token generation)."""
