"""jax_nkilib.moe: a float64 dense oracle for top-1/2/8, 8 and 64 experts, uneven loads; gradients; jit and vmap;
expert and tensor parallelism on 8 CPU devices (values, gradients and the collectives of the compiled program)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib._src.framework.common_types import ActFnType
from jax_nkilib._src.ops import moe as moe_module
from tests.support.data import random
from tests.support.hlo import compiled_collectives, kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, use_mesh


def silu(x):
    return x / (1 + np.exp(-x))


def moe_oracle(x, indices, weights, w_gate_up, w_down, gate_up_bias=None, down_bias=None, act=silu):
    """``out[t] = sum_k weights[t, k] * (act(x W_g + b_g) * (x W_u + b_u)) W_d + b_d`` of expert ``indices[t, k]``,
    in float64, one token at a time (an index outside [0, E) selects nothing)."""
    x, weights, w_gate_up, w_down = (np.asarray(a, np.float64) for a in (x, weights, w_gate_up, w_down))
    experts, _, _, inter = w_gate_up.shape
    b_gu = np.zeros((experts, 2, inter)) if gate_up_bias is None else np.asarray(gate_up_bias, np.float64)
    b_d = np.zeros((experts, x.shape[-1])) if down_bias is None else np.asarray(down_bias, np.float64)
    flat, idx, wts = x.reshape(-1, x.shape[-1]), np.asarray(indices).reshape(-1, indices.shape[-1]), weights
    wts = wts.reshape(idx.shape)
    out = np.zeros_like(flat)
    for t in range(flat.shape[0]):
        for k in range(idx.shape[1]):
            e = idx[t, k]
            if not 0 <= e < experts:
                continue
            gate = flat[t] @ w_gate_up[e, :, 0] + b_gu[e, 0]
            up = flat[t] @ w_gate_up[e, :, 1] + b_gu[e, 1]
            out[t] += wts[t, k] * ((act(gate) * up) @ w_down[e] + b_d[e])
    return out.reshape(x.shape)


def softmax_topk(logits, k, normalize):
    logits = np.asarray(logits, np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    idx = np.argsort(-p, axis=-1, kind="stable")[..., :k]
    w = np.take_along_axis(p, idx, -1)
    return idx, (w / w.sum(-1, keepdims=True) if normalize else w)


def experts(num_experts, hidden, inter, dtype=jnp.float32, seed=10):
    return (
        random((num_experts, hidden, 2, inter), dtype, seed, 0.3),
        random((num_experts, inter, hidden), dtype, seed + 1, 0.3),
    )


def uneven_routing(tokens, num_experts, top_k, seed=0):
    """Distinct experts per token, skewed towards low ids; the last expert never chosen when possible."""
    rng = np.random.default_rng(seed)
    pool = max(num_experts - 1, top_k)
    p = 1.0 / np.arange(1, pool + 1) ** 1.5
    idx = np.stack([rng.choice(pool, top_k, replace=False, p=p / p.sum()) for _ in range(tokens)])
    return jnp.asarray(idx, jnp.int32), jnp.asarray(rng.uniform(0.1, 1.0, (tokens, top_k)), jnp.float32)


@pytest.mark.parametrize(
    "top_k, num_experts, dtype",
    [
        (1, 8, jnp.float32),
        (2, 8, jnp.float32),
        (2, 8, jnp.bfloat16),
        (8, 8, jnp.float32),
        (2, 64, jnp.float32),
        (8, 64, jnp.bfloat16),
    ],
)
def test_forward_matches_dense_oracle(top_k, num_experts, dtype):
    tokens, hidden, inter = 37, 24, 20
    x = random((tokens, hidden), dtype, 0)
    idx, w = uneven_routing(tokens, num_experts, top_k)
    w_gu, w_d = experts(num_experts, hidden, inter, dtype)
    out = jax.jit(jax_nkilib.moe)(x, (idx, w.astype(dtype)), w_gu, w_d)
    assert out.shape == x.shape and out.dtype == dtype
    want = moe_oracle(x, idx, w.astype(dtype), w_gu, w_d)
    assert_close(out, want, dtype, reduction=hidden + inter, ops=2 * top_k)


@pytest.mark.parametrize("normalize", [pytest.param(False, marks=pytest.mark.slow), True])
def test_router_logits_softmax_top_k(normalize):
    tokens, hidden, inter, num_experts = 19, 16, 12, 8
    x, logits = random((2, tokens, hidden), seed=0), random((2, tokens, num_experts), seed=1, scale=2.0)
    w_gu, w_d = experts(num_experts, hidden, inter)
    out = jax_nkilib.moe(x, logits, w_gu, w_d, top_k=2, normalize=normalize)
    idx, w = softmax_topk(logits, 2, normalize)
    assert_close(out, moe_oracle(x, idx, w, w_gu, w_d), jnp.float32, reduction=hidden + inter, ops=4)


def test_split_weights_biases_and_activations():
    tokens, hidden, inter, num_experts = 13, 16, 8, 4
    x = random((tokens, hidden), seed=0)
    idx, w = uneven_routing(tokens, num_experts, 2)
    w_gu, w_d = experts(num_experts, hidden, inter)
    b_gu, b_d = random((num_experts, 2, inter), seed=5, scale=0.2), random((num_experts, hidden), seed=6, scale=0.2)
    gelu_tanh = lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3)))  # noqa: E731
    out = jax_nkilib.moe(
        x,
        (idx, w),
        (w_gu[:, :, 0], w_gu[:, :, 1]),
        w_d,
        gate_up_bias=(b_gu[:, 0], b_gu[:, 1]),
        down_bias=b_d,
        activation="gelu_tanh",
    )
    want = moe_oracle(x, idx, w, w_gu, w_d, b_gu, b_d, act=gelu_tanh)
    assert_close(out, want, jnp.float32, reduction=hidden + inter, ops=4)


def test_out_of_range_indices_select_nothing():
    x = random((5, 8), seed=0)
    w_gu, w_d = experts(4, 8, 4)
    idx = jnp.array([[0, 4], [-1, 1], [2, 3], [7, -3], [1, 1]], jnp.int32)
    w = jnp.ones((5, 2), jnp.float32)
    assert_close(jax_nkilib.moe(x, (idx, w), w_gu, w_d), moe_oracle(x, idx, w, w_gu, w_d), jnp.float32, reduction=12)


def test_gradients_float64():
    tokens, hidden, inter, num_experts = 7, 6, 4, 5
    x = random((tokens, hidden), jnp.float64, 0)
    idx, w = uneven_routing(tokens, num_experts, 2)
    w_gu, w_d = experts(num_experts, hidden, inter, jnp.float64)
    b_gu, b_d = random((num_experts, 2, inter), jnp.float64, 5), random((num_experts, hidden), jnp.float64, 6)

    def fn(x, w, w_gu, w_d, b_gu, b_d):
        return jax_nkilib.moe(x, (idx, w), w_gu, w_d, gate_up_bias=b_gu, down_bias=b_d)

    check_grads(fn, (x, w.astype(jnp.float64), w_gu, w_d, b_gu, b_d), order=1, modes=["rev"])  # logits: conformance


def dense_moe_float64(x, w_router, w_gate_up, w_down, *, top_k, activation):
    """A dense float64 MoE written in jnp for its gradients: every expert on every token, weighted by the routing
    (softmax over all experts then the top-k renormalised, or sigmoid scores of the top-k renormalised)."""
    logits = x @ w_router
    scores = jax.nn.softmax(logits, axis=-1) if activation == "softmax" else jax.nn.sigmoid(logits)
    top, idx = jax.lax.top_k(scores, top_k)
    combine = jnp.zeros_like(scores).at[jnp.arange(x.shape[0])[:, None], idx].set(top / top.sum(-1, keepdims=True))
    h = jnp.einsum("th,ehki->tkei", x, w_gate_up)
    y = jnp.einsum("tei,eih->teh", jax.nn.silu(h[:, 0]) * h[:, 1], w_down)
    return jnp.einsum("te,teh->th", combine, y)


@pytest.mark.parametrize(
    "top_k, num_experts, activation",
    [
        (2, 8, "softmax"),
        *(
            pytest.param(*case, marks=pytest.mark.slow)
            for case in [(1, 8, "softmax"), (1, 8, "sigmoid"), (2, 8, "sigmoid"), (8, 8, "softmax"), (8, 8, "sigmoid")]
            + [(2, 64, "softmax"), (2, 64, "sigmoid"), (8, 64, "softmax"), (8, 64, "sigmoid")]
        ),
    ],
)
def test_router_and_moe_gradients_match_a_dense_float64_oracle(top_k, num_experts, activation):
    """x, w_router and both expert weights: jax_nkilib.router + moe against a dense float64 layer (experts that
    receive no token included: 24 tokens, 64 experts)."""
    tokens, hidden, inter = 24, 16, 8
    x = random((tokens, hidden), jnp.float64, 0)
    w_router = random((hidden, num_experts), jnp.float64, 1)
    w_gu, w_d = experts(num_experts, hidden, inter, jnp.float64)

    def ours(x, w_router, w_gu, w_d):
        routing = jax_nkilib.router(x, w_router, top_k=top_k, activation=activation, normalize=True)
        return jax_nkilib.moe(x, routing, w_gu, w_d)

    oracle = functools.partial(dense_moe_float64, top_k=top_k, activation=activation)
    cotangent = random((tokens, hidden), jnp.float64, 9)
    args = (x, w_router, w_gu, w_d)
    np.testing.assert_allclose(ours(*args), oracle(*args), rtol=1e-10, atol=1e-12)
    loss = lambda fn: lambda *a: jnp.sum(fn(*a) * cotangent)  # noqa: E731
    for got, want in zip(
        jax.grad(loss(ours), argnums=(0, 1, 2, 3))(*args), jax.grad(loss(oracle), argnums=(0, 1, 2, 3))(*args)
    ):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


@pytest.mark.slow  # CI: the conformance checklist's vmap, nested vmap and vmap of grad of the `moe` arg spec
def test_vmap_and_vmap_of_grad():
    hidden, inter, num_experts = 8, 6, 4
    x = random((3, 5, hidden), seed=0)
    idx, w = uneven_routing(15, num_experts, 2)
    idx, w = idx.reshape(3, 5, 2), w.reshape(3, 5, 2)
    w_gu, w_d = experts(num_experts, hidden, inter)
    fn = lambda x, w: jax_nkilib.moe(x, (idx_b, w), w_gu, w_d)  # noqa: E731
    mapped = []
    for b in range(3):
        idx_b = idx[b]
        mapped.append(fn(x[b], w[b]))
    got = jax.vmap(lambda x, i, w: jax_nkilib.moe(x, (i, w), w_gu, w_d))(x, idx, w)
    np.testing.assert_allclose(got, jnp.stack(mapped), rtol=1e-6, atol=1e-6)
    loss = lambda x, i, w_d: jnp.sum(jax_nkilib.moe(x, (i, w[0]), w_gu, w_d) ** 2)  # noqa: E731
    grads = jax.vmap(jax.grad(loss, argnums=2), in_axes=(0, 0, None))(x, idx, w_d)
    for b in range(3):
        np.testing.assert_allclose(grads[b], jax.grad(loss, argnums=2)(x[b], idx[b], w_d), rtol=1e-5, atol=1e-6)


def test_bad_inputs():
    x = jnp.ones((4, 8))
    w_gu, w_d = experts(3, 8, 4)
    idx, w = jnp.zeros((4, 2), jnp.int32), jnp.ones((4, 2))
    cases = [
        (lambda: jax_nkilib.moe(x, (idx, w), w_gu[:, :4], w_d), ValueError, "`w_gate_up` must have layout"),
        (lambda: jax_nkilib.moe(x, (idx, w), w_gu, w_d[:, :, :5]), ValueError, "`w_down` must have layout"),
        (lambda: jax_nkilib.moe(x, (idx.astype(jnp.float32), w), w_gu, w_d), TypeError, "`indices` must be an integer"),
        (lambda: jax_nkilib.moe(x, (idx[:3], w[:3]), w_gu, w_d), ValueError, "`indices` must be [leading axes of x"),
        (lambda: jax_nkilib.moe(x, jnp.ones((4, 3)), w_gu, w_d), TypeError, "router logits need top_k"),
        (
            lambda: jax_nkilib.moe(x, jnp.ones((4, 5)), w_gu, w_d, top_k=1),
            ValueError,
            "`routing` (router logits) must be",
        ),
        (lambda: jax_nkilib.moe(x, (idx, w), w_gu, w_d, top_k=2), ValueError, "top_k and normalize apply to"),
        (lambda: jax_nkilib.moe(x, (idx, w), w_gu, w_d, activation="tanh"), ValueError, "activation must be one of"),
        (lambda: jax_nkilib.moe(x, jnp.ones((4, 3)), w_gu, w_d, top_k=4), ValueError, "`top_k`"),
    ]
    for call, error, fragment in cases:
        with pytest.raises(error) as info:
            call()
        assert "jax_nkilib.moe" in str(info.value) and fragment in str(info.value), str(info.value)


# ------------------------------------------------------------------------------------------- expert parallelism
TOKENS, HIDDEN, INTER, EXPERTS = 32, 16, 12, 8


def _layer(x, logits, w_gu, w_d, b_d):
    return jax_nkilib.moe(x, logits, w_gu, w_d, top_k=2, normalize=True, down_bias=b_d)


SPLITS = {  # name: (x / logits spec, w_gate_up, w_down, down_bias specs, expected collectives of the forward)
    "ep_all_to_all": (P(("data", "expert")), P("expert"), P("expert"), P("expert"), {"all-to-all": 3}),
    "ep_replicated_tokens": (P("data"), P("expert"), P("expert"), P("expert"), {"all-reduce": 1}),
    "tp": (P("data"), P(None, None, None, "expert"), P(None, "expert"), P(), {"all-reduce": 1}),
}


@pytest.mark.parametrize("split", ["ep_all_to_all", pytest.param("ep_replicated_tokens", marks=pytest.mark.slow), "tp"])
def test_expert_and_tensor_parallel_match_single_device(split):
    mesh = make_mesh((2, 4), ("data", "expert"))
    x, logits = random((TOKENS, HIDDEN), seed=0), random((TOKENS, EXPERTS), seed=1, scale=2.0)
    w_gu, w_d = experts(EXPERTS, HIDDEN, INTER)
    b_d = random((EXPERTS, HIDDEN), seed=4, scale=0.2)
    args = (x, logits, w_gu, w_d, b_d)
    token_spec, *weight_specs, expected = SPLITS[split]
    specs = (token_spec, token_spec, *weight_specs)
    loss = lambda *a: jnp.sum(_layer(*a) ** 2)  # noqa: E731
    want, want_grads = _layer(*args), jax.grad(loss, argnums=(0, 1, 2, 3, 4))(*args)
    with use_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        forward = jax.jit(_layer)
        got = forward(*placed)
        compiled = forward.lower(*placed).compile().as_text()
        grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*placed)
    assert compiled_collectives(compiled) == expected
    assert got.sharding.spec[0] == token_spec[0]
    assert_close(got, want, jnp.float32, reduction=HIDDEN + INTER, ops=4)
    for g, w in zip(grads, want_grads):
        assert_close(g, w, jnp.float32, reduction=TOKENS * HIDDEN, ops=8)


# ----------------------------------------------------------------------------------------------------------- Neuron
@pytest.mark.parametrize("tokens, kernels", [(512, ["router_topk", "moe_cte"]), (4, ["router_topk", "moe_tkg"])])
def test_on_neuron_a_layer_is_the_router_and_expert_kernels(tokens, kernels):
    """Prefill: router_topk + moe_cte, whose VJP adds blockwise_mm_bwd; decode (<= 128 tokens): moe_tkg. Between the
    kernels only routing metadata and layout (no matmul, no activation: the experts run in the kernels)."""
    experts_, hidden, inter = 8, 512, 256
    x = random((tokens, hidden), jnp.bfloat16, 0)
    w_router = random((hidden, experts_), jnp.bfloat16, 1, 0.05)
    w_gu, w_d = experts(experts_, hidden, inter, jnp.bfloat16)

    def layer(x, w_router, w_gu, w_d):
        return jax_nkilib.moe(x, jax_nkilib.router(x, w_router, top_k=2, normalize=True), w_gu, w_d)

    with jax_nkilib.neuron.dry_run():
        text = neuron_text(layer, x, w_router, w_gu, w_d)
        assert [cfg["func_name"] for cfg in kernel_configs(text)] == kernels
        assert not {"stablehlo.dot_general", "stablehlo.logistic", "stablehlo.exponential"} & set(operations(text))
        if tokens > 128:
            loss = lambda *a: jnp.sum(layer(*a).astype(jnp.float32))  # noqa: E731
            text = neuron_text(jax.grad(loss, argnums=(0, 1, 2, 3)), x, w_router, w_gu, w_d)
            assert [cfg["func_name"] for cfg in kernel_configs(text)] == kernels + ["blockwise_mm_bwd"]


def _a2av_layer(x, indices, routing_weights, w_gu, w_d):
    """The Neuron branch of the expert-parallel exchange (a2av kernels), called directly so that it runs (as the
    kernels' JAX references) on CPU: inside shard_map over `expert`, 2 of 16 experts per device."""
    num_experts, _, _, inter = w_gu.shape
    zeros = jnp.zeros((num_experts, 2, inter), x.dtype), jnp.zeros((num_experts, x.shape[1]), x.dtype)
    weights = moe_module.ExpertWeights(w_gu, w_d, *zeros)
    return moe_module._a2av_experts(x, routing_weights, indices, weights, ActFnType.SiLU, ("expert",))


def test_the_neuron_exchange_through_the_a2av_kernels_matches_the_oracle_and_one_device():
    mesh = make_mesh((8,), ("expert",))
    tokens, hidden, inter, num_experts = 48, 8, 6, 16
    x = random((tokens, hidden), jnp.float64, 0)
    idx, w = uneven_routing(tokens, num_experts, 2)
    w = w.astype(jnp.float64)
    w_gu, w_d = experts(num_experts, hidden, inter, jnp.float64)
    specs = (P("expert"),) * 5
    body = jax.jit(jax.shard_map(_a2av_layer, mesh=mesh, in_specs=specs, out_specs=P("expert")))
    placed = [jax.device_put(a, NamedSharding(mesh, P("expert"))) for a in (x, idx, w, w_gu, w_d)]
    np.testing.assert_allclose(body(*placed), moe_oracle(x, idx, w, w_gu, w_d), rtol=1e-10, atol=1e-12)
    cotangent = random((tokens, hidden), jnp.float64, 5)
    argnums = (0, 2, 3, 4)
    with use_mesh(mesh):
        got = jax.jit(jax.grad(lambda *a: jnp.sum(body(*a) * cotangent), argnums=argnums))(*placed)
    single = lambda x, i, w, gu, d: jax_nkilib.moe(x, (i, w), gu, d)  # noqa: E731
    want = jax.grad(lambda *a: jnp.sum(single(*a) * cotangent), argnums=argnums)(x, idx, w, w_gu, w_d)
    for g, v in zip(got, want):
        np.testing.assert_allclose(g, v, rtol=1e-9, atol=1e-11)


def test_on_neuron_expert_parallel_moe_exchanges_through_the_a2av_kernels():
    mesh = make_mesh((8,), ("expert",))
    tokens, hidden, inter, num_experts = 8 * 64, 512, 256, 16
    args = (
        random((tokens, hidden), jnp.bfloat16, 0),
        random((tokens, num_experts), jnp.bfloat16, 1),
        *experts(num_experts, hidden, inter, jnp.bfloat16),
    )
    specs = (P("expert"), P("expert"), P("expert"), P("expert"))
    layer = lambda x, r, gu, d: jax_nkilib.moe(x, r, gu, d, top_k=2)  # noqa: E731
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    with use_mesh(mesh), jax_nkilib.neuron.dry_run():
        text = jax.jit(layer).trace(*shapes).lower(lowering_platforms=("neuron",)).as_text()
    names = [cfg["func_name"] for cfg in kernel_configs(text)]
    # the experts see the static receive buffer, 8 ranks x 128 pairs: moe_cte
    assert names == ["build_all_to_all_v_metadata", "permute_a2av", "moe_cte", "unpermute_a2av"], names
    assert "stablehlo.all_to_all" not in operations(text)
