"""The all-gather kernels (fine_grained_allgather, allgather_compute_matmul, allgather_sb2sb(_tiled)) inside
jax.shard_map on 8 CPU devices: the gathering ranks are a mesh axis."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.collectives.allgather import (
    ALLGATHER_COMPUTE_MATMUL_SPEC,
    FINE_GRAINED_ALLGATHER_SPEC,
    allgather_compute_matmul,
    allgather_sb2sb,
    allgather_sb2sb_tiled,
    communication_path,
    fine_grained_allgather,
)
from jax_nkilib._src.framework import compat
from jax_nkilib._src.framework.spec import CallInfo
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close, assert_no_worse_than_plain, f64
from tests.support.sharding import make_mesh, mesh_1d, place
from tests.support.sharding import run_sharded as run

TP, M, K, N = 8, 3, 5, 2  # odd per-rank sizes


def fg(lhs, **kw):
    return fine_grained_allgather(lhs, **dict(dict(tp_degree=TP, num_groups=1, replica_groups="tp"), **kw))


def fgcc(lhs, rhs, **kw):
    return allgather_compute_matmul(lhs, rhs, **dict(dict(tp_degree=TP, num_groups=1, replica_groups="tp"), **kw))


def sb2sb(inp, tiled=False, **kw):
    kernel = allgather_sb2sb_tiled if tiled else allgather_sb2sb
    return kernel(inp, **dict(dict(replica_groups="tp", tp_degree=TP), **kw))


# ------------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fine_grained_allgather_gives_every_rank_all_rows_in_rank_order(dtype):
    lhs = random((TP * M, K), dtype)  # rank r holds rows r*M ... r*M + M - 1
    out = run(fg, mesh_1d("tp"), (P("tp"),), P("tp"), lhs)  # each rank's [TP, M, K] stacked along axis 0
    assert out.dtype == dtype and out.shape == (TP * TP, M, K)
    want = f64(lhs).reshape(TP, M, K)
    np.testing.assert_array_equal(f64(out).reshape(TP, TP, M, K), np.broadcast_to(want, (TP, TP, M, K)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_allgather_compute_matmul_matches_oracle(dtype):
    lhs, rhs = random((TP * M, K), dtype, 1), random((K, TP * N), dtype, 2)  # rhs columns sharded
    out = run(fgcc, mesh_1d("tp"), (P("tp"), P(None, "tp")), P(None, None, "tp"), lhs, rhs)
    assert out.dtype == dtype and out.shape == (TP, M, TP * N)
    want = (f64(lhs) @ f64(rhs)).reshape(TP, M, TP * N)
    assert_close(out, want, dtype, reduction=K)
    if dtype == jnp.bfloat16:
        assert_no_worse_than_plain(out, jnp.matmul(lhs, rhs).reshape(TP, M, TP * N), want)


@pytest.mark.parametrize("tiled", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_sb2sb_gathers_along_the_last_axis(tiled, dtype):
    rows, width = 7, 3
    inp = random((rows, TP * width), dtype, 3)  # rank r holds columns r*width ...
    out = run(functools.partial(sb2sb, tiled=tiled), mesh_1d("tp"), (P(None, "tp"),), P("tp"), inp)
    assert out.dtype == dtype and out.shape == (TP * rows, TP, width)
    want = f64(inp).reshape(rows, TP, width)  # = the kernel's [rows, width * tp] result, split rank-major
    np.testing.assert_array_equal(f64(out).reshape(TP, rows, TP, width), np.broadcast_to(want, (TP,) + want.shape))


def test_on_a_4x2_mesh_over_each_axis():
    mesh = make_mesh((4, 2), ("dp", "tp"))
    lhs, rhs = random((8, K), jnp.float32, 4), random((K, 4 * N), jnp.float32, 5)
    # gather over dp (4 ranks, 2 groups); rhs columns over dp; the tp copies stack on axis 0
    call = functools.partial(fgcc, tp_degree=4, num_groups=2, replica_groups="dp")
    out = run(call, mesh, (P(("dp", "tp")), P(None, "dp")), P("tp", None, "dp"), lhs, rhs)
    # ranks (dp=d, tp=t) hold lhs rows 2d + t: group t gathers rows t, 2 + t, 4 + t, 6 + t
    for t in range(2):
        rows = f64(lhs)[t::2]
        assert_close(np.asarray(out)[4 * t : 4 * t + 4].reshape(4, 4 * N), rows @ f64(rhs), jnp.float32, reduction=K)
    out = run(
        lambda x: fg(x, tp_degree=2, num_groups=4, replica_groups="tp"), mesh, (P(("dp", "tp")),), P(("dp", "tp")), lhs
    )
    pairs = f64(lhs).reshape(4, 2, 1, K)  # group d gathers rows 2d, 2d + 1
    np.testing.assert_array_equal(f64(out).reshape(4, 2, 2, 1, K), np.repeat(pairs[:, None], 2, axis=1))
    inp = random((3, 4 * 2), jnp.float32, 6)
    out = run(lambda x: sb2sb(x, replica_groups="dp", tp_degree=4), mesh, (P(None, "dp"),), P(("dp", "tp")), inp)
    np.testing.assert_array_equal(
        f64(out).reshape(8, 3, 4, 2), np.broadcast_to(f64(inp).reshape(3, 4, 2), (8, 3, 4, 2))
    )


# ----------------------------------------------------------------------------------------------------- gradients
def test_fgcc_gradient_oracle():
    mesh = mesh_1d("tp")
    lhs, rhs, c = (
        random((TP * M, K), jnp.float64, 12),
        random((K, TP * N), jnp.float64, 13),
        random((TP, M, TP * N), jnp.float64, 14),
    )

    def grads(x, w, ct):
        return jax.vjp(fgcc, x, w)[1](ct)

    specs = (P("tp"), P(None, "tp"), P(None, None, "tp"))
    dx, dw = run(grads, mesh, specs, (P("tp"), P(None, "tp")), lhs, rhs, c)
    flat = f64(c).reshape(TP * M, TP * N)
    assert_close(dx, flat @ f64(rhs).T, jnp.float64, reduction=TP * N)
    assert_close(dw, f64(lhs).T @ flat, jnp.float64, reduction=TP * M)


# ------------------------------------------------------------------------------------------------ Neuron lowering
def _neuron(fn, mesh, in_specs, out_specs, *args):
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    with jax_nkilib.neuron.dry_run():
        return neuron_text(body, *place(mesh, in_specs, *args))


def _one_collective_call(text, name):
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == name and cfg["has_collectives"] is True
    assert cfg["entry_point"] == f"jax_nkilib_kernels.allgather:{name}"
    assert 'has_collectives = "1"' in text
    assert operations(text).count("stablehlo.custom_call") == 1
    assert not {"stablehlo.all_gather", "stablehlo.collective_permute", "stablehlo.dot_general"} & set(operations(text))
    return cfg


def test_neuron_lowering_on_8_devices():
    mesh = mesh_1d("tp")
    lhs, rhs = random((TP * 4, 128)), random((128, TP * 8), seed=1)
    cfg = _one_collective_call(_neuron(fg, mesh, (P("tp"),), P("tp"), lhs), "fine_grained_allgather")
    assert cfg["params"] == {"tp_degree": 8, "num_groups": 1, "force_hbm_cc": False, "replica_groups": [list(range(8))]}
    assert cfg["input_specs"] == [[[4, 128], "float32"]]
    cfg = _one_collective_call(
        _neuron(fgcc, mesh, (P("tp"), P(None, "tp")), P(None, None, "tp"), lhs, rhs), "allgather_compute_matmul"
    )
    assert cfg["mac_count"] == 8 * 4 * 128 * 8 and cfg["params"]["replica_groups"] == [list(range(8))]
    for tiled, name in ((False, "allgather_sb2sb"), (True, "allgather_sb2sb_tiled")):
        cfg = _one_collective_call(
            _neuron(functools.partial(sb2sb, tiled=tiled), mesh, (P(None, "tp"),), P("tp"), random((16, TP * 4))), name
        )
        assert cfg["params"] == {"replica_groups": [list(range(8))], "tp_degree": 8}


def test_neuron_lowering_on_a_4x2_mesh_passes_rank_lists():
    mesh = make_mesh((4, 2), ("dp", "tp"))
    cfg = _one_collective_call(
        _neuron(
            lambda x: sb2sb(x, replica_groups="dp", tp_degree=4),
            mesh,
            (P(None, "dp"),),
            P(("dp", "tp")),
            random((16, 4 * 4)),
        ),
        "allgather_sb2sb",
    )
    assert cfg["params"]["replica_groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    mesh = make_mesh((2, 4), ("dp", "tp"))  # the ring kernels need the minor-most axis (consecutive ranks)
    cfg = _one_collective_call(
        _neuron(
            lambda x: fg(x, tp_degree=4, num_groups=2), mesh, (P(("dp", "tp")),), P(("dp", "tp")), random((8 * 4, 128))
        ),
        "fine_grained_allgather",
    )
    assert cfg["params"]["replica_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and cfg["params"]["num_groups"] == 2


def test_ring_kernels_fall_back_when_the_axis_ranks_are_not_consecutive():
    mesh = make_mesh((4, 2), ("dp", "tp"))
    call = functools.partial(fg, tp_degree=4, num_groups=2, replica_groups="dp")
    args = (mesh, (P(("dp", "tp")),), P(("dp", "tp")), random((8 * 4, 128)))
    with pytest.warns(NeuronFallbackWarning, match="consecutive ranks"):
        text = _neuron(call, *args)
    assert "stablehlo.custom_call" not in operations(text) and "stablehlo.all_gather" in operations(text)
    with jax_nkilib.config(on_unsupported="error"), pytest.raises(NeuronUnsupportedError, match="minor-most"):
        _neuron(call, *args)


def test_sb2sb_beyond_128_rows_runs_as_several_kernel_calls():
    text = _neuron(sb2sb, mesh_1d("tp"), (P(None, "tp"),), P("tp"), random((256, TP * 4)))
    configs = kernel_configs(text)
    assert len(configs) == 2 and all(cfg["input_specs"] == [[[128, 4], "float32"]] for cfg in configs)


def _call(spec, lnc=1, force_hbm_cc=False, **shapes):
    avals = {name: compat.ShapedArray(shape, jnp.bfloat16) for name, shape in shapes.items()}
    dims = {"m": shapes["lhs"][0], "K": shapes["lhs"][1], **({"N": shapes["rhs"][1]} if "rhs" in shapes else {})}
    params = dict(tp_degree=8, num_groups=1, force_hbm_cc=force_hbm_cc, replica_groups=("tp",), lnc=lnc)
    return CallInfo(spec.public_name, avals, dims, params)


def test_communication_path_and_neuron_limits():
    small = _call(FINE_GRAINED_ALLGATHER_SPEC, lhs=(256, 1024))
    assert communication_path(small) == "sbuf"
    assert communication_path(_call(FINE_GRAINED_ALLGATHER_SPEC, force_hbm_cc=True, lhs=(256, 1024))) == "hbm"
    assert communication_path(_call(FINE_GRAINED_ALLGATHER_SPEC, lhs=(8192, 1024))) == "hbm"  # 2 x 16 MiB > 24
    assert communication_path(_call(ALLGATHER_COMPUTE_MATMUL_SPEC, lhs=(256, 1024), rhs=(1024, 512))) == "sbuf"
    assert communication_path(_call(ALLGATHER_COMPUTE_MATMUL_SPEC, lhs=(4096, 1024), rhs=(1024, 4096))) == "hbm"
    limits = FINE_GRAINED_ALLGATHER_SPEC.neuron_limits
    assert limits(_call(FINE_GRAINED_ALLGATHER_SPEC, lhs=(256, 1024))) == []
    assert any("LNC x channels = 4" in s for s in limits(_call(FINE_GRAINED_ALLGATHER_SPEC, lnc=2, lhs=(6, 128))))
    assert any("K=200" in s for s in limits(_call(FINE_GRAINED_ALLGATHER_SPEC, lhs=(8, 200))))
    assert any(
        "N=600" in s
        for s in ALLGATHER_COMPUTE_MATMUL_SPEC.neuron_limits(
            _call(ALLGATHER_COMPUTE_MATMUL_SPEC, lhs=(8, 128), rhs=(128, 600))
        )
    )


def test_unsupported_tp_degree_and_dtype_fall_back():
    mesh = make_mesh((4, 2), ("dp", "tp"))  # tp has 2 ranks: the kernel supports 4..128
    with pytest.warns(NeuronFallbackWarning, match=r"tp_degree=2 must be one of"):
        _neuron(
            lambda x: fg(x, tp_degree=2, num_groups=4), mesh, (P(("dp", "tp")),), P(("dp", "tp")), random((8 * 4, 128))
        )
    lhs, rhs = random((TP * 4, 128)), random((128, TP * 8), jnp.bfloat16)
    with pytest.warns(NeuronFallbackWarning, match="must equal lhs dtype"):
        _neuron(fgcc, mesh_1d("tp"), (P("tp"), P(None, "tp")), P(None, None, "tp"), lhs, rhs)


# ---------------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "kernel, flags, error, fragment",
    [
        ("fg", dict(tp_degree=4), ValueError, "has 8 ranks"),
        ("fg", dict(num_groups=2), ValueError, "forms 1 groups"),
        ("fg", dict(replica_groups=None), ValueError, "`replica_groups` is required"),
        ("fg", dict(replica_groups="nope"), ValueError, "not bound here"),
        ("fg", dict(replica_groups=3), TypeError, "mesh axis name"),
        ("fg", dict(num_groups=None), ValueError, "`num_groups` is required"),
        ("fg", dict(tp_degree=8.0), TypeError, "Python int"),
        ("fgcc", dict(rhs=(K + 1, N)), ValueError, "argument `rhs`"),
        ("fgcc", dict(lhs=(M, K, 1)), ValueError, "argument `lhs`"),
        ("fgcc", dict(dtype=jnp.int32), TypeError, "dtype"),
        ("sb2sb", dict(tp_degree=None), ValueError, "`tp_degree` is required"),
        ("sb2sb", dict(tp_degree=2), ValueError, "has 8 ranks"),
    ],
)
def test_bad_inputs(kernel, flags, error, fragment):
    lhs = jnp.ones(flags.pop("lhs", (M, K)), flags.pop("dtype", jnp.float32))
    rhs = jnp.ones(flags.pop("rhs", (K, N)), jnp.float32)
    call = {
        "fg": lambda x, w: fg(x, **flags),
        "fgcc": lambda x, w: fgcc(x, w, **flags),
        "sb2sb": lambda x, w: sb2sb(x, **flags),
    }[kernel]
    body = jax.shard_map(call, mesh=mesh_1d("tp"), in_specs=(P(), P()), out_specs=P(), check_vma=False)
    with pytest.raises(error) as info:
        jax.jit(body)(lhs, rhs)
    assert fragment in str(info.value)


def test_lnc2_grid_and_row_split_limit():
    mesh = mesh_1d("tp")
    with jax_nkilib.config(lnc=2):
        cfg = _one_collective_call(
            _neuron(fg, mesh, (P("tp"),), P("tp"), random((TP * 4, 128))), "fine_grained_allgather"
        )
        assert cfg["grid"] == 2
        with pytest.warns(NeuronFallbackWarning, match="LNC x channels = 4"):  # 2 rows per rank over 2 x 2 lanes
            _neuron(fg, mesh, (P("tp"),), P("tp"), random((TP * 2, 128)))
