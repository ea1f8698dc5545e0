"""Deterministic random test inputs."""

import jax.numpy as jnp
import numpy as np


def random(shape, dtype=jnp.float32, seed=0, scale=1.0):
    """Standard-normal values of ``shape`` rounded to ``dtype`` (as a jax array)."""
    values = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(values, dtype=dtype)


def angles(shape, dtype=jnp.float32, seed=1):
    """``(cos, sin)`` of random angles of ``shape``."""
    theta = np.random.default_rng(seed).uniform(-np.pi, np.pi, shape)
    return jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)
