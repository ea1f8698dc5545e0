"""Sharding: automatic ``shard_map`` planning for the idiomatic ops (``auto``), context-parallel sequence layouts
(``sequence_layouts``) and the collective matmuls (``all_gather_matmul``, ``matmul_reduce_scatter``)."""
