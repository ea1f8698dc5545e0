"""The collective kernels (layer 1), called inside ``jax.shard_map``: the HBM collectives
(``all_reduce_hbm_kernel``...), the all-gather kernels (``fine_grained_allgather``, ``allgather_compute_matmul``,
``allgather_sb2sb*``), ``attn_q_batch_shard``, and the ring schedule they and the collective matmuls share
(``ring``)."""
