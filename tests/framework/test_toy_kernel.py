"""Adding a kernel is writing a spec: a toy spec gets validation, jit, vmap, autodiff and Neuron lowering."""

import enum

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.framework.primitive import make_kernel
from jax_nkilib._src.framework.spec import FOLLOW_LNC, FoldPlan, KernelSpec, Operand, Output, Param
from tests.support.hlo import kernel_configs, neuron_text


class Mode(enum.Enum):
    ADD = 0
    SUB = 1


def reference(x, w, bias=None, *, mode=Mode.ADD, scale=1.0, shard=False):
    out = x * w[:, None] * scale
    if bias is not None:
        out = out + bias if mode is Mode.ADD else out - bias
    return (out, jnp.sum(out, axis=1))


SPEC = KernelSpec(
    name="toy_scale_bias",
    entry_point="toy.kernels:toy_scale_bias",
    operands=(Operand.of("x", "N, M"), Operand.of("w", "N"), Operand.of("bias", "N, M", optional=True)),
    params=(Param("mode", Mode.ADD, Mode), Param("scale", 1.0, float), Param("shard", FOLLOW_LNC, bool)),
    outputs=(Output.of("out", "N, M", "x"), Output.of("row_sums", "N", "x")),
    reference=reference,
    neuron_limits=lambda call: ["N must be even"] if call.dims["N"] % 2 else [],
    fold_plans=(FoldPlan({"x": "N", "w": "N", "bias": "N"}, outputs=("N", "N")),),
    aliases={"x": "out"},
)


def vjp(kernel, operands, params, outs, cotangents):
    g, g_sums = cotangents
    g_total = g + g_sums[:, None]
    x, w = operands["x"], operands["w"]
    sign = 1.0 if params["mode"] is Mode.ADD else -1.0
    grads = {"x": g_total * w[:, None] * params["scale"], "w": jnp.sum(g_total * x, axis=1) * params["scale"]}
    if operands["bias"] is not None:
        grads["bias"] = sign * g_total
    return grads


toy = make_kernel(SPEC, vjp=vjp)
X = jnp.arange(12.0, dtype=jnp.float32).reshape(4, 3)
W = jnp.arange(1.0, 5.0, dtype=jnp.float32)
B = jnp.ones((4, 3), jnp.float32)


def test_call_with_enum_member_names_and_optional_operand():
    out, sums = toy(X, W, B, mode="SUB", scale=2.0)
    np.testing.assert_allclose(out, X * W[:, None] * 2 - 1)
    np.testing.assert_allclose(sums, out.sum(1))
    out, _ = toy(X, W)
    np.testing.assert_allclose(out, X * W[:, None])


def test_param_errors():
    with pytest.raises(TypeError, match="`mode` must be a Mode member or one of ADD, SUB"):
        toy(X, W, mode="MUL")
    with pytest.raises(TypeError, match="`scale` must be a Python float"):
        toy(X, W, scale="2")


def test_vmap_folds_into_the_kernel_axis():
    xs = jnp.stack([X, 2 * X])
    out, sums = jax.vmap(toy, in_axes=(0, None))(xs, W)  # fold plan: w broadcast into N
    np.testing.assert_allclose(out[1], 2 * X * W[:, None])
    assert "scan" not in str(jax.make_jaxpr(jax.vmap(toy, in_axes=(0, None)))(xs, W))


def test_gradients():
    from jax.test_util import check_grads

    args = tuple(a.astype(jnp.float64) for a in (X, W, B))
    check_grads(lambda x, w, b: toy(x, w, b, mode="SUB"), args, order=1, modes=["rev"])


def test_neuron_lowering_aliases_and_lnc_flag():
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(lambda x, w: toy(x, w), X, W)
    (cfg,) = kernel_configs(text)
    assert cfg["params"] == {"mode": "ADD", "scale": 1.0, "shard": True} and cfg["aliases"] == [[0, 0]]
    assert "output_operand_aliases" in text
