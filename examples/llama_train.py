"""Train a tiny random Llama for a few optax steps, data x tensor parallel on 8 devices, and check it against one
device.

Run: python examples/llama_train.py   (on CPU it asks XLA for 8 host devices)

The mesh is ``data`` (2) x ``model`` (4) with explicit axes: the batch is split over ``data`` and the weights
Megatron-style over ``model`` (``jax_nkilib.models.llama.param_specs``). Every jax_nkilib op reads its inputs'
shardings and plans its own ``shard_map``; ``llama.train_step`` (``jax.value_and_grad`` of the next-token loss and
an optax update) is the same function on one device and on the mesh. The script runs the same steps on both and
reports the losses and the largest relative difference of the trained parameters.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from jax_nkilib.models import llama  # noqa: E402

CONFIG = llama.LlamaConfig(
    vocab=256, hidden=128, layers=2, heads=8, kv_heads=4, intermediate=256, max_len=64, rope_theta=10000.0
)
BATCH, SEQ, STEPS = 4, 16, 3
# jax.set_mesh (also a context manager) is JAX >= 0.8; JAX 0.7 has the context manager as jax.sharding.use_mesh
set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh


def synthetic_batch(key, config=CONFIG):
    """Token sequences that repeat a short random pattern (learnable), as (inputs, next-token targets)."""
    pattern = jax.random.randint(key, (BATCH, 5), 0, config.vocab)
    data = jnp.tile(pattern, (1, (SEQ + 1) // 5 + 1))[:, : SEQ + 1]
    return data[:, :-1], data[:, 1:]


def train(params, tokens, targets, optimizer, steps=STEPS, config=CONFIG):
    state = optimizer.init(params)
    losses = []
    for _ in range(steps):
        params, state, loss = llama.train_step(params, state, tokens, targets, config=config, optimizer=optimizer)
        losses.append(float(loss))
    return params, losses


def main(steps=STEPS, config=CONFIG):
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    key_params, key_data = jax.random.split(jax.random.key(0))
    params = llama.init_params(config, key_params)
    tokens, targets = synthetic_batch(key_data, config)
    optimizer = optax.sgd(0.5, momentum=0.9)  # SGD: rounding-level differences between layouts stay small

    one_device, want = train(params, tokens, targets, optimizer, steps, config)
    with set_mesh(mesh):
        place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        sharded = jax.tree.map(place, params, llama.param_specs(params), is_leaf=lambda s: isinstance(s, P))
        tokens_s, targets_s = (place(a, P("data")) for a in (tokens, targets))
        trained, got = train(sharded, tokens_s, targets_s, optimizer, steps, config)
        layout = trained["layers"][0]["w_qkv"].sharding.spec

    difference = max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b))))
        for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(one_device))
    )
    print(f"mesh {dict(mesh.shape)}; w_qkv sharded as {layout}")
    print("losses, 2x4 mesh:  ", " ".join(f"{loss:.4f}" for loss in got))
    print("losses, one device:", " ".join(f"{loss:.4f}" for loss in want))
    print(f"largest relative difference of the trained parameters: {difference:.2e}")
    return {"losses": got, "one_device_losses": want, "difference": difference, "layout": layout}


if __name__ == "__main__":
    main()
