"""Time of jax_nkilib.deformable_attention (forward + backward) against a plain-JAX Deformable DETR core on CPU.

Run:
  python tests/benchmarks/bench_deformable_attention.py

The baseline is ``ms_deform_attn_core_pytorch`` written with ``jax.scipy.ndimage.map_coordinates`` (order 1,
zeros outside: ``grid_sample``'s bilinear, ``align_corners=False``, zero padding), one call per level vmapped over
batch, heads and channels. Off Neuron jax_nkilib runs the kernels' JAX reference (one gather of every level's
corners; its VJP is the backward kernel's reference); on Neuron each is the NKI kernel instead. The ratio ours /
plain JAX is measured in one run (median of repeated jitted calls of the gradient of sum(op * dy) in all three
inputs); the largest difference of the two forwards is printed as a check.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.ndimage import map_coordinates

import jax_nkilib

CASES = {  # name: (batch, spatial shapes, queries, heads, channels, points)
    "decoder: 300 queries, 4 levels 32..4": (2, ((32, 32), (16, 16), (8, 8), (4, 4)), 300, 8, 32, 4),
    "encoder: 1360 queries, 4 levels 32..4": (1, ((32, 32), (16, 16), (8, 8), (4, 4)), 1360, 8, 32, 4),
}


def plain_deformable_attention(value, spatial_shapes, sampling_locations, attention_weights):
    """The PyTorch core op in plain JAX: bilinear samples per level by map_coordinates."""
    batch, _, heads, channels = value.shape
    out, start = 0.0, 0
    for level, (height, width) in enumerate(spatial_shapes):
        maps = value[:, start : start + height * width].reshape(batch, height, width, heads, channels)
        start += height * width
        px = sampling_locations[:, :, :, level, :, 0] * width - 0.5  # [B, Nq, Nh, Np]
        py = sampling_locations[:, :, :, level, :, 1] * height - 0.5

        def sample(image, rows, cols):  # image [H, W], rows/cols [Nq, Np]
            return map_coordinates(image, [rows, cols], order=1, mode="constant", cval=0.0)

        per_channel = jax.vmap(sample, in_axes=(-1, None, None), out_axes=-1)  # [Nq, Np, C]
        per_head = jax.vmap(per_channel, in_axes=(-2, 1, 1), out_axes=1)  # [Nq, Nh, Np, C]
        samples = jax.vmap(per_head)(maps, py, px)  # [B, Nq, Nh, Np, C]
        out = out + jnp.einsum("bqhp,bqhpc->bqhc", attention_weights[:, :, :, level], samples)
    return out.reshape(*out.shape[:2], heads * channels)


def seconds(fn, args, dy, repeats=5):
    step = jax.jit(jax.grad(lambda args, dy: jnp.sum(fn(*args) * dy)))
    jax.block_until_ready(step(args, dy))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(args, dy))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"{'case':40s} {'ours ms':>9s} {'plain ms':>9s} {'ratio':>6s} {'max |diff|':>11s}")
    for name, (batch, shapes, queries, heads, channels, points) in CASES.items():
        rng = np.random.default_rng(0)
        pixels = sum(h * w for h, w in shapes)
        value = jnp.asarray(rng.standard_normal((batch, pixels, heads, channels)), jnp.float32)
        locations = jnp.asarray(rng.uniform(0, 1, (batch, queries, heads, len(shapes), points, 2)), jnp.float32)
        weights = jnp.asarray(rng.uniform(0, 1, (batch, queries, heads, len(shapes), points)), jnp.float32)
        dy = jnp.asarray(rng.standard_normal((batch, queries, heads * channels)), jnp.float32)

        def ours(v, s, a):
            return jax_nkilib.deformable_attention(v, shapes, s, a)

        def plain(v, s, a):
            return plain_deformable_attention(v, shapes, s, a)

        args = (value, locations, weights)
        diff = float(jnp.max(jnp.abs(jax.jit(ours)(*args) - jax.jit(plain)(*args))))
        mine, theirs = seconds(ours, args, dy), seconds(plain, args, dy)
        print(f"{name:40s} {mine * 1e3:9.2f} {theirs * 1e3:9.2f} {mine / theirs:6.2f} {diff:11.2e}")


if __name__ == "__main__":
    main()
