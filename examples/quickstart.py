"""A small transformer block built from jax_nkilib ops, trained for a few steps on CPU.

Run: python examples/quickstart.py

The block is pre-norm: ``rms_norm -> qkv_projection -> rope -> attention -> output_projection`` with a residual add,
then ``rms_norm -> mlp`` (SwiGLU) with a residual add. On CPU every op runs its kernel's JAX reference; lowered for
Neuron each op becomes one NKI kernel (rmsnorm_tkg, qkv, RoPE, attention_cte, output_projection_cte, mlp); the
training step adds the loss (cross_entropy_forward, and cross_entropy_backward in the gradient), attention_bwd and
one fused adamw_kernel per parameter. The script jits a forward pass and a training step (AdamW through
``jax_nkilib.optim``), trains for a few steps, and prints
`jax_nkilib.explain` of the forward: every kernel call, its shapes, and whether Neuron would run the kernel.
"""

import jax
import jax.numpy as jnp

import jax_nkilib

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2, 128, 4, 2, 64, 512
MODEL = HEADS * HEAD_DIM


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0):
    """cos, sin of shape [seq, head_dim/2] for the standard RoPE frequencies."""
    inv_freq = base ** (-jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(seq)[:, None] * inv_freq[None, :]
    return jnp.cos(angles).astype(jnp.float32), jnp.sin(angles).astype(jnp.float32)


def init_params(key):
    keys = jax.random.split(key, 5)
    normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * shape[0] ** -0.5  # noqa: E731
    return {
        "attn_norm": jnp.ones((MODEL,), jnp.float32),
        "qkv": normal(keys[0], (MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM)),
        "out": normal(keys[1], (MODEL, MODEL)),
        "mlp_norm": jnp.ones((MODEL,), jnp.float32),
        "gate": normal(keys[2], (MODEL, INTERMEDIATE)),
        "up": normal(keys[3], (MODEL, INTERMEDIATE)),
        "down": normal(keys[4], (INTERMEDIATE, MODEL)),
    }


def transformer_block(params, x, cos, sin):
    """x: [batch, seq, model] -> [batch, seq, model]."""
    h = jax_nkilib.rms_norm(x, params["attn_norm"])
    q, k, v = jax_nkilib.qkv_projection(h, params["qkv"], num_q_heads=HEADS, num_kv_heads=KV_HEADS)
    q, k = jax_nkilib.rope(q, cos, sin), jax_nkilib.rope(k, cos, sin)
    x = x + jax_nkilib.output_projection(jax_nkilib.attention(q, k, v, causal=True), params["out"])
    h = jax_nkilib.rms_norm(x, params["mlp_norm"])
    return x + jax_nkilib.mlp(h, params["gate"], params["up"], params["down"], activation="silu")


OPTIMIZER = jax_nkilib.optim.adamw(1e-3)  # optax.adamw's updates, on the fused adamw_kernel (optax not needed)


def loss_fn(params, x, labels, cos, sin):
    """The block's output read as logits over ``MODEL`` classes, against integer ``labels [batch, seq]``."""
    return jax_nkilib.cross_entropy(transformer_block(params, x, cos, sin), labels)


@jax.jit
def train_step(params, opt_state, x, labels, cos, sin):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, labels, cos, sin)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, params)
    return jax.tree.map(jnp.add, params, updates), opt_state, loss


def main():
    key_params, key_x, key_target = jax.random.split(jax.random.key(0), 3)
    params = init_params(key_params)
    x = jax.random.normal(key_x, (BATCH, SEQ, MODEL), jnp.float32)
    labels = jax.random.randint(key_target, (BATCH, SEQ), 0, MODEL)
    cos, sin = rotary_tables(SEQ, HEAD_DIM)

    out = jax.jit(transformer_block)(params, x, cos, sin)
    print(f"forward: output {out.shape} {out.dtype}")
    losses, opt_state = [], OPTIMIZER.init(params)
    for _ in range(5):
        params, opt_state, loss = train_step(params, opt_state, x, labels, cos, sin)
        losses.append(float(loss))
    print("training losses:", " ".join(f"{loss:.4f}" for loss in losses))
    print()
    print(jax_nkilib.explain(transformer_block, params, x, cos, sin))
    return losses


if __name__ == "__main__":
    main()
