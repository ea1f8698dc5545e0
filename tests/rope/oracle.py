"""NumPy float64 oracles for the rotary-embedding kernels, written from the catalog's semantics.

Rotation of a pair (a, b) by angle (cos, sin) is the complex product (a + ib)(cos + i sin), which is how these
oracles compute it (independently of the library's JAX references).
"""

import numpy as np


def f64(x):
    return np.asarray(x, dtype=np.float64)


def rope_oracle(x_in, cos, sin, contiguous_layout=True):
    """RoPE kernel: x_in [d, B, H, S], cos/sin [d/2, B, S]; pairs are halves or interleaved neighbours."""
    x_in, cos, sin = f64(x_in), f64(cos), f64(sin)
    d = x_in.shape[0]
    first, second = (
        (np.arange(d // 2), np.arange(d // 2) + d // 2)
        if contiguous_layout
        else (np.arange(0, d, 2), np.arange(1, d, 2))
    )
    z = x_in[first] + 1j * x_in[second]
    rotated = z * (cos[:, :, None, :] + 1j * sin[:, :, None, :])
    out = np.empty_like(x_in)
    out[first], out[second] = rotated.real, rotated.imag
    return out


def rope_hf_oracle(q, k, cos=None, sin=None, rope_cache=None, backward=False):
    """rope_hf kernel: q/k [B, H, S, D], tables [(B), S_rope, D] (or packed [(B), S_rope, 2D]), first S rows.

    Forward is x*cos + rotate_half(x)*sin with rotate_half(x) = [-x2, x1]; backward applies the transpose,
    x*cos + rotate_half^T(x*sin) with rotate_half^T(y) = [y2, -y1].
    """
    if rope_cache is not None:
        rope_cache = f64(rope_cache)
        width = q.shape[-1]
        cos, sin = rope_cache[..., :width], rope_cache[..., width:]

    def apply(x):
        x = f64(x)
        seq, half = x.shape[2], x.shape[3] // 2
        c, s = f64(cos)[..., :seq, :], f64(sin)[..., :seq, :]
        c, s = (t[None, None] if t.ndim == 2 else t[:, None] for t in (c, s))
        if not backward:
            rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            return x * c + rotated * s
        xs = x * s
        return x * c + np.concatenate([xs[..., half:], -xs[..., :half]], axis=-1)

    return apply(q), apply(k)


def idiomatic_rope_oracle(x, cos, sin, interleaved=False):
    """jax_nkilib.rope: x [..., S, H, D], cos/sin [S, D/2] or [batch, S, D/2] broadcast over leading axes; the
    result has x's shape."""
    x, cos, sin = f64(x), f64(cos), f64(sin)
    d = x.shape[-1]
    first, second = (
        (np.arange(0, d, 2), np.arange(1, d, 2)) if interleaved else (np.arange(d // 2), np.arange(d // 2) + d // 2)
    )
    angle = (cos + 1j * sin)[..., :, None, :]  # [..., S, 1, D/2]
    rotated = (x[..., first] + 1j * x[..., second]) * angle
    out = np.empty(np.broadcast_shapes(x.shape, rotated.shape[:-1] + (d,)))
    out[..., first], out[..., second] = rotated.real, rotated.imag
    assert out.size == x.size, "the tables may not add batch elements"
    return out.reshape(x.shape)
