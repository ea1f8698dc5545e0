"""Array arguments of the idiomatic ops and shard_map building blocks, checked at trace time with one wording.

``array_argument(where, name, value, ...)`` returns ``value`` as a JAX array, or raises

* ``TypeError`` "``where: `name` must be an array <layout>``" for anything without a shape and a dtype;
* ``TypeError`` "``must have a floating dtype``" when ``dtypes`` asks for one: ``"kernel"`` accepts the dtypes the
  kernels compute in (float32, bfloat16, float16, float64), ``"floating"`` any floating dtype (FP8 included);
  ``"integer"`` asks for an integer dtype instead ("``must have an integer dtype``": indices, labels);
* ``ValueError`` when ``rank`` is given and differs ("must be <layout>", or "must have rank <rank>" without one).

``layout`` (e.g. ``"[batch, seq, hidden]"``), when given, is shown in every message.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .spec import FLOAT_DTYPES

KERNEL_FLOATS = "float32, bfloat16, float16 or float64"


def is_array(value) -> bool:
    return hasattr(value, "shape") and hasattr(value, "dtype") and not isinstance(value, (str, bytes))


def array_argument(
    where: str, name: str, value, *, layout: str = "", rank: int | None = None, dtypes: str | None = "kernel"
):
    """``value`` as an array after the checks of the module docstring (``dtypes``: ``"kernel"``, ``"floating"``,
    ``"integer"`` or ``None`` for any dtype)."""
    described = f"`{name}` {layout}" if layout else f"`{name}`"
    if not is_array(value):
        shape = f" {layout}" if layout else ""
        raise TypeError(f"{where}: `{name}` must be an array{shape}; got {type(value).__name__}")
    value = jnp.asarray(value)
    floating = jnp.issubdtype(value.dtype, jnp.floating)
    if dtypes == "kernel" and not (floating and np.dtype(value.dtype) in FLOAT_DTYPES):
        raise TypeError(f"{where}: {described} must have a floating dtype ({KERNEL_FLOATS}); got {value.dtype}")
    if dtypes == "floating" and not floating:
        raise TypeError(f"{where}: {described} must have a floating dtype; got {value.dtype}")
    if dtypes == "integer" and not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{where}: {described} must have an integer dtype; got {value.dtype}")
    if rank is not None and value.ndim != rank:
        expected = f"be {layout}" if layout else f"have rank {rank}"
        raise ValueError(f"{where}: `{name}` must {expected}; got shape {tuple(value.shape)}")
    return value
