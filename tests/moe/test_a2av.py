"""permute_a2av / unpermute_a2av (catalog rows 60-61) on 8 CPU devices against NumPy oracles: a 1-D mesh with every
device one EP rank, and a 4x2 mesh with EP groups of 4 along "a".

Per-rank operands are stacked along axis 0 in the mesh's flattened device order (rank = position), and so are the
outputs. The oracles follow the kernels' torch references (fixed-stride receive layout, zero beyond the counts).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib import nki
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close, f64
from tests.support.sharding import make_mesh, reshard

RANKS, T, H = 8, 5, 3  # T, H odd
MESHES = {"8": ((8,), ("x",), "x"), "4x2": ((4, 2), ("a", "b"), "a")}


def groups_of(mesh_id):
    """The rank lists of the EP groups (ranks = positions in the flattened mesh)."""
    shape, names, group = MESHES[mesh_id]
    ranks = np.arange(RANKS).reshape(shape)
    moved = np.moveaxis(ranks, names.index(group), -1)
    return moved.reshape(-1, shape[names.index(group)]).tolist()


def routing(ep, seed, full=False):
    """Per-rank ``send_indices [R, T, EP]`` (sentinel ``T`` past the counts) and ``send_counts [R, EP]``: random
    counts in ``[0, T]`` (zeros and full columns included), random source rows (a token may go to several ranks,
    as with top-k routing)."""
    rng = np.random.default_rng(seed)
    counts = np.full((RANKS, ep), T) if full else rng.integers(0, T + 1, (RANKS, ep))
    counts[0, 0], counts[-1, -1] = 0, T
    indices = np.full((RANKS, T, ep), T)
    for r in range(RANKS):
        for d in range(ep):
            indices[r, : counts[r, d], d] = rng.permutation(T)[: counts[r, d]]
    return indices.astype(np.int32), counts.astype(np.int32)


def oracle_permute(x, indices, counts, groups):
    """float64 ``(recv_data [R, EP*T, H], metadata [R, 4, EP])`` of the dispatch."""
    ep = indices.shape[-1]
    recv, meta = np.zeros((RANKS, ep * T, H)), np.zeros((RANKS, 4, ep), np.int64)
    for group in groups:
        for d, r in enumerate(group):
            for s_pos, s in enumerate(group):
                c = counts[s, d]
                recv[r, s_pos * T : s_pos * T + c] = x[s, indices[s, :c, d]]
            meta[r, 0] = counts[r] * H
            meta[r, 1] = (np.cumsum(counts[r]) - counts[r]) * H
            meta[r, 2] = [counts[s, d] * H for s in group]
    return recv, meta


def oracle_unpermute(y, indices, recv_counts, groups):
    """float64 ``result [R, T, H]`` of the combine: rank r scatter-adds what each rank d returns."""
    result = np.zeros((RANKS, T, H))
    for group in groups:
        for r_pos, r in enumerate(group):
            for d_pos, d in enumerate(group):
                for i in range(recv_counts[d, r_pos]):
                    target = indices[r, i, d_pos]
                    if 0 <= target < T:
                        result[r, target] += y[d, r_pos * T + i]
    return result


def run(mesh_id, fn, *args):
    """``fn`` inside shard_map on per-rank blocks of ``args`` stacked along axis 0; outputs stacked likewise."""
    shape, names, _ = MESHES[mesh_id]
    mesh = make_mesh(shape, names)
    every = P(names if len(names) > 1 else names[0])
    body = jax.shard_map(fn, mesh=mesh, in_specs=(every,) * len(args), out_specs=every)
    placed = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, every)) for a in args]
    return jax.jit(body)(*placed)


def stack(x):
    return np.asarray(x).reshape(RANKS * x.shape[1], *x.shape[2:])


def permute(mesh_id):
    group = MESHES[mesh_id][2]
    return lambda x, i, c: nki.permute_a2av(x, i, c, replica_group=group)


def unpermute(mesh_id):
    group = MESHES[mesh_id][2]
    return lambda y, i, c: nki.unpermute_a2av(y, i, c, replica_group=group)


def ep_of(mesh_id):
    return len(groups_of(mesh_id)[0])


# ------------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("mesh_id", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_permute_matches_oracle(mesh_id, dtype):
    ep, groups = ep_of(mesh_id), groups_of(mesh_id)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((RANKS, T, H)), dtype)
    indices, counts = routing(ep, seed=2)
    recv, meta = run(mesh_id, permute(mesh_id), stack(x), stack(indices), counts)
    assert recv.dtype == dtype and recv.shape == (RANKS * ep * T, H)
    assert meta.dtype == jnp.uint32 and meta.shape == (RANKS * 4, ep)
    want_recv, want_meta = oracle_permute(f64(x), indices, counts, groups)
    np.testing.assert_array_equal(f64(recv).reshape(RANKS, ep * T, H), want_recv)  # a gather: exact
    np.testing.assert_array_equal(np.asarray(meta).reshape(RANKS, 4, ep), want_meta)


@pytest.mark.parametrize("mesh_id", list(MESHES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unpermute_matches_oracle(mesh_id, dtype):
    ep, groups = ep_of(mesh_id), groups_of(mesh_id)
    indices, counts = routing(ep, seed=3)
    recv_counts = np.stack([[counts[s, d] for s in group] for group in groups for d, _ in enumerate(group)])
    order = [r for group in groups for r in group]  # rank of each row of recv_counts
    recv_counts = recv_counts[np.argsort(order)].astype(np.int32)
    y = jnp.asarray(np.random.default_rng(4).standard_normal((RANKS, ep * T, H)), dtype)
    out = run(mesh_id, unpermute(mesh_id), stack(y), stack(indices), recv_counts)
    assert out.dtype == dtype and out.shape == (RANKS * T, H)
    want = oracle_unpermute(f64(y), indices, recv_counts, groups)
    assert_close(f64(out).reshape(RANKS, T, H), want, dtype, reduction=ep)


def test_combine_of_dispatch_counts_each_copy():
    """``U(P(x))`` with the dispatch's own receive counts: token t comes back once per rank it was sent to."""
    ep, groups = ep_of("8"), groups_of("8")
    x = np.random.default_rng(5).standard_normal((RANKS, T, H))
    indices, counts = routing(ep, seed=6)

    def round_trip(x, i, c):
        recv, meta = nki.permute_a2av(x, i, c, replica_group="x")
        recv_counts = (meta[2:3] // H).astype(jnp.int32)
        return nki.unpermute_a2av(recv, i, recv_counts, replica_group="x")

    out = run("8", round_trip, stack(x), stack(indices), counts)
    copies = np.zeros((RANKS, T))
    for r in range(RANKS):
        for d in range(ep):
            copies[r, indices[r, : counts[r, d], d]] += 1
    assert groups == [list(range(8))]
    assert_close(np.asarray(out).reshape(RANKS, T, H), x * copies[..., None], jnp.float32, reduction=ep)


# ------------------------------------------------------------------------------------------------------- adjoint
def _inner(a, b):
    return float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))


@pytest.mark.parametrize("mesh_id", list(MESHES))
def test_unpermute_is_the_adjoint_of_permute(mesh_id):
    """``sum_r <P(x)_r, y_r> == sum_s <x_s, U(y)_s>`` in float64, U with the dispatch's receive counts."""
    ep = ep_of(mesh_id)
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((RANKS * T, H)), rng.standard_normal((RANKS * ep * T, H))
    indices, counts = routing(ep, seed=8)

    def both(x, y, i, c):
        recv, meta = nki.permute_a2av(x, i, c, replica_group=MESHES[mesh_id][2])
        back = nki.unpermute_a2av(y, i, (meta[2:3] // H).astype(jnp.int32), replica_group=MESHES[mesh_id][2])
        return recv, back

    recv, back = run(mesh_id, both, x, y, stack(indices), counts)
    assert abs(_inner(recv, y) - _inner(x, back)) <= 1e-12 * max(1.0, abs(_inner(recv, y)))


def _sharded_loss(mesh_id, fn, *fixed):
    """``value -> fn(value, *fixed)`` inside shard_map, on a global float64 array."""
    shape, names, _ = MESHES[mesh_id]
    mesh = make_mesh(shape, names)
    every = P(names if len(names) > 1 else names[0])
    body = jax.shard_map(fn, mesh=mesh, in_specs=(every,) * (1 + len(fixed)), out_specs=every)
    placed = [jax.device_put(jnp.asarray(a), NamedSharding(mesh, every)) for a in fixed]
    return lambda value: body(reshard(value, NamedSharding(mesh, every)), *placed)


@pytest.mark.parametrize("mesh_id", list(MESHES))
def test_gradients_bind_the_adjoint_and_match_the_oracle(mesh_id):
    """grad of ``<P(x), y>`` is ``U(y)``; grad of ``<U(y), z>`` is ``P``'s transpose: both against the oracles,
    and ``check_grads`` (float64, reverse mode) on both kernels."""
    ep, groups, group = ep_of(mesh_id), groups_of(mesh_id), MESHES[mesh_id][2]
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((RANKS * T, H)), rng.standard_normal((RANKS * ep * T, H))
    indices, counts = routing(ep, seed=10)
    _, meta = oracle_permute(x.reshape(RANKS, T, H), indices, counts, groups)
    recv_counts = (meta[:, 2] // H).astype(np.int32)

    dispatch = _sharded_loss(
        mesh_id, lambda v, i, c: nki.permute_a2av(v, i, c, replica_group=group)[0], stack(indices), counts
    )
    combine = _sharded_loss(
        mesh_id, lambda v, i, c: nki.unpermute_a2av(v, i, c, replica_group=group), stack(indices), recv_counts
    )
    grad_x = jax.jit(jax.grad(lambda v: jnp.sum(dispatch(v) * y)))(jnp.asarray(x))
    want = oracle_unpermute(y.reshape(RANKS, ep * T, H), indices, recv_counts, groups)
    np.testing.assert_allclose(np.asarray(grad_x).reshape(RANKS, T, H), want, rtol=1e-13, atol=1e-13)

    z = rng.standard_normal((RANKS * T, H))
    grad_y = jax.jit(jax.grad(lambda v: jnp.sum(combine(v) * z)))(jnp.asarray(y))
    want_y, _ = oracle_permute(z.reshape(RANKS, T, H), indices, counts, groups)
    np.testing.assert_allclose(np.asarray(grad_y).reshape(RANKS, ep * T, H), want_y, rtol=1e-13, atol=1e-13)

    check_grads(jax.jit(dispatch), (jnp.asarray(x),), order=1, modes=["rev"])
    check_grads(jax.jit(combine), (jnp.asarray(y),), order=1, modes=["rev"])


def test_reverse_mode_on_neuron_runs_both_kernels():
    """Lowered for Neuron, the VJP of permute_a2av is the unpermute_a2av kernel (after the forward kernel, whose
    metadata gives the receive counts) and that of unpermute_a2av is permute_a2av (the linear forward itself is
    not needed for the gradient, so it is dropped)."""
    mesh = make_mesh((8,), ("x",))
    spec = P("x")
    indices, counts = routing(8, seed=11)

    def loss(kernel, value, i, c):
        return jnp.sum(
            kernel(value, i, c, replica_group="x")[0]
            if kernel is nki.permute_a2av
            else kernel(value, i, c, replica_group="x")
        )

    cases = ((nki.permute_a2av, T, ["permute_a2av", "unpermute_a2av"]), (nki.unpermute_a2av, 8 * T, ["permute_a2av"]))
    for kernel, rows, expected in cases:
        body = jax.shard_map(jax.grad(functools.partial(loss, kernel)), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        args = (
            jax.ShapeDtypeStruct((RANKS * rows, H), jnp.float32, sharding=NamedSharding(mesh, spec)),
            jax.ShapeDtypeStruct((RANKS * T, 8), jnp.int32, sharding=NamedSharding(mesh, spec)),
            jax.ShapeDtypeStruct((RANKS, 8), jnp.int32, sharding=NamedSharding(mesh, spec)),
        )
        with jax_nkilib.neuron.dry_run():
            text = jax.jit(body).trace(*args).lower(lowering_platforms=("neuron",)).as_text()
        assert [c["func_name"] for c in kernel_configs(text)] == expected


def test_vmap_of_the_combine_folds_into_h():
    """Several expert outputs combined with one routing: one kernel call over [EP*T, n*H], equal to a loop."""
    indices, counts = routing(8, seed=14)
    ys = np.random.default_rng(15).standard_normal((3, RANKS * 8 * T, H)).astype(np.float32)
    mesh = make_mesh((8,), ("x",))
    body = jax.shard_map(
        jax.vmap(lambda y, i, c: nki.unpermute_a2av(y, i, c, replica_group="x"), in_axes=(0, None, None)),
        mesh=mesh,
        in_specs=(P(None, "x"), P("x"), P("x")),
        out_specs=P(None, "x"),
    )
    args = (jnp.asarray(ys), jnp.asarray(stack(indices)), jnp.asarray(counts))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, (P(None, "x"), P("x"), P("x")))]
    out = jax.jit(body)(*placed)
    for n in range(3):
        np.testing.assert_array_equal(np.asarray(out[n]), np.asarray(run("8", unpermute("8"), ys[n], *args[1:])))
    with jax_nkilib.neuron.dry_run():
        text = jax.jit(body).trace(*placed).lower(lowering_platforms=("neuron",)).as_text()
    assert [c["func_name"] for c in kernel_configs(text)] == ["unpermute_a2av"]


# ---------------------------------------------------------------------------------------------------- bad inputs
def test_columns_must_match_the_replica_group():
    indices, counts = routing(8, seed=12)
    with pytest.raises(ValueError, match="EP=4 columns.*8 ranks"):
        run("8", permute("8"), np.zeros((RANKS * T, H), np.float32), stack(indices)[:, :4], counts[:, :4])


def test_unpermute_output_rows_are_ep_times_t():
    indices, counts = routing(8, seed=13)
    with pytest.raises(ValueError, match=r"output must be \[EP\*T, H\]"):
        run("8", unpermute("8"), np.zeros((RANKS * 7 * T, H), np.float32), stack(indices), counts)


def test_outside_shard_map_says_so():
    with pytest.raises((NameError, ValueError), match="shard_map"):
        nki.permute_a2av(
            jnp.zeros((T, H)), jnp.zeros((T, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32), replica_group="x"
        )


def test_runtime_checks_report_bad_counts_and_active_indices():
    """Under checkify (an Auto mesh: checkify of a shard_map over Explicit axes cannot index the checks' arrays)."""
    indices, counts = routing(8, seed=16)
    bad_counts, bad_indices = counts.copy(), stack(indices).copy()
    bad_counts[3, 2] = T + 1
    column = next(d for d in range(8) if counts[0, d] > 0)
    bad_indices[0, column] = -1
    mesh = jax.make_mesh((8,), ("x",), axis_types=(AxisType.Auto,))
    body = jax.shard_map(permute("8"), mesh=mesh, in_specs=(P("x"),) * 3, out_specs=(P("x"), P("x")))
    x = np.zeros((RANKS * T, H), np.float32)
    with jax_nkilib.config(runtime_checks=True):
        checked = jax.jit(checkify.checkify(body, errors=checkify.user_checks))
        assert checked(x, stack(indices), counts)[0].get() is None
        counts_message = checked(x, stack(indices), bad_counts)[0].get()
        index_message = checked(x, bad_indices, counts)[0].get()
    assert f"at mapped index 3: jax_nkilib.nki.permute_a2av: send_counts[0, 2] = {T + 1} is outside [0, T={T}]" in (
        counts_message
    )
    assert f"send_indices[0 {column}] = -1 is an active slot" in index_message
