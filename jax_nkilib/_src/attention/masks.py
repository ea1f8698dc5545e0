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
* sliding window ``w > 0`` (the left window; ``w <= 0``: none): ``key_pos > query_pos - w``;
* right window ``r`` (``right_window`` not ``None``): ``key_pos <= query_pos + r`` (causal is ``r = 0``;
  ``jax.nn.dot_product_attention``'s ``local_window_size=(left, right)``, ``left >= 0``, is ``window = left + 1``,
  ``right_window = right``);
* sequence packing by bounds: ``bound_min[i] <= key_pos < bound_max[i]``;
* sequence packing by segment ids (splash attention's and tokamax's semantics): query row ``i`` may attend to active
  key ``j`` (the storage index, whatever its position) only when ``q_segment_ids[i] == kv_segment_ids[j]``. Equal
  ids need not be contiguous, and a row whose id no key carries sees no key. Prior (prefix) slots carry no segment,
  so segment ids with ``n_prior > 0`` are refused (``ValueError``).

Causal, the windows and the static positions let :meth:`MaskRule.block_may_attend` rule out whole blocks at trace
time; bounds and segment ids only narrow what those allow (they are runtime values, so they never skip a block).

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
    right_window: int | None = None  # key_pos <= query_pos + right_window
    q_segment_ids: Any = None  # [n_queries] integer array, or None
    kv_segment_ids: Any = None  # [n_active] integer array (one id per active key, in storage order), or None

    def __post_init__(self):
        if (self.q_segment_ids is None) != (self.kv_segment_ids is None):
            raise ValueError("MaskRule: q_segment_ids and kv_segment_ids come together (both or neither)")
        if self.q_segment_ids is None:
            return
        if self.n_prior:
            raise ValueError(
                f"MaskRule: segment ids with n_prior={self.n_prior} prefix slots: prefix keys carry no segment id"
            )
        for name, ids, size in (
            ("q_segment_ids", self.q_segment_ids, self.n_queries),
            ("kv_segment_ids", self.kv_segment_ids, self.n_active),
        ):
            if jnp.shape(ids) != (size,) or not jnp.issubdtype(jnp.result_type(ids), jnp.integer):
                raise ValueError(
                    f"MaskRule: {name} must be an integer array of shape ({size},), got "
                    f"{jnp.result_type(ids)}{list(jnp.shape(ids))}"
                )

    def runtime_values(self) -> tuple:
        """The traced values the rule reads (for loop-carry typing inside ``shard_map``)."""
        values = (
            self.prior_used,
            self.q_base,
            self.bound_min,
            self.bound_max,
            self.k_rank,
            self.q_segment_ids,
            self.kv_segment_ids,
        )
        return tuple(value for value in values if value is not None and not isinstance(value, int))

    def block_may_attend(self, q_first: int, q_last: int, k_first: int, k_last: int) -> bool:
        """Whether queries ``q_first..q_last`` may attend to any of keys ``k_first..k_last`` (True when unknown
        at trace time: runtime offsets or lengths). Bounds and segment ids only narrow the positional rules, so
        blocks those hide are skipped with or without them."""
        positional = (self.prior_used, self.q_base, self.k_rank)
        if any(value is not None and not isinstance(value, int) for value in positional):
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
        if self.right_window is not None and k_lo > q_hi + self.right_window:
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
        if self.right_window is not None:
            ok &= k_pos <= q_pos + self.right_window
        rows = jnp.clip(q_index, 0, self.n_queries - 1)
        if self.bound_min is not None:
            ok &= (self.bound_min[rows][:, None] <= k_pos) & (k_pos < self.bound_max[rows][:, None])
        if self.q_segment_ids is not None:  # no prior slots (refused): active key j is key index j
            columns = jnp.clip(k_index[0], 0, self.n_active - 1)
            q_ids, kv_ids = jnp.asarray(self.q_segment_ids), jnp.asarray(self.kv_segment_ids)
            ok &= q_ids[rows][:, None] == kv_ids[columns][None, :]
        return ok
