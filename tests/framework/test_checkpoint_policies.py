"""Remat: the names of the residuals every kernel VJP saves, and ``jax_nkilib.checkpoint_policies``.

A policy's effect is read from the jaxpr of ``jax.grad`` of a checkpointed model: ``jax_nkilib.explain`` lists its
kernel calls (a forward kernel appears once when its outputs are saved, twice when the backward recomputes it) and a
walk counts its matmuls (the JAX code between kernels). Only tracing: nothing here compiles but the gradient check.
"""

import collections
import contextlib
import functools
import io
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.framework import registry
from jax_nkilib._src.tools.arg_specs import arg_specs
from jax_nkilib.checkpoint_policies import save_kernel_outputs, save_kernel_residuals
from tests.support.data import random
from tests.support.sharding import mesh_1d, shard

BATCH, SEQ, HEADS, HEAD_DIM = 1, 128, 2, 16  # SEQ % 128 == 0: attention's VJP is the attention_bwd kernel
HIDDEN = HEADS * HEAD_DIM
jax_policies = jax.checkpoint_policies


def model(x, gamma, w_qkv):
    """rms_norm -> QKV projection (one matmul) -> attention, the norm's output reused after attention."""
    h = jax_nkilib.rms_norm(x, gamma)
    q, k, v = (t.reshape(BATCH, SEQ, HEADS, HEAD_DIM) for t in jnp.split(h @ w_qkv, 3, axis=-1))
    o = jax_nkilib.attention(q, k, v, causal=True)
    return jnp.sum(o.reshape(BATCH, SEQ, HIDDEN) * h)


def model_args():
    return (
        random((BATCH, SEQ, HIDDEN), jnp.float32, 0),
        random((HIDDEN,), jnp.float32, 1),
        random((HIDDEN, 3 * HIDDEN), jnp.float32, 2) * 0.2,
    )


def grad_of(policy):
    """``jax.grad`` of the model in all its arguments, checkpointed with ``policy`` (``"off"``: no jax.checkpoint;
    ``None``: jax.checkpoint's default)."""
    fn = model if policy == "off" else jax.checkpoint(model, policy=policy)
    return jax.grad(fn, argnums=(0, 1, 2))


def count(primitive: str, jaxpr) -> int:
    """Equations of ``primitive`` in ``jaxpr`` and its sub-jaxprs (a loop body counts once)."""
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == primitive
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    total += count(primitive, inner)
    return total


def saved_names(fn, *args) -> list[str]:
    """The residuals ``jax.vjp(fn, *args)`` saves (``jax.ad_checkpoint.print_saved_residuals``): the name of each,
    or ``"unnamed: <what it is>"``."""
    listing = io.StringIO()
    with contextlib.redirect_stdout(listing):
        jax.ad_checkpoint.print_saved_residuals(fn, *args)
    names = []
    for line in listing.getvalue().splitlines():
        match = re.search(r"named '([^']*)'", line)
        names.append(match.group(1) if match else f"unnamed: {line}")
    return names


# ----------------------------------------------------------------------------------------------- the policies
POLICIES = {
    # policy: ({kernel: calls in the gradient's jaxpr}, matmuls)
    "off": ({"rmsnorm_tkg": 1, "attention_cte": 1, "attention_bwd": 1}, 3),
    "jax.checkpoint default": ({"rmsnorm_tkg": 2, "attention_cte": 2, "attention_bwd": 1}, 4),
    "nothing_saveable": ({"rmsnorm_tkg": 2, "attention_cte": 2, "attention_bwd": 1}, 4),
    "dots_saveable": ({"rmsnorm_tkg": 2, "attention_cte": 2, "attention_bwd": 1}, 3),
    "save_kernel_outputs": ({"rmsnorm_tkg": 1, "attention_cte": 1, "attention_bwd": 1}, 4),
    "save_kernel_residuals": ({"rmsnorm_tkg": 1, "attention_cte": 1, "attention_bwd": 1}, 3),
    "save_kernel_outputs + dots_saveable": ({"rmsnorm_tkg": 1, "attention_cte": 1, "attention_bwd": 1}, 3),
}
POLICY_FNS = {
    "off": "off",
    "jax.checkpoint default": None,
    "nothing_saveable": jax_policies.nothing_saveable,
    "dots_saveable": jax_policies.dots_saveable,
    "save_kernel_outputs": save_kernel_outputs,
    "save_kernel_residuals": save_kernel_residuals,
    "save_kernel_outputs + dots_saveable": jax_policies.save_from_both_policies(
        save_kernel_outputs, jax_policies.dots_saveable
    ),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_a_policy_recomputes_exactly_what_it_says(name):
    """The forward kernels run once in the gradient when their outputs are saved, twice when recomputed (JAX's
    policies save no kernel call: ``dots_saveable`` keeps the projection but reruns both kernels).
    ``save_kernel_outputs`` reruns the projection feeding attention; ``save_kernel_residuals`` keeps attention's
    inputs, so the gradient has the un-checkpointed three matmuls (forward, and the two of its backward)."""
    kernels, matmuls = POLICIES[name]
    grad = grad_of(POLICY_FNS[name])
    args = model_args()
    assert dict(collections.Counter(call.kernel for call in jax_nkilib.explain(grad, *args))) == kernels
    assert count("dot_general", jax.make_jaxpr(grad)(*args).jaxpr) == matmuls


def test_what_each_policy_saves():
    """``save_kernel_outputs`` saves the kernels' outputs and attention's statistics (besides arguments, which
    recomputing the kernels' inputs needs); ``save_kernel_residuals`` the kernels' inputs as well."""
    if jax.__version_info__ < (0, 8):  # JAX 0.7 reports a float residual as the reduce_precision remat puts on it
        pytest.skip("JAX 0.7's print_saved_residuals does not show a remat residual's name")
    args = model_args()
    outputs = ["rmsnorm_tkg.out", "attention_cte.o", "attention_cte.neg_max", "attention_cte.recip"]
    inputs = ["rmsnorm_tkg.input", "rmsnorm_tkg.gamma", "attention_cte.q", "attention_cte.k", "attention_cte.v"]

    def named(policy):
        """The names of the residuals saved; the others may only be the model's arguments."""
        names = saved_names(jax.checkpoint(model, policy=policy), *args)
        assert all("from the argument" in n for n in names if n.startswith("unnamed: ")), names
        return sorted(n for n in names if not n.startswith("unnamed: "))

    assert named(save_kernel_outputs) == sorted(outputs)
    assert named(save_kernel_residuals) == sorted(outputs + inputs)


def test_the_blockwise_dot_product_attention_names_its_residuals():
    """The drop-in's blockwise route (a dense bias) is a JAX-level custom_vjp: it names its residuals too."""
    if jax.__version_info__ < (0, 8):
        pytest.skip("JAX 0.7's print_saved_residuals does not show a remat residual's name")
    q, bias = jnp.ones((1, 16, 2, 8)), jnp.zeros((1, 2, 16, 16))
    attend = lambda q, bias: jax_nkilib.dot_product_attention(q, q, q, bias, is_causal=True)  # noqa: E731
    names = lambda policy: sorted(  # noqa: E731
        n for n in saved_names(jax.checkpoint(attend, policy=policy), q, bias) if not n.startswith("unnamed: ")
    )
    assert names(save_kernel_outputs) == ["dot_product_attention.lse", "dot_product_attention.out"]
    assert names(save_kernel_residuals) == sorted(
        ["dot_product_attention.lse", "dot_product_attention.out", "dot_product_attention.bias"]
        + ["dot_product_attention.query", "dot_product_attention.key", "dot_product_attention.value"]
    )


def test_moe_residuals_follow_the_policies():
    """jax_nkilib.moe's grouped experts (a JAX-level custom_vjp) name their blocked rows ``moe.x_blocks`` and output
    ``moe.y`` [blocks, rows, hidden]. They sit in a ``lax.platform_dependent`` branch, whose residuals JAX reports as
    unnamed outputs of the ``cond``; the policies still decide them: the outputs policy saves ``y``, the residuals
    policy ``x_blocks`` too, and ``nothing_saveable`` neither."""
    if jax.__version_info__ < (0, 8):
        pytest.skip("JAX 0.7's print_saved_residuals does not show a remat residual's origin")
    x, logits = jnp.ones((8, 16)), jnp.arange(32.0).reshape(8, 4)
    w_gu, w_d = jnp.full((4, 16, 2, 8), 0.1), jnp.full((4, 8, 16), 0.1)
    layer = lambda x: jnp.tanh(jax_nkilib.moe(x, logits, w_gu, w_d, top_k=2))  # noqa: E731
    blocked = lambda policy: sum(  # noqa: E731  # the [6 blocks, 8 rows, 16] residuals saved
        "[6,8,16]" in n for n in saved_names(jax.checkpoint(layer, policy=policy), x)
    )
    assert blocked(save_kernel_outputs) == 1
    assert blocked(save_kernel_residuals) == 2
    assert blocked(jax.checkpoint_policies.nothing_saveable) == 0


@pytest.mark.parametrize("policy", [save_kernel_outputs, save_kernel_residuals], ids=lambda p: p.__name__)
def test_policies_keep_the_gradient(policy):
    args = model_args()
    expected = jax.jit(grad_of("off"))(*args)
    for got, want in zip(jax.jit(grad_of(policy))(*args), expected):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_policies_read_the_names():
    name_p = jax.make_jaxpr(lambda x: checkpoint_name(x, "n"))(1.0).eqns[0].primitive
    f32 = jax.ShapeDtypeStruct((), jnp.float32)

    def saves(policy, name):
        return policy(name_p, f32, name=name)

    for name, output in [
        ("attention_cte.o", True),
        ("attention_cte.neg_max", True),
        ("attention_cte.q", False),
        ("qkv.k_cache", False),  # an operand ...
        ("qkv.k_cache_out", True),  # ... and the output updated in place
        ("ring_attention.lse", True),
        ("ring_attention.k", False),
    ]:
        assert saves(save_kernel_outputs, name) is output, name
        assert saves(save_kernel_residuals, name) is True, name
    for name in ["attention_cte", "attention_cte.", "not_a_kernel.o", "my_layer.attention_cte.o"]:
        assert not saves(save_kernel_outputs, name) and not saves(save_kernel_residuals, name), name
    # a kernel bound without a VJP (its results are no kernel's residuals) and other primitives
    bwd = registry.bound_kernels()["attention_bwd"].primitive
    assert save_kernel_outputs(bwd) and not save_kernel_residuals(bwd)
    assert not save_kernel_outputs(jax.lax.exp_p, f32) and not save_kernel_residuals(jax.lax.exp_p, f32)


# --------------------------------------------------------------------------------------------------- the names
def test_attention_cte_saves_its_output_and_statistics_by_name():
    """What the docs say: with the attention_bwd kernel as its VJP, attention_cte's forward runs with
    ``cache_softmax`` and saves ``o``, ``neg_max`` and ``recip`` besides q, k, v (though the call returns ``o``
    alone), and the idiomatic ``attention`` saves those same residuals."""
    q = random((2, SEQ, HEAD_DIM), jnp.float32, 0)
    k = random((2, HEAD_DIM, SEQ), jnp.float32, 1)
    v = random((2, SEQ, HEAD_DIM), jnp.float32, 2)
    expected = [f"attention_cte.{name}" for name in ("q", "k", "v", "o", "neg_max", "recip")]
    assert saved_names(jax_nkilib.nki.attention_cte, q, k, v) == expected
    qkv = (random((BATCH, SEQ, HEADS, HEAD_DIM), jnp.float32, seed) for seed in range(3))
    assert sorted(saved_names(functools.partial(jax_nkilib.attention, causal=True), *qkv)) == sorted(expected)


def _layer_one_differentiable_specs():
    kernels = registry.bound_kernels()
    return [
        pytest.param(spec, id=spec.name)
        for spec in arg_specs(size="small")
        if spec.grad
        and kernels.get(getattr(spec.fn, "__name__", None)) is spec.fn
        # collective kernels run only inside shard_map, whose residuals JAX reports as the shard_map's outputs
        and not (spec.sharding is not None and spec.sharding.collective)
    ]


@pytest.mark.parametrize("spec", _layer_one_differentiable_specs())
def test_every_residual_of_a_kernel_vjp_is_named(spec):
    """Every differentiable layer-1 kernel (one arg spec each): all its VJP saves is named
    ``<kernel>.<operand>`` (the operands given) or ``<kernel>.<output>``."""
    kernel = spec.fn.__name__
    args = spec.args()
    at = [spec.operands.index(name) for name in spec.grad]

    def differentiable(*values):
        full = list(args)
        for index, value in zip(at, values):
            full[index] = value
        return spec(*full)

    names = saved_names(differentiable, *(args[i] for i in at))
    given = {name for name, value in zip(spec.operands, args) if value is not None}
    prepare = spec.fn.spec.prepare  # a spec may fill in an operand the kernel requires (ssd's causal mask)
    if prepare is not None:
        operands, _ = prepare(kernel, dict(zip(spec.operands, args)), dict(spec.fn.params(**spec.kwargs)))
        given |= {name for name, value in operands.items() if value is not None}
    assert names and all(name.startswith(f"{kernel}.") for name in names), names
    suffixes = [name.removeprefix(f"{kernel}.") for name in names]
    operands = {op.name for op in spec.fn.spec.operands}
    assert {s for s in suffixes if s in operands} <= given, names


def test_output_names_never_read_as_operand_names():
    """An output named like an operand is saved as ``<output>_out``, which must not be an operand's name too."""
    for kernel in registry.bound_kernels().values():
        operands = {op.name for op in kernel.spec.operands}
        assert not {f"{name}_out" for name in operands} & operands, kernel.spec.name


# ------------------------------------------------------------------------------------------------ ring attention
def test_ring_attention_outputs_are_saved_by_save_kernel_outputs():
    """ring_attention (a JAX ring) names its residuals ``ring_attention.*``: saving its output and lse keeps the
    backward from rerunning the forward ring (whose permutes the gradient's jaxpr would hold twice)."""
    mesh, spec = mesh_1d("cp"), P(None, "cp")
    q, k, v = shard(mesh, (spec,) * 3, *(random((1, 64, 2, 8), jnp.float32, seed) for seed in range(3)))

    def permutes(policy):
        ring = functools.partial(jax_nkilib.ring_attention, axis_name="cp", causal=False, layout="contiguous")
        body = ring if policy == "off" else jax.checkpoint(ring, policy=policy)
        attend = jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
        grad = jax.grad(lambda *xs: jnp.sum(attend(*xs)), argnums=(0, 1, 2))
        return count("ppermute", jax.make_jaxpr(grad)(q, k, v).jaxpr)

    plain = permutes("off")
    assert permutes(save_kernel_outputs) == permutes(save_kernel_residuals) == plain
    assert permutes(jax_policies.nothing_saveable) > plain


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_collective_matmuls_are_saved_by_save_kernel_outputs(op):
    """The collective matmuls (JAX rings, or allgather_compute_matmul on Neuron) name their residuals and output
    ``<op>.*``: saving them keeps the backward from rerunning the forward ring."""
    mesh = mesh_1d("tp")
    x_spec, w_spec, out_spec = (
        (P("tp"), P(None, "tp"), P(None, "tp")) if op == "all_gather_matmul" else (P(None, "tp"), P("tp"), P("tp"))
    )
    x, w = shard(mesh, (x_spec, w_spec), random((16, 32), jnp.float32, 0), random((32, 16), jnp.float32, 1))

    def permutes(policy):
        # inside the checkpointed block the product feeds sin, whose backward needs it: the ring runs again
        # unless a policy saves the product
        fn = lambda x, w: jnp.sin(getattr(jax_nkilib, op)(x, w, axis_name="tp"))  # noqa: E731
        body = fn if policy == "off" else jax.checkpoint(fn, policy=policy)
        product = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_spec), out_specs=out_spec)
        jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(product(*a)), argnums=(0, 1)))(x, w).jaxpr
        # the forward of all_gather_matmul is the allgather_compute_matmul kernel; the rings' steps are ppermutes
        return count("ppermute", jaxpr) + count("allgather_compute_matmul", jaxpr)

    plain = permutes("off")
    assert permutes(save_kernel_outputs) == permutes(save_kernel_residuals) == plain
    assert permutes(jax_policies.nothing_saveable) > plain
