"""jax_nkilib.models.llama.train_step with jax_nkilib.optim.adamw: the same steps as optax.adamw, and lowered for
Neuron the optimizer is one fused adamw_kernel call per parameter leaf."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jax_nkilib
from jax_nkilib import optim
from jax_nkilib.models import llama
from tests.support.numerics import relative_error, tolerance

CONFIG = llama.LlamaConfig(vocab=64, hidden=128, layers=1, heads=2, kv_heads=2, intermediate=128, max_len=16)


@pytest.mark.slow  # about 12 s: two jitted Llama train steps per optimizer and a Neuron lowering
def test_llama_train_step_with_fused_adamw():
    params = llama.init_params(CONFIG, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, CONFIG.vocab)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    results = {}
    for name, optimizer in (
        ("ours", optim.adamw(1e-3, weight_decay=0.01)),
        ("optax", optax.adamw(1e-3, weight_decay=0.01)),
    ):
        p, state, losses = params, optimizer.init(params), []
        for _ in range(2):
            p, state, value = llama.train_step(p, state, inputs, targets, config=CONFIG, optimizer=optimizer)
            losses.append(float(value))
        results[name] = (p, losses)
    (ours, ours_losses), (theirs, theirs_losses) = results["ours"], results["optax"]
    assert ours_losses[1] < ours_losses[0]
    np.testing.assert_allclose(ours_losses, theirs_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert relative_error(a, np.asarray(b, np.float64)) <= tolerance(jnp.float32, ops=16)


def test_llama_train_step_census_lists_the_loss_and_optimizer_kernels():
    """Lowered for Neuron, the train step runs the loss as cross_entropy_forward / cross_entropy_backward and the
    update as one fused adamw_kernel per parameter leaf."""
    params = llama.init_params(CONFIG, jax.random.key(0))
    tokens = jnp.zeros((2, 8), jnp.int32)
    optimizer = optim.adamw(1e-3)
    step = lambda p, s, x, y: llama.train_step(p, s, x, y, config=CONFIG, optimizer=optimizer)  # noqa: E731
    census = jax_nkilib.neuron.op_census(step, params, optimizer.init(params), tokens, tokens)
    kernels = census.kernels
    assert kernels.count("cross_entropy_forward") == 1 and kernels.count("cross_entropy_backward") == 1
    assert kernels.count("adamw_kernel") == len(jax.tree.leaves(params))
    assert kernels[-len(jax.tree.leaves(params)) :] == ("adamw_kernel",) * len(jax.tree.leaves(params))
