"""MX quantization and the MXFP8 training matmul in JAX layouts: ``quantize_mx``, ``dequantize_mx``,
``mxfp8_matmul``.

Plain MX layout: ``quantize_mx(x, axis=a)`` gives ``data`` of ``x``'s shape (fp8) and ``scales`` of ``x``'s shape
with axis ``a`` divided by ``block`` (uint8 biased exponents: ``value = data * 2**(scale - 127)``), one scale per
``block`` consecutive elements along ``a``. The scale rule is the NKI MXFP8 kernels' (the alternative emax of
Trn3's ``quantize_mx``): with ``E`` the largest biased float32 exponent of a block, ``scale = E - emax`` and ``data =
fp8(x * 2**(127 + emax - E))`` rounded to nearest even, emax 7 for ``float8_e4m3fn`` and 14 for ``float8_e5m2``: the
block's largest magnitude maps into [128, 256] (e4m3; [2**14, 2**15] e5m2), so finite values never saturate and the
round-trip error is at most half a step of the block (``2**(E - 127 - 4)`` for e4m3, ``2**(E - 127 - 3)`` e5m2);
a block whose largest value rounds up to ``2**128`` (|x| near the float32 maximum) dequantizes to inf; blocks below
``2**-120`` (e4m3; ``2**-113`` e5m2) get scale 0 and do not round-trip (see :mod:`~jax_nkilib._src.quant.mx`).

Non-finite elements follow the quantizers' common contract (as ``quantize_fp8`` and ``quantize_weight_fp8``): a NaN
or +-inf is left out of its block's ``E`` (the block's other elements quantize as if it were 0), and becomes NaN
(NaN) or +-448 (+-57344 for e5m2; +-inf, saturated, in the block's scale) itself; an all-non-finite block has
scale 0. On Neuron this is the kernel on ``x`` with non-finite elements replaced by 0, and those elements patched
afterwards (elementwise glue). The kernel-native ``jax_nkilib.nki.quantize_block_mxfp8_kernel`` keeps the kernel's
rule, where a NaN or inf has exponent 255 and so sets its block's scale, flushing its 31 block-mates to 0.

On Neuron ``quantize_mx`` is ``quantize_block_mxfp8_kernel`` when the layout matches (``block == 32`` and the axis a
multiple of 512): the K axis is permuted within each tile of 512 so that the kernel's wrapX blocks are 32
consecutive elements (one transpose), the other axes are the kernel's ``F``, and its swizzled outputs come back by
transposes and a slice of the scale rows; otherwise the same math runs in JAX. ``dequantize_mx`` is JAX math.

``mxfp8_matmul(x [..., K], w [K, N])`` is ``matmul_mxfp8`` (raw operands, wrapX blocks along K; ``w`` reaches the
kernel transposed, as ``[N, K]``). Reverse mode is ``matmul_mxfp8_backward``: the quantization is passed
straight through (``dx = dy w^T``, ``dw = x^T dy``) and each of those products is itself an MXFP8 matmul quantizing
``dy`` and ``w`` along N, ``dy`` and ``x`` along the tokens. The output dtype is ``x``'s and ``w``'s common dtype.
"""

from __future__ import annotations

import math
import operator

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument
from ..framework.validation import check_operand_layouts
from ..quant import mx
from ..quant.fp8 import saturate
from ..quant.matmul_mxfp8 import matmul_mxfp8
from ..quant.quantize_block_mxfp8 import FP8_NAMES, quantize_block_mxfp8_kernel, scale_bytes
from ..sharding import auto

KERNEL_TILE = 512  # the quantize kernel's K tile: 16 blocks of 8 rows x 4 lanes


def _fp8_name(where: str, name: str, dtype) -> str:
    try:
        found = np.dtype(dtype).name
    except TypeError:
        found = None
    if found not in FP8_NAMES:
        raise ValueError(f"{where}: `{name}` must be jnp.float8_e4m3fn or jnp.float8_e5m2; got {dtype!r}")
    return found


def _axis(where: str, axis, ndim: int) -> int:
    try:
        axis = operator.index(axis)
    except TypeError:
        raise TypeError(f"{where}: `axis` must be an int; got {axis!r}") from None
    if not -ndim <= axis < ndim:
        raise ValueError(f"{where}: `axis`={axis} is out of range for an array of rank {ndim}")
    return axis % ndim


def _quantize_with_kernel(rows, name: str):
    """``(data, scales uint8)`` of ``rows [F, L]`` (L % 512 == 0) by ``quantize_block_mxfp8_kernel``."""
    f, length = rows.shape
    tiles = length // KERNEL_TILE
    # element 32i + 8j + r of a tile goes to swizzled row 8i + r, lane j: the kernel's block i is 32 consecutive
    src = jnp.swapaxes(rows.reshape(f, tiles, 16, 4, 8), 2, 3).reshape(f, length)
    params = quantize_block_mxfp8_kernel.params(return_fp8_dtype=name, enable_scale_packing=False)
    scales, data = quantize_block_mxfp8_kernel.call({"src_tensor": src}, params)  # [L/4, F], [L/4, 4F]
    data = data.reshape(tiles, 16, 8, f, 4).transpose(3, 0, 1, 4, 2).reshape(f, length)
    scales = scales.reshape(tiles, 4, 32, f)[:, :, :4].reshape(length // mx.BLOCK_SIZE, f)  # 4 rows per quadrant
    return data, scale_bytes(scales).T


QUANTIZE_MX_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.quantize_mx",
        free={**auto.LEADING, "q": "quantized axis"},
        granule={"q": mx.BLOCK_SIZE},
        note="a shard of the quantized axis must hold whole blocks",
    )
)
DEQUANTIZE_MX_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.dequantize_mx",
        free={**auto.LEADING, "q": "quantized axis"},
        note="a shard of the quantized axis must hold whole blocks",
    )
)
MXFP8_MATMUL_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.mxfp8_matmul",
        free={**auto.LEADING, "n": "output features"},
        collective={"k": ("contraction", "local MXFP8 matmuls + all-reduce (psum); shards hold whole 32-blocks")},
        granule={"k": mx.BLOCK_SIZE},
    )
)


def _dims_with_blocks(ndim: int, axis: int, where: str, operand: str) -> str:
    """Dimension letters of an MX operand: leading letters with ``q`` at the quantized axis."""
    letters = list(auto.leading(ndim, where, operand))
    letters[axis] = "q"
    return "".join(letters)


def quantize_mx(x, *, axis: int = -1, dtype=jnp.float8_e4m3fn, block: int = 32, scale_dtype=jnp.uint8):
    """MX-quantize ``x`` in blocks of ``block`` consecutive elements along ``axis``: ``(data, scales)``.

    ``data`` has ``x``'s shape and the fp8 ``dtype`` (``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``); ``scales`` has
    ``x``'s shape with ``axis`` divided by ``block`` (``x.shape[axis] % block == 0``): biased exponents as uint8 (the
    kernels' format) or, with ``scale_dtype=jnp.float8_e8m0fnu``, the same bits as JAX's own MX scale type, so that
    ``jax.nn.scaled_matmul`` and ``jax.lax.scaled_dot`` take ``(data, scales)`` as they are (the conversion either
    way is ``jax.lax.bitcast_convert_type``). The scale rule, and what a NaN or inf does (nothing to its
    block-mates), are the module's. Outputs are quantized values: no gradient flows through them.
    """
    where = "jax_nkilib.quantize_mx"
    x = array_argument(where, "x", x)
    name = _fp8_name(where, "dtype", dtype)
    axis = _axis(where, axis, x.ndim)
    if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
        raise TypeError(f"{where}: `block` must be a positive int; got {block!r}")
    if jnp.dtype(scale_dtype) not in (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e8m0fnu)):
        raise TypeError(f"{where}: `scale_dtype` must be jnp.uint8 or jnp.float8_e8m0fnu; got {scale_dtype!r}")
    length = x.shape[axis]
    if length % block:
        raise ValueError(
            f"{where}: the quantized axis {axis} of `x` (shape {tuple(x.shape)}) must be a multiple of block={block}"
        )
    dims = _dims_with_blocks(x.ndim, axis, where, "x")
    sharded = auto.plan(QUANTIZE_MX_SHARDING, [auto.ShardedArgument("x", x, dims)], granule={"q": block})
    if sharded:
        return sharded.run(
            lambda x, axes: quantize_mx(x, axis=axis, dtype=dtype, block=block, scale_dtype=scale_dtype), (dims, dims)
        )
    moved = jnp.moveaxis(x, axis, -1)
    rows = moved.reshape(math.prod(moved.shape[:-1]), length)
    finite = jnp.isfinite(rows)  # non-finite elements take no part in their block's scale (see the module)
    clean = jnp.where(finite, rows, jnp.zeros((), rows.dtype))
    if block == mx.BLOCK_SIZE and length % KERNEL_TILE == 0 and rows.size > 0:
        data, scales = _quantize_with_kernel(clean, name)
    else:
        data, scales = mx.quantize_mx_along(clean, -1, FP8_NAMES[name], block)
    data = jnp.where(finite, data, saturate(rows.astype(jnp.float32), FP8_NAMES[name]))
    data = jnp.moveaxis(data.reshape(moved.shape), -1, axis)
    scales = jnp.moveaxis(scales.reshape(*moved.shape[:-1], length // block), -1, axis)
    if jnp.dtype(scale_dtype) != scales.dtype:
        scales = jax.lax.bitcast_convert_type(scales, scale_dtype)
    return jax.lax.stop_gradient(data), jax.lax.stop_gradient(scales)


def dequantize_mx(data, scales, *, axis: int = -1, dtype=jnp.float32):
    """``data * 2**(scales - 127)`` as ``dtype``: the inverse of :func:`quantize_mx` (each scale covers the block of
    consecutive elements along ``axis`` whose size is the ratio of the two arrays' sizes there). ``scales`` are
    uint8 biased exponents (or ``float8_e8m0fnu``)."""
    where = "jax_nkilib.dequantize_mx"
    data, scales = (
        array_argument(where, name, value, dtypes=None) for name, value in (("data", data), ("scales", scales))
    )
    _fp8_name(where, "data.dtype", data.dtype)
    if scales.dtype not in (jnp.uint8, jnp.float8_e8m0fnu):
        raise TypeError(f"{where}: `scales` must be uint8 biased exponents (or float8_e8m0fnu); got {scales.dtype}")
    axis = _axis(where, axis, data.ndim)
    expected = data.shape[:axis] + data.shape[axis + 1 :]
    if (
        scales.ndim != data.ndim
        or scales.shape[:axis] + scales.shape[axis + 1 :] != expected
        or scales.shape[axis] == 0
        or data.shape[axis] % scales.shape[axis]
    ):
        raise ValueError(
            f"{where}: `scales` must have the shape of `data` {tuple(data.shape)} with axis {axis} "
            f"divided by the block size; got {tuple(scales.shape)}"
        )
    dims = _dims_with_blocks(data.ndim, axis, where, "data")
    # equal shards of data and scales along the quantized axis hold whole blocks
    sharded = auto.plan(
        DEQUANTIZE_MX_SHARDING, [auto.ShardedArgument("data", data, dims), auto.ShardedArgument("scales", scales, dims)]
    )
    if sharded:
        return sharded.run(lambda data, scales, axes: dequantize_mx(data, scales, axis=axis, dtype=dtype), dims)
    return mx.dequantize_mx_along(data, scale_bytes(scales), axis).astype(dtype)


def mxfp8_matmul(x, w, *, float8_dtype=jnp.float8_e4m3fn):
    """``x [..., K] @ w [K, N] -> [..., N]`` with both operands MXFP8-quantized along K (a quantized training
    matmul; see the module doc for the forward and the straight-through gradient).

    ``float8_dtype`` (``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``) is the element format of every quantized
    operand, forward and backward. On Neuron the forward is ``matmul_mxfp8`` and reverse mode
    ``matmul_mxfp8_backward``; elsewhere their JAX references run.
    """
    where = "jax_nkilib.mxfp8_matmul"
    check_operand_layouts(where, {"x": "..., K", "w": "K, N"}, x=x, w=w)
    x, w = jnp.asarray(x), jnp.asarray(w)
    name = _fp8_name(where, "float8_dtype", float8_dtype)
    rows_dims = auto.leading(x.ndim - 1, where)
    sharded = auto.plan(
        MXFP8_MATMUL_SHARDING, [auto.ShardedArgument("x", x, rows_dims + "k"), auto.ShardedArgument("w", w, "kn")]
    )
    if sharded:

        def local(x, w, axes):
            out = mxfp8_matmul(x, w, float8_dtype=float8_dtype)
            return jax.lax.psum(out, axes["k"]) if "k" in axes else out

        return sharded.run(local, rows_dims + "n")
    dtype = jnp.result_type(x.dtype, w.dtype)
    params = matmul_mxfp8.params(lhs_is_swizzled=False, rhs_is_swizzled=False, float8_dtype=name, output_dtype=dtype)
    rows = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    (out,) = matmul_mxfp8.call(
        {"lhs": rows.astype(dtype), "rhs": w.T.astype(dtype), "lhs_scales": None, "rhs_scales": None}, params
    )
    return out.reshape(*x.shape[:-1], w.shape[1])
