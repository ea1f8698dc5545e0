"""Adapter for the NKI Library's ``attn_q_batch_shard`` (``nkilib.experimental.collectives.batch_shard``).

The HBM collective kernels of ``experimental/collectives/collectives.py`` need no adapter: ``NkiCompiler`` hands
them their ``replica_group`` as an ``nki.collectives.ReplicaGroup``. ``attn_q_batch_shard`` takes its enum as
``layout``, a name jax_nkilib's primitives reserve for layout views, so jax_nkilib calls it ``q_layout``: the
adapter passes it on as the library's ``AttnQBatchShardLayout`` member of that name, with the replica group built
from the rank lists. Its ``gathered_buf`` stays a kernel input (the kernel needs it to be one for its rank-offset
DMA). Not yet run on Trainium by this project.
"""

import nki
from nki.collectives import ReplicaGroup

from jax_nkilib_kernels._library import body, load

_library_batch_shard = load("experimental.collectives.batch_shard", "attn_q_batch_shard")
AttnQBatchShardLayout = load("experimental.collectives.batch_shard", "AttnQBatchShardLayout")


@nki.jit
def attn_q_batch_shard(
    input, iota_workers, gathered_buf=None, rank_id_in=None, gqa_group_size=None, replica_group=None, q_layout="NBSd"
):
    """The group's heads for this rank's batch slice (``gathered_buf``: the kernel's HBM workspace input)."""
    return body(_library_batch_shard)(
        input,
        iota_workers,
        gathered_buf,
        gqa_group_size,
        ReplicaGroup([list(ranks) for ranks in replica_group]),
        layout=AttnQBatchShardLayout[q_layout],
        rank_id_in=rank_id_in,
    )
