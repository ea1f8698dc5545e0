"""The one tolerance helper: bounds derived from the dtype's machine epsilon and the reduction length.

``assert_close`` compares against a float64 oracle with a normwise bound ``ops * eps(dtype) * sqrt(reduction)``
relative to the oracle's largest magnitude. For low-precision dtypes, ``assert_no_worse_than_plain`` also requires
the error to be within a small multiple of the error of a plain same-precision ``jnp`` computation.
"""

import math

import jax.numpy as jnp
import numpy as np

EPSILON = {
    np.dtype(jnp.float64): 2.0**-52,
    np.dtype(jnp.float32): 2.0**-23,
    np.dtype(jnp.float16): 2.0**-10,
    np.dtype(jnp.bfloat16): 2.0**-8,
}


def tolerance(dtype, reduction: int = 1, ops: int = 4) -> float:
    """Relative normwise tolerance for ``ops`` rounded operations over a reduction of ``reduction`` terms."""
    return ops * EPSILON[np.dtype(dtype)] * math.sqrt(max(reduction, 1))


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"shape {actual.shape} != oracle shape {expected.shape}"
    scale = max(float(np.max(np.abs(expected), initial=0.0)), np.finfo(np.float64).tiny)
    return float(np.max(np.abs(actual - expected), initial=0.0)) / scale


def assert_close(actual, expected, dtype, *, reduction: int = 1, ops: int = 4) -> None:
    """``actual`` (computed in ``dtype``) matches the float64 oracle ``expected`` within :func:`tolerance`."""
    error, bound = relative_error(actual, expected), tolerance(dtype, reduction, ops)
    assert error <= bound, f"relative error {error:.3e} exceeds {bound:.3e} for {np.dtype(dtype)}"


def assert_no_worse_than_plain(actual, plain, expected, factor: float = 2.0) -> None:
    """``actual``'s error against the oracle is at most ``factor`` times that of the plain computation."""
    ours, theirs = relative_error(actual, expected), relative_error(plain, expected)
    assert ours <= factor * theirs + EPSILON[np.dtype(np.float32)], (
        f"error {ours:.3e} is more than {factor}x the plain same-precision error {theirs:.3e}"
    )


def f64(x):
    """float64 NumPy copy of ``x`` (``None`` stays ``None``; low-precision floats go through float32, which holds
    them exactly)."""
    if x is None:
        return None
    x = jnp.asarray(x)
    if x.dtype != jnp.float64 and jnp.issubdtype(x.dtype, jnp.floating):
        x = x.astype(jnp.float32)
    return np.asarray(x, np.float64)
