"""A sharded training step of a small Llama-style block compiles and matches one device (issue 11).

The block is pre-norm attention and a SwiGLU MLP (``rms_norm``, ``qkv_projection`` with split weights, ``rope``,
``attention``, ``output_projection``, ``rms_norm``, ``mlp``); the step is ``jax.value_and_grad`` and an SGD update
with momentum written in plain JAX, under ``jax.jit``. Each layout splits the block the ways the README's sharding
table allows:

* ``data``: the batch over ``data``, every weight replicated (plain data parallelism; on a 2-D mesh ``model`` is
  left unused, the layout that failed to compile before the fix);
* ``megatron``: the batch over ``data``, heads and the MLP's intermediate over ``model`` (the README's layout: q/k/v
  column-parallel, the output projection and the down projection row-parallel, each ending in one all-reduce);
* ``tensor``: only the heads and the intermediate split (over ``model``; over ``data`` on the 1-D mesh);
* ``sequence``: the batch over ``data`` and the sequence over ``model`` (ring attention), weights replicated.

Each step's loss, gradients and updated parameters must match one device's, the parameters keep their shardings,
and the forward program holds one manual computation per op call (eight), none nested. Every test runs in a
subprocess under a time limit (``tests/support/isolation.py``): before the fix the 8x1 mesh hung in JAX's lowering.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from tests.support.data import angles, random
from tests.support.hlo import manual_computations
from tests.support.isolation import time_limit
from tests.support.numerics import relative_error, tolerance

# 64 tokens: the qkv, output projection and MLP kernels take their TKG paths (float32) sharded or not; their CTE
# paths compute float32 in bfloat16, which a shard with fewer tokens than the batch would not take
BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM, MODEL, INTER = 8, 8, 16, 8, 16, 128, 256
OP_CALLS = 8  # rms_norm, qkv_projection, rope (q), rope (k), attention, output_projection, rms_norm, mlp
BOUND = tolerance(jnp.float32, reduction=MODEL * INTER, ops=16)  # sums over shards add in another order


def init_params():
    return {
        "attn_norm": 1.0 + random((MODEL,), seed=1, scale=0.1),
        "w_q": random((MODEL, HEADS * HEAD_DIM), seed=2, scale=MODEL**-0.5),
        "w_k": random((MODEL, KV_HEADS * HEAD_DIM), seed=3, scale=MODEL**-0.5),
        "w_v": random((MODEL, KV_HEADS * HEAD_DIM), seed=4, scale=MODEL**-0.5),
        "w_o": random((HEADS * HEAD_DIM, MODEL), seed=5, scale=(HEADS * HEAD_DIM) ** -0.5),
        "mlp_norm": 1.0 + random((MODEL,), seed=6, scale=0.1),
        "gate": random((MODEL, INTER), seed=7, scale=MODEL**-0.5),
        "up": random((MODEL, INTER), seed=8, scale=MODEL**-0.5),
        "down": random((INTER, MODEL), seed=9, scale=INTER**-0.5),
    }


def block(params, x, cos, sin):
    h = jax_nkilib.rms_norm(x, params["attn_norm"])
    q, k, v = jax_nkilib.qkv_projection(
        h, (params["w_q"], params["w_k"], params["w_v"]), num_q_heads=HEADS, num_kv_heads=KV_HEADS
    )
    q, k = jax_nkilib.rope(q, cos, sin), jax_nkilib.rope(k, cos, sin)
    x = x + jax_nkilib.output_projection(jax_nkilib.attention(q, k, v, causal=True), params["w_o"])
    h = jax_nkilib.rms_norm(x, params["mlp_norm"])
    return x + jax_nkilib.mlp(h, params["gate"], params["up"], params["down"])


def loss_fn(params, x, target, cos, sin):
    return jnp.mean((block(params, x, cos, sin) - target) ** 2)


def sgd_init(params):
    return jax.tree.map(jnp.zeros_like, params)  # momentum, sharded like the parameters


def sgd_update(params, grads, momentum, lr=0.1, beta=0.9):
    """SGD with heavy-ball momentum (not Adam: its first steps move each weight by about ``lr * sign(g)``, so
    rounding-level gradient differences between layouts would flip whole steps)."""
    momentum = jax.tree.map(lambda m, g: beta * m + g, momentum, grads)
    return jax.tree.map(lambda p, m: p - lr * m, params, momentum), momentum


@jax.jit
def train_step(params, state, x, target, cos, sin):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, target, cos, sin)
    params, state = sgd_update(params, grads, state)
    return params, state, loss, grads


def layouts(axes: tuple[str, ...]) -> dict:
    """Layout name -> (activation spec, parameter specs, op calls planning a shard_map) on a mesh with these axes."""
    tp = axes[-1]  # `model`, or the one axis of a 1-D mesh
    data = {name: P() for name in init_params()}
    tensor = {
        **data,
        "w_q": P(None, tp),
        "w_k": P(None, tp),
        "w_v": P(None, tp),
        "w_o": P(tp),
        "gate": P(None, tp),
        "up": P(None, tp),
        "down": P(tp),
    }
    found = {"data": (P("data"), data, OP_CALLS), "tensor": (P(), tensor, OP_CALLS - 2)}  # the norms: nothing split
    if len(axes) == 2:
        found.update(megatron=(P("data"), tensor, OP_CALLS), sequence=(P("data", "model"), data, OP_CALLS))
    else:
        found.update(sequence=(P(None, "data"), data, OP_CALLS))
    return found


MESHES = {
    "8": ((8,), ("data",)),
    "8x1": ((8, 1), ("data", "model")),
    "4x2": ((4, 2), ("data", "model")),
    "2x4": ((2, 4), ("data", "model")),
}
CI = [("4x2", "megatron"), ("8x1", "megatron"), ("2x4", "data"), ("8", "data")]
EVERY = [(shape, layout) for shape, (_, axes) in MESHES.items() for layout in layouts(axes)]


def inputs():
    x = random((BATCH, SEQ, MODEL), seed=10)
    target = random((BATCH, SEQ, MODEL), seed=11)
    cos, sin = angles((SEQ, HEAD_DIM // 2))
    return x, target, cos, sin


def check_training(shape: str, layout: str, steps: int = 2) -> None:
    sizes, axes = MESHES[shape]
    mesh = jax.make_mesh(sizes, axes, axis_types=(AxisType.Explicit,) * len(axes))
    x_spec, param_specs, manual = layouts(axes)[layout]
    if layout == "tensor" and sizes[-1] == 1:
        manual = 0  # JAX lowers a shard_map over only size-1 mesh axes to no manual computation
    x, target, cos, sin = inputs()
    params, state = init_params(), sgd_init(init_params())
    with jax.set_mesh(mesh):
        placed = {name: jax.device_put(value, NamedSharding(mesh, param_specs[name])) for name, value in params.items()}
        sharded = (
            placed,
            sgd_init(placed),
            *(jax.device_put(a, NamedSharding(mesh, x_spec)) for a in (x, target)),
            cos,
            sin,
        )
        forward = jax.jit(block).lower(placed, sharded[2], cos, sin).as_text()
        for _ in range(steps):
            got = train_step(*sharded)
            sharded = (*got[:2], *sharded[2:])
    assert manual_computations(forward) == manual, f"mesh {shape}, layout {layout}: one manual computation per op call"
    for _ in range(steps):
        want = train_step(params, state, x, target, cos, sin)
        params, state = want[:2]
    where = f"mesh {shape}, layout {layout}"
    assert relative_error(got[2], want[2]) <= BOUND, f"{where}: loss"
    for what, index in (("gradient", 3), ("updated parameter", 0)):
        for name in params:
            error = relative_error(got[index][name], want[index][name])
            assert error <= BOUND, f"{where}: {what} {name} differs from one device by {error:.2e}"
    for name, value in got[0].items():
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, param_specs[name]), value.ndim), f"{where}: {name}"


def test_the_layouts_split_what_the_table_allows():
    assert set(layouts(("data", "model"))) == {"data", "megatron", "tensor", "sequence"}
    assert set(CI) <= set(EVERY)


@time_limit(400)
def test_sharded_training_steps_match_one_device():
    """1-D data parallelism, the README's layout on 4x2 and 8x1 (8x1 hung before the fix), and plain data
    parallelism on 2x4, in one process (one reference compilation)."""
    for shape, layout in CI:
        check_training(shape, layout)


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(MESHES))
@time_limit(600)
def test_sharded_training_step_every_layout(shape):
    for layout in layouts(MESHES[shape][1]):
        check_training(shape, layout)
