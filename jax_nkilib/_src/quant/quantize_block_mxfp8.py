"""``quantize_block_mxfp8_kernel`` (catalog row 84; docs-only, ``experimental/quantize_mxfp8/quantize_mxfp8.py``):
a ``[F, K]`` matrix to the MXFP8 operand form of the ``matmul_mxfp8`` family.

Math (its golden ``quantize_mxfp8_torch_ref``): ``src [F, K]`` is wrapX-swizzled along K to ``[K/4, 4F]``
(:func:`~jax_nkilib._src.quant.mx.swizzle_wrapx`: K in tiles of 512, a remainder that is a multiple of 128 in tiles
of 256 and 128; in a tile of size T at k0, row ``k0/4 + p`` lane ``j`` holds ``src[f, k0 + j*T/4 + p]`` at column
``4f + j``), then MX-quantized in blocks of 8 rows x 4 lanes of one ``f`` (4 runs of 8 consecutive K, T/4 apart)
with the alternative emax (emax 7 for e4m3, 14 for e5m2: ``E`` the block's largest biased float32 exponent, element
``fp8(x * 2**(127 + emax - E))`` rounded to nearest even and clipped to the format's largest value, scale byte
``E - emax``), see :mod:`jax_nkilib._src.quant.mx`.

Outputs, in the kernel's order: ``quantized_scales_hbm`` ``float8_e8m0fnu`` (the kernel's scale dtype; bitcast to
uint8 for the biased exponents), either ``[K/4, F]`` (``enable_scale_packing=False``: the scale of dense block row
``c`` in row ``(c // 4) * 32 + c % 4``, 4 rows per 32-row quadrant) or packed ``[ceil(K/2048)*128, F]`` (the 4
K-tiles of 512 of each 2048 share 128 rows: block row ``i`` of tile ``t`` in row ``(t // 4) * 128 + 4 (t % 4) +
(i // 4) * 32 + i % 4``); and ``quantized_data_hbm [K/4, 4F]`` of ``return_fp8_dtype`` (``"float8_e4m3fn"`` or
``"float8_e5m2"``, required). They are ``matmul_mxfp8``'s pre-quantized operand (``lhs``/``rhs`` with
``*_scales``).

Where this differs from the golden: rows of the scales that hold no scale are 0 here (the kernel leaves them
unwritten: undefined on Neuron). Blocks whose largest magnitude is below ``2**-120`` (e4m3; ``2**-113`` e5m2),
all-zero blocks included, get scale byte 0 (the shared rule of ``mx``, the hardware ``quantize_mx`` golden); the
kernel's golden computes ``(E - emax) mod 256`` there (249 for zeros). Their elements are the same. Inputs in
float32 are quantized from their float32 values (the kernel reads bfloat16 only). On CPU any ``K % 32 == 0`` works
(a remainder that is not a multiple of 128 is one wrapX tile, as the matmul golden swizzles it).

Quantized outputs carry no gradient.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..framework.primitive import make_kernel, zero_cotangents
from ..framework.spec import FLOAT_DTYPES, FOLLOW_LNC, CallInfo, FoldPlan, KernelSpec, Operand, Param, dtype_value
from . import mx

FP8_NAMES = {"float8_e4m3fn": jnp.dtype(jnp.float8_e4m3fn), "float8_e5m2": jnp.dtype(jnp.float8_e5m2)}
SCALE_DTYPE = jnp.dtype(jnp.float8_e8m0fnu)  # the kernels' e8m0 scale dtype
SCALE_DTYPES = (jnp.dtype(jnp.uint8), SCALE_DTYPE)  # scale bytes as the kernels accept them
MIN_K = 128  # the kernel's K granularity (its tiles of 512, 256, 128)
MIN_F = 8
MIN_F_LNC2 = 512


def float8_name(value, where: str) -> str:
    """A float8 format given as the kernels' string (``"float8_e4m3fn"``, ``"float8_e5m2"``) or as a dtype,
    as the string the kernel takes."""
    try:
        name = np.dtype(value).name
    except TypeError:
        name = None
    if name not in FP8_NAMES:
        raise ValueError(f"{where} must be one of {tuple(FP8_NAMES)} (or that jnp dtype); got {value!r}")
    return name


def dtype_or_bfloat16(value, where: str) -> np.dtype:
    """A dtype, where ``None`` (the default) means bfloat16, the kernel's ``nl.bfloat16`` default."""
    return np.dtype(jnp.bfloat16) if value is None else dtype_value(value, where)


def scale_bytes(scales):
    """uint8 biased exponents of e8m0 scales (``float8_e8m0fnu`` bitcast; uint8 passes)."""
    scales = jnp.asarray(scales)
    return scales if scales.dtype == jnp.uint8 else lax.bitcast_convert_type(scales, jnp.uint8)


def require_fp8_name(call: CallInfo, param: str) -> None:
    if call.params[param] is None:
        raise TypeError(f"{call.function}: missing required parameter `{param}` (one of {tuple(FP8_NAMES)})")


def _outputs(call: CallInfo):
    """``quantized_scales_hbm``: uint8 e8m0 scales ``[K/4, F]``, or packed ``[ceil(K/2048)*128, F]`` with
    ``enable_scale_packing``; ``quantized_data_hbm [K/4, 4F]`` in ``return_fp8_dtype``."""
    k, f = call.dims["K"], call.dims["F"]
    rows = mx.matmul_scale_rows(k, True) if call.params["enable_scale_packing"] else k // 4
    return [
        ("quantized_scales_hbm", (rows, f), SCALE_DTYPE),
        ("quantized_data_hbm", (k // 4, 4 * f), call.params["return_fp8_dtype"]),
    ]


def reference_quantize_block_mxfp8_kernel(
    src_tensor, *, return_fp8_dtype, run_with_lnc2=False, enable_scale_packing=True
):
    """JAX reference: ``(quantized_scales_hbm, quantized_data_hbm)`` (see the module doc)."""
    del run_with_lnc2  # how the two cores split F; no numeric effect
    dtype = FP8_NAMES[return_fp8_dtype]
    words, scales = mx.quantize_matmul_operand(src_tensor, dtype, packed=enable_scale_packing)
    return lax.bitcast_convert_type(scales, SCALE_DTYPE), mx.unpack_x4(words, dtype)


def _check(call: CallInfo) -> None:
    require_fp8_name(call, "return_fp8_dtype")
    if call.dims["K"] % mx.BLOCK_SIZE:
        raise ValueError(
            f"{call.function}: argument `src_tensor` must have layout [F, K] with K a multiple of 32 "
            f"(one MX scale per 32 elements); got K={call.dims['K']}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, unmet = call.dims, []
    if call.avals["src_tensor"].dtype != jnp.bfloat16:
        unmet.append(f"src_tensor must be bfloat16; got {call.avals['src_tensor'].dtype}")
    if dims["K"] % MIN_K:
        unmet.append(f"K={dims['K']} must be a multiple of {MIN_K}")
    if dims["F"] % MIN_F:
        unmet.append(f"F={dims['F']} must be a multiple of {MIN_F}")
    if call.params["run_with_lnc2"] and call.lnc != 2:
        unmet.append(f"run_with_lnc2=True needs LNC=2; the LNC degree is {call.lnc}")
    if call.params["run_with_lnc2"] and dims["F"] < MIN_F_LNC2:
        unmet.append(f"run_with_lnc2 needs F >= {MIN_F_LNC2}; got F={dims['F']}")
    return unmet


QUANTIZE_BLOCK_MXFP8_SPEC = KernelSpec(
    name="quantize_block_mxfp8_kernel",
    entry_point="nkilib.experimental.quantize_mxfp8.quantize_mxfp8:quantize_block_mxfp8_kernel",
    operands=(Operand.of("src_tensor", "F, K", dtypes=FLOAT_DTYPES, doc="matrix to quantize along K (bfloat16)"),),
    params=(
        Param(
            "return_fp8_dtype",
            None,
            doc="element format: 'float8_e4m3fn' or 'float8_e5m2'",
            required=True,
            normalizer=float8_name,
        ),
        Param("run_with_lnc2", FOLLOW_LNC, bool, "split F over two logical cores (default: LNC degree > 1)"),
        Param("enable_scale_packing", True, bool, "packed scales [ceil(K/2048)*128, F] instead of [K/4, F]"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_quantize_block_mxfp8_kernel,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {"src_tensor": "F"},  # F merges into the columns of both outputs
            outputs={"quantized_scales_hbm": 1, "quantized_data_hbm": 1},
        ),
    ),
    mac_count=lambda call: math.prod(call.avals["src_tensor"].shape),
    family="quant",
    catalog="row 84",
    nondifferentiable_outputs=("quantized_scales_hbm", "quantized_data_hbm"),
    support={
        "idiomatic": "quantize_mx",
        "vjp": "none (quantized outputs)",
        "notes": f"Trn3; Neuron: bfloat16 src, K % {MIN_K} == 0, F % {MIN_F} == 0, run_with_lnc2 needs LNC=2 and "
        f"F >= {MIN_F_LNC2}; "
        "scale rows the kernel does not write are 0 here (undefined on Neuron)",
    },
)

# zero gradients: both outputs are quantized, no cotangent flows to src_tensor
quantize_block_mxfp8_kernel = make_kernel(QUANTIZE_BLOCK_MXFP8_SPEC, vjp=zero_cotangents)
