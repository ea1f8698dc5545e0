"""Memory and time of jax_nkilib.selective_scan / jax_nkilib.ssd (forward + backward) on CPU.

Run:
  python tests/benchmarks/bench_scan.py

Off Neuron both ops run the kernels' JAX references: the recurrence as ``jax.lax.associative_scan`` (ssd: chunked,
the scan over chunks). Printed per sequence length L = 4k, 16k, 64k: the compiled gradient's temporary memory
(``memory_analysis().temp_size_in_bytes``) and its ratio to the 4k one, which must grow like L (4x, 16x), not like
L log L or L^2. Then the time ratio ours / a plain ``jax.lax.scan`` loop over time steps (the same math, the same
gradient), measured in one run as the median of repeated jitted calls. ``ssd (seq_idx)`` is ssd on packed
sequences of ``PACKED`` tokens (Mamba-2's ``seq_idx``: the chunked scan with state resets), against the same loop
with the resets.
"""

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_nkilib

LENGTHS = (4096, 16384, 65536)
MAMBA = dict(batch=1, dim=32, dstate=8)
MAMBA2 = dict(batch=1, heads=4, headdim=16, dstate=16, chunk=64)
PACKED = 1000  # tokens per packed sequence (not a multiple of the chunk: resets inside chunks)


def mamba_args(length, dtype=jnp.float32):
    b, d, n = MAMBA["batch"], MAMBA["dim"], MAMBA["dstate"]
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((b, d, length)), dtype),
        jnp.asarray(0.5 * rng.standard_normal((b, d, length)), dtype),
        jnp.asarray(-rng.uniform(0.1, 1.0, (d, n)), dtype),
        jnp.asarray(rng.standard_normal((b, n, length)), dtype),
        jnp.asarray(rng.standard_normal((b, n, length)), dtype),
    )


def mamba2_args(length, dtype=jnp.float32):
    b, h, p, n = MAMBA2["batch"], MAMBA2["heads"], MAMBA2["headdim"], MAMBA2["dstate"]
    rng = np.random.default_rng(0)
    return (
        jnp.asarray(rng.standard_normal((b, length, h, p)), dtype),
        jnp.asarray(0.5 * rng.standard_normal((b, length, h)), dtype),
        jnp.asarray(-rng.uniform(0.1, 1.0, h), dtype),
        jnp.asarray(rng.standard_normal((b, length, 1, n)), dtype),
        jnp.asarray(rng.standard_normal((b, length, 1, n)), dtype),
    )


def ours_selective(u, delta, A, B, C):
    return jax_nkilib.selective_scan(u, delta, A, B, C, delta_softplus=True)


def plain_selective(u, delta, A, B, C):
    """The same recurrence as a sequential ``lax.scan`` over time steps."""
    delta = jax.nn.softplus(delta)

    def step(state, t):
        u_t, d_t, b_t, c_t = t  # [b, d], [b, d], [b, n], [b, n]
        state = jnp.exp(d_t[..., None] * A) * state + (d_t * u_t)[..., None] * b_t[:, None, :]
        return state, jnp.einsum("bdn,bn->bd", state, c_t)

    steps = (jnp.moveaxis(u, -1, 0), jnp.moveaxis(delta, -1, 0), jnp.moveaxis(B, -1, 0), jnp.moveaxis(C, -1, 0))
    _, y = jax.lax.scan(step, jnp.zeros(u.shape[:2] + A.shape[1:], u.dtype), steps)
    return jnp.moveaxis(y, 0, -1)


def ours_ssd(x, dt, A, B, C):
    return jax_nkilib.ssd(x, dt, A, B, C, chunk_size=MAMBA2["chunk"], dt_softplus=True)


def packed_seq_idx(x):
    """``seq_idx [batch, L]`` of sequences of ``PACKED`` tokens (a constant of the program)."""
    return jnp.broadcast_to(jnp.arange(x.shape[1], dtype=jnp.int32) // PACKED, x.shape[:2])


def ours_packed_ssd(x, dt, A, B, C):
    seq_idx = packed_seq_idx(x)
    return jax_nkilib.ssd(x, dt, A, B, C, chunk_size=MAMBA2["chunk"], dt_softplus=True, seq_idx=seq_idx)


def plain_packed_ssd(x, dt, A, B, C):
    return plain_ssd(x, dt, A, B, C, packed_seq_idx(x))


def plain_ssd(x, dt, A, B, C, seq_idx=None):
    """Mamba-2's recurrence as a sequential ``lax.scan`` over time steps (one group); with ``seq_idx``, the state
    is reset where the index changes."""
    dt = jax.nn.softplus(dt)
    if seq_idx is None:
        keep = jnp.ones(x.shape[:2], x.dtype)
    else:
        keep = jnp.concatenate([jnp.ones_like(seq_idx[:, :1]), seq_idx[:, 1:] == seq_idx[:, :-1]], 1).astype(x.dtype)

    def step(state, t):
        x_t, dt_t, b_t, c_t, keep_t = t  # [b, h, p], [b, h], [b, n], [b, n], [b]
        decay = (jnp.exp(dt_t * A) * keep_t[:, None])[..., None, None]
        state = decay * state + (dt_t[..., None] * x_t)[..., None] * b_t[:, None, None, :]
        return state, jnp.einsum("bhpn,bn->bhp", state, c_t)

    b, _, h, p = x.shape
    steps = (
        jnp.moveaxis(x, 1, 0),
        jnp.moveaxis(dt, 1, 0),
        jnp.moveaxis(B[:, :, 0], 1, 0),
        jnp.moveaxis(C[:, :, 0], 1, 0),
        jnp.moveaxis(keep, 1, 0),
    )
    _, y = jax.lax.scan(step, jnp.zeros((b, h, p, B.shape[-1]), x.dtype), steps)
    return jnp.moveaxis(y, 0, 1)


def gradient(fn):
    return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3, 4)))


def temp_bytes(fn, args) -> int:
    return gradient(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def seconds(fn, args, repeats=5) -> float:
    step = gradient(fn)
    jax.block_until_ready(step(*args))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"selective_scan {MAMBA}, ssd {MAMBA2}: forward + backward, float32")
    for name, ours, plain, build in (
        ("selective_scan", ours_selective, plain_selective, mamba_args),
        ("ssd", ours_ssd, plain_ssd, mamba2_args),
        ("ssd (seq_idx)", ours_packed_ssd, plain_packed_ssd, mamba2_args),
    ):
        base = None
        for length in LENGTHS:
            shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in build(length)]
            temp = temp_bytes(ours, shapes)
            base = base or temp
            growth = f"{temp / base:5.1f}x the 4k one for {length // LENGTHS[0]}x the length"
            print(f"  {name:15s} L={length:6d}: temp {temp / 2**20:8.1f} MiB ({growth})")
        for length in LENGTHS[:1]:
            args = build(length)
            ratio = seconds(ours, args) / seconds(plain, args)
            print(f"  {name:15s} L={length:6d}: time ours / plain lax.scan = {ratio:.2f}")


if __name__ == "__main__":
    main()
