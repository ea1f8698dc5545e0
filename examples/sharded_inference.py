"""The quickstart transformer block on 8 devices: data parallel x tensor parallel, with no hand-written shard_map.

Run: python examples/sharded_inference.py   (on CPU it asks XLA for 8 host devices)

The mesh is ``data`` (4) x ``model`` (2) with explicit axes. The batch is split over ``data``; the weights are split
Megatron-style over ``model``: q/k/v projections by columns (so each device owns whole heads), the output projection
and the MLP down projection by rows, the gate/up projections by columns. Each jax_nkilib op reads its inputs'
shardings and plans its own ``shard_map``: norms, RoPE and attention run on local shards with no communication, and
the row-parallel output projection and MLP each end with one all-reduce, the two a hand-written Megatron layer
needs. The script checks the result against the unsharded block, counts the collectives XLA compiled, and prints
the Neuron program's kernel calls: each sits inside the manual computation at per-device shapes.
"""

import os
import re
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import quickstart  # noqa: E402

import jax_nkilib  # noqa: E402

BATCH = 4
# jax.set_mesh (also a context manager) is JAX >= 0.8; JAX 0.7 has the context manager as jax.sharding.use_mesh
set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")


def split_qkv(params):
    """The fused [model, (q + 2 kv) heads * d] projection as (w_q, w_k, w_v), so heads can be split by columns."""
    q_cols, kv_cols = quickstart.HEADS * quickstart.HEAD_DIM, quickstart.KV_HEADS * quickstart.HEAD_DIM
    w = params["qkv"]
    return {**params, "qkv": (w[:, :q_cols], w[:, q_cols : q_cols + kv_cols], w[:, q_cols + kv_cols :])}


def param_specs():
    """Megatron tensor parallelism over `model`."""
    return {
        "attn_norm": P(),
        "qkv": (P(None, "model"),) * 3,
        "out": P("model"),
        "mlp_norm": P(),
        "gate": P(None, "model"),
        "up": P(None, "model"),
        "down": P("model"),
    }


def place(mesh, tree, specs):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs, is_leaf=lambda s: isinstance(s, P)
    )


def collective_counts(compiled_text: str) -> dict[str, int]:
    found = re.findall(r"\b(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", compiled_text)
    return {name: found.count(name) for name in sorted(set(found))}


def kernel_calls(neuron_text: str) -> list[tuple[str, list]]:
    """(kernel, per-device input shapes) of every NKI custom call in a Neuron StableHLO module."""
    calls = []
    for encoded in re.findall(r'@AwsNeuronCustomNativeKernel\(.*?backend_config = "([A-Za-z0-9+/=]*)"', neuron_text):
        config = jax_nkilib.neuron.decode_backend_config(encoded)
        calls.append((config["func_name"], [shape for shape, _ in config["input_specs"]]))
    return calls


def main():
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    key_params, key_x = jax.random.split(jax.random.key(0))
    params = split_qkv(quickstart.init_params(key_params))
    x = jax.random.normal(key_x, (BATCH, quickstart.SEQ, quickstart.MODEL), jnp.float32)
    cos, sin = quickstart.rotary_tables(quickstart.SEQ, quickstart.HEAD_DIM)
    expected = jax.jit(quickstart.transformer_block)(params, x, cos, sin)

    with set_mesh(mesh):
        sharded_params = place(mesh, params, param_specs())
        sharded_x = jax.device_put(x, NamedSharding(mesh, P("data")))
        block = jax.jit(quickstart.transformer_block)
        out = block(sharded_params, sharded_x, cos, sin)
        counts = collective_counts(block.lower(sharded_params, sharded_x, cos, sin).compile().as_text())
        with jax_nkilib.neuron.dry_run():
            neuron_text = jax_nkilib.neuron_hlo(quickstart.transformer_block, sharded_params, sharded_x, cos, sin)

    error = float(jnp.max(jnp.abs(out - expected)) / jnp.max(jnp.abs(expected)))
    calls = kernel_calls(neuron_text)
    print(f"mesh {dict(mesh.shape)}; output {out.shape} sharded as {out.sharding.spec}")
    print(f"relative difference to the unsharded block: {error:.2e}")
    print(f"collectives in the compiled program: {counts}")
    print(
        f"Neuron program: {len(calls)} NKI kernel calls inside {neuron_text.count('sdy.manual_computation')} "
        "manual computations, at per-device shapes:"
    )
    for name, shapes in calls:
        print(f"  {name}{tuple(tuple(s) for s in shapes)}")
    return {
        "error": error,
        "collectives": counts,
        "kernels": [name for name, _ in calls],
        "manual": "sdy.manual_computation" in neuron_text,
    }


if __name__ == "__main__":
    main()
