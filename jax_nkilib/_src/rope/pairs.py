"""RoPE's rotation of coordinate pairs in ``jnp``, the plain math the MLA projection and indexer references share
(the ``RoPE`` / ``rope_hf`` kernels' own references, with their roundings, are :mod:`.rope`)."""

from __future__ import annotations

import jax.numpy as jnp


def rotate_pairs(x, cos, sin, interleaved: bool):
    """``x [..., R]`` with each pair ``(a, b)`` turned to ``(a cos - b sin, a sin + b cos)``; ``cos``, ``sin``
    ``[..., R / 2]`` (broadcast against ``x``) hold pair ``j``'s angle. The pairs are ``(x[2j], x[2j + 1])`` when
    ``interleaved``, else the halves ``(x[j], x[j + R / 2])``."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(x.shape)
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
