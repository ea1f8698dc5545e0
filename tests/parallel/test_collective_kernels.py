"""The NKI Library HBM collective kernels (catalog row 59) on 8 CPU devices: a 1-D mesh and a 4x2 mesh.

Per-rank inputs are stacked along axis 0 in the mesh's flattened device order (rank = position), and so are the
outputs; the oracle simulates each collective over the stacked float64 inputs and the rank lists.
"""

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib._src.collectives.hbm_collectives import (
    all_gather_hbm_kernel,
    all_reduce_hbm_kernel,
    all_to_all_hbm_kernel,
    dma_copy_rank_id_kernel,
    rank_id_kernel,
    reduce_scatter_hbm_kernel,
)
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, reshard, shard

RANKS, H, W = 8, 8, 3  # H rows per rank (divisible by every group size), W odd


def rank_lists(shape, names, group):
    """The rank lists of the groups over mesh axes ``group`` (ranks = positions in the flattened mesh)."""
    ranks = np.arange(RANKS).reshape(shape)
    moved = np.moveaxis(ranks, [names.index(n) for n in group], range(-len(group), 0))
    return moved.reshape(-1, int(np.prod([shape[names.index(n)] for n in group]))).tolist()


MESHES = {  # id: (shape, axis names, replica group)
    "8": ((8,), ("x",), ("x",)),
    "4x2": ((4, 2), ("a", "b"), ("a",)),
}


def simulate(kind, xs, groups):
    """float64 oracle: per-rank outputs ``[ranks, ...]`` of collective ``kind`` over per-rank inputs ``xs``."""
    xs = np.asarray(jnp.asarray(xs, jnp.float32), np.float64) if xs.dtype == jnp.bfloat16 else np.asarray(xs)
    outs = [None] * len(xs)
    for group in groups:
        members, size = xs[group], len(group)
        for i, r in enumerate(group):
            if kind == "all_reduce":
                outs[r] = members.sum(0)
            elif kind == "all_gather":
                outs[r] = np.concatenate(list(members), 0)
            elif kind == "reduce_scatter":
                outs[r] = np.split(members.sum(0), size, 0)[i]
            else:  # all_to_all: block s of the output is block r of rank s's input
                outs[r] = np.concatenate([np.split(m, size, 0)[i] for m in members], 0)
    return np.stack(outs)


KERNELS = {
    "all_reduce": lambda x, g, n: all_reduce_hbm_kernel(x, replica_group=g),
    "all_gather": lambda x, g, n: all_gather_hbm_kernel(x, replica_group=g, num_ranks=n),
    "reduce_scatter": lambda x, g, n: reduce_scatter_hbm_kernel(x, replica_group=g, num_ranks=n),
    "all_to_all": lambda x, g, n: all_to_all_hbm_kernel(x, replica_group=g),
}


def run(fn, mesh_id, *args, specs=None):
    """``fn`` on per-rank blocks of ``args`` (stacked along axis 0 over every device, unless ``specs`` says
    otherwise); outputs stacked along axis 0 in rank order."""
    shape, names, _ = MESHES[mesh_id]
    mesh = make_mesh(shape, names)
    every = P(names if len(names) > 1 else names[0])
    specs = specs or (every,) * len(args)
    body = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=every)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    return jax.jit(body)(*placed)


def no_other_computation(text):
    """Nothing but kernel calls and constants in the lowered module (the shard_map region aside)."""
    return not [op for op in compute_operations(text) if op.startswith("stablehlo.")]


def per_rank(stacked):
    return np.asarray(
        jnp.asarray(stacked, jnp.float64) if stacked.dtype != jnp.bfloat16 else jnp.asarray(stacked, jnp.float32),
        np.float64,
    ).reshape(RANKS, -1, *stacked.shape[1:])


def group_call(kind, mesh_id):
    shape, names, group = MESHES[mesh_id]
    size = int(np.prod([shape[names.index(n)] for n in group]))
    return functools.partial(KERNELS[kind], g=group if len(group) > 1 else group[0], n=size), rank_lists(
        shape, names, group
    )


# ----------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("mesh_id", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", list(KERNELS))
def test_matches_oracle(kind, dtype, mesh_id):
    x = random((RANKS * H, W), dtype, seed=1)
    fn, groups = group_call(kind, mesh_id)
    out = run(fn, mesh_id, x)
    assert out.dtype == dtype
    want = simulate(
        kind, np.asarray(x).reshape(RANKS, H, W) if dtype != jnp.bfloat16 else x.reshape(RANKS, H, W), groups
    )
    assert per_rank(out).shape == want.shape
    assert_close(per_rank(out), want, dtype, reduction=len(groups[0]))


def test_kernel_docstring_examples_two_ranks():
    """The kernels' own examples (replica_group [[0, 1]], inputs (2, 3)), here as 4 groups of 2 ranks."""
    pairs = np.tile([[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]], (4, 1))
    mesh = make_mesh((4, 2), ("dp", "pair"))

    def body(kernel, x, **flags):
        spec = P(("dp", "pair"))
        fn = jax.jit(
            jax.shard_map(lambda v: kernel(v, replica_group="pair", **flags), mesh=mesh, in_specs=spec, out_specs=spec)
        )
        return np.asarray(fn(jax.device_put(jnp.asarray(x, jnp.float32), NamedSharding(mesh, spec))))

    np.testing.assert_array_equal(body(all_reduce_hbm_kernel, pairs)[:4], [[8, 10, 12], [14, 16, 18]] * 2)
    np.testing.assert_array_equal(body(all_gather_hbm_kernel, pairs, num_ranks=2)[:8], pairs[:4].tolist() * 2)
    np.testing.assert_array_equal(
        body(all_to_all_hbm_kernel, pairs)[:4], [[1, 2, 3], [7, 8, 9], [4, 5, 6], [10, 11, 12]]
    )
    ramps = np.repeat(np.tile(np.arange(1, 5)[:, None], (8, 1)), 3, axis=1)  # every rank: rows 1, 2, 3, 4
    np.testing.assert_array_equal(
        body(reduce_scatter_hbm_kernel, ramps, num_ranks=2)[:4], np.repeat([[2], [4], [6], [8]], 3, axis=1)
    )


def test_any_rank_input():
    x = random((RANKS * 4, 2, 3, 2), seed=2)
    out = run(lambda v: all_reduce_hbm_kernel(v, replica_group="x"), "8", x)
    assert_close(
        per_rank(out),
        simulate("all_reduce", np.asarray(x).reshape(RANKS, 4, 2, 3, 2), [list(range(8))]),
        jnp.float32,
        reduction=RANKS,
    )
    out = run(lambda v: all_to_all_hbm_kernel(v, replica_group="x"), "8", random((RANKS * 8,), seed=3))
    want = simulate("all_to_all", np.asarray(random((RANKS * 8,), seed=3)).reshape(RANKS, 8), [list(range(8))])
    np.testing.assert_array_equal(per_rank(out), want)


@pytest.mark.parametrize("mesh_id", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rank_kernels_select_the_global_rank(mesh_id, dtype):
    table = random((RANKS, 5, W), dtype, seed=4)  # replicated on every rank
    out = run(rank_id_kernel, mesh_id, table, specs=(P(),))
    np.testing.assert_array_equal(per_rank(out), np.asarray(table.astype(jnp.float32), np.float64))
    lookup = jnp.asarray(np.random.default_rng(5).permutation(RANKS)[None, :], jnp.int32)
    out = run(dma_copy_rank_id_kernel, mesh_id, table, lookup, specs=(P(), P()))
    np.testing.assert_array_equal(per_rank(out), np.asarray(table.astype(jnp.float32), np.float64)[lookup[0]])


# ---------------------------------------------------------------------------------------------------------- vmap
def test_vmap_of_a_vector_all_to_all_runs_under_lax_map():
    """A rank-1 input has no other axis to fold into: the framework maps the kernel over the vmapped axis."""
    x = random((RANKS * 4, 3), seed=12)  # per rank: 3 vectors of 4 (one entry per rank of the "a" groups)
    fn, groups = group_call("all_to_all", "4x2")
    out = run(jax.vmap(fn, in_axes=1, out_axes=1), "4x2", x)
    blocks = np.asarray(x).reshape(RANKS, 4, 3)
    want = np.stack([simulate("all_to_all", blocks[:, :, i], groups) for i in range(3)], 2)
    np.testing.assert_array_equal(per_rank(out), want)


# ------------------------------------------------------------------------------------------------------- gradients
def _grad_check(fn, x, specs, mesh_id="4x2"):
    shape, names, _ = MESHES[mesh_id]
    mesh = make_mesh(shape, names)
    every = P(names)
    body = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=every)

    def loss(value):
        return body(reshard(value, NamedSharding(mesh, specs[0])))

    check_grads(jax.jit(loss), (shard(mesh, specs, x),), order=1, modes=["rev"], atol=1e-7, rtol=1e-7)


def test_rank_kernel_gradients_float64_replicated_table():
    table = random((RANKS, 2, W), jnp.float64, seed=9)
    _grad_check(rank_id_kernel, table, (P(),))
    lookup = jnp.asarray(np.array([[3, 3, 0, 1, 7, 2, 5, 4]]), jnp.int32)  # two ranks read row 3
    shape, names, _ = MESHES["4x2"]
    mesh = make_mesh(shape, names)
    body = jax.jit(
        jax.shard_map(
            lambda t, lk: dma_copy_rank_id_kernel(t, lk).sum() * jnp.ones((1,)),
            mesh=mesh,
            in_specs=(P(), P()),
            out_specs=P(names),
        )
    )
    placed = [jax.device_put(a, NamedSharding(mesh, P())) for a in (table, lookup)]
    grad = jax.jit(jax.grad(lambda t, lk: body(t, lk).sum()))(*placed)
    np.testing.assert_array_equal(grad[:, 0, 0], np.bincount(np.asarray(lookup[0]), minlength=RANKS))


@pytest.mark.parametrize(
    "kernel, flags, rows, dual",
    [
        (all_reduce_hbm_kernel, {}, H, "all_reduce"),
        (all_gather_hbm_kernel, dict(num_ranks=4), 4 * H, "reduce_scatter"),
        (reduce_scatter_hbm_kernel, dict(num_ranks=4), H // 4, "all_gather"),
        (all_to_all_hbm_kernel, {}, H, "all_to_all"),
    ],
)
def test_vjp_is_the_dual_collective_under_vmap_of_grad(kernel, flags, rows, dual):
    """Over every rank of the 4x2 mesh's groups, grad of sum(w * kernel(x)) is the dual collective of w: all_reduce's
    is all_reduce, all_gather's is reduce_scatter and back, all_to_all's is all_to_all; two weight sets at once with
    vmap of grad."""
    x = random((RANKS * H, W), jnp.float64, seed=10)
    weights = random((RANKS * rows, 2, W), jnp.float64, seed=11)  # per rank [rows, 2, W]

    def local(v, w):
        loss = lambda wi: jax.grad(lambda u: (wi * kernel(u, replica_group="a", **flags)).sum())(v)  # noqa: E731
        return jax.vmap(loss, in_axes=1, out_axes=1)(w)

    out = per_rank(run(local, "4x2", x, weights))  # [ranks, H, 2, W]
    groups = rank_lists((4, 2), ("a", "b"), ("a",))
    for i in range(2):
        cotangent = np.asarray(weights).reshape(RANKS, rows, 2, W)[:, :, i]
        assert_close(out[:, :, i], simulate(dual, cotangent, groups), jnp.float64, reduction=4)


# ---------------------------------------------------------------------------------------------- Neuron lowering
@pytest.mark.parametrize(
    "kind, entry",
    [
        ("all_reduce", "all_reduce_hbm_kernel"),
        ("all_gather", "all_gather_hbm_kernel"),
        ("reduce_scatter", "reduce_scatter_hbm_kernel"),
        ("all_to_all", "all_to_all_hbm_kernel"),
    ],
)
def test_neuron_lowering_is_one_collective_kernel_call_with_rank_lists(kind, entry):
    mesh = make_mesh((4, 2), ("a", "b"))
    fn, groups = group_call(kind, "4x2")
    body = jax.shard_map(fn, mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b")))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(body, jax.device_put(random((RANKS * H, W)), NamedSharding(mesh, P(("a", "b")))))
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == entry and cfg["has_collectives"] is True
    assert cfg["entry_point"] == f"nkilib.experimental.collectives.collectives:{entry}"
    assert cfg["params"]["replica_group"] == [[0, 2, 4, 6], [1, 3, 5, 7]] == groups
    if kind in ("all_gather", "reduce_scatter"):
        assert cfg["params"]["num_ranks"] == 4
    assert 'has_collectives = "1"' in text
    assert operations(text).count("stablehlo.custom_call") == 1 and no_other_computation(text)


def test_rank_lists_number_devices_as_xlas_own_collectives_do():
    """NKI ranks are the SPMD program's partition ids, the positions in the mesh's device order, as XLA numbers its
    own collectives (replica_groups with use_global_device_ids, one replica), not the devices' ids: on a mesh whose
    devices are permuted the two differ, and the kernel's groups equal XLA's all_reduce groups over the same axis."""
    devices = np.array(jax.devices()[:RANKS])[::-1].reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("a", "b"))
    assert [d.id for d in mesh.devices.flat] != list(range(RANKS))  # the permutation is real
    body = jax.shard_map(
        lambda v: all_reduce_hbm_kernel(v, replica_group="a") + jax.lax.psum(v, "a"),
        mesh=mesh,
        in_specs=P(("a", "b")),
        out_specs=P(("a", "b")),
    )
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(body, jax.device_put(random((RANKS * H, W)), NamedSharding(mesh, P(("a", "b")))))
    (cfg,) = kernel_configs(text)
    xla = re.search(r"stablehlo.all_reduce.*?replica_groups = dense<(\[\[.*?\]\])>", text, re.S)
    assert xla is not None and "use_global_device_ids" in text
    assert cfg["params"]["replica_group"] == json.loads(xla.group(1)) == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_neuron_lowering_of_a_training_step_uses_the_dual_kernels():
    mesh = make_mesh((8,), ("x",))
    body = jax.shard_map(
        lambda v: all_gather_hbm_kernel(v, replica_group="x", num_ranks=8), mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    x = jax.device_put(random((RANKS * H, W)), NamedSharding(mesh, P("x")))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax.grad(lambda v: (body(v) ** 2).sum()), x)
    assert [c["func_name"] for c in kernel_configs(text)] == ["all_gather_hbm_kernel", "reduce_scatter_hbm_kernel"]
    assert all(c["params"]["replica_group"] == [list(range(8))] for c in kernel_configs(text))
    assert not {"stablehlo.all_gather", "stablehlo.reduce_scatter", "stablehlo.all_reduce"} & set(operations(text))


def test_neuron_lowering_of_the_rank_kernels_points_at_the_library():
    mesh = make_mesh((4, 2), ("a", "b"))
    table = random((RANKS, 5, W))
    lookup = jnp.arange(RANKS, dtype=jnp.int32)[None]
    body = jax.shard_map(
        lambda t, lk: (rank_id_kernel(t), dma_copy_rank_id_kernel(t, lk)),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=(P(("a", "b")), P(("a", "b"))),
    )
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(body, *shard(mesh, (P(), P()), table, lookup))
    cfgs = kernel_configs(text)
    assert [c["entry_point"] for c in cfgs] == [
        "nkilib.experimental.collectives.collectives:rank_id_kernel",
        "nkilib.experimental.collectives.collectives:dma_copy_rank_id_kernel",
    ]
    assert all(c["has_collectives"] for c in cfgs) and no_other_computation(text)


# -------------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x: all_gather_hbm_kernel(x, replica_group="a", num_ranks=8), ValueError, "has 4 ranks"),
        (
            lambda x: reduce_scatter_hbm_kernel(x, replica_group="a"),
            TypeError,
            "missing required parameter `num_ranks`",
        ),
        (lambda x: reduce_scatter_hbm_kernel(x[:6], replica_group="a", num_ranks=4), ValueError, "equal blocks"),
        (lambda x: all_to_all_hbm_kernel(x[:6], replica_group="a"), ValueError, "one block per rank"),
        (lambda x: all_reduce_hbm_kernel(x, replica_group="nope"), ValueError, "not bound here"),
        (lambda x: all_reduce_hbm_kernel(x, replica_group=3), TypeError, "mesh axis name"),
        (lambda x: all_reduce_hbm_kernel(x), TypeError, "missing required parameter `replica_group`"),
        (lambda x: all_gather_hbm_kernel(x[None], replica_group="a", num_ranks=4), ValueError, "[H, W]"),
        (lambda x: all_reduce_hbm_kernel(x.astype(jnp.int32), replica_group="a"), TypeError, "dtype"),
        (lambda x: rank_id_kernel(x), ValueError, "[R, H, W]"),
        (
            lambda x: dma_copy_rank_id_kernel(x.reshape(8, 1, W), jnp.zeros((1, 4), jnp.int32)),
            ValueError,
            "entry for each of the 8 ranks",
        ),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        run(call, "4x2", random((RANKS * H, W)))
    assert fragment in str(info.value)


def test_rank_kernels_need_every_mesh_axis_manual():
    table = random((RANKS, 2, W))
    with pytest.raises(ValueError, match="inside jax.shard_map over every mesh axis"):
        rank_id_kernel(table)
    mesh = make_mesh((4, 2), ("a", "b"))
    body = jax.shard_map(rank_id_kernel, mesh=mesh, in_specs=P(), out_specs=P("a"), axis_names={"a"})
    with pytest.raises(ValueError, match="every mesh axis"):
        jax.jit(body)(jax.device_put(table, NamedSharding(mesh, P())))
