"""Peak memory and time of attention forward+backward: jax_nkilib.attention vs jax.nn.dot_product_attention (CPU).

Run:
  python tests/benchmarks/bench_attention.py            # sweep over sequence lengths, ratios ours / jax.nn
  python tests/benchmarks/bench_attention.py --long     # issue 3's bar: seq 32768, 8 heads, head_dim 128, f32
  python tests/benchmarks/bench_attention.py --packed   # issue 13's bar: the same, 4 sequences packed by segment ids
                                                        # (jax_nkilib.dot_product_attention), peak under 3 GiB

The sweep's heads and head_dim are the arg spec ``attention.realistic``'s (``jax_nkilib/_src/tools/arg_specs``).
Each measurement runs in a fresh process (peak resident memory is per process), with causal attention, batch 1,
float32, and the gradient of sum(attention(q, k, v) * dy) with respect to q, k and v.
"""

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(impl: str, seq: int, heads: int, head_dim: int) -> dict:
    import jax
    import jax.numpy as jnp

    import jax_nkilib

    q, k, v, dy = (
        jax.random.normal(key, (1, seq, heads, head_dim), jnp.float32) for key in jax.random.split(jax.random.key(0), 4)
    )
    segment_ids = jnp.repeat(jnp.arange(4, dtype=jnp.int32), seq // 4)[None]
    attend = {
        "jax_nkilib": lambda a, b, c: jax_nkilib.attention(a, b, c, causal=True),
        "packed": lambda a, b, c: jax_nkilib.dot_product_attention(
            a, b, c, is_causal=True, query_segment_ids=segment_ids
        ),
        "xla": lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=True),
    }[impl]
    step = jax.jit(jax.grad(lambda a, b, c, g: jnp.sum(attend(a, b, c) * g), argnums=(0, 1, 2)))
    start = time.perf_counter()
    compiled = step.lower(q, k, v, dy).compile()
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v, dy))
    run_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    return {"impl": impl, "seq": seq, "run_s": run_s, "compile_s": compile_s, "peak_rss_gib": peak}


def in_child(impl: str, seq: int, heads: int, head_dim: int) -> dict:
    out = subprocess.run(
        [sys.executable, __file__, "--one", impl, str(seq), str(heads), str(head_dim)], capture_output=True, text=True
    )
    if out.returncode:
        return {"impl": impl, "seq": seq, "error": out.stderr.strip().splitlines()[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", nargs=4, metavar=("IMPL", "SEQ", "HEADS", "HEAD_DIM"))
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--packed", action="store_true")
    parser.add_argument("--seqs", default="1024,2048,4096,8192")
    opts = parser.parse_args()
    if opts.one:
        impl, seq, heads, head_dim = opts.one
        print(json.dumps(measure(impl, int(seq), int(heads), int(head_dim))))
        return
    if opts.long or opts.packed:
        result = in_child("packed" if opts.packed else "jax_nkilib", 32768, 8, 128)
        what = "dot_product_attention, 4 packed sequences," if opts.packed else "attention"
        print(
            f"jax_nkilib.{what} fwd+bwd seq=32768 heads=8 head_dim=128 f32 causal: run_s={result['run_s']:.1f} "
            f"compile_s={result['compile_s']:.1f} peak_rss_gib={result['peak_rss_gib']:.2f}"
        )
        return
    from jax_nkilib._src.tools.arg_specs import arg_spec

    _, _, heads, head_dim = arg_spec("attention.realistic").shapes()[0].shape
    print(
        f"seq    time ratio  memory ratio   (jax_nkilib / jax.nn.dot_product_attention; {heads} heads, "
        f"head_dim {head_dim})"
    )
    for seq in map(int, opts.seqs.split(",")):
        ours, theirs = in_child("jax_nkilib", seq, heads, head_dim), in_child("xla", seq, heads, head_dim)
        if "error" in theirs:
            print(
                f"{seq:<6} jax_nkilib {ours['run_s']:.2f}s {ours['peak_rss_gib']:.2f} GiB; jax.nn failed: "
                f"{theirs['error']}"
            )
            continue
        print(
            f"{seq:<6} {ours['run_s'] / theirs['run_s']:10.2f}  {ours['peak_rss_gib'] / theirs['peak_rss_gib']:12.2f}"
            f"   (peaks {ours['peak_rss_gib']:.2f} / {theirs['peak_rss_gib']:.2f} GiB)"
        )


if __name__ == "__main__":
    main()
