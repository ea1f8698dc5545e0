"""The NKI Library ring attention kernels as layer-1 primitives (catalog rows 42-44): one import point.

* :func:`ring_attention_spmd_fwd` (:mod:`.ring_fwd`): ring attention forward, optionally with the training LSE;
  its VJP binds the backward kernel.
* :func:`ring_attention_spmd_bwd` (:mod:`.ring_bwd`): its backward (float32 gradients).
* :func:`ring_attention_unpermute` (:mod:`.ring_unpermute`): striped -> contiguous token order.

All three issue collectives: call them inside ``jax.shard_map`` with ``replica_groups`` naming the ring's mesh
axes and ``num_workers`` its size. The shared math and the reference's all-gather strategy: :mod:`.ring_math`.
"""

from .ring_bwd import RING_ATTENTION_SPMD_BWD_SPEC, ring_attention_spmd_bwd
from .ring_fwd import RING_ATTENTION_SPMD_FWD_SPEC, ring_attention_spmd_fwd
from .ring_unpermute import RING_ATTENTION_UNPERMUTE_SPEC, ring_attention_unpermute

__all__ = ["RING_ATTENTION_SPMD_BWD_SPEC", "RING_ATTENTION_SPMD_FWD_SPEC", "RING_ATTENTION_UNPERMUTE_SPEC",
           "ring_attention_spmd_bwd", "ring_attention_spmd_fwd", "ring_attention_unpermute"]
