"""jax_nkilib.topk / argmax / router against float64 oracles (float32, bfloat16, leading axes, odd sizes), the
Mixtral, Qwen3-MoE and DeepSeek-V3 routers, jit / vmap / grad, automatic sharding under an explicit mesh, the Neuron
lowering (exactly the kernel, no second computation of the math) and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.moe import oracles
from tests.support.data import random
from tests.support.hlo import compiled_collectives, kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, use_mesh


def router_oracle(x, w, k, act="softmax", normalize=False, bias=None, before=True, selection_bias=None):
    """The documented routing math in float64: ``(indices, weights, logits)`` over the flattened tokens."""
    tokens = oracles.f64(x).reshape(-1, x.shape[-1])
    logits = tokens @ oracles.f64(w) + (0.0 if bias is None else oracles.f64(bias))
    activation = oracles.softmax if act == "softmax" else oracles.sigmoid
    rows = np.arange(logits.shape[0])[:, None]
    if before:
        scores = activation(logits)
        chosen = scores if selection_bias is None else scores + oracles.f64(selection_bias)
        index = oracles.descending(chosen, k)
        weights = scores[rows, index]
    else:
        index = oracles.descending(logits, k)
        weights = activation(logits[rows, index])
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return index, weights, logits


def check_routing(routing, x, w, k, **options):
    index, weights, logits = router_oracle(x, w, k, **options)
    lead = x.shape[:-1]
    assert routing.indices.shape == lead + (k,) and routing.indices.dtype == jnp.int32
    assert routing.weights.shape == lead + (k,) and routing.weights.dtype == x.dtype
    assert routing.logits.shape == lead + (w.shape[1],) and routing.logits.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(routing.indices).reshape(-1, k), index)
    assert_close(np.asarray(routing.weights, np.float64).reshape(-1, k), weights, x.dtype, reduction=w.shape[1])
    assert_close(np.asarray(routing.logits, np.float64).reshape(logits.shape), logits, x.dtype, reduction=x.shape[-1])


# ----------------------------------------------------------------------------------------------------- topk, argmax
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape, k", [((2, 3, 77), 5), ((50,), 50), ((4, 1, 2, 130), 1)])
def test_topk_is_lax_top_k(dtype, shape, k):
    x = random(shape, dtype, seed=len(shape))
    values, indices = jax_nkilib.topk(x, k)
    want_values, want_indices = jax.lax.top_k(x, k)
    assert values.dtype == dtype and indices.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    oracle_values, oracle_indices = oracles.topk(x, k)
    np.testing.assert_array_equal(np.asarray(indices), oracle_indices)
    np.testing.assert_array_equal(np.asarray(values, np.float64), oracle_values)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("shape", [(3, 5, 129), (1000,), (2, 1, 7), (2, 20000)])
def test_argmax_is_jnp_argmax(dtype, shape):
    x = random(shape, dtype, seed=4)
    got = jax_nkilib.argmax(x)
    assert got.shape == shape[:-1] and got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))
    np.testing.assert_array_equal(np.asarray(got), oracles.topk(x, 1)[1][..., 0])


def test_integer_inputs_run_in_xla_like_lax():
    x = jnp.asarray(np.random.default_rng(0).permutation(60).reshape(3, 20), jnp.int32)
    values, indices = jax_nkilib.topk(x, 4)
    want = jax.lax.top_k(x, 4)
    np.testing.assert_array_equal(values, want[0])
    np.testing.assert_array_equal(indices, want[1])
    np.testing.assert_array_equal(jax_nkilib.argmax(x), jnp.argmax(x, axis=-1))
    with jax_nkilib.neuron.dry_run():
        assert kernel_configs(neuron_text(jax_nkilib.argmax, x)) == []


def test_topk_and_argmax_under_jit_vmap_and_grad():
    x = random((4, 6, 40), jnp.float32, seed=1)
    np.testing.assert_array_equal(jax.jit(jax_nkilib.argmax)(x), jax.vmap(jax_nkilib.argmax)(x))
    values, indices = jax.vmap(lambda x: jax_nkilib.topk(x, 3), in_axes=1, out_axes=1)(x)
    want = jax.lax.top_k(x, 3)
    np.testing.assert_array_equal(values, want[0])
    np.testing.assert_array_equal(indices, want[1])
    grad = jax.grad(lambda x: jnp.sum(jax_nkilib.topk(x, 3)[0] ** 2))(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: jnp.sum(jax.lax.top_k(x, 3)[0] ** 2))(x), rtol=1e-6)


# ------------------------------------------------------------------------------------------------------------- router
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "k, options",
    [
        (2, dict(act="softmax", normalize=True)),  # Mixtral
        (2, dict(act="softmax", before=False)),  # Mixtral, the other way round
        (8, dict(act="softmax", normalize=False)),  # Qwen3-MoE, norm_topk_prob=False
        (3, dict(act="sigmoid", normalize=True, bias=True)),
        (4, dict(act="sigmoid", normalize=False, before=False)),
        (5, dict(act="softmax", normalize=True, before=False, bias=True)),  # normalize: a no-op after top-k
    ],
)
def test_router_matches_the_oracle(dtype, k, options):
    x, w = random((3, 5, 256), dtype, 0), random((256, 24), dtype, 1, scale=0.2)
    options = dict(options)
    if options.pop("bias", False):
        options["bias"] = random((24,), dtype, 2, scale=0.5)
    act, before = options.pop("act"), options.pop("before", True)
    routing = jax_nkilib.router(x, w, top_k=k, activation=act, activation_before_topk=before, **options)
    check_routing(routing, x, w, k, act=act, before=before, **options)


def test_mixtral_router_is_the_reference_formula():
    """Mixtral: softmax over all experts, top-2, renormalised == softmax over the two selected logits."""
    x, w = random((6, 128), jnp.float32, 3), random((128, 8), jnp.float32, 4, scale=0.3)
    routing = jax_nkilib.router(x, w, top_k=2, activation="softmax", normalize=True)
    logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    top = np.sort(logits, axis=-1)[:, ::-1][:, :2]
    np.testing.assert_allclose(np.asarray(routing.weights), oracles.softmax(top), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(routing.weights).sum(-1), 1.0, rtol=1e-6)


def test_deepseek_v3_router_biases_the_selection_only():
    x, w = random((16, 96), jnp.float32, 5), random((96, 12), jnp.float32, 6, scale=0.3)
    correction = jnp.zeros((12,)).at[11].set(2.0)  # expert 11 always chosen, its weight unchanged
    routing = jax_nkilib.router(x, w, top_k=4, activation="sigmoid", normalize=True, selection_bias=correction)
    check_routing(routing, x, w, 4, act="sigmoid", normalize=True, selection_bias=correction)
    assert np.all(np.asarray(routing.indices)[:, 0] == 11)
    scores = oracles.sigmoid(np.asarray(x, np.float64) @ np.asarray(w, np.float64))
    first = scores[:, 11] / np.take_along_axis(scores, np.asarray(routing.indices), -1).sum(-1)
    np.testing.assert_allclose(np.asarray(routing.weights)[:, 0], first, rtol=1e-5)


def test_router_gradients_against_the_oracle():
    x, w = random((5, 128), jnp.float64, 7), random((128, 8), jnp.float64, 8, scale=0.3)
    bias, g = random((8,), jnp.float64, 9), random((5, 3), jnp.float64, 10)

    def loss(x, w, bias):
        return jnp.sum(jax_nkilib.router(x, w, top_k=3, normalize=True, bias=bias).weights * g)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, bias)

    def oracle_loss(x, w, bias):
        return np.sum(router_oracle(x, w, 3, normalize=True, bias=bias)[1] * np.asarray(g))

    eps = 1e-6
    for argnum, picks in ((0, [(0, 0), (4, 100)]), (1, [(3, 2), (127, 7)]), (2, [(1,), (6,)])):
        args = [np.asarray(a) for a in (x, w, bias)]
        for pick in picks:
            plus, minus = [a.copy() for a in args], [a.copy() for a in args]
            plus[argnum][pick] += eps
            minus[argnum][pick] -= eps
            numeric = (oracle_loss(*plus) - oracle_loss(*minus)) / (2 * eps)
            np.testing.assert_allclose(float(grads[argnum][pick]), numeric, rtol=1e-5, atol=1e-9)


def test_router_under_jit_and_vmap():
    x, w = random((4, 3, 128), jnp.float32, 11), random((128, 16), jnp.float32, 12, scale=0.2)
    route = lambda x: jax_nkilib.router(x, w, top_k=2, normalize=True)
    direct, jitted, mapped = route(x), jax.jit(route)(x), jax.vmap(route, in_axes=1, out_axes=1)(x)
    for got in (jitted, mapped):
        np.testing.assert_array_equal(got.indices, direct.indices)
        np.testing.assert_allclose(got.weights, direct.weights, rtol=1e-6)
        np.testing.assert_allclose(got.logits, direct.logits, rtol=1e-6)


def test_routing_ops_shard_tokens_with_no_collective():
    mesh = make_mesh((8,), ("data",))
    x, w = random((16, 3, 128), jnp.float32, 13), random((128, 16), jnp.float32, 14, scale=0.2)
    fns = {
        "router": lambda x: jax_nkilib.router(x, w, top_k=2, normalize=True),
        "topk": lambda x: jax_nkilib.topk(x, 4),
        "argmax": jax_nkilib.argmax,
    }
    with use_mesh(mesh):
        placed = jax.device_put(x, NamedSharding(mesh, P("data")))
        for name, fn in fns.items():
            jitted = jax.jit(fn)
            got = jitted(placed)
            assert compiled_collectives(jitted.lower(placed).compile().as_text()) == {}, name
            for leaf in jax.tree.leaves(got):
                assert leaf.sharding.spec[0] == "data", name
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(fn(x))):
                np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-6)
        with pytest.raises(ValueError, match="hidden|this dimension"):
            jax.jit(fns["topk"])(jax.device_put(x, NamedSharding(mesh, P(None, None, "data"))))


@pytest.mark.parametrize(
    "name, fn, shape, kernel",
    [
        ("topk", lambda x: jax_nkilib.topk(x, 8), (4, 16, 512), "topk"),
        ("argmax", jax_nkilib.argmax, (2, 3, 1024), "cascaded_max"),
        ("argmax_large_vocab", jax_nkilib.argmax, (2, 3, 32000), "topk"),
        ("argmax_many_rows", jax_nkilib.argmax, (64, 8, 512), "topk"),
        (
            "router",
            lambda x: jax_nkilib.router(x, jnp.ones((256, 64), x.dtype), top_k=4, normalize=True),
            (4, 32, 256),
            "router_topk",
        ),
    ],
)
def test_neuron_lowering_is_exactly_the_kernel(name, fn, shape, kernel):
    x = random(shape, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(fn, x)
    assert [c["func_name"] for c in kernel_configs(text)] == [kernel]
    assert operations(text).count("stablehlo.custom_call") == 1
    math_ops = {"stablehlo.dot_general", "stablehlo.sort", "stablehlo.reduce", "chlo.top_k", "stablehlo.exponential"}
    assert not math_ops & set(operations(text)), name


def test_router_past_the_kernel_limits_falls_back(monkeypatch):
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    x, w = random((4, 128), jnp.bfloat16), random((128, 600), jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match=r"E=600 must be in \[8, 512\]"):
        assert kernel_configs(neuron_text(lambda x, w: jax_nkilib.router(x, w, top_k=2), x, w)) == []


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x, w: jax_nkilib.router(x, w, top_k=0), ValueError, "top_k"),
        (lambda x, w: jax_nkilib.router(x, w, top_k=2, activation="relu"), ValueError, "activation"),
        (lambda x, w: jax_nkilib.router(x, w[:10], top_k=2), ValueError, "w_router"),
        (lambda x, w: jax_nkilib.router(x, w, top_k=2, bias=jnp.ones(3)), ValueError, "bias"),
        (lambda x, w: jax_nkilib.router(x, w, top_k=2, normalize=1), TypeError, "normalize"),
        (
            lambda x, w: jax_nkilib.router(x, w, top_k=2, activation_before_topk=False, selection_bias=jnp.zeros(16)),
            ValueError,
            "selection_bias",
        ),
        (lambda x, w: jax_nkilib.topk(x, 129), ValueError, "`k`"),
        (lambda x, w: jax_nkilib.topk(x.astype(jnp.bool_), 2), TypeError, "`x`"),
        (lambda x, w: jax_nkilib.argmax(3.0), TypeError, "`x`"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(call, error, match):
    x, w = random((4, 128), jnp.float32), random((128, 16), jnp.float32)
    with pytest.raises(error, match=match):
        call(x, w)


def test_token_free_calls_return_empty_results():
    x, w = jnp.zeros((0, 128)), random((128, 16), jnp.float32)
    routing = jax_nkilib.router(x, w, top_k=2)
    assert routing.indices.shape == (0, 2) and routing.logits.shape == (0, 16)
    assert jax_nkilib.topk(x, 3)[0].shape == (0, 3) and jax_nkilib.argmax(x).shape == (0,)


def test_router_gradient_lowers_to_one_kernel_call():
    """Reverse mode reuses the forward's kernel outputs: one router_topk call, the backward in XLA."""
    x, w = random((64, 256), jnp.bfloat16), random((256, 16), jnp.bfloat16, 1)
    loss = lambda x, w: jnp.sum(jax_nkilib.router(x, w, top_k=2, normalize=True).weights.astype(jnp.float32))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax.grad(loss, argnums=(0, 1)), x, w)
    assert [c["func_name"] for c in kernel_configs(text)] == ["router_topk"]
