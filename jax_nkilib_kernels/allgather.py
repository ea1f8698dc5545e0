"""Adapters for the NKI Library's all-gather kernels (``experimental/collectives``: ``fg_allgather``, ``fgcc``,
``sb2sb_allgather``).

The library kernels are HBM-in/HBM-out ``@nki.jit`` functions; the adapters only fit them to jax_nkilib's
signatures (see ``jax_nkilib/_src/parallel/allgather.py``):

* ``replica_groups`` arrives as rank lists (from the mesh axis names). sb2sb gets them as a ``ReplicaGroup``.
  fine_grained_allgather and FGCC build their own groups of consecutive ranks from ``tp_degree`` and
  ``num_groups``: the adapter refuses rank lists that differ (the lowering falls back before that happens).
* The results are returned as row-major views in jax_nkilib's layouts: ``[tp_degree, m, .]`` for
  fine_grained_allgather and FGCC (whose ``[RANK_N, ...]`` middle depends on the SBUF/HBM path), ``[rows,
  tp_degree, width]`` for sb2sb.

Not yet run on Trainium by this project: check them on a trn2 instance.
"""

import nki
from nki.collectives import ReplicaGroup

from jax_nkilib_kernels._library import load

_library_fg_allgather = load("experimental.collectives.fg_allgather", "fine_grained_allgather")
_library_fgcc = load("experimental.collectives.fgcc", "allgather_compute_matmul")
_library_sb2sb = load("experimental.collectives.sb2sb_allgather", "allgather_sb2sb")
_library_sb2sb_tiled = load("experimental.collectives.sb2sb_allgather", "allgather_sb2sb_tiled")


def _require_consecutive_groups(replica_groups, tp_degree, num_groups):
    expected = [[g * tp_degree + i for i in range(tp_degree)] for g in range(num_groups)]
    given = [list(group) for group in replica_groups]
    if given != expected:
        raise ValueError(f"the kernel gathers over consecutive ranks {expected}; the mesh axis groups {given}")


@nki.jit
def fine_grained_allgather(lhs, tp_degree=None, num_groups=None, force_hbm_cc=False, replica_groups=None):
    """``result [tp_degree, m, K]`` for ``lhs [m, K]``."""
    _require_consecutive_groups(replica_groups, tp_degree, num_groups)
    m, k = lhs.shape
    result = _library_fg_allgather(lhs, tp_degree, num_groups, force_hbm_cc=force_hbm_cc)
    return result.reshape((tp_degree, m, k))


@nki.jit
def allgather_compute_matmul(lhs, rhs, tp_degree=None, num_groups=None, force_hbm_cc=False, replica_groups=None):
    """``result [tp_degree, m, N]`` for ``lhs [m, K]``, ``rhs [K, N]``."""
    _require_consecutive_groups(replica_groups, tp_degree, num_groups)
    m = lhs.shape[0]
    n = rhs.shape[1]
    result = _library_fgcc(lhs, rhs, tp_degree, num_groups, force_hbm_cc=force_hbm_cc)
    return result.reshape((tp_degree, m, n))


@nki.jit
def allgather_sb2sb(inp, replica_groups=None, tp_degree=None):
    """``out [H, tp_degree, W]`` for ``inp [H, W]``."""
    rows, width = inp.shape
    out = _library_sb2sb(inp, ReplicaGroup(replica_groups), tp_degree)
    return out.reshape((rows, tp_degree, width))


@nki.jit
def allgather_sb2sb_tiled(inp, replica_groups=None, tp_degree=None):
    """``out [M, tp_degree, K]`` for ``inp [M, K]``."""
    rows, width = inp.shape
    out = _library_sb2sb_tiled(inp, ReplicaGroup(replica_groups), tp_degree)
    return out.reshape((rows, tp_degree, width))
