"""Adapters for the NKI Library's rotary-embedding kernels (``nkilib.core.embeddings``).

``RoPE`` is HBM in / HBM out and needs no adapter. ``rope_hf`` takes its outputs as arguments
(destination passing), so ``rope_hf`` below allocates them in shared HBM and returns them, which is the
calling convention a framework custom call needs. Not yet run on Trainium by this project.
"""

import nki
import nki.language as nl

from jax_nkilib_kernels._library import body, load

# Call the undecorated kernel body inside our kernel so that it is traced inline.
_rope_hf_body = body(load("core.embeddings.rope_hf", "rope_hf"))


@nki.jit
def rope_hf(q, k, cos=None, sin=None, rope_cache=None, backward=False):
    """``(q_out, k_out) = rope_hf(q, k, cos, sin, rope_cache, backward)`` with freshly allocated outputs."""
    q_out = nl.ndarray(q.shape, dtype=q.dtype, buffer=nl.shared_hbm)
    k_out = nl.ndarray(k.shape, dtype=k.dtype, buffer=nl.shared_hbm)
    _rope_hf_body(q, k, q_out, k_out, cos=cos, sin=sin, rope_cache=rope_cache, backward=backward)
    return q_out, k_out
