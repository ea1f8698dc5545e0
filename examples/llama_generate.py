"""Generate tokens with a tiny random Llama: one prefill, then a jitted decode loop over a KV cache.

Run: python examples/llama_generate.py [--batch 2 --prompt 16 --steps 32]

``jax_nkilib.models.llama.generate`` prefills the prompt (writing each layer's keys and values into the cache) and
runs ``lax.scan`` over ``decode_step``, which per layer projects the new token's q/k/v (RMSNorm and RoPE fused into
the qkv op), writes its key and value into the cache in place, attends over the cache (``decode_attention``) and
applies the output projection and the MLP. The script prints the tokens, the decode rate and ``jax_nkilib.explain``
of one decode step: the kernel calls it would make on Neuron.
"""

import argparse
import time

import jax

import jax_nkilib
from jax_nkilib.models import llama

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
    return {"greedy": greedy, "sampled": sampled, "tokens_per_second": rate, "explanation": explanation}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--steps", type=int, default=32)
    opts = parser.parse_args()
    main(opts.batch, opts.prompt, opts.steps)
