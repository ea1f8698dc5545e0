"""Which keys each query may attend to, as the NKI attention kernels define it.

Queries and keys have *positions*. Query row ``i`` has position ``q_base + i * q_stride`` (context parallelism gives
a runtime ``q_base`` = ``cp_offset`` and, with strided slicing, ``q_stride`` = the CP degree). Keys are the
``n_prior`` prefix-cache slots followed by the ``n_active`` active keys: prior slot ``j`` holds position
``j - prior_used`` and is valid only when ``j < prior_used`` (a runtime length); active key ``j`` has position ``j``,
unless the keys are a round-robin shard of blocks (KV parallelism): with ``k_block = b``, ``k_groups = R`` and
``k_rank = r`` (runtime or static), active key ``j`` lies in global block ``(j // b) * R + r`` and has position
``((j // b) * R + r) * b + j % b``.

A valid key is allowed when every rule in force holds:

* causal: ``key_pos <= query_pos``;
* sliding window ``w > 0``: ``key_pos > query_pos - w``;
* sequence packing: ``bound_min[i] <= key_pos < bound_max[i]``.

Prior slots at or past ``prior_used`` are invalid for every query (:meth:`MaskRule.key_valid`): they hold stale cache
memory, so the engine also zeroes their keys and values, and nothing there (not even a NaN or inf) reaches a result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MaskRule:
    n_queries: int
    n_active: int
    n_prior: int = 0
    prior_used: Any = None  # runtime int32 scalar, or None for "all prior slots"
    q_base: Any = 0  # runtime int32 scalar or 0
    q_stride: int = 1
    causal: bool = False
    window: int = 0
    bound_min: Any = None  # [n_queries] array, or None
    bound_max: Any = None
    k_block: int = 0  # round-robin key blocks (0: keys are contiguous)
    k_groups: int = 1
    k_rank: Any = 0  # runtime int32 scalar or int

    def runtime_values(self) -> tuple:
        """The traced values the rule reads (for loop-carry typing inside ``shard_map``)."""
        values = (self.prior_used, self.q_base, self.bound_min, self.bound_max, self.k_rank)
        return tuple(value for value in values if value is not None and not isinstance(value, int))

    def block_may_attend(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """Whether queries ``q_first..q_last`` may attend to any of keys ``k_first..k_last`` (True when unknown
        at trace time: runtime offsets, lengths or bounds)."""
        if self.runtime_values():
            return True
        used = self.n_prior if self.prior_used is None else self.prior_used
        q_lo, q_hi = self.q_base + q_first * self.q_stride, self.q_base + q_last * self.q_stride
        # key positions rise with the index inside the prior and inside the active part
        k_lo = k_first - used if k_first < self.n_prior else self._active_position(k_first - self.n_prior)
        k_hi = k_last - used if k_last < self.n_prior else self._active_position(k_last - self.n_prior)
        if k_first < self.n_prior <= k_last:  # the block straddles prior and active keys
            k_lo = min(k_first - used, self._active_position(0))
            k_hi = max(self.n_prior - 1 - used, self._active_position(k_last - self.n_prior))
        if self.causal and k_lo > q_hi:
            return False
        if self.window > 0 and k_hi <= q_lo - self.window:
            return False
        return True

    def _active_position(self, j):
        """Position of active key ``j`` (monotonic in ``j``)."""
        if not self.k_block:
            return j
        return ((j // self.k_block) * self.k_groups + self.k_rank) * self.k_block + j % self.k_block

    def key_valid(self, k_index):
        """Boolean ``[len(k_index)]``: is key ``k_index[b]`` valid for every query (not a prior slot at or past
        ``prior_used``)? ``None`` when every key is (no runtime prior length)."""
        if not self.n_prior or self.prior_used is None:
            return None
        return (k_index >= self.n_prior) | (k_index < self.prior_used)

    @property
    def n_keys(self) -> int:
        return self.n_prior + self.n_active

    def allowed(self, q_index, k_index):
        """Boolean ``[len(q_index), len(k_index)]``: may query row ``q_index[a]`` attend to key ``k_index[b]``?"""
        q_pos = (self.q_base + q_index * self.q_stride)[:, None]
        k_index = k_index[None, :]
        is_prior = k_index < self.n_prior
        used = self.n_prior if self.prior_used is None else self.prior_used
        k_pos = jnp.where(is_prior, k_index - used, self._active_position(k_index - self.n_prior))
        ok = (k_index < self.n_keys) & (q_index < self.n_queries)[:, None]
        if self.n_prior:
            ok &= ~is_prior | (k_index < used)
        if self.causal:
            ok &= k_pos <= q_pos
        if self.window > 0:
            ok &= k_pos > q_pos - self.window
        if self.bound_min is not None:
            rows = jnp.clip(q_index, 0, self.n_queries - 1)
            ok &= (self.bound_min[rows][:, None] <= k_pos) & (k_pos < self.bound_max[rows][:, None])
        return ok
