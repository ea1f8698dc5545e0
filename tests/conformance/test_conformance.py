"""The conformance checklist, run over every arg spec (``jax_nkilib._src.tools.arg_specs``): jit, vmap (full,
partial, nested, of grad), gradients, ``jax.shard_map``, the dry-run Neuron lowering and a bad input.

Collective kernels only run inside ``jax.shard_map`` over their mesh axes: for them every check runs the spec's
``shard_map`` over global arrays (per-rank semantics are checked against oracles in ``tests/parallel``).
"""

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib._src.tools.arg_specs import arg_specs
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import compute_operations, kernel_configs, operations
from tests.support.numerics import EPSILON, tolerance
from tests.support.sharding import make_mesh, reshard

SPECS = arg_specs(size="small")
N = 2  # batch size of the vmap checks


def params(*selectors, slow=()):
    """pytest params over the small specs that have every one of ``selectors`` (attribute names); those named in
    ``slow`` are marked slow. A spec's checks run in one xdist worker (``--dist loadgroup``), so they share its
    compiled functions."""
    chosen = [s for s in SPECS if all(getattr(s, attr) for attr in selectors)]
    return pytest.mark.parametrize(
        "spec",
        [
            pytest.param(
                s, id=s.name, marks=[pytest.mark.xdist_group(s.name)] + ([pytest.mark.slow] if s.name in slow else [])
            )
            for s in chosen
        ],
    )


# Op-by-op dispatch of the rings takes 10-20 s per call on a small CPU machine: their eager runs stay slow, as the
# per-file eager checks they replace were (the ring kernels' own specs run eagerly in CI).
EAGER_IS_SLOW = ("ring_attention", "all_gather_matmul", "matmul_reduce_scatter")
# A variant spec (named `<kernel>.<variant>`) checks a flag or path of a kernel whose main spec runs every check in
# CI: its jit, vmap, vmap-of-grad and shard_map checks run with `-m slow` (its gradients, lowering and bad input in CI).
VARIANTS_ARE_SLOW = tuple(spec.name for spec in SPECS if "." in spec.name)
# The MoE family's kernels and ops (issue 14): their jit, vmap, vmap-of-grad and shard_map checks run with `-m slow`
# (CI runs their gradients, lowering and bad inputs here, and vmap, shard_map and sharding in tests/moe).
_MOE_FAMILY = ("moe", "router", "topk", "blockwise", "mx_moe", "rmsnorm_router", "permute", "unpermute", "build_all")
_MOE_FAMILY += ("cascaded_max", "argmax", "find_nonzero", "indexed_flatten", "gpsimd", "argsort")
VARIANTS_ARE_SLOW += tuple(spec.name for spec in SPECS if spec.name.startswith(_MOE_FAMILY))
# transformer_tkg (issue 15): its jit, vmap, vmap-of-grad and shard_map checks compile a multi-layer decode step
# several times; tests/attention/test_transformer_tkg.py covers them fast.
VARIANTS_ARE_SLOW += ("transformer_tkg",)
# ms_deformable_attention_bwd (issue 17): its variants run with `-m slow`;
# tests/attention/test_ms_deformable_attention.py covers its jit, vmap and shard_map fast (as the forward's VJP).
VARIANTS_ARE_SLOW += ("ms_deformable_attention_bwd",)
# mla_attention (issue 17): its eager reference runs op by op; tests/mla covers jit, vmap and shard_map fast.
VARIANTS_ARE_SLOW += ("mla_attention",)
# The scan kernels (issue 17): tests/scan covers their jit, vmap and shard_map fast (one shard_map program for all).
VARIANTS_ARE_SLOW += ("linear_scan", "selective_scan", "ssd")
# mla_qkv_cte_kernel (issue 17): tests/mla/test_mla_qkv_cte.py covers its jit, vmap and shard_map fast.
VARIANTS_ARE_SLOW += ("mla_qkv_cte_kernel",)


# ------------------------------------------------------------------------------------------------------- helpers
@functools.cache
def mesh_of(spec):
    return make_mesh(spec.sharding.axis_sizes, spec.sharding.axis_names)


@functools.cache
def function(spec, neuron=False):
    """The spec's call on global arrays: ``spec`` itself, or for collective kernels its ``shard_map`` (with
    ``neuron``: the call lowered for Neuron)."""
    sharding, call = spec.sharding, spec.neuron_call if neuron else spec
    if sharding is None or not sharding.collective:
        return call
    mesh = mesh_of(spec)
    body = jax.shard_map(call, mesh=mesh, in_specs=sharding.in_specs, out_specs=sharding.out_specs)

    def collective(*args):
        return body(*(a if a is None else reshard(a, NamedSharding(mesh, s)) for a, s in zip(args, sharding.in_specs)))

    return collective


@functools.cache
def jitted(spec):
    return jax.jit(function(spec))


def assert_same(actual, expected, reduction=64):
    """Every leaf of ``actual`` equals ``expected``'s within the shared tolerance of its dtype (exactly for
    integer and fp8/MX leaves)."""
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for got, want in zip(actual_leaves, expected_leaves):
        assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
        if np.dtype(got.dtype) not in EPSILON:  # integers, and fp8/MX values compared byte for byte
            np.testing.assert_array_equal(bits(got), bits(want))
            continue
        bound = tolerance(got.dtype, reduction)
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        scale = max(float(np.max(np.abs(want), initial=0.0)), 1.0)
        error = float(np.max(np.abs(got - want), initial=0.0)) / scale
        assert error <= bound, f"relative error {error:.3e} exceeds {bound:.3e} for {got.dtype}"


def bits(x):
    """``x`` as NumPy, one-byte floats as their bytes (NaN-like packed scale bytes compare equal)."""
    x = np.asarray(x)
    return x.view(np.uint8) if x.dtype.itemsize == 1 else x


def stacked(spec, axes, n=N):
    """Operands for vmap: those with an axis in ``axes`` stacked from ``n`` seeds along it, the rest seed 0's."""
    per_seed = [spec.args(seed) for seed in range(n)]
    return tuple(
        a if axis is None else jax.tree.map(lambda *leaves: jnp.stack(leaves, axis), *[p[i] for p in per_seed])
        for i, (a, axis) in enumerate(zip(per_seed[0], axes))
    )


def loop(fn, args, axes, n=N):
    """``fn`` called on each slice, results stacked along axis 0."""

    def sliced(a, axis, i):  # an operand may be a tuple of arrays
        return a if axis is None else jax.tree.map(lambda leaf: jnp.take(leaf, i, axis), a)

    outs = [fn(*(sliced(a, axis, i) for a, axis in zip(args, axes))) for i in range(n)]
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *outs)


def in_axes(spec, only=None, axis=0):
    names = spec.batched if only is None else only
    return tuple(axis if name in names else None for name in spec.operands)


def to_float64(args):
    return jax.tree.map(lambda a: a.astype(jnp.float64) if a.dtype == jnp.float32 else a, args)


def differentiable(spec):
    """``(loss_args -> outputs, grad argnums, args)``: the spec's call on float64 operands, as a function of the
    differentiable ones."""
    args = to_float64(spec.args())
    argnums = tuple(spec.operands.index(name) for name in spec.grad)
    fn, pick = function(spec), spec.grad_output or (lambda out: out)

    def of_grad_operands(*grad_args):
        full = list(args)
        for i, value in zip(argnums, grad_args):
            full[i] = value
        return pick(fn(*full))

    return of_grad_operands, argnums, args


def squared_sum(out):
    return sum(jnp.sum(leaf.astype(jnp.float64) ** 2) for leaf in jax.tree.leaves(out))


# --------------------------------------------------------------------------------------------------------- tests
@params(slow=EAGER_IS_SLOW + VARIANTS_ARE_SLOW)
def test_jit_matches_eager(spec):
    args = spec.args()
    assert_same(jitted(spec)(*args), function(spec)(*args))


@params("batched", slow=VARIANTS_ARE_SLOW)
def test_vmap_full_and_partial_match_loops(spec):
    """Two vmaps, compiled as one program, each equal to a loop of single calls: over every batchable operand; over
    the last batchable operand alone, along its last axis (partial ``in_axes`` on a trailing axis). (``vmap`` of
    ``vmap``: :func:`test_nested_vmap_matches_loops`, with ``-m slow``.)"""
    fn, full_axes = function(spec), in_axes(spec)
    name = spec.batched[-1]
    partial_axes = in_axes(spec, only=(name,), axis=spec.args()[spec.operands.index(name)].ndim)
    full, partial = stacked(spec, full_axes), stacked(spec, partial_axes)

    @jax.jit
    def vmaps(full, partial):
        return jax.vmap(fn, in_axes=full_axes)(*full), jax.vmap(fn, in_axes=partial_axes)(*partial)

    got_full, got_partial = vmaps(full, partial)
    single = jitted(spec)
    assert_same(got_full, loop(single, full, full_axes))
    assert_same(got_partial, loop(single, partial, partial_axes))


@pytest.mark.slow  # CI: the full and partial vmaps above
@params("batched")
def test_nested_vmap_matches_loops(spec):
    """``vmap(vmap(f))`` over every batchable operand equals a loop of loops of single calls."""
    fn, full_axes = function(spec), in_axes(spec)
    nested = tuple(
        a if axis is None else jax.tree.map(lambda leaf: leaf.reshape(N, N, *leaf.shape[1:]), a)
        for a, axis in zip(stacked(spec, full_axes, N * N), full_axes)
    )
    got = jax.jit(jax.vmap(jax.vmap(fn, in_axes=full_axes), in_axes=full_axes))(*nested)
    single = jitted(spec)
    assert_same(got, loop(lambda *a: loop(single, a, full_axes), nested, full_axes))


# A variant spec's float64 gradient check runs with `-m slow` too (CI time): CI checks the gradients of its kernel's
# main spec (a variant's flag path is then covered in CI only where the family's own tests differentiate it).
VARIANT_GRADIENTS_ARE_SLOW = tuple(spec.name for spec in SPECS if "." in spec.name)


@params("grad", "check_grads", slow=VARIANT_GRADIENTS_ARE_SLOW)
def test_gradients_float64(spec):
    fn, argnums, args = differentiable(spec)
    check_grads(jax.jit(fn), tuple(args[i] for i in argnums), order=spec.grad_order, modes=["rev"])


@params("grad", slow=VARIANTS_ARE_SLOW)
def test_vmap_of_grad_matches_a_loop(spec):
    fn, argnums, args = differentiable(spec)
    grad = jax.jit(jax.grad(lambda *g: squared_sum(fn(*g)), argnums=tuple(range(len(argnums)))))
    first = to_float64(jnp.stack([spec.args(seed)[argnums[0]] for seed in range(N)])[None])[0]
    rest = tuple(args[i] for i in argnums[1:])
    axes = (0,) + (None,) * len(rest)
    assert_same(jax.jit(jax.vmap(grad, in_axes=axes))(first, *rest), loop(grad, (first, *rest), axes))


@params("sharding", slow=VARIANTS_ARE_SLOW)
def test_inside_shard_map_on_8_devices(spec):
    sharding, args = spec.sharding, spec.args()
    mesh = mesh_of(spec)
    if sharding.collective:
        with pytest.raises((NameError, ValueError), match="|".join(sharding.axis_names)) as info:
            spec(*(a[: a.shape[0] // mesh.size] if a.ndim else a for a in args))
        assert "shard_map" in str(info.value), "the error should say to call it inside jax.shard_map"
        return
    sharded = jax.jit(jax.shard_map(spec, mesh=mesh, in_specs=sharding.in_specs, out_specs=sharding.out_specs))
    placed = tuple(
        a if a is None else jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, sharding.in_specs)
    )
    assert_same(sharded(*placed), jitted(spec)(*args))
    if spec.grad:
        argnums = tuple(spec.operands.index(name) for name in spec.grad)
        loss = lambda fn: jax.jit(jax.grad(lambda *a: squared_sum(fn(*a)), argnums=argnums))  # noqa: E731
        assert_same(loss(sharded)(*placed), loss(spec)(*args))


@params()
def test_neuron_lowering_is_the_expected_kernel_calls(spec, monkeypatch):
    args = spec.shapes(neuron=True)
    expected = contextlib.nullcontext()
    if spec.neuron_fallback:
        expected = pytest.warns(NeuronFallbackWarning, match=spec.neuron_fallback)
        # the fallback warns once per (op, call site, reasons), and a reference-only call site can be "<unknown>":
        # an earlier test in this process with the same op and reasons must not silence the warning expected here
        monkeypatch.setattr(neuron_lowering, "_warned", set())
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=spec.neuron_lnc, target=spec.neuron_target), expected:
        text = jax.jit(function(spec, neuron=True)).trace(*args).lower(lowering_platforms=("neuron",)).as_text()
    assert [config["func_name"] for config in kernel_configs(text)] == list(spec.kernels)
    assert operations(text).count("stablehlo.custom_call") == len(spec.kernels), "a custom call that is no kernel"
    if spec.only_kernels:
        assert [op for op in compute_operations(text) if op.startswith("stablehlo.")] == []


@params("bad")
def test_bad_input_names_the_argument(spec):
    bad, args, kwargs = spec.bad, list(spec.args()), dict(spec.kwargs)
    if bad.argument in spec.operands:
        index = spec.operands.index(bad.argument)
        args[index] = bad.value(args[index])
    else:
        kwargs[bad.argument] = bad.value(kwargs.get(bad.argument))
    with pytest.raises(bad.error, match=bad.match) as info:
        function(dataclasses.replace(spec, kwargs=kwargs))(*args)
    assert bad.argument in str(info.value)


# ------------------------------------------------------------------------------------------------------ coverage
def test_every_bound_kernel_has_arg_specs():
    bound = {row.kernel for row in jax_nkilib.support_matrix() if row.status == "bound"}
    covered = {kernel for spec in SPECS for kernel in spec.kernels}
    assert sorted(bound - covered) == [], "bound kernels without arg specs (see tests/conformance/README.md)"


def test_every_public_kernel_and_op_has_arg_specs():
    tools = {"config", "current_lnc", "explain", "neuron_hlo", "support_matrix"}
    public = [
        f"jax_nkilib.nki.{name}"
        for name in jax_nkilib.nki.__all__
        if callable(getattr(jax_nkilib.nki, name)) and not isinstance(getattr(jax_nkilib.nki, name), type)
    ]
    public += [
        f"jax_nkilib.{name}"
        for name in jax_nkilib.__all__
        if name not in tools and callable(getattr(jax_nkilib, name)) and not isinstance(getattr(jax_nkilib, name), type)
    ]
    covered = {spec.fn_name for spec in SPECS}
    assert sorted(set(public) - covered) == [], "public functions without arg specs (see tests/conformance/README.md)"
