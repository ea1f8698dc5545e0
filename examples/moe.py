"""A Mixtral-style mixture-of-experts block trained on CPU, then run expert-parallel over 8 devices.

Run: python examples/moe.py   (on CPU it asks XLA for 8 host devices)

The block is pre-norm attention (``rms_norm -> qkv_projection (RoPE) -> attention -> output_projection``) and a
sparse MoE feed-forward: ``rms_norm -> jax_nkilib.router -> jax_nkilib.moe`` with 8 SwiGLU experts, each token sent
to its top-2 experts with their renormalised softmax weights (Mixtral's routing). Lowered for Neuron the MoE half is
the ``router_topk`` kernel and ``moe_cte`` (``moe_tkg`` for a decode step of few tokens), and its gradient adds
``blockwise_mm_bwd``. ``jax_nkilib.moe`` is dropless: no
token is dropped whatever the experts' loads. The script

1. trains the block for a few steps on one device;
2. runs it expert-parallel on a ``data`` (2) x ``expert`` (4) mesh: tokens are split over both axes and the experts
   over ``expert``, so each device owns 2 experts and its tokens travel to their experts' devices and back by
   all-to-alls (``moe`` plans this itself from the inputs' shardings); it checks the result and the gradients
   against one device and counts the collectives XLA compiled;
3. prints ``jax_nkilib.explain`` of the block.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import re  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_nkilib  # noqa: E402

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 4, 64, 4, 2, 32
MODEL, EXPERTS, TOP_K, INTERMEDIATE = HEADS * HEAD_DIM, 8, 2, 96
# jax.set_mesh (also a context manager) is JAX >= 0.8; JAX 0.7 has the context manager as jax.sharding.use_mesh
set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def rotary_tables(seq: int, head_dim: int, base: float = 10000.0):
    inv_freq = base ** (-jnp.arange(0, head_dim, 2) / head_dim)
    angles = jnp.arange(seq)[:, None] * inv_freq[None, :]
    return jnp.cos(angles), jnp.sin(angles)


def init_params(key):
    keys = jax.random.split(key, 5)
    normal = lambda k, shape, fan_in: jax.random.normal(k, shape, jnp.float32) * fan_in**-0.5  # noqa: E731
    return {
        "attn_norm": jnp.ones((MODEL,), jnp.float32),
        "qkv": normal(keys[0], (MODEL, (HEADS + 2 * KV_HEADS) * HEAD_DIM), MODEL),
        "out": normal(keys[1], (MODEL, MODEL), MODEL),
        "moe_norm": jnp.ones((MODEL,), jnp.float32),
        "router": normal(keys[2], (MODEL, EXPERTS), MODEL),
        "gate_up": normal(keys[3], (EXPERTS, MODEL, 2, INTERMEDIATE), MODEL),  # the kernels' [E, H, 2, I]
        "down": normal(keys[4], (EXPERTS, INTERMEDIATE, MODEL), INTERMEDIATE),
    }


def moe_layer(params, x):
    """The MoE feed-forward with its residual: x [..., model] -> [..., model]."""
    h = jax_nkilib.rms_norm(x, params["moe_norm"])
    routing = jax_nkilib.router(h, params["router"], top_k=TOP_K, normalize=True)
    return x + jax_nkilib.moe(h, routing, params["gate_up"], params["down"])


def moe_block(params, x, cos, sin):
    """x: [batch, seq, model] -> [batch, seq, model]."""
    h = jax_nkilib.rms_norm(x, params["attn_norm"])
    q, k, v = jax_nkilib.qkv_projection(h, params["qkv"], num_q_heads=HEADS, num_kv_heads=KV_HEADS, rope=(cos, sin))
    x = x + jax_nkilib.output_projection(jax_nkilib.attention(q, k, v, causal=True), params["out"])
    return moe_layer(params, x)


def loss_fn(params, x, target, cos, sin):
    return jnp.mean((moe_block(params, x, cos, sin) - target) ** 2)


@jax.jit
def train_step(params, x, target, cos, sin, learning_rate=0.5):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target, cos, sin)
    return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss


def expert_parallel(params, x, target, cos, sin):
    """The MoE layer and its gradients on a data x expert mesh (attention needs whole sequences, so this splits
    the tokens freely); returns (output, gradients, compiled collectives)."""
    mesh = jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Explicit,) * 2)
    expert_split = {"gate_up": P("expert"), "down": P("expert")}
    specs = {name: expert_split.get(name, P()) for name in params}
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    with set_mesh(mesh):
        placed = {name: put(value, specs[name]) for name, value in params.items()}
        tokens = P(("data", "expert"))  # the batch over both axes: each device holds one sequence's half
        xs, ts = put(x.reshape(-1, SEQ // 2, MODEL), tokens), put(target.reshape(-1, SEQ // 2, MODEL), tokens)
        forward = jax.jit(moe_layer)
        out = forward(placed, xs)
        compiled = forward.lower(placed, xs).compile().as_text()
        grads = jax.jit(jax.grad(lambda p, a, t: jnp.mean((moe_layer(p, a) - t) ** 2)))(placed, xs, ts)
    counts = {name: len(re.findall(rf"\s{name}(?:-start)?\(", compiled)) for name in COLLECTIVES}
    return jax.device_get(out).reshape(x.shape), jax.device_get(grads), {name: n for name, n in counts.items() if n}


def main():
    key_params, key_x, key_target = jax.random.split(jax.random.key(0), 3)
    params = init_params(key_params)
    x = jax.random.normal(key_x, (BATCH, SEQ, MODEL), jnp.float32)
    target = jax.random.normal(key_target, (BATCH, SEQ, MODEL), jnp.float32)
    cos, sin = rotary_tables(SEQ, HEAD_DIM)

    losses = []
    for _ in range(5):
        params, loss = train_step(params, x, target, cos, sin)
        losses.append(float(loss))
    print("training losses:", " ".join(f"{loss:.4f}" for loss in losses))

    out, grads, collectives = expert_parallel(params, x, target, cos, sin)
    single = moe_layer(params, x)
    single_grads = jax.grad(lambda p: jnp.mean((moe_layer(p, x) - target) ** 2))(params)
    error = float(jnp.max(jnp.abs(out - single)))
    grad_error = max(
        float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(single_grads))
    )
    print(f"expert-parallel MoE on 2x4 devices: max |difference| {error:.2e} (output), {grad_error:.2e} (gradients)")
    print("collectives of the expert-parallel forward:", collectives)
    print()
    print(jax_nkilib.explain(moe_block, params, x, cos, sin))
    return {"losses": losses, "error": error, "grad_error": grad_error, "collectives": collectives}


if __name__ == "__main__":
    main()
