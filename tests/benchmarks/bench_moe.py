"""jax_nkilib.moe against two plain-JAX MoE layers on CPU: time and memory ratios, forward and forward+backward.

Run:
  python tests/benchmarks/bench_moe.py                      # 4096 tokens, hidden 1024, intermediate 512, top-2,
                                                            # 8 and 64 experts, float32
  python tests/benchmarks/bench_moe.py --experts 8 --tokens 1024

Baselines, written as a JAX user would:
* ``dense``: every token through every expert (one-hot einsums over all experts), then the routing weights;
* ``ragged_dot``: tokens sorted by expert, ``jax.lax.ragged_dot`` for the grouped matmuls, unsorted and combined.

Memory is XLA's own account of the compiled program (``memory_analysis``: temporaries + outputs), time the best
of ``--repeats`` runs after a warm-up; each line gives the baselines' numbers divided by ``jax_nkilib.moe``'s
(a ratio above 1: ours is faster or smaller).
"""

import argparse
import time

import jax
import jax.numpy as jnp

import jax_nkilib


def route(logits, top_k):
    weights, indices = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return indices, weights / weights.sum(-1, keepdims=True)


def ours(x, logits, w_gate_up, w_down, top_k):
    return jax_nkilib.moe(x, logits, w_gate_up, w_down, top_k=top_k, normalize=True)


def dense(x, logits, w_gate_up, w_down, top_k):
    indices, weights = route(logits, top_k)
    combine = jnp.zeros(logits.shape, x.dtype).at[jnp.arange(x.shape[0])[:, None], indices].add(weights)
    h = jnp.einsum("th,ehki->tkei", x, w_gate_up)
    y = jnp.einsum("tei,eih->teh", jax.nn.silu(h[:, 0]) * h[:, 1], w_down)
    return jnp.einsum("te,teh->th", combine, y)


def ragged(x, logits, w_gate_up, w_down, top_k):
    indices, weights = route(logits, top_k)
    num_experts = w_gate_up.shape[0]
    flat = indices.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    token = order // top_k
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    h = jax.lax.ragged_dot(x[token], w_gate_up.reshape(num_experts, x.shape[1], -1), sizes)
    inter = w_down.shape[1]
    y = jax.lax.ragged_dot(jax.nn.silu(h[:, :inter]) * h[:, inter:], w_down, sizes)
    y = y * weights.reshape(-1)[order][:, None]
    return jnp.zeros_like(x).at[token].add(y)


IMPLS = {"jax_nkilib.moe": ours, "dense": dense, "ragged_dot": ragged}


def measure(fn, args, backward: bool, repeats: int) -> tuple[float, float]:
    if backward:
        step = jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a[:4], a[4]) ** 2), argnums=(0, 1, 2, 3)), static_argnums=4)
    else:
        step = jax.jit(fn, static_argnums=4)
    compiled = step.lower(*args).compile()
    stats = compiled.memory_analysis()
    memory = stats.temp_size_in_bytes + stats.output_size_in_bytes
    jax.block_until_ready(compiled(*args[:4]))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args[:4]))
        best = min(best, time.perf_counter() - start)
    return best, memory


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--experts", default="8,64")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    keys = jax.random.split(jax.random.key(0), 4)
    for num_experts in map(int, opts.experts.split(",")):
        x = jax.random.normal(keys[0], (opts.tokens, opts.hidden), jnp.float32)
        logits = jax.random.normal(keys[1], (opts.tokens, num_experts), jnp.float32)
        w_gate_up = 0.02 * jax.random.normal(keys[2], (num_experts, opts.hidden, 2, opts.intermediate), jnp.float32)
        w_down = 0.02 * jax.random.normal(keys[3], (num_experts, opts.intermediate, opts.hidden), jnp.float32)
        args = (x, logits, w_gate_up, w_down, opts.top_k)
        for backward in (False, True):
            results = {name: measure(fn, args, backward, opts.repeats) for name, fn in IMPLS.items()}
            base_time, base_memory = results["jax_nkilib.moe"]
            line = [
                f"experts={num_experts} {'fwd+bwd' if backward else 'fwd'}: jax_nkilib.moe {base_time * 1e3:.0f} ms, "
                f"{base_memory / 2**20:.0f} MiB"
            ]
            for name in ("ragged_dot", "dense"):
                t, m = results[name]
                line.append(f"{name} time x{t / base_time:.2f} memory x{m / base_memory:.2f}")
            print("; ".join(line), flush=True)


if __name__ == "__main__":
    main()
