"""Mixture of experts: routing, the blockwise expert kernels and their references."""
