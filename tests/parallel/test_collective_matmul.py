"""all_gather_matmul and matmul_reduce_scatter: ppermute rings inside jax.shard_map on 8 CPU devices."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

from jax_nkilib._src.sharding.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from tests.support.data import random
from tests.support.hlo import compiled_collectives
from tests.support.numerics import assert_close, assert_no_worse_than_plain, f64
from tests.support.sharding import make_mesh, mesh_1d, place, reshard
from tests.support.sharding import run_sharded as run

B, S, K, N = 2, 24, 12, 16  # S and N divide over 8 ranks; S_local = 3


def collective_counts(fn, mesh, in_specs, out_specs, *args) -> dict:
    body = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs))
    found = compiled_collectives(body.lower(*place(mesh, in_specs, *args)).compile().as_text())
    return {op: found.get(op, 0) for op in ("collective-permute", "all-gather", "reduce-scatter", "all-reduce")}


# ----------------------------------------------------------------------------------------------- all_gather_matmul
GATHER = dict(in_specs=(P(None, "r"), P(None, "r")), out_specs=P(None, None, "r"))  # x [B, S/8, K], w [K, N/8]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_all_gather_matmul_matches_oracle(dtype):
    x, w = random((B, S, K), dtype, 0), random((K, N), dtype, 1)
    out = run(
        functools.partial(all_gather_matmul, axis_name="r", gather_axis=1),
        mesh_1d("r"),
        GATHER["in_specs"],
        GATHER["out_specs"],
        x,
        w,
    )
    want = f64(x) @ f64(w)
    assert out.dtype == dtype and out.shape == (B, S, N)
    assert_close(out, want, dtype, reduction=K)
    if dtype == jnp.bfloat16:
        assert_no_worse_than_plain(out, jnp.matmul(x, w), want)


def test_all_gather_matmul_first_axis_replicated_weight():
    x, w = random((S, K), jnp.float32, 2), random((K, N), jnp.float32, 3)
    out = run(functools.partial(all_gather_matmul, axis_name="r"), mesh_1d("r"), (P("r"), P()), P("r"), x, w)
    assert out.shape == (8 * S, N)  # every rank returns the full [S, N]
    for rank in range(8):
        assert_close(np.asarray(out)[rank * S : (rank + 1) * S], f64(x) @ f64(w), jnp.float32, reduction=K)


def test_all_gather_matmul_ring_over_one_axis_of_a_2x4_mesh():
    mesh = make_mesh((2, 4), ("a", "b"))
    x, w = random((B, S, K), jnp.float32, 4), random((K, N), jnp.float32, 5)
    # batch over a, tokens over b (the ring), weight columns replicated
    out = run(
        functools.partial(all_gather_matmul, axis_name="b", gather_axis=1), mesh, (P("a", "b"), P()), P("a", "b"), x, w
    )
    # each rank of b returns the full sequence: the output stacks 4 copies along the token axis
    want = f64(x) @ f64(w)
    for rank in range(4):
        assert_close(np.asarray(out)[:, rank * S : (rank + 1) * S], want, jnp.float32, reduction=K)
    # and over the other axis, with the weight's columns sharded over b
    # (the ring's result is typed as varying over a: the two copies stack along the batch axis)
    out = run(
        functools.partial(all_gather_matmul, axis_name="a", gather_axis=1),
        mesh,
        (P(None, "a"), P(None, "b")),
        P("a", None, "b"),
        x,
        w,
    )
    assert_close(out, np.concatenate([want, want]), jnp.float32, reduction=K)


def test_all_gather_matmul_compiles_to_n_minus_1_collective_permutes():
    x, w = random((B, S, K)), random((K, N), seed=1)
    fn = functools.partial(all_gather_matmul, axis_name="r", gather_axis=1)
    counts = collective_counts(fn, mesh_1d("r"), GATHER["in_specs"], GATHER["out_specs"], x, w)
    assert counts == {"collective-permute": 7, "all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}
    mesh = make_mesh((2, 4), ("a", "b"))
    counts = collective_counts(
        functools.partial(all_gather_matmul, axis_name="b", gather_axis=1), mesh, (P("a", "b"), P()), P("a", "b"), x, w
    )
    assert counts["collective-permute"] == 3 and counts["all-gather"] == 0


# ------------------------------------------------------------------------------------------- matmul_reduce_scatter
SCATTER = dict(in_specs=(P(None, None, "r"), P("r")), out_specs=P(None, "r"))  # x [B, S, K/8], w [K/8, N]
K8 = 32  # contraction split over 8 ranks


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float64])
def test_matmul_reduce_scatter_matches_oracle(dtype):
    x, w = random((B, S, K8), dtype, 6), random((K8, N), dtype, 7)
    out = run(
        functools.partial(matmul_reduce_scatter, axis_name="r", scatter_axis=1),
        mesh_1d("r"),
        SCATTER["in_specs"],
        SCATTER["out_specs"],
        x,
        w,
    )
    want = f64(x) @ f64(w)
    assert out.dtype == dtype and out.shape == (B, S, N)
    assert_close(out, want, dtype, reduction=K8)
    if dtype == jnp.bfloat16:  # the partial sums travel in float32: no worse than one bf16 matmul
        assert_no_worse_than_plain(out, jnp.matmul(x, w), want)


def test_matmul_reduce_scatter_on_a_2x4_mesh_and_negative_axis():
    mesh = make_mesh((2, 4), ("a", "b"))
    x, w = random((B, S, K8), jnp.float32, 8), random((K8, N), jnp.float32, 9)
    # contraction over b (the ring), batch over a; the scattered token axis given as -2
    out = run(
        functools.partial(matmul_reduce_scatter, axis_name="b", scatter_axis=-2),
        mesh,
        (P("a", None, "b"), P("b")),
        P("a", "b"),
        x,
        w,
    )
    assert_close(out, f64(x) @ f64(w), jnp.float32, reduction=K8)


def test_matmul_reduce_scatter_compiles_to_n_minus_1_collective_permutes():
    x, w = random((B, S, K8)), random((K8, N), seed=1)
    fn = functools.partial(matmul_reduce_scatter, axis_name="r", scatter_axis=1)
    counts = collective_counts(fn, mesh_1d("r"), SCATTER["in_specs"], SCATTER["out_specs"], x, w)
    assert counts == {"collective-permute": 7, "all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}


# ----------------------------------------------------------------------------------------------- autodiff and vmap
def _differentiable(fn, mesh, in_specs, out_spec):
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    return lambda *args: body(*(reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)))


def test_matmul_reduce_scatter_gradients_replicated_operands():
    """Both operands replicated (the arg spec shards the contraction): every rank adds the whole product."""
    mesh = mesh_1d("r")
    x, w = random((S, 2), jnp.float64, 12), random((2, 4), jnp.float64, 13)
    fn = _differentiable(functools.partial(matmul_reduce_scatter, axis_name="r"), mesh, (P(), P()), P("r"))
    check_grads(jax.jit(fn), place(mesh, (P(), P()), x, w), order=1, modes=["rev"])


def test_gradients_match_oracle_and_backward_is_rings_only():
    """d/dx and d/dw of <C, y>: C w^T and x^T C (the global matrices), by ppermute rings only."""
    mesh = mesh_1d("r")
    x, w, c = random((S, K), jnp.float32, 14), random((K, N), jnp.float32, 15), random((S, N), jnp.float32, 16)

    def grads(x_, w_, c_):
        _, vjp = jax.vjp(functools.partial(all_gather_matmul, axis_name="r"), x_, w_)
        return vjp(c_)

    specs = (P("r"), P(None, "r"), P(None, "r"))
    dx, dw = run(grads, mesh, specs, (P("r"), P(None, "r")), x, w, c)
    assert_close(dx, f64(c) @ f64(w).T, jnp.float32, reduction=N)
    assert_close(dw, f64(x).T @ f64(c), jnp.float32, reduction=S)
    counts = collective_counts(grads, mesh, specs, (P("r"), P(None, "r")), x, w, c)
    assert counts == {"collective-permute": 14, "all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}

    def grads_rs(x_, w_, c_):
        _, vjp = jax.vjp(functools.partial(matmul_reduce_scatter, axis_name="r"), x_, w_)
        return vjp(c_)

    x2, w2 = random((S, K8), jnp.float32, 17), random((K8, N), jnp.float32, 18)
    specs = (P(None, "r"), P("r"), P("r"))
    dx2, dw2 = run(grads_rs, mesh, specs, (P(None, "r"), P("r")), x2, w2, c)
    assert_close(dx2, f64(c) @ f64(w2).T, jnp.float32, reduction=N)
    assert_close(dw2, f64(x2).T @ f64(c), jnp.float32, reduction=S)
    counts = collective_counts(grads_rs, mesh, specs, (P(None, "r"), P("r")), x2, w2, c)
    # both backward rings circulate dy: XLA shares their 7 permutes
    assert counts == {"collective-permute": 7, "all-gather": 0, "reduce-scatter": 0, "all-reduce": 0}


def test_vmap_of_the_activations_alone_inside_shard_map():
    """in_axes=(0, None): a batch of activations against one column-sharded weight."""
    mesh = mesh_1d("r")
    xs, w = random((3, S, K), jnp.float32, 19), random((K, N), jnp.float32, 20)
    batched = lambda x_, w_: jax.vmap(functools.partial(all_gather_matmul, axis_name="r"), (0, None))(x_, w_)  # noqa: E731
    out = run(batched, mesh, (P(None, "r"), P(None, "r")), P(None, None, "r"), xs, w)
    assert_close(out, f64(xs) @ f64(w), jnp.float32, reduction=K)


# ------------------------------------------------------------------------------------------------------ bad inputs
@pytest.mark.parametrize("fn", [all_gather_matmul, matmul_reduce_scatter])
@pytest.mark.parametrize(
    "case, error, fragment",
    [
        (dict(axis_name="nope"), ValueError, "inside jax.shard_map"),
        (dict(axis_name=3), TypeError, "mesh axis name"),
        (dict(w_shape=(K8, N, 1)), ValueError, "[K, N]"),
        (dict(w_shape=(K8 + 1, N)), ValueError, "contraction dimensions differ"),
        (dict(x_shape=(K8,)), ValueError, "rank >= 2"),
        (dict(axis=1), ValueError, "not its last"),
        (dict(axis=-1), ValueError, "not its last"),
        (dict(axis=5), ValueError, "out of range"),
        (dict(axis=0.0), TypeError, "must be an int"),
        (dict(dtype=jnp.int32), TypeError, "floating dtype"),
    ],
)
def test_bad_inputs(fn, case, error, fragment):
    mesh = mesh_1d("r")
    x = jnp.ones(case.get("x_shape", (S, K8)), case.get("dtype", jnp.float32))
    w = jnp.ones(case.get("w_shape", (K8, N)), jnp.float32)
    axis_kw = "gather_axis" if fn is all_gather_matmul else "scatter_axis"
    call = functools.partial(fn, axis_name=case.get("axis_name", "r"), **{axis_kw: case.get("axis", 0)})
    body = jax.shard_map(call, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(error) as info:
        jax.jit(body)(x, w)
    assert fragment in str(info.value)


def test_scatter_axis_must_divide_over_the_ring():
    mesh = mesh_1d("r")
    body = jax.shard_map(
        functools.partial(matmul_reduce_scatter, axis_name="r"),
        mesh=mesh,
        in_specs=(P(), P()),
        out_specs=P(),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="does not divide over the 8 ranks"):
        jax.jit(body)(jnp.ones((12, 4)), jnp.ones((4, 2)))


def test_on_neuron_all_gather_matmul_is_the_fgcc_kernel():
    """Row blocks [m, K] over a ring of consecutive ranks lower to one allgather_compute_matmul call, the ring's
    transfers inside the kernel; a ring over a major mesh axis (ranks not consecutive) falls back to the ring."""
    import jax_nkilib
    from jax_nkilib.neuron import NeuronFallbackWarning
    from tests.support.hlo import kernel_configs, operations

    x, w = random((8 * 16, 64), jnp.bfloat16, 0), random((64, 8 * 32), jnp.bfloat16, 1)
    mesh = mesh_1d("r")
    body = jax.shard_map(
        functools.partial(all_gather_matmul, axis_name="r"),
        mesh=mesh,
        in_specs=(P("r"), P(None, "r")),
        out_specs=P(None, "r"),
    )
    with jax_nkilib.neuron.dry_run():
        text = (
            jax.jit(body)
            .trace(*place(mesh, (P("r"), P(None, "r")), x, w))
            .lower(lowering_platforms=("neuron",))
            .as_text()
        )
    (config,) = kernel_configs(text)
    assert config["func_name"] == "allgather_compute_matmul" and config["params"]["tp_degree"] == 8
    assert "stablehlo.collective_permute" not in operations(text)
    mesh2 = make_mesh((4, 2), ("a", "b"))
    body2 = jax.shard_map(
        functools.partial(all_gather_matmul, axis_name="a"), mesh=mesh2, in_specs=(P("a"), P()), out_specs=P("a")
    )  # typed as varying over a
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match="consecutive ranks"):
        text = (
            jax.jit(body2)
            .trace(*place(mesh2, (P("a"), P()), x[:64], w))
            .lower(lowering_platforms=("neuron",))
            .as_text()
        )
    assert kernel_configs(text) == [] and "stablehlo.collective_permute" in operations(text)
