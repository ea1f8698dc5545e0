"""`jax_nkilib.cross_entropy` against optax's `softmax_cross_entropy_with_integer_labels` on this machine (CPU):
forward + backward (``jax.value_and_grad`` of the mean loss) at a Llama-3 vocabulary.

Run: python tests/benchmarks/bench_cross_entropy.py [--tokens 4096 --vocab 131072 --dtype bfloat16 --repeats 3]

Reports ratios measured in one run (jax_nkilib / optax):
* run time: median over interleaved repeats of the jitted value_and_grad;
* memory: XLA's compiled ``memory_analysis()`` of each jitted value_and_grad, temporaries + outputs (the logits
  argument is the same for both and not counted). This is the buffer assignment's peak-free total of every
  temporary the program allocates, an upper bound of what it holds at once; nothing is executed to measure it.

On CPU jax_nkilib runs the kernels' JAX references: the forward's online log-sum-exp and the backward's gradient,
both over chunks of 16384 vocabulary columns, so the only ``[tokens, vocab]`` buffers are the gradient (in the
logits' dtype) and the backward kernel's result that the row scaling reads; optax materialises the float32
log-softmax and its gradient.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_nkilib


def ours(logits, labels):
    return jax_nkilib.cross_entropy(logits, labels)


def theirs(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def memory(compiled) -> int:
    stats = compiled.memory_analysis()
    return stats.temp_size_in_bytes + stats.output_size_in_bytes


def timed(fn, *args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def main(tokens: int = 4096, vocab: int = 131072, dtype: str = "bfloat16", repeats: int = 3) -> dict:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((tokens, vocab), np.float32) * 2, dtype)
    labels = jnp.asarray(rng.integers(0, vocab, tokens), jnp.int32)
    compiled = {
        name: jax.jit(jax.value_and_grad(fn)).lower(logits, labels).compile()
        for name, fn in (("jax_nkilib", ours), ("optax", theirs))
    }
    mem = {name: memory(c) for name, c in compiled.items()}
    (value, grad), (want, want_grad) = (jax.block_until_ready(c(logits, labels)) for c in compiled.values())
    times = {name: [] for name in compiled}
    for i in range(repeats):  # interleaved, alternating who goes first
        order = list(compiled.items()) if i % 2 == 0 else list(compiled.items())[::-1]
        for name, c in order:
            times[name].append(timed(c, logits, labels))
    median = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "time_ratio": median["jax_nkilib"] / median["optax"],
        "memory_ratio": mem["jax_nkilib"] / mem["optax"],
        "memory_bytes": mem,
        "loss_difference": abs(float(value) - float(want)),
        "grad_max_difference": float(jnp.max(jnp.abs(grad.astype(jnp.float32) - want_grad.astype(jnp.float32)))),
    }
    print(f"cross_entropy fwd+bwd, {tokens} tokens x vocab {vocab}, {dtype} logits, CPU ({jax.devices()[0]})")
    print(f"  run time  jax_nkilib / optax: {result['time_ratio']:.2f}  (median of {repeats} interleaved runs)")
    print(
        f"  memory    jax_nkilib / optax: {result['memory_ratio']:.2f}  (compiled temp + output: "
        f"{mem['jax_nkilib'] / 2**30:.2f} GiB vs {mem['optax'] / 2**30:.2f} GiB)"
    )
    loss_diff, grad_diff = result["loss_difference"], result["grad_max_difference"]
    print(f"  |loss difference| {loss_diff:.2e}, max |grad difference| {grad_diff:.2e}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    main(args.tokens, args.vocab, args.dtype, args.repeats)
