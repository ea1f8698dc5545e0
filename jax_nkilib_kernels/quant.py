"""Adapters for the NKI Library's MXFP8 matmul kernels (``nkilib.experimental.matmul_mxfp8``) and FP8 quantization
helpers (``nkilib.core.quantization.fp8_quantize``).

``matmul_mxfp8`` and ``matmul_mxfp8_backward`` are plain functions (not ``@nki.jit``) that take a pre-quantized
operand as its data plus a ``*_scales`` keyword and the backward's per-phase tiling as ``MatmulMxfp8KernelConfig``
objects: the adapters are the ``@nki.jit`` entry points, build the configs from jax_nkilib's tiling mappings and pass
``quant_scheme`` only when it is not the default (older libraries lack it). ``output_dtype=None`` means the
kernels' ``nl.bfloat16``.

The FP8 helpers of ``nkilib.core.quantization.fp8_quantize`` (``static_quantization``, ``row_quantization``,
``pre_combine_dequant_scales``) take SBUF tiles (and an optional buffer manager, left out): their adapters load the
HBM operands into SBUF tiles of the same shapes, call the helper and store each result to a new HBM tensor. Dtype
parameters arrive as dtype names or objects and are passed as the ``nl`` dtypes the helpers look up.
Not yet run on Trainium by this project.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from jax_nkilib_kernels._library import load

MatmulMxfp8KernelConfig = load("experimental.matmul_mxfp8.matmul_mxfp8_config", "MatmulMxfp8KernelConfig")
_library_backward = load("experimental.matmul_mxfp8.matmul_mxfp8_generic_backward_kernel", "matmul_mxfp8_backward")
_library_matmul = load("experimental.matmul_mxfp8.matmul_mxfp8_generic_kernel", "matmul_mxfp8")
_static_quantization = load("core.quantization.fp8_quantize", "static_quantization")
_row_quantization = load("core.quantization.fp8_quantize", "row_quantization")
_pre_combine_dequant_scales = load("core.quantization.fp8_quantize", "pre_combine_dequant_scales")


def _config(fields, m, k, n):
    """A ``MatmulMxfp8KernelConfig`` for a phase computing ``[m, n]`` over ``k`` from ``(field, value)`` pairs."""
    return None if fields is None else MatmulMxfp8KernelConfig(M=m, K=k, N=n, **dict(fields))


@nki.jit
def matmul_mxfp8(
    lhs,
    rhs,
    lhs_scales=None,
    rhs_scales=None,
    TILES_IN_BLOCK_M=None,
    TILES_IN_BLOCK_N=None,
    TILES_IN_BLOCK_K=None,
    TILES_IN_LOAD_M=None,
    TILES_IN_LOAD_N=None,
    lhs_matmul_tile_shape_logical=None,
    rhs_matmul_tile_shape_logical=None,
    block_loop_order="mnk",
    tile_loop_order="mnk",
    float8_dtype="float8_e5m2",
    output_dtype=None,
    run_with_lnc2=True,
    lnc_2_shard_rhs=None,
    use_scale_packing=False,
    spill_reload=False,
    lhs_is_swizzled=True,
    rhs_is_swizzled=True,
    quant_scheme="wrapX",
):
    """``out [M, N]`` from the library's ``matmul_mxfp8``."""
    newer = {} if quant_scheme == "wrapX" else {"quant_scheme": quant_scheme}
    return _library_matmul(
        lhs,
        rhs,
        TILES_IN_BLOCK_M=TILES_IN_BLOCK_M,
        TILES_IN_BLOCK_N=TILES_IN_BLOCK_N,
        TILES_IN_BLOCK_K=TILES_IN_BLOCK_K,
        TILES_IN_LOAD_M=TILES_IN_LOAD_M,
        TILES_IN_LOAD_N=TILES_IN_LOAD_N,
        lhs_matmul_tile_shape_logical=lhs_matmul_tile_shape_logical,
        rhs_matmul_tile_shape_logical=rhs_matmul_tile_shape_logical,
        block_loop_order=block_loop_order,
        tile_loop_order=tile_loop_order,
        float8_dtype=float8_dtype,
        output_dtype=nl.bfloat16 if output_dtype is None else output_dtype,
        run_with_lnc2=run_with_lnc2,
        lnc_2_shard_rhs=lnc_2_shard_rhs,
        lhs_scales=lhs_scales,
        rhs_scales=rhs_scales,
        use_scale_packing=use_scale_packing,
        spill_reload=spill_reload,
        lhs_is_swizzled=lhs_is_swizzled,
        rhs_is_swizzled=rhs_is_swizzled,
        **newer,
    )


@nki.jit
def matmul_mxfp8_backward(
    output_grad,
    weights,
    input_activation,
    input_grad_config=None,
    weight_grad_config=None,
    tile_loop_order="mnk",
    float8_dtype="float8_e5m2",
    output_dtype=None,
    run_with_lnc2=True,
    lnc_2_shard_rhs=True,
    use_scale_packing=False,
    spill_reload=False,
    output_grad_is_swizzled=False,
    weights_is_swizzled=False,
    input_is_swizzled=False,
):
    """``(input_grad [M, K], weight_grad [N, K])`` from the library's ``matmul_mxfp8_backward``."""
    m, n = output_grad.shape
    k = weights.shape[1]
    return _library_backward(
        output_grad,
        weights,
        input_activation,
        input_grad_config=_config(input_grad_config, m, n, k),
        weight_grad_config=_config(weight_grad_config, n, m, k),
        tile_loop_order=tile_loop_order,
        float8_dtype=float8_dtype,
        output_dtype=nl.bfloat16 if output_dtype is None else output_dtype,
        run_with_lnc2=run_with_lnc2,
        lnc_2_shard_rhs=lnc_2_shard_rhs,
        use_scale_packing=use_scale_packing,
        spill_reload=spill_reload,
        output_grad_is_swizzled=output_grad_is_swizzled,
        weights_is_swizzled=weights_is_swizzled,
        input_is_swizzled=input_is_swizzled,
    )


def _nl_dtype(dtype):
    """The ``nl`` dtype of a dtype name (``"float8_e4m3fn"``) or dtype object; ``None`` stays ``None``."""
    return None if dtype is None else getattr(nl, getattr(dtype, "name", str(dtype)))


def _to_sbuf(tensor):
    """An SBUF tile holding the HBM ``tensor`` (same shape and dtype)."""
    tile = nl.ndarray(tensor.shape, dtype=tensor.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=tensor)
    return tile


def _to_hbm(tile):
    """A new HBM tensor holding the SBUF ``tile``."""
    out = nl.ndarray(tile.shape, dtype=tile.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=tile)
    return out


@nki.jit
def static_quantization(hidden_state, input_dequant_scale, quant_scale=None, dtype="float8_e4m3fn"):
    """``(quantized [P, F], input_dequant_scale [P, 1])`` from the library's ``static_quantization``."""
    quantized, passed_scale = _static_quantization(
        _to_sbuf(hidden_state),
        _to_sbuf(input_dequant_scale),
        quant_scale=None if quant_scale is None else _to_sbuf(quant_scale),
        dtype=_nl_dtype(dtype),
    )
    return _to_hbm(quantized), _to_hbm(passed_scale)


@nki.jit
def row_quantization(hidden_state, dtype="float8_e4m3fn", output_dtype=None):
    """``(quantized, dequant_scale)`` from the library's ``row_quantization``: ``[P, F]`` and ``[P, 1]``, or
    ``[P0, BxS, F0]`` and ``[P0, BxS, 1]``."""
    quantized, dequant_scale = _row_quantization(
        _to_sbuf(hidden_state), dtype=_nl_dtype(dtype), output_dtype=_nl_dtype(output_dtype)
    )
    return _to_hbm(quantized), _to_hbm(dequant_scale)


@nki.jit
def pre_combine_dequant_scales(input_dequant_scale, weight_dequant_scale):
    """``combined [P, F_w]`` float32 from the library's ``pre_combine_dequant_scales``."""
    return _to_hbm(_pre_combine_dequant_scales(_to_sbuf(input_dequant_scale), _to_sbuf(weight_dequant_scale)))
