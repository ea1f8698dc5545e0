"""GPU: jax_nkilib.dot_product_attention against jax.nn.dot_product_attention(implementation="cudnn"), fwd+bwd.

Run on a machine with a CUDA GPU and jax[cuda]:
  python tests/benchmarks/bench_gpu_attention.py

Reports, for causal bf16 self-attention (batch 2, 16 heads, head_dim 128) at several sequence lengths, time ratios
measured in one run against cuDNN through jax.nn (lower is faster):
  default   jax_nkilib.dot_product_attention with no implementation: on a GPU it should be cuDNN itself (ratio ~1),
            and the lowered HLO is checked to hold the cuDNN custom call;
  soft-cap  the same call with logits_soft_cap (Gemma 2), which cuDNN cannot do: the blockwise engine;
  xla       jax.nn.dot_product_attention(implementation="xla") (the score matrix materialized), for scale.
"""

import time

import jax
import jax.numpy as jnp

import jax_nkilib


def timed(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))  # compile and warm up
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / repeats


def step(attend):
    return jax.jit(jax.grad(lambda q, k, v, g: jnp.sum(attend(q, k, v).astype(jnp.float32) * g), argnums=(0, 1, 2)))


def main():
    assert jax.default_backend() == "gpu", f"needs a GPU; JAX's backend is {jax.default_backend()}"
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}")
    impls = {
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn"),
        "default": lambda q, k, v: jax_nkilib.dot_product_attention(q, k, v, is_causal=True),
        "soft-cap": lambda q, k, v: jax_nkilib.dot_product_attention(q, k, v, is_causal=True, logits_soft_cap=50.0),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla"),
    }
    print("seq     default/cudnn  soft-cap/cudnn  xla/cudnn   (fwd+bwd time ratios; cudnn ms)")
    for seq in (1024, 4096, 8192):
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v, g = (jax.random.normal(key, (2, seq, 16, 128), jnp.bfloat16) for key in keys)
        hlo = jax.jit(impls["default"]).lower(q, k, v).as_text()
        assert "__cudnn$fmha" in hlo, "the default did not lower to cuDNN attention"
        times = {}
        for name, attend in impls.items():
            try:
                times[name] = timed(step(attend), q, k, v, g)
            except Exception as err:  # e.g. xla out of memory at long sequences
                times[name] = float("nan")
                print(f"  {name} failed at seq {seq}: {type(err).__name__}: {str(err)[:100]}")
        base = times["cudnn"]
        print(
            f"{seq:<7} {times['default'] / base:13.2f}  {times['soft-cap'] / base:14.2f}  {times['xla'] / base:9.2f}"
            f"   ({base * 1e3:.2f} ms)"
        )


if __name__ == "__main__":
    main()
