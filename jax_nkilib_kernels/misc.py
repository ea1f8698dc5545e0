"""Adapter for the NKI Library's ``scatter_add`` (``nkilib.experimental.misc``; ``gather`` needs none).

``scatter_add`` is HBM in / HBM out and returns ``input``, updated in place. The adapter bridges a version
difference: the 2.32 release takes ``(input, dim, index, src)``, newer ones add ``unique_indices=True``. It passes
``unique_indices`` only when it is False, so the default call works with both, and it refuses False with a library
that cannot honour it (that kernel drops repeated indices within a 128-row tile) instead of computing something
else. Not yet run on Trainium by this project.
"""

import inspect

import nki

from jax_nkilib_kernels._library import body, load

# Call the undecorated kernel body inside our kernel so that it is traced inline.
_scatter_add_body = body(load("experimental.misc.scatter_add", "scatter_add"))


def _library_takes_unique_indices() -> bool:
    try:
        return "unique_indices" in inspect.signature(_scatter_add_body).parameters
    except (TypeError, ValueError):
        return False


@nki.jit
def scatter_add(input, index, src, dim=0, unique_indices=True):
    """``input[index[i], :] += src[i, :]`` in place; returns ``input``."""
    newer = {}
    if not unique_indices:
        if not _library_takes_unique_indices():
            raise TypeError(
                "the installed NKI Library's scatter_add has no unique_indices parameter (2.32 and older): it would "
                "drop repeated indices within a 128-row tile; install a newer NKI Library for unique_indices=False"
            )
        newer["unique_indices"] = False
    return _scatter_add_body(input, dim, index, src, **newer)
