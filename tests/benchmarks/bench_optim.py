"""Time of one optimizer step: jax_nkilib.optim.adamw vs optax.adamw over a Llama-shaped parameter pytree (CPU).

Run:
  python tests/benchmarks/bench_optim.py              # Llama-3.2-1B's shapes at hidden 1024, 4 layers (~125M params)
  python tests/benchmarks/bench_optim.py --layers 2   # smaller

Each step is ``update`` + ``optax.apply_updates`` under ``jax.jit`` with the parameters and the state donated, in
float32. Both optimizers run in this one process, interleaved, after a warm-up; the report is the ratio of the
median step times (ours / optax), not an absolute time. On CPU ours is the JAX reference of the fused kernel (per
leaf, flattened) plus the ``new_params - params`` deltas optax's interface needs; on Neuron each leaf is one
``adamw_kernel`` call.
"""

import argparse
import statistics
import time


def llama_shapes(hidden: int, layers: int, vocab: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    """Parameter shapes of a Llama decoder (embedding, per-layer attention/MLP/norms, final norm, LM head)."""
    head_dim = hidden // heads
    shapes = {"embed": (vocab, hidden), "final_norm": (hidden,), "lm_head": (hidden, vocab)}
    for i in range(layers):
        shapes.update(
            {
                f"layer{i}.wq": (hidden, heads * head_dim),
                f"layer{i}.wk": (hidden, kv_heads * head_dim),
                f"layer{i}.wv": (hidden, kv_heads * head_dim),
                f"layer{i}.wo": (heads * head_dim, hidden),
                f"layer{i}.w_gate": (hidden, intermediate),
                f"layer{i}.w_up": (hidden, intermediate),
                f"layer{i}.w_down": (intermediate, hidden),
                f"layer{i}.attn_norm": (hidden,),
                f"layer{i}.mlp_norm": (hidden,),
            }
        )
    return shapes


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import optax

    from jax_nkilib import optim

    shapes = llama_shapes(args.hidden, args.layers, args.vocab, 32 * args.hidden // 2048, 8, 4 * args.hidden)
    keys = dict(zip(shapes, jax.random.split(jax.random.key(0), len(shapes))))
    params = {name: jax.random.normal(keys[name], shape, jnp.float32) * 0.02 for name, shape in shapes.items()}
    grads = {name: jax.random.normal(jax.random.fold_in(keys[name], 1), p.shape, p.dtype) for name, p in params.items()}
    count = sum(p.size for p in params.values())
    print(f"{len(params)} leaves, {count / 1e6:.0f}M parameters, float32")

    transforms = {"jax_nkilib": optim.adamw(1e-3, weight_decay=0.01), "optax": optax.adamw(1e-3, weight_decay=0.01)}
    steps, states = {}, {}
    for name, transform in transforms.items():

        def step(params, state, grads, transform=transform):
            updates, state = transform.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        steps[name] = jax.jit(step, donate_argnums=(0, 1))
        states[name] = (jax.tree.map(jnp.copy, params), transform.init(params))
        states[name] = jax.block_until_ready(steps[name](*states[name], grads))  # compile and warm up

    times = {name: [] for name in transforms}
    for _ in range(args.steps):
        for name in transforms:  # interleaved: both see the same machine load
            start = time.perf_counter()
            states[name] = jax.block_until_ready(steps[name](*states[name], grads))
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"step time ratio jax_nkilib.optim.adamw / optax.adamw: {medians['jax_nkilib'] / medians['optax']:.2f}")


if __name__ == "__main__":
    main()
