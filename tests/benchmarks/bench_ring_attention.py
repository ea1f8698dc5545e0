"""Ring attention over 8 CPU devices vs single-device blockwise jax_nkilib.attention: memory, time, agreement.

Run (not part of CI):
  python tests/benchmarks/bench_ring_attention.py               # total seq 65536, 8 heads, head_dim 64, f32, causal
  python tests/benchmarks/bench_ring_attention.py --seq 8192    # smaller

Both programs compute the output and the gradients of ``sum(out * dy)`` with respect to q, k and v (one
``jax.vjp``), batch 1, causal, float32. The ring runs in ``jax.shard_map`` with the sequence split over 8 CPU devices
(zigzag layout by default); the single-device program is ``jax_nkilib.attention`` on device 0. Reported:

* per-device peak memory from ``compiled.memory_analysis()``: temp + argument + output bytes of the compiled program
  (for the ring, the SPMD program of one device), and ring / single;
* the max abs difference between the two programs' output and gradients (the ring's put back in global order);
* wall time of one run each, after compilation, and ring / single. The 8 CPU "devices" share this machine's cores,
  so the time ratio measures overheads, not the speedup real devices would give.
"""

import argparse
import json
import os
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nkilib  # noqa: E402
from jax_nkilib._src.ops.ring_attention import ring_attention  # noqa: E402
from jax_nkilib._src.sharding.sequence_layouts import from_ring_layout, to_ring_layout  # noqa: E402
from jax_nkilib._src.tools.arg_specs import arg_spec  # noqa: E402

DEVICES = 8


def peak_bytes(compiled) -> int:
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes + stats.argument_size_in_bytes + stats.output_size_in_bytes


def forward_and_grads(attend):
    def run(q, k, v, dy):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out,) + vjp(dy)

    return run


def timed(compiled, *args):
    start = time.perf_counter()
    results = jax.block_until_ready(compiled(*args))
    return results, time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _, seq, heads, head_dim = arg_spec("ring_attention.realistic").shapes()[0].shape
    parser.add_argument("--seq", type=int, default=seq, help=f"total sequence length (default {seq})")
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--head-dim", type=int, default=head_dim)
    parser.add_argument("--layout", default="zigzag", choices=("zigzag", "striped", "contiguous"))
    opts = parser.parse_args()
    shape = (1, opts.seq, opts.heads, opts.head_dim)
    q, k, v, dy = (jax.random.normal(key, shape, jnp.float32) for key in jax.random.split(jax.random.key(0), 4))

    mesh = jax.make_mesh((DEVICES,), ("cp",))
    spec = P(None, "cp")
    ring_body = jax.shard_map(
        forward_and_grads(lambda a, b, c: ring_attention(a, b, c, axis_name="cp", causal=True, layout=opts.layout)),
        mesh=mesh,
        in_specs=(spec,) * 4,
        out_specs=(spec,) * 4,
    )
    placement = NamedSharding(mesh, spec)
    ring_args = tuple(
        jax.device_put(to_ring_layout(x, layout=opts.layout, axis_size=DEVICES), placement) for x in (q, k, v, dy)
    )
    start = time.perf_counter()
    ring = jax.jit(ring_body).lower(*ring_args).compile()
    ring_compile = time.perf_counter() - start

    device = jax.devices()[0]
    single_args = tuple(jax.device_put(x, device) for x in (q, k, v, dy))
    start = time.perf_counter()
    single = (
        jax.jit(forward_and_grads(lambda a, b, c: jax_nkilib.attention(a, b, c, causal=True)))
        .lower(*single_args)
        .compile()
    )
    single_compile = time.perf_counter() - start

    ring_results, ring_s = timed(ring, *ring_args)
    single_results, single_s = timed(single, *single_args)
    errors = {}
    for name, got, want in zip(("out", "dq", "dk", "dv"), ring_results, single_results):
        got = jax.device_get(from_ring_layout(jax.device_get(got), layout=opts.layout, axis_size=DEVICES))
        errors[name] = float(jnp.max(jnp.abs(got - jax.device_get(want))))

    ring_bytes, single_bytes = peak_bytes(ring), peak_bytes(single)
    report = {
        "seq": opts.seq,
        "heads": opts.heads,
        "head_dim": opts.head_dim,
        "layout": opts.layout,
        "devices": DEVICES,
        "ring_peak_bytes_per_device": ring_bytes,
        "single_peak_bytes": single_bytes,
        "memory_ratio": ring_bytes / single_bytes,
        "ring_memory": {
            k: getattr(ring.memory_analysis(), k)
            for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
        },
        "single_memory": {
            k: getattr(single.memory_analysis(), k)
            for k in ("temp_size_in_bytes", "argument_size_in_bytes", "output_size_in_bytes")
        },
        "ring_run_s": ring_s,
        "single_run_s": single_s,
        "time_ratio": ring_s / single_s,
        "ring_compile_s": ring_compile,
        "single_compile_s": single_compile,
        "max_abs_error": errors,
        "cpu_cores": os.cpu_count(),
    }
    print(
        f"seq={opts.seq} heads={opts.heads} head_dim={opts.head_dim} f32 causal fwd+bwd, {opts.layout} ring over "
        f"{DEVICES} CPU devices vs single-device jax_nkilib.attention ({os.cpu_count()} CPU cores)"
    )
    print(
        f"  peak memory per device: ring {ring_bytes / 2**20:.1f} MiB, single {single_bytes / 2**20:.1f} MiB, "
        f"ratio {ring_bytes / single_bytes:.3f}"
    )
    print(
        f"  run time: ring {ring_s:.2f} s, single {single_s:.2f} s, ratio {ring_s / single_s:.2f} "
        f"(compile {ring_compile:.1f} s / {single_compile:.1f} s)"
    )
    print("  max abs error ring vs single: " + ", ".join(f"{name} {err:.2e}" for name, err in errors.items()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
