"""Checks of run-time values (indices and lengths read from arrays) that tracing cannot see.

The contract an op defines for an invalid run-time index is a visible failure in the data (NaN in the rows it
affects, no write anywhere); these checks add an error report on top of it. They are ``checkify.debug_check``
calls, emitted only inside ``jax_nkilib.config(runtime_checks=True)``: under ``checkify.checkify(f,
errors=checkify.user_checks)`` a failed check becomes an error (``err.throw()``) naming the op, the argument and the
first bad value; without ``checkify`` JAX drops them. They are off by default because any check in a jitted function
makes each of its calls pay JAX's effect handling.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import checkify

from . import config


def enabled() -> bool:
    return config.runtime_checks_enabled()


def check_all(valid, message: str, *values) -> None:
    """When run-time checks are on, report ``message`` unless every entry of the boolean array ``valid`` holds.

    ``message`` may contain ``{index}`` (the index of the first failing entry: an int for a 1-d ``valid``, else the
    list of its coordinates) and ``{}`` fields filled with ``values[i]`` at that entry (arrays shaped like
    ``valid``)."""
    if not enabled():
        return
    valid = jnp.asarray(valid)
    first = jnp.argmin(valid.reshape(-1))  # the first False (0 when every entry holds)
    picked = [jnp.broadcast_to(jnp.asarray(value), valid.shape).reshape(-1)[first] for value in values]
    index = first if valid.ndim == 1 else jnp.stack(jnp.unravel_index(first, valid.shape))
    checkify.debug_check(jnp.all(valid), message, *picked, index=index)
