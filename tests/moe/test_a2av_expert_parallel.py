"""An expert-parallel MoE layer built from the a2av kernels on 8 CPU devices, against a dense float64 oracle: the
dispatch/combine that ``jax_nkilib.moe`` can use on Neuron.

Per rank: ``T`` tokens, top-``K`` routing over ``E`` experts, ``E / 8`` experts per rank. The routed rows (one per
(token, k)) carry ``[x_t, affinity, local expert id]``; ``build_all_to_all_v_metadata`` gives the rows per
destination rank, ``permute_a2av`` dispatches them, each rank applies its experts to what it received, and
``unpermute_a2av`` (with the dispatch's receive counts from the metadata) returns the results, summed over k.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from tests.support.hlo import kernel_configs, operations
from tests.support.sharding import make_mesh

RANKS, T, K, H, INNER = 8, 6, 2, 4, 3
EXPERTS = 16
LOCAL = EXPERTS // RANKS


def routing_table(expert_index):
    """``send_indices [T*K, EP]`` (routed rows per destination in row order, then the sentinel) and
    ``send_counts [1, EP]`` for the rows ``t*K + k`` of ``expert_index [T, K]``."""
    rows = expert_index.size
    counts = nki.build_all_to_all_v_metadata(expert_index, replica_group_size=RANKS, E=EXPERTS)[0]
    destination = expert_index.reshape(rows) // LOCAL
    to_rank = destination[:, None] == jnp.arange(RANKS)[None, :]
    order = jnp.argsort(~to_rank, axis=0, stable=True)  # each column: its rows first, in order
    active = jnp.arange(rows)[:, None] < counts.astype(jnp.int32)[None, :]
    return jnp.where(active, order, rows).astype(jnp.int32), counts[None].astype(jnp.int32)


def expert_parallel_layer(x, expert_index, affinity, w_in, w_out):
    """Inside shard_map over "x": per rank ``x [T, H]``, ``expert_index``/``affinity [T, K]``, this rank's experts'
    ``w_in [LOCAL, H, INNER]`` and ``w_out [LOCAL, INNER, H]``."""
    send_indices, send_counts = routing_table(expert_index)
    local_id = jax.lax.stop_gradient((expert_index % LOCAL).astype(x.dtype))
    rows = jnp.concatenate(
        [jnp.repeat(x, K, axis=0), affinity.reshape(T * K, 1), local_id.reshape(T * K, 1)], axis=1
    )  # [T*K, H + 2]
    received, metadata = nki.permute_a2av(rows, send_indices, send_counts, replica_group="x")
    hidden, weight, expert = received[:, :H], received[:, H], received[:, H + 1]
    choose = jax.nn.one_hot(expert.astype(jnp.int32), LOCAL, dtype=x.dtype)  # rows past the counts: weight 0
    inner = jax.nn.silu(jnp.einsum("rh,lhi,rl->ri", hidden, w_in, choose))
    out = jnp.einsum("ri,lih,rl->rh", inner, w_out, choose) * weight[:, None]
    recv_counts = (metadata[2:3] // (H + 2)).astype(jnp.int32)
    back = nki.unpermute_a2av(out, send_indices, recv_counts, replica_group="x")  # [T*K, H]
    return back.reshape(T, K, H).sum(axis=1)


def problem(seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((RANKS * T, H))
    index = np.stack([rng.permutation(EXPERTS)[:K] for _ in range(RANKS * T)])
    index[:T] = [0, 1]  # rank 0's tokens all on rank 0's two experts; some experts get no token below
    index[index == 5] = 4
    affinity = rng.uniform(0.1, 1.0, (RANKS * T, K))
    w_in, w_out = rng.standard_normal((EXPERTS, H, INNER)), rng.standard_normal((EXPERTS, INNER, H))
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(x), jnp.asarray(index, jnp.int32), cast(affinity), cast(w_in), cast(w_out)


def oracle(x, index, affinity, w_in, w_out):
    x, index, affinity = np.asarray(x, np.float64), np.asarray(index), np.asarray(affinity, np.float64)
    w_in, w_out = np.asarray(w_in, np.float64), np.asarray(w_out, np.float64)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(K):
            e = index[t, k]
            pre = x[t] @ w_in[e]
            out[t] += affinity[t, k] * ((pre / (1 + np.exp(-pre))) @ w_out[e])
    return out


def dense(x, index, affinity, w_in, w_out):
    """The same layer in plain JAX on one device (every expert on every token, masked): for the gradients."""
    pre = jnp.einsum("th,ehi->tei", x, w_in)
    every = jnp.einsum("tei,eih->teh", jax.nn.silu(pre), w_out)
    gates = jnp.sum(jax.nn.one_hot(index, EXPERTS, dtype=x.dtype) * affinity[..., None], axis=1)
    return jnp.einsum("teh,te->th", every, gates)


SPECS = (P("x"), P("x"), P("x"), P("x"), P("x"))


def sharded():
    mesh = make_mesh((RANKS,), ("x",))
    body = jax.shard_map(expert_parallel_layer, mesh=mesh, in_specs=SPECS, out_specs=P("x"))
    return mesh, body


def place(mesh, args):
    return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, SPECS)]


@pytest.mark.parametrize("dtype, bound", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_expert_parallel_layer_matches_the_dense_oracle(dtype, bound):
    args = problem(seed=1, dtype=dtype)
    mesh, body = sharded()
    out = jax.jit(body)(*place(mesh, args))
    want = oracle(*args)
    assert np.max(np.abs(np.asarray(out, np.float64) - want)) <= bound * np.max(np.abs(want))


def test_expert_parallel_gradients_match_single_device():
    """Gradients for x, the affinities and both expert weights (through permute_a2av's VJP, unpermute_a2av, and
    back) equal the dense layer's."""
    args = problem(seed=2)
    mesh, body = sharded()
    cotangent = jnp.asarray(np.random.default_rng(3).standard_normal((RANKS * T, H)))
    argnums = (0, 2, 3, 4)

    def loss(fn):
        return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=argnums))

    got = loss(body)(*place(mesh, args))
    want = loss(dense)(*args)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-10, atol=1e-12)


def test_lowered_for_neuron_the_collectives_are_the_kernels():
    """The gradient step on Neuron: the metadata kernel and the dispatch (whose metadata the backward needs), then
    the transposed pair: permute_a2av for the combine's cotangent, unpermute_a2av for the dispatch's (the forward
    combine is not needed for the gradient); no other custom call and no XLA all-to-all."""
    args = problem(seed=4, dtype=np.float32)
    mesh, body = sharded()
    cotangent = jnp.zeros((RANKS * T, H), jnp.float32)

    def step(*a):
        return jax.grad(lambda *v: jnp.sum(body(*v) * cotangent), argnums=(0, 3))(*a)

    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=NamedSharding(mesh, s)) for a, s in zip(args, SPECS)]
    with jax_nkilib.neuron.dry_run():
        forward = jax.jit(body).trace(*shapes).lower(lowering_platforms=("neuron",)).as_text()
        text = jax.jit(step).trace(*shapes).lower(lowering_platforms=("neuron",)).as_text()
    names = [c["func_name"] for c in kernel_configs(forward)]
    assert names == ["build_all_to_all_v_metadata", "permute_a2av", "unpermute_a2av"]
    assert [c["func_name"] for c in kernel_configs(text)] == [
        "build_all_to_all_v_metadata",
        "permute_a2av",
        "permute_a2av",
        "unpermute_a2av",
    ]
    assert "stablehlo.all_to_all" not in operations(text)
