"""SPMD algorithms as shard_map bodies (ring attention, collective matmuls) and the collective kernels."""
