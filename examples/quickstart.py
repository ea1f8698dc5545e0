"""A tiny attention layer built from jax_nkilib ops, trained for a few steps on CPU.

Run: python examples/quickstart.py

The layer uses `jax_nkilib.rope` for the rotary embeddings and `jax_nkilib.attention` for causal grouped-query
attention. On CPU they run the kernels' JAX references; lowered for Neuron they become the NKI RoPE, attention_cte
and (in the gradient) attention_bwd kernels. The script jits a forward pass and a gradient step, then prints
`jax_nkilib.explain` of the step: every kernel call, its shapes, and whether Neuron would run the kernel.
"""

import jax
import jax.numpy as jnp

import jax_nkilib

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 2, 128, 4, 2, 64
MODEL = HEADS * HEAD_DIM
KV = KV_HEADS * HEAD_DIM


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0):
    """cos, sin of shape [seq, head_dim/2] for the standard RoPE frequencies."""
    inv_freq = base ** (-jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(seq)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(jnp.float32), jnp.sin(angles).astype(jnp.float32)


def init_params(key):
    k_qkv, k_out = jax.random.split(key)
    scale = MODEL ** -0.5
    return {"qkv": jax.random.normal(k_qkv, (MODEL, MODEL + 2 * KV), jnp.float32) * scale,
            "out": jax.random.normal(k_out, (MODEL, MODEL), jnp.float32) * scale}


def attention_layer(params, x, cos, sin):
    """Causal grouped-query self-attention with rotary embeddings on queries and keys. x: [batch, seq, model]."""
    q, k, v = jnp.split(x @ params["qkv"], [MODEL, MODEL + KV], axis=-1)
    q = q.reshape(BATCH, SEQ, HEADS, HEAD_DIM)
    k, v = (t.reshape(BATCH, SEQ, KV_HEADS, HEAD_DIM) for t in (k, v))
    q, k = jax_nkilib.rope(q, cos, sin), jax_nkilib.rope(k, cos, sin)
    out = jax_nkilib.attention(q, k, v, causal=True).reshape(BATCH, SEQ, MODEL)
    return out @ params["out"]


def loss_fn(params, x, target, cos, sin):
    return jnp.mean((attention_layer(params, x, cos, sin) - target) ** 2)


@jax.jit
def train_step(params, x, target, cos, sin, learning_rate=0.1):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target, cos, sin)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss


def main():
    key_params, key_x, key_target = jax.random.split(jax.random.key(0), 3)
    params = init_params(key_params)
    x = jax.random.normal(key_x, (BATCH, SEQ, MODEL), jnp.float32)
    target = jax.random.normal(key_target, (BATCH, SEQ, MODEL), jnp.float32)
    cos, sin = rotary_tables(SEQ, HEAD_DIM)

    out = jax.jit(attention_layer)(params, x, cos, sin)
    print(f"forward: output {out.shape} {out.dtype}")
    losses = []
    for _ in range(5):
        params, loss = train_step(params, x, target, cos, sin)
        losses.append(float(loss))
    print("training losses:", " ".join(f"{loss:.4f}" for loss in losses))
    print()
    print(jax_nkilib.explain(train_step, params, x, target, cos, sin))
    return losses


if __name__ == "__main__":
    main()
