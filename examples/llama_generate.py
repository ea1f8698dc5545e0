"""Generate tokens with a tiny random Llama: one prefill, then a jitted decode loop over a KV cache.

Run: python examples/llama_generate.py [--batch 2 --prompt 16 --steps 32]

``jax_nkilib.models.llama.generate`` prefills the prompt (writing each layer's keys and values into the cache) and
runs ``lax.scan`` over ``decode_step``. Per layer a decode step is ``jax_nkilib.decode_block`` (RMSNorm, QKV, RoPE,
the cache write in place, attention over the cache, output projection) and the MLP. The script prints the tokens,
the decode rate and ``jax_nkilib.explain`` of one decode step, the kernel calls it would make on Neuron: on one
device (two kv heads: ``qkv``, ``attention_tkg``, ``output_projection_tkg``, ``mlp`` per layer), then tensor-parallel
over the kv heads on a mesh of ``kv_heads`` CPU devices, where each device holds one kv head and each layer's
attention half is one fused ``attention_block_tkg`` kernel.
"""

import argparse
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts: 8 CPU devices

import jax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nkilib  # noqa: E402
from jax_nkilib.models import llama  # noqa: E402

# jax.set_mesh (also a context manager) is JAX >= 0.8; JAX 0.7 has the context manager as jax.sharding.use_mesh
set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh

CONFIG = llama.LlamaConfig(
    vocab=512, hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512, max_len=128, rope_theta=10000.0
)


def main(batch=2, prompt_len=16, steps=32, config=CONFIG):
    key_params, key_prompt, key_sample = jax.random.split(jax.random.key(0), 3)
    params = llama.init_params(config, key_params)
    prompt = jax.random.randint(key_prompt, (batch, prompt_len), 0, config.vocab)

    greedy = llama.generate(params, config, prompt, steps).block_until_ready()  # compiles, then runs
    start = time.perf_counter()
    greedy = llama.generate(params, config, prompt, steps).block_until_ready()
    seconds = time.perf_counter() - start
    sampled = llama.generate(params, config, prompt, steps, key=key_sample, temperature=0.8, top_k=20, top_p=0.9)
    rate = batch * steps / seconds
    print(f"{config.layers} layers, hidden {config.hidden}, {config.heads} heads / {config.kv_heads} kv heads")
    print(
        f"prompt {tuple(prompt.shape)}; {steps} new tokens per sequence in {seconds * 1e3:.1f} ms: {rate:.0f} tokens/s"
    )
    print("greedy: ", greedy[0].tolist())
    print("sampled:", sampled[0].tolist())

    cache = llama.init_cache(config, batch)
    token = greedy[:, 0]
    print()
    step = lambda params, token, cache: llama.decode_step(params, config, token, prompt_len, cache)  # noqa: E731
    explanation = jax_nkilib.explain(step, params, token, cache)
    print(explanation)
    result = {"greedy": greedy, "sampled": sampled, "tokens_per_second": rate, "explanation": explanation}
    if len(jax.devices()) >= config.kv_heads:
        print(f"\ntensor-parallel over {config.kv_heads} devices (one kv head each):")
        result["tensor_parallel_explanation"] = explain_tensor_parallel(step, params, token, cache, config.kv_heads)
        print(result["tensor_parallel_explanation"])
    return result


def explain_tensor_parallel(step, params, token, cache, devices: int):
    """``explain`` of ``step`` with the weights split by ``llama.param_specs`` over a ``model`` axis of ``devices``
    devices and the caches over their kv heads."""
    mesh = jax.make_mesh((devices,), ("model",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:devices])
    with set_mesh(mesh):
        placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), llama.param_specs(params)))
        cache = jax.device_put(cache, NamedSharding(mesh, P(None, "model")))
        return jax_nkilib.explain(step, placed, jax.device_put(token, NamedSharding(mesh, P())), cache)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    opts = parser.parse_args()
    main(opts.batch, opts.prompt, opts.steps)
