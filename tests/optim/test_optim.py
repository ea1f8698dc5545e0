"""jax_nkilib.optim: adam / adamw equal optax's step for step (100 AdamW steps on an MLP regression, learning-rate
schedules, masks), clip_by_global_norm equals optax's, the state shards like the parameters on 8 devices, and
lowered for Neuron the update is one fused kernel call per parameter leaf."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import optim
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_no_worse_than_plain, relative_error, tolerance
from tests.support.sharding import mesh_1d, use_mesh


def mlp_problem():
    params = {
        "w1": random((8, 32), seed=1) * 0.3,
        "b1": jnp.zeros((32,), jnp.float32),
        "w2": random((32, 1), seed=2) * 0.3,
        "b2": jnp.zeros((1,), jnp.float32),
    }
    x = random((64, 8), seed=3)
    y = jnp.sin(x @ random((8, 1), seed=4))
    return params, x, y


def mse(params, x, y):
    hidden = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def train(transform, params, x, y, steps):
    @jax.jit
    def step(params, state):
        grads = jax.grad(mse)(params, x, y)
        updates, state = transform.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = transform.init(params)
    for _ in range(steps):
        params, state = step(params, state)
    return params, state


def assert_trees_close(ours, theirs, ops, steps=1):
    for path, a in jax.tree.flatten_with_path(ours)[0]:
        b = dict(jax.tree.flatten_with_path(theirs)[0])[path]
        error, bound = relative_error(a, np.asarray(b, np.float64)), tolerance(jnp.float32, reduction=steps, ops=ops)
        assert error <= bound, f"{jax.tree_util.keystr(path)}: relative error {error:.2e} > {bound:.2e}"


def test_100_adamw_steps_equal_optax_adamw():
    """Within float32 tolerance of optax's own float32 run (rounding that adds up over the 100 steps, like a random
    walk: ``reduction=100``), and no further from optax's float64 run than optax's float32 run is."""
    params, x, y = mlp_problem()
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 10, 100)
    mask = lambda p: {name: name.startswith("w") for name in p}  # no decay on the biases
    ours, state = train(optim.adamw(schedule, weight_decay=0.05, mask=mask), params, x, y, 100)
    theirs, _ = train(optax.adamw(schedule, weight_decay=0.05, mask=mask), params, x, y, 100)
    wide = lambda tree: jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), tree)  # noqa: E731
    exact, _ = train(optax.adamw(schedule, weight_decay=0.05, mask=mask), wide(params), wide(x), wide(y), 100)
    assert mse(ours, x, y) < 0.5 * mse(params, x, y)  # it trained
    assert int(state.count) == 100
    assert_trees_close(ours, theirs, ops=16, steps=100)
    for name in params:
        assert_no_worse_than_plain(ours[name], theirs[name], np.asarray(exact[name]))


def test_adam_equals_optax_adam_step_for_step():
    """A schedule here; a constant learning rate in the sharded test."""
    learning_rate = optax.exponential_decay(1e-2, 5, 0.5)
    params, x, y = mlp_problem()
    ours, theirs = optim.adam(learning_rate), optax.adam(learning_rate)
    ours_state, theirs_state, p_ours = ours.init(params), theirs.init(params), params
    gradient, ours_update, theirs_update = jax.jit(jax.grad(mse)), jax.jit(ours.update), jax.jit(theirs.update)
    for _ in range(6):
        grads = gradient(p_ours, x, y)
        u_ours, ours_state = ours_update(grads, ours_state, p_ours)
        u_theirs, theirs_state = theirs_update(grads, theirs_state, p_ours)
        # the same step from the same point; updates are new_param - param, exact to param's rounding, so compare
        # the parameters they lead to
        stepped_ours, stepped_theirs = optax.apply_updates(p_ours, u_ours), optax.apply_updates(p_ours, u_theirs)
        assert_trees_close(stepped_ours, stepped_theirs, ops=8)
        assert_trees_close(ours_state.nu, theirs_state[0].nu, ops=8)
        p_ours = stepped_ours


def test_adam_weight_decay_is_torch_l2():
    """adam(weight_decay=wd) adds wd * param to the gradient (torch.optim.Adam), checked in float64."""
    p, g = np.asarray(random((50,), seed=5), np.float64), np.asarray(random((50,), seed=6), np.float64)
    transform = optim.adam(0.1, weight_decay=0.3)
    updates, _ = transform.update(jnp.asarray(g, jnp.float32), transform.init(jnp.asarray(p, jnp.float32)),
                                  jnp.asarray(p, jnp.float32))  # fmt: skip
    g2 = g + 0.3 * p
    m, v = 0.1 * g2, 0.001 * g2 * g2
    expected = p - 0.1 / 0.1 * m / (np.sqrt(v) / np.sqrt(0.001) + 1e-8)
    assert relative_error(jnp.asarray(p, jnp.float32) + updates, expected) <= tolerance(jnp.float32, ops=4)


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clips", "keeps"])
def test_clip_by_global_norm_equals_optax(max_norm):
    grads = {"a": random((7, 5), seed=7), "b": random((13,), seed=8), "c": jnp.float32(0.5)}
    ours, _ = optim.clip_by_global_norm(max_norm).update(grads, ())
    theirs, _ = optax.clip_by_global_norm(max_norm).update(grads, optax.EmptyState())
    assert_trees_close(ours, theirs, ops=8)
    expected = np.sqrt(sum(np.sum(np.asarray(v, np.float64) ** 2) for v in jax.tree.leaves(grads)))
    assert relative_error(optim.global_norm(grads), expected) <= tolerance(jnp.float32, reduction=49)


def test_the_state_shards_like_the_parameters():
    mesh = mesh_1d()
    params, x, y = mlp_problem()
    specs = {"w1": P(None, "data"), "b1": P("data"), "w2": P("data", None), "b2": P()}
    with use_mesh(mesh):
        sharded = {k: jax.device_put(v, NamedSharding(mesh, specs[k])) for k, v in params.items()}
        transform = optax.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
        state = transform.init(sharded)
        grads = jax.tree.map(lambda p: p * 0.5 + 0.1, sharded)
        updates, state = jax.jit(transform.update)(grads, state, sharded)
    for name, spec in specs.items():
        for tree in (state[1].mu, state[1].nu, updates):
            assert tree[name].sharding.is_equivalent_to(NamedSharding(mesh, spec), tree[name].ndim), name
    reference = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=0.1))
    plain = jax.tree.map(np.asarray, params)
    expected, _ = reference.update(jax.tree.map(lambda p: p * 0.5 + 0.1, plain), reference.init(plain), plain)
    stepped = optax.apply_updates(plain, updates)
    assert_trees_close(stepped, optax.apply_updates(plain, expected), ops=4)


def test_neuron_lowering_is_one_fused_kernel_per_leaf():
    params, x, y = mlp_problem()
    transform = optim.adamw(1e-3)
    state = transform.init(params)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda g, s, p: transform.update(g, s, p), params, state, params)
    assert [c["func_name"] for c in kernel_configs(text)] == ["adamw_kernel"] * len(params)
    clip = optim.clip_by_global_norm(1.0)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(lambda g: clip.update(g, ())[0], params)
    assert [c["func_name"] for c in kernel_configs(text)] == ["l2_norm_kernel"] * len(params)


def test_update_needs_params():
    params, _, _ = mlp_problem()
    transform = optim.adamw(1e-3)
    with pytest.raises(ValueError, match="needs `params`"):
        transform.update(params, transform.init(params))


def test_without_optax_a_structural_match(monkeypatch):
    monkeypatch.setitem(sys.modules, "optax", None)  # import optax raises ImportError
    transform = optim.adam(1e-3)
    assert not isinstance(transform, optax.GradientTransformation)
    assert transform._fields == ("init", "update")
    params = {"w": jnp.ones((3,))}
    updates, _ = transform.update(params, transform.init(params), params)
    assert updates["w"].shape == (3,)


def test_amsgrad_is_torchs():
    """amsgrad keeps the running max of the raw v and bias-corrects it afterwards (torch.optim.Adam(amsgrad=True)),
    against a float64 NumPy oracle over 4 steps whose gradients shrink (so the max matters)."""
    n, lr, b1, b2, eps = 300, 1e-2, 0.9, 0.999, 1e-8
    p = random((n,), seed=9)
    transform = optim.adam(lr, amsgrad=True)
    update = jax.jit(transform.update)
    state, ref = transform.init(p), [np.asarray(p, np.float64), np.zeros(n), np.zeros(n), np.zeros(n)]
    for t in range(1, 5):
        g = random((n,), seed=20 + t) * (0.1 ** (t - 1))
        updates, state = update(g, state, p)
        p = optax.apply_updates(p, updates)
        pr, m, v, v_max = ref
        gr = np.asarray(g, np.float64)
        m, v = b1 * m + (1 - b1) * gr, b2 * v + (1 - b2) * gr * gr
        v_max = np.maximum(v_max, v)
        pr = pr - lr / (1 - b1**t) * m / (np.sqrt(v_max) / np.sqrt(1 - b2**t) + eps)
        ref = [pr, m, v, v_max]
    assert relative_error(p, ref[0]) <= tolerance(jnp.float32, ops=16)
    assert relative_error(state.nu_max, ref[3]) <= tolerance(jnp.float32, ops=16)
