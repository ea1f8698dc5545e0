"""A tiny attention layer with rotary embeddings from jax_nkilib, trained for a few steps on CPU.

Run: python examples/quickstart.py

The layer uses `jax_nkilib.rope` for the rotary embeddings; on CPU it runs the kernel's JAX reference, and lowered
for Neuron it becomes the NKI RoPE kernel. The script jits a forward pass and a gradient step, then prints
`jax_nkilib.explain` of the step: every kernel call, its shapes, and whether Neuron would run the kernel.
"""

import jax
import jax.numpy as jnp

import jax_nkilib

BATCH, SEQ, HEADS, HEAD_DIM = 2, 32, 4, 64
MODEL = HEADS * HEAD_DIM


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0):
    """cos, sin of shape [seq, head_dim/2] for the standard RoPE frequencies."""
    inv_freq = base ** (-jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(seq)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(jnp.float32), jnp.sin(angles).astype(jnp.float32)


def init_params(key):
    k_qkv, k_out = jax.random.split(key)
    scale = MODEL ** -0.5
    return {"qkv": jax.random.normal(k_qkv, (MODEL, 3 * MODEL), jnp.float32) * scale,
            "out": jax.random.normal(k_out, (MODEL, MODEL), jnp.float32) * scale}


def attention_layer(params, x, cos, sin):
    """Causal multi-head self-attention with rotary embeddings on queries and keys. x: [batch, seq, model]."""
    q, k, v = jnp.split(x @ params["qkv"], 3, axis=-1)
    q, k, v = (t.reshape(BATCH, SEQ, HEADS, HEAD_DIM) for t in (q, k, v))
    q, k = jax_nkilib.rope(q, cos, sin), jax_nkilib.rope(k, cos, sin)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(HEAD_DIM)
    causal = jnp.tril(jnp.ones((SEQ, SEQ), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(BATCH, SEQ, MODEL)
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
