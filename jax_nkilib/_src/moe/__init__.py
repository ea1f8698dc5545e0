"""Mixture of experts: routing, the blockwise and decode expert kernels, the all-to-all dispatch, their references."""
