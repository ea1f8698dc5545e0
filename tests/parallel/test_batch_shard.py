"""attn_q_batch_shard (catalog row 62) on 8 CPU devices: TP -> TP x DP resharding of Q inside jax.shard_map.

Per-rank inputs are stacked along axis 0 in the mesh's flattened device order (rank = position); the oracle
gathers each group's inputs, views them as [G, dim0, B, ...] and slices the batches at iota_workers[rank].
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib._src.collectives.attn_q_batch_shard import AttnQBatchShardLayout, attn_q_batch_shard
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text, operations
from tests.support.sharding import make_mesh, reshard

RANKS, N, B, S, D = 8, 2, 8, 3, 5
MESHES = {  # id: (shape, names, replica group axis, its rank lists)
    "tp2dp4": ((4, 2), ("dp", "g"), "g", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    "tp8": ((8,), ("g",), "g", [list(range(8))]),
    "strided": ((2, 4), ("g", "dp"), "g", [[0, 4], [1, 5], [2, 6], [3, 7]]),
}


def groups_of(mesh_id):
    return MESHES[mesh_id][3]


def iota_workers(groups, shift=0):
    """The kernel's table: rank -> (position in its group) * B/G (+ a shift to test other offsets)."""
    size = len(groups[0])
    position = {r: i for group in groups for i, r in enumerate(group)}
    return jnp.asarray([[((position[r] + shift) % size) * (B // size) for r in range(RANKS)]], jnp.int32)


def oracle(q, iota, groups, layout="NBSd", ranks=None):
    """float64, per rank: gather the group's inputs on dim 0, [G, dim0, B, ...], batches [o, o + B/G)."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64).reshape(RANKS, -1, *q.shape[1:])
    size = len(groups[0])
    per = B // size
    outs = [None] * RANKS
    for group in groups:
        grouped = np.stack([q[r] for r in group])  # [G, dim0, B, ...]
        for r in group:
            offset = int(iota[0, r if ranks is None else ranks[r]])
            rows = grouped[:, :, offset : offset + per]
            outs[r] = rows.reshape(size * q.shape[1], per, S, D) if layout == "NBSd" else rows.reshape(size, D, per, S)
    return np.stack(outs)


def problem(layout="NBSd", dtype=jnp.float32):
    shape = (RANKS * N, B, S, D) if layout == "NBSd" else (RANKS * D, B, 1, S)
    return random(shape, dtype, seed=1)


def run(fn, mesh_id, *args, specs):
    shape, names = MESHES[mesh_id][:2]
    mesh = make_mesh(shape, names)
    body = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P(names))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    out = jax.jit(body)(*placed)
    return out, np.asarray(jnp.asarray(out, jnp.float32), np.float64).reshape(RANKS, -1, *out.shape[1:])


def stacked(mesh_id):
    return P(MESHES[mesh_id][1])


def call(q, iota, *, mesh_id, layout="NBSd", **flags):
    size = len(groups_of(mesh_id)[0])
    return attn_q_batch_shard(q, iota, gqa_group_size=size, replica_group=MESHES[mesh_id][2], layout=layout, **flags)


@pytest.mark.parametrize("mesh_id", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["NBSd", "dBnS"])
def test_matches_oracle(layout, dtype, mesh_id):
    q, groups = problem(layout, dtype), groups_of(mesh_id)
    iota = iota_workers(groups)
    out, per_rank = run(
        functools.partial(call, mesh_id=mesh_id, layout=layout), mesh_id, q, iota, specs=(stacked(mesh_id), P())
    )
    assert out.dtype == dtype
    np.testing.assert_array_equal(per_rank, oracle(q, iota, groups, layout))  # data movement: exact


def test_rank_id_in_shifted_offsets_and_given_workspace():
    """rank_id_in replaces ncc.rank_id(); any table of offsets; an explicit gathered_buf changes nothing."""
    mesh_id, groups = "tp2dp4", groups_of("tp2dp4")
    q, iota = problem(), iota_workers(groups, shift=1)
    ranks = np.array([3, 2, 1, 0, 7, 6, 5, 4], np.int32)  # rank ids read from a tensor
    rank_ids = jnp.asarray(ranks[:, None])
    workspace = jnp.full((RANKS * 2, N, B, S, D), 7.0, jnp.float32)  # garbage content: never read back
    out, per_rank = run(
        lambda x, t, r, buf: call(x, t, mesh_id=mesh_id, rank_id_in=r, gathered_buf=buf),
        mesh_id,
        q,
        iota,
        rank_ids,
        workspace,
        specs=(stacked(mesh_id), P(), stacked(mesh_id), stacked(mesh_id)),
    )
    np.testing.assert_array_equal(per_rank, oracle(q, iota, groups, ranks=ranks))


@pytest.mark.parametrize("flag", [dict(layout=AttnQBatchShardLayout.dBnS), dict(layout="dBnS"), dict(q_layout="dBnS")])
def test_layout_flag_spellings(flag):
    mesh_id, groups = "tp8", groups_of("tp8")
    q, iota = problem("dBnS"), iota_workers(groups)
    fn = lambda x, t: attn_q_batch_shard(x, t, gqa_group_size=8, replica_group="g", **flag)  # noqa: E731
    _, per_rank = run(fn, mesh_id, q, iota, specs=(P("g"), P()))
    np.testing.assert_array_equal(per_rank, oracle(q, iota, groups, "dBnS"))


def test_vmap_partial_and_nested_inside_shard_map_dbns():
    """The dBnS layout (the NBSd one is the attn_q_batch_shard arg spec's), vmapped along trailing axes."""
    mesh_id, layout = "tp2dp4", "dBnS"
    groups = groups_of(mesh_id)
    q = jnp.stack([jnp.stack([problem(layout) * (1 + i + 2 * j) for j in range(2)], -1) for i in range(3)], -1)
    iota = iota_workers(groups)  # the table is not batched
    inner = jax.vmap(functools.partial(call, mesh_id=mesh_id, layout=layout), in_axes=(-1, None), out_axes=-1)
    _, per_rank = run(jax.vmap(inner, in_axes=(-1, None), out_axes=-1), mesh_id, q, iota, specs=(stacked(mesh_id), P()))
    for i in range(3):
        for j in range(2):
            np.testing.assert_array_equal(per_rank[..., j, i], oracle(q[..., j, i], iota, groups, layout))


@pytest.mark.parametrize("layout", ["NBSd", "dBnS"])
def test_gradients_float64(layout):
    mesh_id = "tp2dp4"
    shape, names = MESHES[mesh_id][:2]
    mesh = make_mesh(shape, names)
    q, iota = problem(layout, jnp.float64), iota_workers(groups_of(mesh_id))
    body = jax.shard_map(
        functools.partial(call, mesh_id=mesh_id, layout=layout), mesh=mesh, in_specs=(P(names), P()), out_specs=P(names)
    )
    placed_iota = jax.device_put(iota, NamedSharding(mesh, P()))

    def f(x):
        return body(reshard(x, NamedSharding(mesh, P(names))), placed_iota)

    placed_q = jax.device_put(q, NamedSharding(mesh, P(names)))
    if layout == "dBnS":  # NBSd: the attn_q_batch_shard arg spec's check_grads
        check_grads(jax.jit(f), (placed_q,), order=1, modes=["rev"], atol=1e-7, rtol=1e-7)
    # every input element lands in exactly one rank's output once: the gradient of sum(out) is all ones
    grad = jax.jit(jax.grad(lambda x: f(x).sum()))(placed_q)
    np.testing.assert_array_equal(np.asarray(grad), np.ones(q.shape))


@pytest.mark.parametrize("layout", ["NBSd", "dBnS"])
def test_neuron_lowering_is_one_collective_kernel_call_with_rank_lists(layout):
    mesh_id = "strided"
    shape, names = MESHES[mesh_id][:2]
    mesh = make_mesh(shape, names)
    q, iota = problem(layout), iota_workers(groups_of(mesh_id))
    body = jax.shard_map(
        functools.partial(call, mesh_id=mesh_id, layout=layout), mesh=mesh, in_specs=(P(names), P()), out_specs=P(names)
    )
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((q, iota), (P(names), P()))]
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(body, *args)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "attn_q_batch_shard" and cfg["has_collectives"] is True
    assert cfg["entry_point"] == "jax_nkilib_kernels.collectives:attn_q_batch_shard"
    assert cfg["params"] == {"gqa_group_size": 2, "replica_group": [[0, 4], [1, 5], [2, 6], [3, 7]], "q_layout": layout}
    assert cfg["input_names"] == ["input", "iota_workers", "gathered_buf"]
    assert cfg["input_specs"][2] == [[2, *([N, B, S, D] if layout == "NBSd" else [D, B, 1, S])], "float32"]
    assert 'has_collectives = "1"' in text and operations(text).count("stablehlo.custom_call") == 1
    assert not [
        op
        for op in compute_operations(text)
        if op.startswith("stablehlo.") and op != "stablehlo.broadcast" and op != "stablehlo.broadcast_in_dim"
    ]


@pytest.mark.parametrize(
    "flags, error, fragment",
    [
        (dict(gqa_group_size=4), ValueError, "has 2 ranks"),
        (dict(gqa_group_size=None), ValueError, "`gqa_group_size` is required"),
        (dict(replica_group=None), ValueError, "`replica_group` is required"),
        (dict(replica_group="nope"), ValueError, "not bound here"),
        (dict(layout="BSd"), TypeError, "AttnQBatchShardLayout"),
        (dict(layout="NBSd", q_layout="NBSd"), TypeError, "not both"),
        (dict(iota=jnp.zeros((1, 4), jnp.int32)), ValueError, "entry for each of the 8 ranks"),
        (dict(iota=jnp.zeros((1, 8), jnp.float32)), TypeError, "iota_workers"),
        (dict(gathered_buf=jnp.zeros((3, N, B, S, D), jnp.float32)), ValueError, "gqa_group_size=2"),
        (dict(gathered_buf=jnp.zeros((2, N, B, S), jnp.float32)), ValueError, "gathered_buf"),
        (dict(gathered_buf=jnp.zeros((2, N, B, S, D), jnp.bfloat16)), TypeError, "input's dtype"),
        (dict(q=random((N, 7, S, D))), ValueError, "B=7"),
        (dict(q=random((N, B, S))), ValueError, "[n, B, S, d]"),
        (dict(layout="dBnS"), ValueError, "n=3"),
    ],
)
def test_bad_inputs(flags, error, fragment):
    mesh = make_mesh((4, 2), ("dp", "g"))
    q, iota = flags.pop("q", random((N, B, S, D))), flags.pop("iota", iota_workers(groups_of("tp2dp4")))
    flags = dict(dict(gqa_group_size=2, replica_group="g"), **flags)
    body = jax.shard_map(
        lambda x, t: attn_q_batch_shard(x, t, **flags), mesh=mesh, in_specs=(P(), P()), out_specs=P(("dp", "g"))
    )
    with pytest.raises(error) as info:
        jax.jit(body)(*[jax.device_put(a, NamedSharding(mesh, P())) for a in (q, iota)])
    assert fragment in str(info.value)


def test_global_rank_needs_every_mesh_axis_unless_rank_id_in_is_given():
    mesh = make_mesh((4, 2), ("dp", "g"))
    q, iota = random((N, B, S, D)), iota_workers(groups_of("tp2dp4"))
    specs = (P(), P())

    def partial_map(fn):
        return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=P("g"), axis_names={"g"}))

    placed = [jax.device_put(a, NamedSharding(mesh, P())) for a in (q, iota)]
    with pytest.raises(ValueError, match="every mesh axis"):
        partial_map(lambda x, t: attn_q_batch_shard(x, t, gqa_group_size=2, replica_group="g"))(*placed)
    rank = jnp.ones((1, 1), jnp.int32)  # rank 1: position 1 of its pair, batches [4, 8)
    out = partial_map(lambda x, t: attn_q_batch_shard(x, t, gqa_group_size=2, replica_group="g", rank_id_in=rank))(
        *placed
    )
    np.testing.assert_array_equal(np.asarray(out)[: 2 * N], np.concatenate([q, q])[:, 4:])
