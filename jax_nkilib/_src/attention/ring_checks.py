"""Checks the ring attention kernels share: the replica group is given and matches ``num_workers``; Trn2+."""

from __future__ import annotations

from ..framework.mesh_axes import bound_axis_size
from ..framework.platform import before_trn2
from ..framework.spec import CallInfo


def require_ring(call: CallInfo, groups: str, workers: str) -> None:
    """``ValueError`` unless param ``groups`` names bound mesh axes whose size is param ``workers`` (>= 1)."""
    p, function = call.params, call.function
    if p[groups] is None:
        raise ValueError(
            f"{function}: `{groups}` is required: the mesh axis name(s) of the ring (call the kernel "
            "inside jax.shard_map)"
        )
    if p[workers] < 1:
        raise ValueError(f"{function}: `{workers}` must be >= 1; got {p[workers]}")
    size = bound_axis_size(p[groups])
    if size is not None and size != p[workers]:
        raise ValueError(f"{function}: {workers}={p[workers]} but the replica group {p[groups]} has {size} ranks")


def needs_trn2(call: CallInfo) -> list[str]:
    """The ring kernels run on Trainium2 or later: an unmet limit when the platform target is Trn1/Inf2."""
    if before_trn2(call.target):
        return [f"the kernel needs Trainium2 or later; the platform target is {call.target}"]
    return []
