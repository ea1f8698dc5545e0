"""Float64 NumPy oracles of softmax cross-entropy (written from the catalog's semantics, section 1.22)."""

import numpy as np

from tests.support.numerics import f64


def logsumexp(x):
    x = f64(x)
    top = x.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))[..., 0]


def losses(x, targets):
    """``(loss, lse)`` per row of ``x [..., V]``: ``lse - x[target]``."""
    x, targets = f64(x), np.asarray(targets)
    lse = logsumexp(x)
    picked = np.take_along_axis(x, targets[..., None].astype(np.int64), axis=-1)[..., 0]
    return lse - picked, lse


def softmax_minus_onehot(x, targets, lse=None):
    """``exp(x - lse) - onehot(targets)`` (``lse`` given: the kernel's saved statistics)."""
    x = f64(x)
    lse = logsumexp(x) if lse is None else f64(lse)
    onehot = np.arange(x.shape[-1]) == np.asarray(targets)[..., None]
    return np.exp(x - lse[..., None]) - onehot
