"""NeuronCore constants that the kernels' limits and tile layouts are written in (Trainium2 values)."""

PARTITIONS = 128  # SBUF/PSUM partitions (nl.tile_size.pmax): the row tile of every kernel layout ``[128, ...]``
SBUF_PARTITION_BYTES = 192 * 1024  # trn2: 24 MiB of SBUF over 128 partitions
GEMM_STATIONARY_MAX = 128  # nl.tile_size.gemm_stationary_fmax: the stationary operand's free-size tile
