"""The foreach kernels (catalog rows 63 and 64, docs-only: NKI Library 2.32 API reference
``nki/library/api/foreach-elementwise.rst`` and ``foreach-norm.rst``; source
``nkilib/experimental/foreach/foreach_elementwise.py`` and ``foreach_norm.py``, absent from the local mirror's 2.29
and main; newer versions are in the public code index).

Every kernel takes flat ``[N]`` tensors, scalars as ``[128, 1]`` tensors (see :mod:`.flat`) and the static
``numel = N``, with ``torch._foreach_*`` semantics (``s`` = the scalar tensor's value):

* ``add/sub/mul/div_scalar_kernel(data, scalar_tensor)``: ``data + s``, ``data - s``, ``data * s``, ``data / s``;
* ``add/sub_tensor_kernel(data1, data2, alpha_tensor)``: ``data1 + alpha * data2``, ``data1 - alpha * data2``;
* ``mul/div_tensor_kernel(data1, data2)``: ``data1 * data2``, ``data1 / data2``;
* ``addcdiv_kernel(data, data1, data2, value_tensor)``: ``data + value * (data1 / data2)``;
* ``addcmul_kernel(data, data1, data2, value_tensor)``: ``data + value * (data1 * data2)``;
* ``lerp_kernel(data, end, weight_tensor)``: ``data + weight * (end - data)``;
* ``sqrt_kernel(data)``: ``sqrt(data)``;
* ``l1/l2/linf_norm_kernel(data) -> [1, 1]``: ``sum |x|``, ``sqrt(sum x^2)``, ``max |x|``.

Dtypes: the flat tensors share one float dtype; the output has it (the norm's ``[1, 1]`` too). The kernels
(``@nki.jit``; their source, in the public code index, agrees with these formulas) load the scalar as float32,
keep each intermediate in the operands' dtype (``alpha * data2`` is rounded before the add) and divide by
multiplying with a reciprocal; this reference computes in float32 (float64 for float64 inputs) and rounds once, so
the two differ only in rounding. The norms accumulate in float32. In the indexed version whose signatures match the
2.32 reference (``nl.ndarray`` annotations) the norms always exchange their per-core partials with ``sendrecv``,
which needs a second core: on Neuron they require LNC=2 (at LNC=1 the
call lowers to this reference with a ``NeuronFallbackWarning``; a newer source skips the exchange at LNC=1).
Reverse mode differentiates the reference (no backward kernels).
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, KernelSpec, Operand, Output, accumulation_dtype
from .flat import NUMEL, SCALAR_LAYOUT, check_numel, scalar_value

ELEMENTWISE_MODULE = "nkilib.experimental.foreach.foreach_elementwise"
NORM_MODULE = "nkilib.experimental.foreach.foreach_norm"
NORM_LNC = 2  # 2.32: "SPMD parallelization across 2 cores ... sendrecv-based cross-core reduction"


def _elementwise_reference(tensors: tuple[str, ...], scalar: str | None, math: Callable) -> Callable:
    """``reference(**operands, numel)``: ``math(*tensors[, s])`` in the accumulation dtype, rounded to the input's."""

    def reference(numel, **operands):
        del numel  # checked equal to N
        dtype = operands[tensors[0]].dtype
        wide = accumulation_dtype(dtype)
        values = [operands[name].astype(wide) for name in tensors]
        if scalar is not None:
            values.append(scalar_value(operands[scalar]).astype(wide))
        return (math(*values).astype(dtype),)

    return reference


def _spec(
    name: str,
    module: str,
    tensors: tuple[str, ...],
    scalar: str | None,
    reference: Callable,
    output: Output,
    doc: str,
    neuron_limits: Callable | None = None,
) -> KernelSpec:
    operands = tuple(Operand.of(t, "N", doc="flat tensor") for t in tensors)
    if scalar is not None:
        operands += (Operand.of(scalar, SCALAR_LAYOUT, doc="scalar broadcast to [128, 1] (all entries equal)"),)
    return KernelSpec(
        name=name,
        entry_point=f"{module}:{name}",
        operands=operands,
        params=(NUMEL,),
        outputs=(output,),
        reference=reference,
        check=lambda call: check_numel(call, tensors),
        neuron_limits=neuron_limits,
        mac_count=lambda call: call.dims["N"],
        family="foreach",
        catalog="row 63" if module == ELEMENTWISE_MODULE else "row 64",
        support={
            "idiomatic": "" if module == ELEMENTWISE_MODULE else "jax_nkilib.optim.clip_by_global_norm (l2)",
            "vjp": "JAX (differentiates the reference; no backward kernel)",
            "notes": doc,
        },
    )


def _elementwise(name: str, tensors: tuple[str, ...], scalar: str | None, math: Callable, doc: str):
    reference = _elementwise_reference(tensors, scalar, math)
    spec = _spec(name, ELEMENTWISE_MODULE, tensors, scalar, reference, Output.of("out", "N", tensors[0]), doc)
    return make_kernel(spec, reference_vjp)


_SCALAR = ("data",), "scalar_tensor"
_PAIR = ("data1", "data2")
_TRIPLE = ("data", "data1", "data2")

add_scalar_kernel = _elementwise("add_scalar_kernel", *_SCALAR, lambda x, s: x + s, "data + s; flat [N]")
sub_scalar_kernel = _elementwise("sub_scalar_kernel", *_SCALAR, lambda x, s: x - s, "data - s; flat [N]")
mul_scalar_kernel = _elementwise("mul_scalar_kernel", *_SCALAR, lambda x, s: x * s, "data * s; flat [N]")
div_scalar_kernel = _elementwise("div_scalar_kernel", *_SCALAR, lambda x, s: x / s, "data / s; flat [N]")
add_tensor_kernel = _elementwise(
    "add_tensor_kernel", _PAIR, "alpha_tensor", lambda a, b, alpha: a + alpha * b, "data1 + alpha * data2; flat [N]"
)
sub_tensor_kernel = _elementwise(
    "sub_tensor_kernel", _PAIR, "alpha_tensor", lambda a, b, alpha: a - alpha * b, "data1 - alpha * data2; flat [N]"
)
mul_tensor_kernel = _elementwise("mul_tensor_kernel", _PAIR, None, lambda a, b: a * b, "data1 * data2; flat [N]")
div_tensor_kernel = _elementwise("div_tensor_kernel", _PAIR, None, lambda a, b: a / b, "data1 / data2; flat [N]")
addcdiv_kernel = _elementwise(
    "addcdiv_kernel", _TRIPLE, "value_tensor", lambda x, a, b, v: x + v * (a / b), "data + value * data1 / data2"
)
addcmul_kernel = _elementwise(
    "addcmul_kernel", _TRIPLE, "value_tensor", lambda x, a, b, v: x + v * (a * b), "data + value * data1 * data2"
)
lerp_kernel = _elementwise(
    "lerp_kernel", ("data", "end"), "weight_tensor", lambda x, e, w: x + w * (e - x), "data + weight * (end - data)"
)
sqrt_kernel = _elementwise("sqrt_kernel", ("data",), None, jnp.sqrt, "sqrt(data) (data >= 0); flat [N]")


# ------------------------------------------------------------------------------------------------------ norms
def _norm_lnc(call: CallInfo) -> list[str]:
    if call.lnc != NORM_LNC:
        return [f"the kernel requires LNC=2 (split across 2 cores with a sendrecv reduction); got LNC={call.lnc}"]
    return []


def _norm(name: str, reduce: Callable, doc: str):
    def reference(data, numel):
        del numel  # checked equal to N
        wide = data.astype(accumulation_dtype(data.dtype))
        return (reduce(wide).reshape(1, 1).astype(data.dtype),)

    spec = _spec(name, NORM_MODULE, ("data",), None, reference, Output.of("norm", "1, 1", "data"), doc, _norm_lnc)
    return make_kernel(spec, reference_vjp)


l1_norm_kernel = _norm(
    "l1_norm_kernel", lambda x: jnp.sum(jnp.abs(x)), "sum |x| -> [1, 1]; requires LNC=2 on Neuron (falls back at 1)"
)
l2_norm_kernel = _norm(
    "l2_norm_kernel", lambda x: jnp.sqrt(jnp.sum(x * x)), "sqrt(sum x^2) -> [1, 1]; requires LNC=2 on Neuron"
)
linf_norm_kernel = _norm(
    "linf_norm_kernel", lambda x: jnp.max(jnp.abs(x)), "max |x| -> [1, 1]; requires LNC=2 on Neuron (falls back at 1)"
)
