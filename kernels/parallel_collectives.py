"""Adapters for the NKI Library's HBM collective kernels (``nkilib.experimental.collectives``).

The library kernels take ``replica_group`` as an ``nki.collectives.ReplicaGroup``; jax_nkilib lowers a replica
group to its rank lists (``[[0, 2, 4, 6], [1, 3, 5, 7]]``), so each adapter builds the ``ReplicaGroup`` and traces
the library kernel's body inline. ``attn_q_batch_shard`` also takes its ``layout`` as the enum member's name
(``q_layout``) and passes the library's ``AttnQBatchShardLayout``; its ``gathered_buf`` stays a kernel input (the
kernel needs it to be one for its rank-offset DMA). ``rank_id_kernel`` and ``dma_copy_rank_id_kernel`` take no
replica group and need no adapter. Not yet run on Trainium by this project.
"""

import nki
from nki.collectives import ReplicaGroup

try:  # neuronx-cc bundles the library as `nkilib`; the source tree installs it as `nkilib_src.nkilib`
    from nkilib.experimental.collectives import collectives as _library
    from nkilib.experimental.collectives.batch_shard import AttnQBatchShardLayout
    from nkilib.experimental.collectives.batch_shard import attn_q_batch_shard as _library_batch_shard
except ImportError:  # pragma: no cover - depends on how the NKI Library is installed
    from nkilib_src.nkilib.experimental.collectives import collectives as _library
    from nkilib_src.nkilib.experimental.collectives.batch_shard import AttnQBatchShardLayout
    from nkilib_src.nkilib.experimental.collectives.batch_shard import attn_q_batch_shard as _library_batch_shard


def _body(kernel):
    """The undecorated kernel function, so that it is traced inline in the adapter."""
    return getattr(kernel, "func", kernel)


def _group(rank_lists):
    return ReplicaGroup([list(ranks) for ranks in rank_lists])


@nki.jit
def all_reduce_hbm_kernel(input, replica_group=None):
    """``out = sum over the group of input``."""
    return _body(_library.all_reduce_hbm_kernel)(input, _group(replica_group))


@nki.jit
def all_gather_hbm_kernel(input, replica_group=None, num_ranks=None):
    """``out [num_ranks * H, W]``: the group's inputs along dim 0."""
    return _body(_library.all_gather_hbm_kernel)(input, _group(replica_group), num_ranks)


@nki.jit
def reduce_scatter_hbm_kernel(input, replica_group=None, num_ranks=None):
    """``out [H / num_ranks, W]``: this rank's block of the group's sum."""
    return _body(_library.reduce_scatter_hbm_kernel)(input, _group(replica_group), num_ranks)


@nki.jit
def all_to_all_hbm_kernel(input, replica_group=None):
    """``out``: block ``s`` of dim 0 comes from rank ``s``."""
    return _body(_library.all_to_all_hbm_kernel)(input, _group(replica_group))


@nki.jit
def attn_q_batch_shard(input, iota_workers, gathered_buf=None, rank_id_in=None, gqa_group_size=None,
                       replica_group=None, q_layout="NBSd"):
    """The group's heads for this rank's batch slice (``gathered_buf``: the kernel's HBM workspace input)."""
    return _body(_library_batch_shard)(input, iota_workers, gathered_buf, gqa_group_size, _group(replica_group),
                                       layout=AttnQBatchShardLayout[q_layout], rank_id_in=rank_id_in)
