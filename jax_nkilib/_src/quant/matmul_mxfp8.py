"""``matmul_mxfp8`` and ``matmul_mxfp8_backward`` (catalog rows 65, 66; docs-only,
``experimental/matmul_mxfp8/matmul_mxfp8_generic_{kernel,backward_kernel}.py``): MXFP8 matmuls on Trn3.

``matmul_mxfp8(lhs, rhs) -> out [M, N]`` is ``out[m, n] = sum_k q(lhs)[m, k] q(rhs)[n, k]`` (float32 accumulation,
rounded to ``output_dtype``), each operand MX-quantized along K (golden ``matmul_mxfp8_torch_ref``:
``quantize_mx_golden`` with the alternative emax, then ``nc_matmul_mx_golden``). An operand is given as

* raw ``[M, K]`` / ``[N, K]`` (``lhs_is_swizzled=False`` / ``rhs_is_swizzled=False``), swizzled by the kernel;
* pre-swizzled (default, ``*_is_swizzled=True``) ``[K/4, 4M]``: its 8-row x 4-lane blocks of one column group are
  what gets quantized (``quant_scheme`` says how K was swizzled: ``"wrapX"``
  :func:`~jax_nkilib._src.quant.mx.swizzle_wrapx`, blocks of 4 runs of 8 K T/4 apart; ``"1x32"``
  :func:`~jax_nkilib._src.quant.mx.swizzle_mx`, blocks of 32 consecutive K);
* pre-quantized: fp8 ``[K/4, 4M]`` of ``float8_dtype`` (the swizzled elements, as ``quantize_block_mxfp8_kernel``
  returns them) with ``*_scales`` e8m0 bytes ``[K/4, M]``, or packed ``[ceil(K/2048)*128, M]`` when
  ``use_scale_packing`` (layouts in :mod:`~jax_nkilib._src.quant.quantize_block_mxfp8`); ``*_is_swizzled`` must be True.
  Scales are uint8 or ``float8_e8m0fnu``; on Neuron pass uint8 (bitcast), as no Neuron operand may be e8m0.

Quantization: ``E`` the block's largest biased float32 exponent, element ``fp8(x * 2**(127 + emax - E))`` (nearest
even, clipped to the format's largest value), scale ``2**(E - emax - 127)``, emax 7 (e4m3) / 14 (e5m2), so finite
values never saturate; see :mod:`~jax_nkilib._src.quant.mx`. Tile, block, load and loop-order knobs, ``spill_reload``
and the LNC flags only change how the kernel walks the matrices: validated, passed to the kernel, no effect here.

``matmul_mxfp8_backward(output_grad dY [M, N], weights W [N, K], input_activation X [M, K]) -> (dX [M, K],
dW [N, K])`` is the gradient of ``Y = X W^T`` with the quantization passed straight through, each product itself
an MXFP8 matmul (two ``matmul_mxfp8`` calls with wrapX swizzles): ``dX = q_N(dY) q_N(W)`` (dY and W quantized along
N) and ``dW = q_M(dY)^T q_M(X)`` (along M). Its golden compares with an unquantized float32 product; this is the
kernel's datapath. The kernel takes no pre-swizzled operand (every ``*_is_swizzled=True`` fails its assertions) and
its pre-quantized ``*_scales`` operands are not bound (one quantized ``output_grad`` cannot serve its two
contractions). ``input_grad_config`` / ``weight_grad_config`` take the tiling fields of ``MatmulMxfp8KernelConfig``
as a mapping (``{"tile_k": 512, "TILES_IN_BLOCK_M": 4, ...}``).

Reverse mode of ``matmul_mxfp8`` binds ``matmul_mxfp8_backward`` on the operands' raw values (pre-swizzled ones
unswizzled with ``quant_scheme``, pre-quantized ones dequantized; gradients of pre-swizzled operands are swizzled
back; pre-quantized operands and scales get none): a straight-through estimator, not the derivative of the
piecewise-constant forward. The backward kernel quantizes with wrapX blocks whatever the forward's
``quant_scheme``; it is itself not differentiable.

CPU extensions: a raw contraction of any length (zero-padded to a multiple of 32 before the swizzle, as the
kernel's masked tiles are; the Neuron kernels need multiples of 128), any output dtype, float32 operands (the
kernels read bfloat16).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..framework.primitive import make_kernel
from ..framework.spec import FLOAT_DTYPES, FOLLOW_LNC, CallInfo, FoldPlan, KernelSpec, Operand, Param
from . import mx
from .quantize_block_mxfp8 import FP8_NAMES, MIN_K, SCALE_DTYPES, dtype_or_bfloat16, float8_name, scale_bytes

SCHEMES = ("wrapX", "1x32")
TILE_LOOP_ORDERS = ("mnk", "nmk", "mkn")
NEURON_OUTPUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
OPERAND_DTYPES = FLOAT_DTYPES + tuple(FP8_NAMES.values())
DGT_TILE_K = 512  # raw operands are loaded (and wrapX-swizzled) in K tiles of 512
PACKED_TILE_K = 512
F_BY_K_TILE = 512  # the backward's K-by-F operands need F % 512
TILE_LIMITS = {"tile_k": (128, 512), "tile_m": (32, 128), "tile_n": (32, 8192)}  # (multiple of, at most)
TILE_FIELDS = (
    "tile_m",
    "tile_k",
    "tile_n",
    "TILES_IN_BLOCK_M",
    "TILES_IN_BLOCK_N",
    "TILES_IN_BLOCK_K",
    "TILES_IN_LOAD_M",
    "TILES_IN_LOAD_N",
)
_HIGHEST = lax.Precision.HIGHEST
_SIDES = ("lhs", "rhs")


# ------------------------------------------------------------------------------------------------ operand math
def mx_round_trip(x, axis: int, scheme: str, dtype):
    """float32 ``dequantize(quantize(x))`` along the contraction ``axis`` in ``scheme`` blocks (alternative emax),
    the axis zero-padded to a multiple of 32 first."""
    size = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, -size % mx.BLOCK_SIZE)
    x = jnp.pad(jnp.asarray(x).astype(jnp.float32), pad)
    if scheme == "wrapX":
        out = mx.mx_round_trip_wrapx(x, axis, dtype)
    else:
        out = mx.dequantize_mx_along(*mx.quantize_mx_along(x, axis, dtype), axis)
    return lax.slice_in_dim(out, 0, size, axis=axis)


def mx_contract(a, b, a_axis: int, b_axis: int, dtype, scheme: str = "wrapX", quantized=(False, False)):
    """float32 ``sum_k a[.., k, ..] b[.., k, ..]`` (remaining axes of ``a`` then ``b``), each operand MX-quantized
    along its contraction unless ``quantized`` says it already is."""
    a = a.astype(jnp.float32) if quantized[0] else mx_round_trip(a, a_axis, scheme, dtype)
    b = b.astype(jnp.float32) if quantized[1] else mx_round_trip(b, b_axis, scheme, dtype)
    return jnp.tensordot(a, b, axes=(a_axis, b_axis), precision=_HIGHEST)


def swizzle(x, scheme: str):
    """``[F, K]`` -> ``[K/4, 4F]`` by ``scheme``."""
    return mx.swizzle_wrapx(x) if scheme == "wrapX" else mx.swizzle_mx(x)


def unswizzle(x, scheme: str):
    """``[K/4, 4F]`` -> ``[F, K]`` by ``scheme``."""
    return mx.unswizzle_wrapx(x) if scheme == "wrapX" else mx.unswizzle_mx(x)


def dequantize_operand(data, scales):
    """float32 swizzled values ``[K/4, 4F]`` of a pre-quantized operand (fp8 data, e8m0 scales unpacked or packed)."""
    k = 4 * data.shape[0]
    packed = scales.shape[0] != data.shape[0]
    dense = jnp.take(scale_bytes(scales), mx._scale_row_index(k, packed), axis=0)  # [K/32, F]
    return mx.dequantize_mx(data, dense)


def logical_operand(value, scales, swizzled: bool, scheme: str):
    """``(values [F, K], quantized)``: the raw operand in K order, or the dequantized values of a pre-quantized one."""
    if scales is not None:
        return unswizzle(dequantize_operand(value, scales), scheme), True
    return (unswizzle(value, scheme) if swizzled else value), False


# ------------------------------------------------------------------------------------------------- parameters
def tile_shape(value, where: str):
    """``None`` or a ``(tile_k, tile_other)`` pair of positive ints (the kernel's logical matmul tile)."""
    if value is None:
        return None
    if (
        isinstance(value, (tuple, list))
        and len(value) == 2
        and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in value)
    ):
        return tuple(int(v) for v in value)
    raise TypeError(f"{where} must be None or a (tile_k, tile) pair of positive ints; got {value!r}")


def tile_config(value, where: str):
    """``None`` or a mapping of ``MatmulMxfp8KernelConfig`` tiling fields to positive ints (normalized to sorted
    ``(field, value)`` pairs, hashable)."""
    if value is None:
        return None
    if (
        not isinstance(value, Mapping)
        or not set(value) <= set(TILE_FIELDS)
        or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in value.values())
    ):
        raise TypeError(f"{where} must be None or a mapping of {TILE_FIELDS} to positive ints; got {value!r}")
    return tuple(sorted((key, int(v)) for key, v in value.items()))


def _check_tiling(function: str, fields: Mapping[str, int | None], where: str = "") -> None:
    """The kernel's assertions on its tiling knobs (tile sizes, and load tiles dividing block tiles)."""
    for name, (multiple, largest) in TILE_LIMITS.items():
        size = fields.get(name)
        if size is not None and (size % multiple or size > largest):
            raise ValueError(f"{function}: {where}{name}={size} must be a multiple of {multiple} and at most {largest}")
    for axis in ("M", "N"):
        block, load = fields.get(f"TILES_IN_BLOCK_{axis}"), fields.get(f"TILES_IN_LOAD_{axis}")
        if block is not None and load is not None and block % load:
            raise ValueError(
                f"{function}: {where}TILES_IN_BLOCK_{axis}={block} must be a multiple of TILES_IN_LOAD_{axis}={load}"
            )
    for name in TILE_FIELDS:
        value = fields.get(name)
        if value is not None and value <= 0:
            raise ValueError(f"{function}: {where}{name} must be positive; got {value}")


def _forward_tiling(params) -> dict[str, int | None]:
    lhs_tile, rhs_tile = params["lhs_matmul_tile_shape_logical"], params["rhs_matmul_tile_shape_logical"]
    fields = {name: params[name] for name in TILE_FIELDS if name in params}
    if rhs_tile is not None:
        fields.update(tile_k=rhs_tile[0], tile_n=rhs_tile[1])
    if lhs_tile is not None:
        fields.update(tile_k=lhs_tile[0], tile_m=lhs_tile[1])
    return fields


# ---------------------------------------------------------------------------------------------- matmul_mxfp8
def reference_matmul_mxfp8(
    lhs,
    rhs,
    lhs_scales=None,
    rhs_scales=None,
    *,
    float8_dtype="float8_e5m2",
    output_dtype=jnp.bfloat16,
    lhs_is_swizzled=True,
    rhs_is_swizzled=True,
    quant_scheme="wrapX",
    **knobs,
):
    """JAX reference of ``matmul_mxfp8``: ``(out [M, N],)`` (see the module doc)."""
    del knobs  # tiling, loop orders, LNC, spill_reload, use_scale_packing (read from the scales' shape)
    a, a_quantized = logical_operand(lhs, lhs_scales, lhs_is_swizzled, quant_scheme)
    b, b_quantized = logical_operand(rhs, rhs_scales, rhs_is_swizzled, quant_scheme)
    out = mx_contract(a, b, 1, 1, FP8_NAMES[float8_dtype], quant_scheme, (a_quantized, b_quantized))
    return (out.astype(output_dtype),)


def _operand_k(call: CallInfo, side: str) -> int:
    aval = call.avals[side]
    return 4 * aval.shape[0] if call.params[f"{side}_is_swizzled"] else aval.shape[1]


def _check_operand(call: CallInfo, side: str) -> None:
    function, params = call.function, call.params
    aval, scales = call.avals[side], call.avals.get(f"{side}_scales")
    swizzled, fp8 = params[f"{side}_is_swizzled"], FP8_NAMES[params["float8_dtype"]]
    free = "M" if side == "lhs" else "N"
    if scales is not None:
        if not swizzled:
            raise ValueError(
                f"{function}: a pre-quantized `{side}` (given `{side}_scales`) is always in the swizzled "
                f"layout [K/4, 4*{free}]; {side}_is_swizzled must be True"
            )
        if np.dtype(aval.dtype) != fp8:
            raise TypeError(
                f"{function}: pre-quantized `{side}` must hold {params['float8_dtype']} elements "
                f"(float8_dtype); got {aval.dtype}"
            )
    elif np.dtype(aval.dtype) not in FLOAT_DTYPES:
        raise TypeError(
            f"{function}: `{side}` has dtype {aval.dtype}; fp8 data needs its `{side}_scales`, else give a float matrix"
        )
    if swizzled:
        rows, cols = aval.shape
        if cols % 4 or rows % 8:
            raise ValueError(
                f"{function}: swizzled `{side}` must have layout [K/4, 4*{free}] with K a multiple of 32 "
                f"(one MX scale per 32 elements); got shape {tuple(aval.shape)}"
            )
    if scales is not None:
        k, cols = _operand_k(call, side), aval.shape[1] // 4
        packing = params["use_scale_packing"]
        expected = (mx.matmul_scale_rows(k, packing), cols)
        if tuple(scales.shape) != expected:
            form = "packed [ceil(K/2048)*128" if packing else "[K/4"
            raise ValueError(
                f"{function}: argument `{side}_scales` must have layout {form}, {free}] = {expected} for "
                f"`{side}` {tuple(aval.shape)} (use_scale_packing={packing}); got {tuple(scales.shape)}"
            )


def _check_matmul(call: CallInfo) -> None:
    for side in _SIDES:
        _check_operand(call, side)
    _check_tiling(call.function, _forward_tiling(call.params))
    lhs_tile, rhs_tile = call.params["lhs_matmul_tile_shape_logical"], call.params["rhs_matmul_tile_shape_logical"]
    if lhs_tile is not None and rhs_tile is not None and lhs_tile[0] != rhs_tile[0]:
        raise ValueError(
            f"{call.function}: lhs_matmul_tile_shape_logical and rhs_matmul_tile_shape_logical must have "
            f"the same tile_k; got {lhs_tile[0]} and {rhs_tile[0]}"
        )


def _matmul_neuron_limits(call: CallInfo) -> list[str]:
    params, unmet = call.params, []
    tile = params["lhs_matmul_tile_shape_logical"] or params["rhs_matmul_tile_shape_logical"]
    for side in _SIDES:
        aval, scales = call.avals[side], call.avals.get(f"{side}_scales")
        if scales is None and aval.dtype != jnp.bfloat16:
            unmet.append(f"{side} must be bfloat16; got {aval.dtype}")
        if scales is not None and params["use_scale_packing"] and tile is not None and tile[0] < PACKED_TILE_K:
            unmet.append(f"packed {side}_scales need tile_k >= {PACKED_TILE_K}; got {tile[0]}")
        if not params[f"{side}_is_swizzled"]:
            k = _operand_k(call, side)
            if k % MIN_K:
                unmet.append(f"a raw {side} needs K % {MIN_K} == 0; got K={k}")
            if tile is not None and tile[0] != DGT_TILE_K:
                unmet.append(f"a raw {side} is loaded in K tiles of {DGT_TILE_K}; got tile_k={tile[0]}")
    if np.dtype(params["output_dtype"]) not in NEURON_OUTPUT_DTYPES:
        unmet.append(f"output_dtype must be float32 or bfloat16; got {np.dtype(params['output_dtype'])}")
    if params["run_with_lnc2"] and call.lnc != 2:
        unmet.append(f"run_with_lnc2=True needs LNC=2; the LNC degree is {call.lnc}")
    return unmet


def _straight_through_vjp(kernel, operands, params, outs, cotangents):
    """dlhs, drhs by ``matmul_mxfp8_backward`` on the raw (or dequantized) operands in K order (see the module doc)."""
    ops, (g,) = operands, cotangents
    scheme = params["quant_scheme"]
    values = {
        side: logical_operand(ops[side], ops[f"{side}_scales"], params[f"{side}_is_swizzled"], scheme)
        for side in _SIDES
    }
    raw = [side for side in _SIDES if not values[side][1]]
    if not raw:
        return {}
    dtype = jnp.result_type(*(ops[side].dtype for side in raw))
    bwd_params = matmul_mxfp8_backward.params(
        float8_dtype=params["float8_dtype"], output_dtype=dtype, spill_reload=params["spill_reload"]
    )
    dx, dw = matmul_mxfp8_backward.call(
        {
            "output_grad": g,
            "weights": values["rhs"][0].astype(dtype),
            "input_activation": values["lhs"][0].astype(dtype),
        },
        bwd_params,
    )
    grads = {}
    for side, grad in (("lhs", dx), ("rhs", dw)):
        if side in raw:
            grad = swizzle(grad, scheme) if params[f"{side}_is_swizzled"] else grad
            grads[side] = grad
    return grads


_SWIZZLE_FLAGS = ("lhs_is_swizzled", "rhs_is_swizzled")
_CASES = ((True, True), (True, False), (False, True), (False, False))
_LHS = dict(zip(_CASES, ("Kq, M4", "Kq, M4", "M, K", "M, K")))
_RHS = dict(zip(_CASES, ("Kq, N4", "N, 4*Kq", "K/4, N4", "N, K")))
_OUT = dict(zip(_CASES, ("M4/4, N4/4", "M4/4, N", "M, N4/4", "M, N")))  # out [M, N] in each case


def _swizzled(side: str, value: bool):
    return lambda call: call.params[f"{side}_is_swizzled"] is value


def _matmul_mac_count(call: CallInfo) -> int:
    dims = call.dims
    m, n = dims.get("M") or dims["M4"] // 4, dims.get("N") or dims["N4"] // 4
    return m * n * _operand_k(call, "lhs")


MATMUL_MXFP8_SPEC = KernelSpec(
    name="matmul_mxfp8",
    entry_point="jax_nkilib_kernels.quant:matmul_mxfp8",
    operands=(
        Operand.switched(
            "lhs",
            _SWIZZLE_FLAGS,
            _LHS,
            dtypes=OPERAND_DTYPES,
            doc="[K/4, 4M] swizzled (Kq = K/4, M4 = 4M) or raw [M, K]; fp8 when pre-quantized",
        ),
        Operand.switched(
            "rhs",
            _SWIZZLE_FLAGS,
            _RHS,
            dtypes=OPERAND_DTYPES,
            doc="[K/4, 4N] swizzled (N4 = 4N) or raw [N, K]; fp8 when pre-quantized",
        ),
        Operand.of(
            "lhs_scales",
            "lhs_srows, lhs_scols",
            dtypes=SCALE_DTYPES,
            optional=True,
            doc="e8m0 scales of a pre-quantized lhs: [K/4, M] or packed [ceil(K/2048)*128, M]",
        ),
        Operand.of(
            "rhs_scales",
            "rhs_srows, rhs_scols",
            dtypes=SCALE_DTYPES,
            optional=True,
            doc="e8m0 scales of a pre-quantized rhs: [K/4, N] or packed [ceil(K/2048)*128, N]",
        ),
    ),
    params=(
        Param("TILES_IN_BLOCK_M", None, int, "matmul tiles per block along M (performance only)"),
        Param("TILES_IN_BLOCK_N", None, int, "matmul tiles per block along N (performance only)"),
        Param("TILES_IN_BLOCK_K", None, int, "matmul tiles per block along K (performance only)"),
        Param("TILES_IN_LOAD_M", None, int, "tiles per DMA along M; divides TILES_IN_BLOCK_M"),
        Param("TILES_IN_LOAD_N", None, int, "tiles per DMA along N; divides TILES_IN_BLOCK_N"),
        Param(
            "lhs_matmul_tile_shape_logical",
            None,
            doc="(tile_k, tile_m): tile_k % 128, <= 512; tile_m % 32, <= 128",
            normalizer=tile_shape,
        ),
        Param(
            "rhs_matmul_tile_shape_logical", None, doc="(tile_k, tile_n): tile_n % 32, <= 8192", normalizer=tile_shape
        ),
        Param("block_loop_order", "mnk", ("mnk",), "block loop order (the kernel implements 'mnk' only)"),
        Param("tile_loop_order", "mnk", TILE_LOOP_ORDERS, "tile loop order within a block"),
        Param("float8_dtype", "float8_e5m2", doc="element format of the quantized operands", normalizer=float8_name),
        Param(
            "output_dtype",
            None,
            "dtype",
            "output dtype (None: bfloat16, the kernel's default)",
            normalizer=dtype_or_bfloat16,
        ),
        Param("run_with_lnc2", FOLLOW_LNC, bool, "split over two logical cores (default: LNC degree > 1)"),
        Param("lnc_2_shard_rhs", None, bool, "with LNC2 split N (True) or M (False); None: the larger"),
        Param("use_scale_packing", False, bool, "pre-quantized scales are packed [ceil(K/2048)*128, F]"),
        Param("spill_reload", False, bool, "spill quantized blocks to HBM and reload them (performance only)"),
        Param("lhs_is_swizzled", True, bool, "lhs is [K/4, 4M] (True) or [M, K] (False)"),
        Param("rhs_is_swizzled", True, bool, "rhs is [K/4, 4N] (True) or [N, K] (False)"),
        Param("quant_scheme", "wrapX", SCHEMES, "the K swizzle: 'wrapX' or '1x32' (32 consecutive K per scale)"),
    ),
    outputs=(),
    output_avals=lambda call: [
        ("out", call.shape(_OUT[tuple(call.params[flag] for flag in _SWIZZLE_FLAGS)]), call.params["output_dtype"])
    ],
    reference=reference_matmul_mxfp8,
    check=_check_matmul,
    neuron_limits=_matmul_neuron_limits,
    fold_plans=(
        FoldPlan({"lhs": "M"}, outputs={"out": 0}, when=_swizzled("lhs", False)),  # rows of a raw lhs are independent
        FoldPlan(
            {"lhs": "M4", "lhs_scales": "lhs_scols"},
            outputs={"out": 0},  # M is in 4M (major)
            when=_swizzled("lhs", True),
        ),
        FoldPlan({"rhs": "N"}, outputs={"out": 1}, when=_swizzled("rhs", False)),
        FoldPlan({"rhs": "N4", "rhs_scales": "rhs_scols"}, outputs={"out": 1}, when=_swizzled("rhs", True)),
    ),
    mac_count=_matmul_mac_count,
    family="quant",
    catalog="row 65",
    support={
        "idiomatic": "mxfp8_matmul",
        "vjp": "kernel: matmul_mxfp8_backward (straight-through quantization)",
        "notes": f"Trn3; Neuron: bfloat16 operands, raw operands K % {MIN_K} == 0 (tile_k {DGT_TILE_K}), uint8 "
        "scales, "
        "float32/bfloat16 output, run_with_lnc2 needs LNC=2; not yet run on Trainium",
    },
)


# ------------------------------------------------------------------------------------- matmul_mxfp8_backward
def reference_matmul_mxfp8_backward(
    output_grad, weights, input_activation, *, float8_dtype="float8_e5m2", output_dtype=jnp.bfloat16, **knobs
):
    """JAX reference of ``matmul_mxfp8_backward``: ``(input_grad [M, K], weight_grad [N, K])``."""
    del knobs
    dtype = FP8_NAMES[float8_dtype]
    input_grad = mx_contract(output_grad, weights, 1, 0, dtype)  # dY W, quantized along N
    weight_grad = mx_contract(output_grad, input_activation, 0, 0, dtype)  # dY^T X, quantized along M
    return input_grad.astype(output_dtype), weight_grad.astype(output_dtype)


_BACKWARD_SWIZZLE_FLAGS = ("output_grad_is_swizzled", "weights_is_swizzled", "input_is_swizzled")


def _check_backward(call: CallInfo) -> None:
    for flag in _BACKWARD_SWIZZLE_FLAGS:
        if call.params[flag]:
            raise ValueError(
                f"{call.function}: {flag}=True is not supported by the kernel: it reads its operands "
                f"K-by-F (output_grad for dW, weights, input_activation), which cannot be pre-swizzled; "
                f"give the raw [M, N], [N, K], [M, K] matrices"
            )
    for config in ("input_grad_config", "weight_grad_config"):
        fields = dict(call.params[config] or ())
        _check_tiling(call.function, fields, f"{config}: ")


def _backward_neuron_limits(call: CallInfo) -> list[str]:
    dims, params, unmet = call.dims, call.params, []
    for name in ("output_grad", "weights", "input_activation"):
        if call.avals[name].dtype != jnp.bfloat16:
            unmet.append(f"{name} must be bfloat16; got {call.avals[name].dtype}")
    for dim, multiple, why in (
        ("M", MIN_K, "contraction of dW"),
        ("N", F_BY_K_TILE, "contraction of dX and free dimension of a K-by-F load"),
        ("K", F_BY_K_TILE, "free dimension of a K-by-F load"),
    ):
        if dims[dim] % multiple:
            unmet.append(f"{dim}={dims[dim]} must be a multiple of {multiple} ({why})")
    if np.dtype(params["output_dtype"]) not in NEURON_OUTPUT_DTYPES:
        unmet.append(f"output_dtype must be float32 or bfloat16; got {np.dtype(params['output_dtype'])}")
    if params["run_with_lnc2"] and call.lnc != 2:
        unmet.append(f"run_with_lnc2=True needs LNC=2; the LNC degree is {call.lnc}")
    return unmet


MATMUL_MXFP8_BACKWARD_SPEC = KernelSpec(
    name="matmul_mxfp8_backward",
    entry_point="jax_nkilib_kernels.quant:matmul_mxfp8_backward",
    operands=(
        Operand.of("output_grad", "M, N", doc="dY, the gradient of Y = X W^T"),
        Operand.of("weights", "N, K", doc="W"),
        Operand.of("input_activation", "M, K", doc="X"),
    ),
    params=(
        Param(
            "input_grad_config", None, doc="tiling fields of the dX matmul (performance only)", normalizer=tile_config
        ),
        Param(
            "weight_grad_config", None, doc="tiling fields of the dW matmul (performance only)", normalizer=tile_config
        ),
        Param("tile_loop_order", "mnk", TILE_LOOP_ORDERS, "tile loop order within a block"),
        Param("float8_dtype", "float8_e5m2", doc="element format of the quantized operands", normalizer=float8_name),
        Param(
            "output_dtype",
            None,
            "dtype",
            "dtype of dX and dW (None: bfloat16, the kernel's default)",
            normalizer=dtype_or_bfloat16,
        ),
        Param("run_with_lnc2", FOLLOW_LNC, bool, "split over two logical cores (default: LNC degree > 1)"),
        Param("lnc_2_shard_rhs", True, bool, "with LNC2 split the rhs free dimension (K)"),
        Param("use_scale_packing", False, bool, "packed scales (pre-quantized operands; not bound)"),
        Param("spill_reload", False, bool, "spill quantized blocks to HBM and reload them (performance only)"),
        Param("output_grad_is_swizzled", False, bool, "must be False (the kernel cannot use it)"),
        Param("weights_is_swizzled", False, bool, "must be False (the kernel cannot use it)"),
        Param("input_is_swizzled", False, bool, "must be False (the kernel cannot use it)"),
    ),
    outputs=(),
    output_avals=lambda call: [
        ("input_grad", call.shape("M, K"), call.params["output_dtype"]),
        ("weight_grad", call.shape("N, K"), call.params["output_dtype"]),
    ],
    reference=reference_matmul_mxfp8_backward,
    check=_check_backward,
    neuron_limits=_backward_neuron_limits,
    # K is free in both outputs: a vmapped axis folds into it
    fold_plans=(
        FoldPlan(
            {"output_grad": None, "weights": "K", "input_activation": "K"}, outputs={"input_grad": 1, "weight_grad": 1}
        ),
    ),
    mac_count=lambda call: 2 * call.dims["M"] * call.dims["N"] * call.dims["K"],
    family="quant",
    catalog="row 66",
    support={
        "idiomatic": "mxfp8_matmul (reverse mode)",
        "vjp": "none (it is the backward)",
        "notes": f"Trn3; Neuron: bfloat16 operands, M % {MIN_K}, N % {F_BY_K_TILE}, K % {F_BY_K_TILE}, "
        "run_with_lnc2 needs LNC=2; "
        "pre-quantized and pre-swizzled operands not bound; not yet run on Trainium",
    },
)

matmul_mxfp8_backward = make_kernel(MATMUL_MXFP8_BACKWARD_SPEC)
matmul_mxfp8 = make_kernel(MATMUL_MXFP8_SPEC, vjp=_straight_through_vjp)
