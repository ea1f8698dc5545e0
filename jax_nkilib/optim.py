"""Optimizers on the NKI Library's fused kernels, as optax ``GradientTransformation`` s: ``adam``, ``adamw``
(``adam_kernel`` / ``adamw_kernel`` per parameter leaf) and ``clip_by_global_norm`` (``l2_norm_kernel`` per leaf).
See :mod:`jax_nkilib._src.ops.optim` for the math and the mapping of the kernels' new parameters to optax updates."""

from jax_nkilib._src.ops.optim import FusedAdamState, adam, adamw, clip_by_global_norm, global_norm

__all__ = ["FusedAdamState", "adam", "adamw", "clip_by_global_norm", "global_norm"]
