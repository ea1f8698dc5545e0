"""A tiny DeepSeek-style multi-head latent attention (MLA) layer's prefill, dense and with the sparse top-k indexer.

Run: python examples/mla_prefill.py

The layer is pre-norm MLA with a residual, ``x + mla_attention(rms_norm(x))`` (DeepSeek-V3's attention block):
queries through the low-rank ``wq_a -> rms_norm -> wq_b``, keys and values from the shared KV latent ``c_kv``
(``wkv_a -> rms_norm -> wkv_b``), RoPE on the decoupled ``q_pe``/``k_pe`` heads, causal softmax, output projection.
With DeepSeek-V3.2's indexer each query attends only to its ``TOPK`` best-scoring earlier tokens. The script

1. runs the prefill of a random prompt, dense and sparse, in float32;
2. lowers the dense layer for Neuron (the dry-run compiler: no device needed) and lists its kernel calls: the
   ``rmsnorm_tkg`` norms, the ``RoPE`` rotations and ``attention_cte`` (the head dims here, ``dn + dr = 128``, fit
   it; DeepSeek-V3's 192 would fall back to the JAX reference with a ``NeuronFallbackWarning``).
"""

import jax
import jax.numpy as jnp

import jax_nkilib

BATCH, SEQ, MODEL, HEADS = 1, 128, 256, 4
Q_RANK, KV_RANK, NOPE, ROPE, V_DIM = 256, 256, 64, 64, 64
INDEX_HEADS, INDEX_DIM, TOPK = 4, 64, 32


def rotary_tables(seq: int, dim: int, base: float = 10000.0, dtype=jnp.float32):
    inv_freq = base ** (-jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
    angles = jnp.arange(seq, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(dtype), jnp.sin(angles).astype(dtype)


def init_params(key, dtype=jnp.float32):
    keys = jax.random.split(key, 10)
    normal = lambda k, shape: (jax.random.normal(k, shape) * shape[0] ** -0.5).astype(dtype)  # noqa: E731
    return {
        "norm": jnp.ones((MODEL,), dtype),
        "wq_a": normal(keys[0], (MODEL, Q_RANK)),
        "q_norm": jnp.ones((Q_RANK,), dtype),
        "wq_b": normal(keys[1], (Q_RANK, HEADS, NOPE + ROPE)),
        "wkv_a": normal(keys[2], (MODEL, KV_RANK + ROPE)),
        "kv_norm": jnp.ones((KV_RANK,), dtype),
        "wkv_b": normal(keys[3], (KV_RANK, HEADS, NOPE + V_DIM)),
        "wo": normal(keys[4], (HEADS, V_DIM, MODEL)) * HEADS**-0.5,
        "indexer": (
            normal(keys[5], (Q_RANK, INDEX_HEADS, INDEX_DIM)),
            normal(keys[6], (MODEL, INDEX_DIM)),
            normal(keys[7], (MODEL, INDEX_HEADS)),
        ),
    }


def attention_weights(params):
    """The MLA operands after ``x``, in ``mla_attention``'s order (without the tables)."""
    names = ("wq_a", "q_norm", "wq_b", "wkv_a", "kv_norm", "wkv_b", "wo")
    return tuple(params[name] for name in names)


def mla_layer(params, x, cos, sin, sparse=False):
    """x: [batch, seq, model] -> [batch, seq, model]."""
    h = jax_nkilib.rms_norm(x, params["norm"])
    extra = {"indexer": params["indexer"], "index_topk": TOPK} if sparse else {}
    return x + jax_nkilib.mla_attention(h, *attention_weights(params), cos, sin, **extra)


def main():
    params = init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, MODEL), jnp.float32)
    cos, sin = rotary_tables(SEQ, ROPE)
    dense = jax.jit(mla_layer)(params, x, cos, sin)
    sparse = jax.jit(mla_layer, static_argnames="sparse")(params, x, cos, sin, sparse=True)
    difference = float(jnp.abs(dense - sparse)[:, TOPK:].max())  # the first TOPK queries see every earlier token
    print(
        f"prefill of {SEQ} tokens: output {dense.shape}, sparse (top-{TOPK}) vs dense max difference {difference:.3f}"
    )
    with jax_nkilib.neuron.dry_run():
        text = jax_nkilib.neuron_hlo(mla_layer, params, x, cos, sin)
    print("Neuron kernel calls of the dense layer:", jax_nkilib.explain(mla_layer, params, x, cos, sin))
    return {
        "params": params,
        "x": x,
        "cos": cos,
        "sin": sin,
        "dense": dense,
        "sparse": sparse,
        "neuron_hlo": text,
    }


if __name__ == "__main__":
    main()
