"""Where the declarative grammar ends, a spec passes functions: ``output_avals`` for computed outputs, ``prepare``
for argument preparation, ``keywords`` for a param the kernel names differently."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.framework.primitive import make_kernel
from jax_nkilib._src.framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from tests.support.hlo import kernel_configs, neuron_text, operations


def reference(x, r=None, *, pad, out_dtype):
    """``rows [B*S, H + pad]`` (zero padded, in ``out_dtype``), and ``x + r`` when ``r`` is given."""
    rows = x.reshape(-1, x.shape[-1])
    rows = jnp.concatenate([rows, jnp.zeros((rows.shape[0], pad), rows.dtype)], axis=1).astype(out_dtype)
    return (rows,) if r is None else (rows, x + r)


def outputs(call: CallInfo):
    dims, x = call.dims, call.avals["x"]
    produced = [("rows", (dims["B"] * dims["S"], dims["H"] + call.params["pad"]), call.params["out_dtype"])]
    if call.avals.get("r") is not None:
        produced.append(("sum", x.shape, x.dtype))
    return produced


def prepare(function, operands, params):
    if params["out_dtype"] is None:
        params["out_dtype"] = np.dtype(jnp.asarray(operands["x"]).dtype)
    return operands, params


SPEC = KernelSpec(
    name="toy_rows",
    entry_point="toy.kernels:toy_rows",
    operands=(Operand.of("x", "B, S, H"), Operand.of("r", "B, S, H", optional=True)),
    params=(Param("pad", 1, int), Param("out_dtype", None, "dtype")),
    outputs=(),
    output_avals=outputs,
    prepare=prepare,
    keywords={"padding": "pad"},
    reference=reference,
    neuron_limits=lambda call: [f"B={call.dims['B']} exceeds 2"] if call.dims["B"] > 2 else [],
    neuron_split_dims=("B",),
    fold_plans=(FoldPlan({"x": 0, "r": 0}, outputs={"rows": 0, "sum": 0}),),
)
toy_rows = make_kernel(SPEC)
X = jnp.arange(24.0, dtype=jnp.float32).reshape(2, 3, 4)


def test_computed_and_optional_outputs_and_prepared_params():
    rows = toy_rows(X)
    assert rows.shape == (6, 5) and rows.dtype == jnp.float32  # out_dtype prepared from x
    np.testing.assert_array_equal(rows[:, :4], X.reshape(6, 4))
    rows, total = toy_rows(X, X, padding=2, out_dtype=jnp.bfloat16)
    assert rows.shape == (6, 6) and rows.dtype == jnp.bfloat16
    np.testing.assert_array_equal(total, 2 * X)
    with pytest.raises(TypeError, match="give `padding` or `pad`, not both"):
        toy_rows(X, pad=1, padding=2)


def test_vmap_folds_computed_outputs_by_name():
    xs = jnp.stack([X, 3 * X])
    rows, total = jax.vmap(toy_rows)(xs, xs)
    assert "scan" not in str(jax.make_jaxpr(jax.vmap(toy_rows))(xs, xs))
    np.testing.assert_array_equal(rows[1], toy_rows(3 * X))
    np.testing.assert_array_equal(total[1], 6 * X)


def test_neuron_split_concatenates_along_the_axis_whose_size_changes():
    big = jnp.zeros((4, 3, 4), jnp.float32)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, r: toy_rows(x, r), big, big)
    configs = kernel_configs(text)
    assert len(configs) == 2 and all(cfg["output_names"] == ["rows", "sum"] for cfg in configs)
    assert [spec[0] for spec in configs[0]["input_specs"]] == [[2, 3, 4], [2, 3, 4]]
    assert operations(text).count("stablehlo.concatenate") == 2
    assert "tensor<12x5xf32>" in text and "tensor<6x5xf32>" in text  # rows [B*S, H+1] joined along B*S
