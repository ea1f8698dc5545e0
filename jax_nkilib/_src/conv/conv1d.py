"""``conv1d`` (catalog row 30, section 1.24): a 1-D cross-correlation with optional fused bias and activation.

Source: nki-library ``src/nkilib_src/nkilib/experimental/conv/conv1d.py`` (``@nki.jit conv1d(x_in, filters,
bias=None, stride=1, padding=(0, 0), dilation=1, activation_fn=None, lnc_shard=False)``, the same at tag 2.29 and on
main), its torch reference ``conv1d_torch.py`` (``conv1d_torch_ref``, ``nn.Conv1d`` with the filters permuted to
``[Cout, Cin, K]``) and its tests ``test/integration/nkilib/experimental/conv/test_conv1d.py``.

``x_in [B, Cin, L]``, ``filters [K, Cin, Cout]`` (**not** torch's ``[Cout, Cin, K]``), ``bias [Cout]`` ->
``y [B, Cout, Lout]``, ``Lout = (L + pad_left + pad_right - dilation (K - 1) - 1) // stride + 1``::

    acc[b, o, l] = sum_{k, c} filters[k, c, o] * xpad[b, c, l * stride + k * dilation]

with ``xpad`` zero-padded by ``padding = (pad_left, pad_right)``. All operands share one dtype.

Numerics, as the kernel computes them: ``acc`` is a float32 PSUM sum (float64 off Neuron for float64 inputs); then
with a bias ``y = round(acc + bias)`` and with an activation ``y = round(act(.))`` applied to that rounded sum (bias
and activation) or to ``acc`` (activation only); ``round`` casts to ``x_in``'s dtype. Activations are the kernels'
``nl.silu`` (SiLU), ``nl.gelu`` (GELU), ``nl.gelu_apprx_tanh`` (GELU_Tanh_Approx) and ``nl.gelu_apprx_sigmoid``
(Swish, ``x sigmoid(1.702 x)``; the torch reference maps Swish to SiLU instead); ReLU is not accepted by the kernel.

Reverse mode: JAX's own convolution gradients (the reference differentiated; there is no backward kernel).
``lnc_shard`` splits ``Cout`` over the LNC cores and does not change the result.

Neuron limits (the kernel's documented "intended usage range"): K <= 128, L, Cin, Cout <= 4096; a larger batch is
not a limit (the kernel loops over B).
"""

from __future__ import annotations

import numpy as np

from ..framework.common_types import ActFnType
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from .conv_math import bias_then_activation, check_one_dtype, cross_correlation, kernel_activation, output_size

MAX_K, MAX_L, MAX_CHANNELS = 128, 4096, 4096  # the kernel's documented intended usage range


def conv1d_output_length(length: int, kernel: int, stride: int, padding: tuple[int, int], dilation: int) -> int:
    """``(L + pad_left + pad_right - dilation (K - 1) - 1) // stride + 1``."""
    return output_size(length, kernel, stride, padding[0], padding[1], dilation)


def padding_pair(value, where: str) -> tuple[int, int]:
    """``padding`` as ``(pad_left, pad_right)`` of non-negative Python ints."""
    if (
        not isinstance(value, (tuple, list))
        or len(value) != 2
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value)
    ):
        raise TypeError(f"{where} must be a pair (pad_left, pad_right) of Python ints; got {value!r}")
    if min(value) < 0:
        raise ValueError(f"{where} must be non-negative (the kernel pads with zeros only); got {tuple(value)}")
    return (int(value[0]), int(value[1]))


def reference_conv1d(
    x_in, filters, bias=None, *, stride=1, padding=(0, 0), dilation=1, activation_fn=None, lnc_shard=False
):
    """JAX reference of ``conv1d`` (see the module docstring for the rounding steps)."""
    del lnc_shard  # splits Cout over the cores: same numbers
    acc = cross_correlation(x_in, filters, strides=(stride,), pads=(padding,), dilations=(dilation,))
    return (bias_then_activation(acc, bias, activation_fn, x_in.dtype),)


def _conv1d_outputs(call: CallInfo):
    d, p = call.dims, call.params
    length = conv1d_output_length(d["L"], d["K"], p["stride"], p["padding"], p["dilation"])
    return (("y", (d["B"], d["Cout"], length), call.avals["x_in"].dtype),)


def _check_conv1d(call: CallInfo) -> None:
    d, p, function = call.dims, call.params, call.function
    for name in ("stride", "dilation"):
        if p[name] < 1:
            raise ValueError(f"{function}: parameter `{name}` must be >= 1; got {p[name]}")
    check_one_dtype(call)
    if conv1d_output_length(d["L"], d["K"], p["stride"], p["padding"], p["dilation"]) < 1:
        raise ValueError(
            f"{function}: the output is empty: L={d['L']} with padding={p['padding']} is shorter than the dilated "
            f"filter (dilation * (K - 1) + 1 = {p['dilation'] * (d['K'] - 1) + 1})"
        )


def _conv1d_limits(call: CallInfo) -> list[str]:
    d, unmet = call.dims, []
    for name, limit in (("K", MAX_K), ("L", MAX_L), ("Cin", MAX_CHANNELS), ("Cout", MAX_CHANNELS)):
        if d[name] > limit:
            unmet.append(f"{name}={d[name]} exceeds the kernel's documented range {name} <= {limit}")
    return unmet


def _conv1d_macs(call: CallInfo) -> int:
    (_, shape, _), d = _conv1d_outputs(call)[0], call.dims
    return shape[0] * shape[1] * shape[2] * d["K"] * d["Cin"]


CONV1D_SPEC = KernelSpec(
    name="conv1d",
    entry_point="nkilib.experimental.conv.conv1d:conv1d",
    operands=(
        Operand.of("x_in", "B, Cin, L", doc="input sequences, channels first"),
        Operand.of("filters", "K, Cin, Cout", doc="filter taps (the kernel's layout; torch's is [Cout, Cin, K])"),
        Operand.of("bias", "Cout", optional=True, doc="per-output-channel bias"),
    ),
    params=(
        Param("stride", 1, int, "step between output positions"),
        Param("padding", (0, 0), tuple, "(pad_left, pad_right) zeros", normalizer=padding_pair),
        Param("dilation", 1, int, "spacing between filter taps"),
        Param(
            "activation_fn",
            None,
            ActFnType,
            "fused activation (SiLU, GELU, GELU_Tanh_Approx or Swish)",
            normalizer=kernel_activation,
        ),
        Param("lnc_shard", False, bool, "split Cout over the LNC cores (same result)"),
    ),
    outputs=(),
    output_avals=_conv1d_outputs,
    reference=reference_conv1d,
    check=_check_conv1d,
    neuron_limits=_conv1d_limits,
    neuron_split_dims=("B",),
    fold_plans=(FoldPlan(axes={"x_in": "B", "filters": None, "bias": None}, outputs={"y": 0}),),
    mac_count=_conv1d_macs,
    family="conv",
    catalog="1.24",
    support={
        "idiomatic": "conv",
        "vjp": "JAX (the reference's convolution gradients; no backward kernel)",
        "notes": f"filters [K, Cin, Cout]; one dtype for all operands; float32 accumulation; Neuron: K <= {MAX_K}, "
        f"L, Cin, Cout <= {MAX_L}; lnc_shard splits Cout",
    },
)


conv1d = make_kernel(CONV1D_SPEC, reference_vjp)
