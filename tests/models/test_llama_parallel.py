"""llama.train_step data x tensor parallel on 8 CPU devices (2 x 4) against one device, parameter by parameter.

The CI-run comparison is tests/examples/test_llama_examples.py (examples/llama_train.py, SGD, 2 steps); this one
(slow) chains a global-norm clip (a reduction over every sharded gradient) with momentum SGD, and checks every
parameter keeps its Megatron sharding. (Not Adam: its first steps move each weight by about lr * sign(g), so
rounding-level gradient differences between layouts would flip whole steps.)
"""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.support.numerics import relative_error, tolerance

optax = pytest.importorskip("optax")
from jax_nkilib.models import llama  # noqa: E402

set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh


@pytest.mark.slow
def test_clipped_sgd_steps_on_a_2x4_mesh_match_one_device_and_keep_the_shardings():
    config = llama.LlamaConfig(vocab=128, hidden=128, layers=2, heads=8, kv_heads=4, intermediate=256, max_len=32)
    params = {"params": llama.init_params(config, jax.random.key(0))}  # Flax's wrapper, kept by param_specs
    data = jax.random.randint(jax.random.key(1), (4, 9), 0, config.vocab)
    tokens, targets = data[:, :-1], data[:, 1:]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(0.3, momentum=0.9))
    step = lambda p, s, t, y: llama.train_step(p, s, t, y, config=config, optimizer=optimizer)

    want, state = params, optimizer.init(params)
    want_losses = []
    for _ in range(2):
        want, state, loss = step(want, state, tokens, targets)
        want_losses.append(float(loss))

    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    specs = llama.param_specs(params)
    with set_mesh(mesh):
        place = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))
        got = jax.tree.map(place, params, specs, is_leaf=lambda s: isinstance(s, P))
        state = optimizer.init(got)
        tokens, targets = (place(a, P("data")) for a in (tokens, targets))
        got_losses = []
        for _ in range(2):
            got, state, loss = step(got, state, tokens, targets)
            got_losses.append(float(loss))

    bound = tolerance(jnp.float32, reduction=config.intermediate, ops=64)
    assert relative_error(jnp.asarray(got_losses), jnp.asarray(want_losses)) <= bound
    flat_got, flat_want = jax.tree.leaves_with_path(got), jax.tree.leaves(want)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))
    for (path, value), expected, spec in zip(flat_got, flat_want, flat_specs):
        name = jax.tree_util.keystr(path)
        assert relative_error(value, expected) <= bound, name
        assert value.sharding.is_equivalent_to(NamedSharding(mesh, spec), value.ndim), name
