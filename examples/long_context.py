"""Ring attention over 8 devices: a long causal sequence split along its length, trained through.

Run: python examples/long_context.py [--seq 16384]   (on CPU it asks XLA for 8 host devices)

The global sequence is put in the zigzag order (``to_ring_layout``: shard ``r`` holds chunks ``r`` and ``15 - r`` of
16, so causal work is the same on every shard) and split over mesh axis ``seq``. Inside ``jax.shard_map`` each device
keeps its queries while the key/value blocks travel around the ring (``lax.ppermute``); the backward pass is a ring
too. The script checks the ring's output and gradients against single-device ``jax_nkilib.attention`` on the whole
sequence and compares the per-device memory of the two compiled programs (``compiled.memory_analysis()``).
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nkilib  # noqa: E402

DEVICES, HEADS, HEAD_DIM = 8, 8, 64


def memory_bytes(compiled) -> int:
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes


def loss_and_grads(attend):
    """``sum(attend(q, k, v) * dy)`` and its gradients in q, k, v."""

    def run(q, k, v, dy):
        out, pullback = jax.vjp(attend, q, k, v)
        return (out, *pullback(dy))

    return run


def main(seq: int = 8192):
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, dy = (jax.random.normal(key, (1, seq, HEADS, HEAD_DIM), jnp.float32) for key in keys)
    mesh = jax.make_mesh((DEVICES,), ("seq",))
    spec = P(None, "seq")

    def ring_body(q, k, v, dy):
        return loss_and_grads(lambda *a: jax_nkilib.ring_attention(*a, axis_name="seq", layout="zigzag"))(q, k, v, dy)

    ring = jax.jit(jax.shard_map(ring_body, mesh=mesh, in_specs=(spec,) * 4, out_specs=(spec,) * 4))
    zigzag = [
        jax.device_put(jax_nkilib.to_ring_layout(x, layout="zigzag", axis_size=DEVICES), NamedSharding(mesh, spec))
        for x in (q, k, v, dy)
    ]
    ring_results = [jax_nkilib.from_ring_layout(x, layout="zigzag", axis_size=DEVICES) for x in ring(*zigzag)]

    single = jax.jit(loss_and_grads(lambda *a: jax_nkilib.attention(*a, causal=True)))
    single_results = single(q, k, v, dy)

    errors = {
        name: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
        for name, a, b in zip(("out", "dq", "dk", "dv"), ring_results, single_results)
    }
    ring_memory = memory_bytes(ring.lower(*zigzag).compile())
    single_memory = memory_bytes(single.lower(q, k, v, dy).compile())
    print(f"causal attention, seq {seq}, {HEADS} heads x {HEAD_DIM}, float32, forward + backward")
    print(
        f"ring over {DEVICES} devices vs one device, relative difference: "
        + ", ".join(f"{name} {error:.1e}" for name, error in errors.items())
    )
    print(
        f"per-device memory: ring {ring_memory / 2**20:.1f} MiB, single device {single_memory / 2**20:.1f} MiB "
        f"(ratio {ring_memory / single_memory:.3f})"
    )
    return {"errors": errors, "memory_ratio": ring_memory / single_memory}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=8192, help="total sequence length (a multiple of 16)")
    main(parser.parse_args().seq)
