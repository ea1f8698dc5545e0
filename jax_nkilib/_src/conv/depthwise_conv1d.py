"""``depthwise_conv1d_implicit_gemm`` (catalog row 31, section 1.24): a depthwise 1-D cross-correlation with an
XLA-conv-style signature.

Source: nki-library ``src/nkilib_src/nkilib/experimental/conv/depthwise_conv1d.py`` (``@nki.jit
depthwise_conv1d_implicit_gemm(img_ref, filter_ref, padding=((0, 0), (0, 0)), stride=(1, 1), rhs_dilation=(1, 1),
lhs_dilation=(1, 1), feature_group_count=1, batch_group_count=1, in_perm=None, kern_perm=None, out_perm=None)``,
the same at tag 2.29 and on main) and its tests ``test/integration/nkilib/experimental/conv/test_depthwise_conv1d.py``
(golden: torch ``conv2d(groups=C)``; compiled with ``logical_nc_config=2``). No torch reference file.

``img_ref [N, C, 1, W]``, ``filter_ref [C, 1, 1, S]`` -> ``output [N, C, 1, Q]``, ``Q = (W + pad_l + pad_r - S) //
stride_w + 1``::

    output[n, c, 0, q] = sum_s filter_ref[c, 0, 0, s] * xpad[n, c, 0, q * stride_w + s]

with ``xpad`` zero-padded by ``padding[1] = (pad_l, pad_r)``: ``lax.conv_general_dilated`` with
``feature_group_count=C`` and NCHW/OIHW/NCHW dimension numbers. The kernel supports only that case: ``stride_h = 1``,
no H padding, dilations ``(1, 1)``, ``feature_group_count == C``, ``batch_group_count == 1``; it ignores
``in_perm``/``kern_perm``/``out_perm``, so jax_nkilib accepts only ``None`` for them. ``img_ref`` and ``filter_ref``
share one dtype (the torch test's; the output takes ``img_ref``'s).

Numerics: float32 PSUM sums over S (float64 off Neuron for float64), rounded once to the dtype.

Reverse mode: JAX's own convolution gradients (the reference differentiated; no backward kernel).

Neuron: the kernel splits C over ``nl.num_programs()`` cores as ``C // n`` channels each (an odd C at LNC=2 would drop
the last channel) and is documented and tested only at LNC=2: other LNC degrees, and an odd C, fall back.
"""

from __future__ import annotations

from jax import lax

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype
from .conv_math import int_tuple

DEPTHWISE_LNC = 2  # the kernel shards C over two cores (its docstring and tests)


def int_pair(value, where: str) -> tuple[int, int]:
    """A ``(h, w)`` pair of Python ints."""
    return int_tuple(value, where, 2)


def padding_pairs(value, where: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((pad_h_l, pad_h_r), (pad_w_l, pad_w_r))`` of non-negative Python ints."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise TypeError(f"{where} must be ((pad_h_l, pad_h_r), (pad_w_l, pad_w_r)); got {value!r}")
    pairs = tuple(int_tuple(pair, where, 2) for pair in value)
    if min(pairs[0] + pairs[1]) < 0:
        raise ValueError(f"{where} must be non-negative (the kernel pads with zeros only); got {pairs}")
    return pairs


def no_permutation(value, where: str):
    """``None``: the kernel ignores the layout permutations, so any other value would be silently dropped."""
    if value is not None:
        raise ValueError(f"{where} must be None (the kernel ignores layout permutations); got {value!r}")
    return None


def depthwise_output_width(width: int, taps: int, padding, stride) -> int:
    """``Q = (W + pad_l + pad_r - S) // stride_w + 1``."""
    return (width + padding[1][0] + padding[1][1] - taps) // stride[1] + 1


def reference_depthwise_conv1d_implicit_gemm(img_ref, filter_ref, *, padding, stride, **_):
    """JAX reference: the depthwise convolution in the accumulation dtype, rounded to ``img_ref``'s dtype."""
    wide = accumulation_dtype(img_ref.dtype)
    out = lax.conv_general_dilated(
        img_ref.astype(wide),
        filter_ref.astype(wide),
        window_strides=stride,
        padding=padding,
        dimension_numbers=("NCHW", "OIHW", "NCHW"),
        feature_group_count=img_ref.shape[1],
        precision=lax.Precision.HIGHEST,
        preferred_element_type=wide,
    )
    return (out.astype(img_ref.dtype),)


def _outputs(call: CallInfo):
    d = call.dims
    q = depthwise_output_width(d["W"], d["S"], call.params["padding"], call.params["stride"])
    return (("output", (d["N"], d["C"], 1, q), call.avals["img_ref"].dtype),)


def _check(call: CallInfo) -> None:
    p, d, function = call.params, call.dims, call.function
    unsupported = {
        "stride": (p["stride"][0] != 1 or p["stride"][1] < 1, "(1, stride_w) with stride_w >= 1"),
        "padding": (p["padding"][0] != (0, 0), "((0, 0), (pad_l, pad_r)) (no padding of the H = 1 axis)"),
        "rhs_dilation": (p["rhs_dilation"] != (1, 1), "(1, 1)"),
        "lhs_dilation": (p["lhs_dilation"] != (1, 1), "(1, 1)"),
        "feature_group_count": (p["feature_group_count"] != d["C"], f"C={d['C']} (depthwise only)"),
        "batch_group_count": (p["batch_group_count"] != 1, "1"),
    }
    for name, (bad, expected) in unsupported.items():
        if bad:
            raise ValueError(f"{function}: parameter `{name}` must be {expected}; got {p[name]!r}")
    if call.avals["img_ref"].dtype != call.avals["filter_ref"].dtype:
        raise TypeError(
            f"{function}: img_ref and filter_ref must share one dtype; got {call.avals['img_ref'].dtype} and "
            f"{call.avals['filter_ref'].dtype}"
        )
    if depthwise_output_width(d["W"], d["S"], p["padding"], p["stride"]) < 1:
        raise ValueError(f"{function}: the output is empty: W={d['W']} plus padding is shorter than S={d['S']}")


def _limits(call: CallInfo) -> list[str]:
    unmet = []
    if call.lnc != DEPTHWISE_LNC:
        unmet.append(f"the kernel requires LNC=2 (it splits C over two cores); got LNC={call.lnc}")
    if call.dims["C"] % DEPTHWISE_LNC:
        unmet.append(f"C={call.dims['C']} must be even (the kernel gives each of the 2 cores C // 2 channels)")
    return unmet


DEPTHWISE_CONV1D_SPEC = KernelSpec(
    name="depthwise_conv1d_implicit_gemm",
    entry_point="nkilib.experimental.conv.depthwise_conv1d:depthwise_conv1d_implicit_gemm",
    operands=(
        Operand.of("img_ref", "N, C, 1, W", doc="input rows, channels first, a unit H axis"),
        Operand.of("filter_ref", "C, 1, 1, S", doc="one filter of S taps per channel"),
    ),
    params=(
        Param("padding", ((0, 0), (0, 0)), tuple, "((0, 0), (pad_l, pad_r)) zeros", normalizer=padding_pairs),
        Param("stride", (1, 1), tuple, "(1, stride_w)", normalizer=int_pair),
        Param("rhs_dilation", (1, 1), tuple, "must be (1, 1)", normalizer=int_pair),
        Param("lhs_dilation", (1, 1), tuple, "must be (1, 1)", normalizer=int_pair),
        Param("feature_group_count", 1, int, "must be C (depthwise); the default 1 is the kernel's but fails it"),
        Param("batch_group_count", 1, int, "must be 1"),
        Param("in_perm", None, tuple, "must be None (ignored by the kernel)", normalizer=no_permutation),
        Param("kern_perm", None, tuple, "must be None (ignored by the kernel)", normalizer=no_permutation),
        Param("out_perm", None, tuple, "must be None (ignored by the kernel)", normalizer=no_permutation),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_depthwise_conv1d_implicit_gemm,
    check=_check,
    neuron_limits=_limits,
    fold_plans=(FoldPlan(axes={"img_ref": "N", "filter_ref": None}, outputs={"output": 0}),),
    mac_count=lambda call: call.dims["N"] * call.dims["C"] * _outputs(call)[0][1][3] * call.dims["S"],
    family="conv",
    catalog="1.24",
    support={
        "idiomatic": "conv",
        "vjp": "JAX (the reference's convolution gradients; no backward kernel)",
        "notes": "feature_group_count must be C; stride (1, s); zero W padding only; float32 accumulation; "
        "Neuron: LNC=2 only and C even (falls back otherwise)",
    },
)


depthwise_conv1d_implicit_gemm = make_kernel(DEPTHWISE_CONV1D_SPEC, reference_vjp)
