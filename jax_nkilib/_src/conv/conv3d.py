"""``conv3d`` and ``conv3d_temporal_unroll`` (catalog rows 56, 57, section 1.24; docs-only): 3-D cross-correlation
with optional fused bias and activation, and ``should_use_temporal_unroll``, the library's advisory shape rule.

Sources: the NKI Library API reference (aws-neuron-sdk ``nki/library/api/conv3d.rst`` and
``conv3d-temporal-unroll.rst``, 2.32) and newer nki-library source in the public code index
(``src/nkilib_src/nkilib/experimental/conv/conv3d.py`` and ``conv3d_temporal_unroll.py``); neither kernel is in the
2.29 snapshot, so with an older installed library their Neuron lowering falls back (the warning names the versions).

``x_in [B, Cin, D, H, W]``, ``filters [Kd, Kh, Kw, Cin, Cout]``, ``bias [Cout]`` -> ``y [B, Cout, Do, Ho, Wo]``::

    acc[b, o, d, h, w] = sum_{kd, kh, kw, c} filters[kd, kh, kw, c, o]
                         * xpad[b, c, d sd + kd dd, h sh + kh dh, w sw + kw dw]

with ``stride = (sd, sh, sw)``, ``dilation = (dd, dh, dw)`` and ``padding = (d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)``
(zeros); ``Do = (D + d_lo + d_hi - dd (Kd - 1) - 1) // sd + 1`` and likewise. All operands share one dtype. The
epilogue is the one of :mod:`.conv_math` (float32 PSUM sums; ``round(acc + bias)`` then the activation; the bias
staged in float32).

``conv3d_temporal_unroll`` computes the same numbers for small ``Cout``: it asserts ``Cout <= 32`` and
``Do * 32 <= 128``; its ``lnc_shard`` splits ``Ho`` over the cores (``conv3d``'s splits the output positions).
:func:`should_use_temporal_unroll` mirrors the library's rule for when it pays: ``Do * 32 <= 128``, ``Cout <= 32``,
``Do >= 2``, ``Cin > 64`` and ``Wo > 512``.

Reverse mode: JAX's own convolution gradients (the reference differentiated; no backward kernel).
"""

from __future__ import annotations

from ..framework.common_types import ActFnType
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from .conv_math import (
    bias_then_activation,
    check_one_dtype,
    cross_correlation,
    int_tuple,
    kernel_activation,
    output_size,
)

COLUMN_TILE = 32  # conv3d_temporal_unroll puts each output depth in a 32-column tile of the 128-row PE array
PARTITIONS = 128
PSUM_FREE_MAX = 512  # nl.tile_size.psum_fmax
MIN_CIN_FOR_TEMPORAL_UNROLL = 64  # the library's threshold: more input channels than this
MIN_DOUT_FOR_TEMPORAL_UNROLL = 2


def should_use_temporal_unroll(C_out: int, D_out: int, C_in: int, K_d: int, W_out: int) -> bool:  # noqa: N803
    """The NKI Library's advisory rule (same arguments): whether ``conv3d_temporal_unroll`` applies and pays for a
    shape: all ``D_out`` depths fit one PSUM bank in 32-column tiles, ``C_out <= 32``, ``D_out >= 2``, ``C_in > 64``
    and ``W_out > 512`` (several W tiles). ``K_d`` does not enter the rule (the library takes it for its API)."""
    del K_d
    return (
        D_out * COLUMN_TILE <= PARTITIONS
        and C_out <= COLUMN_TILE
        and D_out >= MIN_DOUT_FOR_TEMPORAL_UNROLL
        and C_in > MIN_CIN_FOR_TEMPORAL_UNROLL
        and W_out > PSUM_FREE_MAX
    )


def triple(value, where: str) -> tuple[int, int, int]:
    """``(d, h, w)`` of Python ints >= 1 (strides, dilations)."""
    return int_tuple(value, where, 3, minimum=1)


def six_pads(value, where: str) -> tuple[int, ...]:
    """``(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi)`` of non-negative Python ints."""
    return int_tuple(value, where, 6, minimum=0)


def output_spatial(call: CallInfo) -> tuple[int, int, int]:
    """``(Do, Ho, Wo)`` of a call."""
    d, p = call.dims, call.params
    return tuple(
        output_size(d[size], d[taps], p["stride"][i], p["padding"][2 * i], p["padding"][2 * i + 1], p["dilation"][i])
        for i, (size, taps) in enumerate((("D", "Kd"), ("H", "Kh"), ("W", "Kw")))
    )


def reference_conv3d(
    x_in,
    filters,
    bias=None,
    *,
    stride=(1, 1, 1),
    padding=(0,) * 6,
    dilation=(1, 1, 1),
    activation_fn=None,
    lnc_shard=False,
):
    """JAX reference of ``conv3d`` / ``conv3d_temporal_unroll`` (see the module docstring)."""
    del lnc_shard  # splits output positions over the cores: same numbers
    pads = tuple(zip(padding[0::2], padding[1::2]))
    acc = cross_correlation(x_in, filters, strides=stride, pads=pads, dilations=dilation)
    return (bias_then_activation(acc, bias, activation_fn, x_in.dtype),)


def _outputs(call: CallInfo):
    d = call.dims
    return (("y", (d["B"], d["Cout"], *output_spatial(call)), call.avals["x_in"].dtype),)


def _check(call: CallInfo) -> None:
    check_one_dtype(call)
    if min(output_spatial(call)) < 1:
        raise ValueError(
            f"{call.function}: the output is empty: (Do, Ho, Wo) = {output_spatial(call)} for input (D, H, W) = "
            f"{(call.dims['D'], call.dims['H'], call.dims['W'])}, padding={call.params['padding']} and the dilated "
            "filter"
        )


def _temporal_unroll_limits(call: CallInfo) -> list[str]:
    d_out, unmet = output_spatial(call)[0], []
    if call.dims["Cout"] > COLUMN_TILE:
        unmet.append(f"Cout={call.dims['Cout']} exceeds {COLUMN_TILE} (the kernel asserts Cout <= {COLUMN_TILE})")
    if d_out * COLUMN_TILE > PARTITIONS:
        unmet.append(f"Do={d_out} exceeds {PARTITIONS // COLUMN_TILE} (the kernel asserts Do * 32 <= 128)")
    return unmet


def _spec(name: str, catalog_note: str, lnc_doc: str, limits) -> KernelSpec:
    return KernelSpec(
        name=name,
        entry_point=f"nkilib.experimental.conv.{name}:{name}",
        operands=(
            Operand.of("x_in", "B, Cin, D, H, W", doc="input volumes, channels first"),
            Operand.of("filters", "Kd, Kh, Kw, Cin, Cout", doc="filter taps (the kernel's layout)"),
            Operand.of("bias", "Cout", optional=True, doc="per-output-channel bias"),
        ),
        params=(
            Param("stride", (1, 1, 1), tuple, "(stride_d, stride_h, stride_w)", normalizer=triple),
            Param("padding", (0,) * 6, tuple, "(d_lo, d_hi, h_lo, h_hi, w_lo, w_hi) zeros", normalizer=six_pads),
            Param("dilation", (1, 1, 1), tuple, "(dilation_d, dilation_h, dilation_w)", normalizer=triple),
            Param(
                "activation_fn",
                None,
                ActFnType,
                "fused activation (SiLU, GELU, GELU_Tanh_Approx or Swish)",
                normalizer=kernel_activation,
            ),
            Param("lnc_shard", False, bool, lnc_doc),
        ),
        outputs=(),
        output_avals=_outputs,
        reference=reference_conv3d,
        check=_check,
        neuron_limits=limits,
        neuron_split_dims=("B",),
        fold_plans=(FoldPlan(axes={"x_in": "B", "filters": None, "bias": None}, outputs={"y": 0}),),
        mac_count=lambda call: (
            (
                call.dims["B"]
                * call.dims["Cout"]
                * call.dims["Cin"]
                * call.dims["Kd"]
                * call.dims["Kh"]
                * call.dims["Kw"]
            )
            * output_spatial(call)[0]
            * output_spatial(call)[1]
            * output_spatial(call)[2]
        ),
        family="conv",
        catalog="1.24",
        support={
            "idiomatic": "conv",
            "vjp": "JAX (the reference's convolution gradients; no backward kernel)",
            "notes": "docs-only (2.32); filters [Kd, Kh, Kw, Cin, Cout]; one dtype; float32 accumulation; "
            + catalog_note,
        },
    )


CONV3D_SPEC = _spec("conv3d", "lnc_shard splits the output positions", "split the output over the LNC cores", None)
CONV3D_TEMPORAL_UNROLL_SPEC = _spec(
    "conv3d_temporal_unroll",
    "Neuron: Cout <= 32 and Do <= 4 (else falls back); see should_use_temporal_unroll; lnc_shard splits Ho",
    "split Ho over the LNC cores (same result)",
    _temporal_unroll_limits,
)

conv3d = make_kernel(CONV3D_SPEC, reference_vjp)
conv3d_temporal_unroll = make_kernel(CONV3D_TEMPORAL_UNROLL_SPEC, reference_vjp)
