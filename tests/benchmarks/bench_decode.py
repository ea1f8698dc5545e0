"""Tokens/s of ``jax_nkilib.models.llama.generate`` against the same Llama in plain JAX (CPU).

Run: python tests/benchmarks/bench_decode.py [--batch 4 --prompt 64 --steps 64 --repeats 7]

Both generate greedily from the same parameters: one prefill, then a ``lax.scan`` of decode steps. The plain model
uses ``jnp`` for the norms, projections, RoPE and SwiGLU MLP, ``jax.nn.dot_product_attention`` (causal for the
prefill; for each decode step over the whole cache with a mask of the filled positions) and a dense cache
``[batch, max_len, kv_heads, head_dim]`` updated by ``lax.dynamic_update_slice``. Reports the ratio of the two
tokens/s (jax_nkilib / plain, medians of interleaved repeats, one run), each absolute rate, and how many generated
tokens agree.
"""

import argparse
import functools
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_rope import run_time_ratio  # noqa: E402

from jax_nkilib.models import llama  # noqa: E402
from jax_nkilib.models.config import rope_tables  # noqa: E402

# a small Llama-3-shaped model: GQA 4:1, head_dim 64, SwiGLU at 2.75x, a 128-multiple cache
CONFIG = llama.LlamaConfig(
    vocab=8192, hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1408, max_len=256, rope_theta=500000.0
)


def plain_rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps) * w).astype(x.dtype)


def plain_rope(x, cos, sin):
    """Halves ``[x1 | x2]`` -> ``[x1 cos - x2 sin, x2 cos + x1 sin]``; tables broadcast over the heads."""
    x1, x2 = jnp.split(x, 2, axis=-1)
    cos, sin = cos[..., None, :], sin[..., None, :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def plain_layer(layer, config, x, cos, sin, attend):
    b, s, _ = x.shape
    h = plain_rms_norm(x, layer["attn_norm"], config.rms_eps)
    group = config.heads // config.kv_heads
    proj = jnp.einsum("bsh,hgjd->bsgjd", h, layer["w_qkv"])  # w_qkv grouped by kv head: [q heads | k | v]
    q = proj[:, :, :, :group].reshape(b, s, config.heads, config.head_dim)
    k, v = proj[:, :, :, group], proj[:, :, :, group + 1]
    out, cache = attend(plain_rope(q, cos, sin), plain_rope(k, cos, sin), v)
    x = x + out.reshape(b, s, -1) @ layer["w_o"]
    h = plain_rms_norm(x, layer["mlp_norm"], config.rms_eps)
    return x + (jax.nn.silu(h @ layer["w_gate"]) * (h @ layer["w_up"])) @ layer["w_down"], cache


def plain_logits(params, config, x):
    return plain_rms_norm(x, params["final_norm"], config.rms_eps) @ params["lm_head"]


@functools.partial(jax.jit, static_argnames=("config", "steps"))
def plain_generate(params, config, prompt, steps):
    batch, seq = prompt.shape
    shape = (batch, config.max_len, config.kv_heads, config.head_dim)
    x = params["embed"][prompt]
    cos, sin = rope_tables(config, jnp.arange(seq))
    caches = []
    for layer in params["layers"]:

        def prefill_attention(q, k, v):
            cache = tuple(jax.lax.dynamic_update_slice(jnp.zeros(shape, x.dtype), t, (0, 0, 0, 0)) for t in (k, v))
            return jax.nn.dot_product_attention(q, k, v, is_causal=True), cache

        x, cache = plain_layer(layer, config, x, cos, sin, prefill_attention)
        caches.append(cache)
    first = jnp.argmax(plain_logits(params, config, x[:, -1]), -1)

    def step(carry, _):
        token, position, caches = carry
        x = params["embed"][token][:, None]
        cos, sin = rope_tables(config, position[None, None])
        filled = (jnp.arange(config.max_len) <= position)[None, None, None, :]
        new_caches = []
        for layer, (k_cache, v_cache) in zip(params["layers"], caches):

            def decode_attention(q, k, v, k_cache=k_cache, v_cache=v_cache):
                k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, position, 0, 0))
                v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, position, 0, 0))
                return jax.nn.dot_product_attention(q, k_cache, v_cache, mask=filled), (k_cache, v_cache)

            x, cache = plain_layer(layer, config, x, cos, sin, decode_attention)
            new_caches.append(cache)
        token = jnp.argmax(plain_logits(params, config, x[:, 0]), -1)
        return (token, position + 1, new_caches), token

    _, rest = jax.lax.scan(step, (first, jnp.int32(seq), caches), None, length=steps - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1).astype(jnp.int32)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    opts = parser.parse_args()
    config = CONFIG
    params = llama.init_params(config, jax.random.key(0))
    prompt = jax.random.randint(jax.random.key(1), (opts.batch, opts.prompt), 0, config.vocab)
    print(
        f"{config.layers} layers, hidden {config.hidden}, {config.heads}/{config.kv_heads} heads of "
        f"{config.head_dim}, vocab {config.vocab}; batch {opts.batch}, prompt {opts.prompt}, {opts.steps} new "
        f"tokens; float32, {jax.devices()[0].platform}, {opts.repeats} repeats"
    )
    ours = lambda p, t: llama.generate(p, config, t, opts.steps)
    theirs = lambda p, t: plain_generate(p, config, t, opts.steps)
    args = (params, prompt)
    agree = float(np.mean(np.asarray(ours(*args)) == np.asarray(theirs(*args))))
    ratio, t_ours, t_theirs = run_time_ratio(ours, theirs, args, opts.repeats)
    tokens = opts.batch * opts.steps
    print(f"generate tokens/s: jax_nkilib {tokens / t_ours:.0f}, plain JAX {tokens / t_theirs:.0f}")
    print(
        f"tokens/s ratio (jax_nkilib / plain JAX) {1 / ratio:.3f}  "
        f"(medians {t_ours * 1e3:.1f} ms / {t_theirs * 1e3:.1f} ms per generate)"
    )
    print(f"generated tokens that agree: {agree:.1%}")


if __name__ == "__main__":
    main()
