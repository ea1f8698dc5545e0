"""``mxfp_load_performance_wrapper`` (catalog row 38, Trainium3): a bfloat16 ``[M, K]`` tile loaded swizzled and
MXFP8-quantized by ``nisa.quantize_mx``, as raw SBUF tiles (the benchmark of ``load_and_quantize_mxfp_mk``).

Source: nki-library ``src/nkilib_src/nkilib/experimental/mxfp_subkernels/mxfp_load_utils.py`` (tag 2.29, ``@nki.jit``,
marked "WARNING: Active development") and its test's golden ``golden_mxfp_load`` (test_mxfp_load.py, Trn3 only).

``mxfp_load_performance_wrapper(tensor [M, K]) -> (out_data_hbm [128, M * K/512] float8_e4m3fn_x4, out_scale_hbm
[128, M * K/512] uint8)``. Each 512-column block ``k`` of ``tensor`` is swizzled to ``[128, 4M]``
(:func:`~jax_nkilib._src.quant.mx.swizzle_mx`: ``s[g, 4m + j] = tensor[m, 512k + 4g + j]``) and quantized in
``nisa.quantize_mx`` blocks of 8 partitions x 4 elements (:func:`~jax_nkilib._src.quant.mx.quantize_mx`, e4m3):
its elements, packed four to a word, are columns ``kM .. (k+1)M`` of ``out_data_hbm``; its ``[16, M]`` scales sit at
partitions 0..3 of each 32-partition quadrant of ``out_scale_hbm``. The other scale rows are zeros here, as in the
golden; the kernel never writes them (no memset of its scale tile), so on a device they hold whatever SBUF held.
JAX holds the ``float8_e4m3fn_x4`` words as uint32. Values are read as float32 (exact for bfloat16).

Neuron limits: ``M == 128`` and bfloat16 input (the kernel asserts M and reads bf16 pairs as float32 words). The
library tests it on Trainium3 only (it excludes trn1/trn2); like ``attention_mxfp8_tkg`` the target is not checked
here. Off Neuron any M works. Outputs are quantized: no operand gets a cotangent.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, zero_cotangents
from ..framework.spec import CallInfo, KernelSpec, Operand
from . import mx

K_BLOCK = 512  # bfloat16 columns per swizzled block (128 partitions x 4)


def reference_mxfp_load_performance_wrapper(tensor):
    """``(out_data_hbm [128, M*K/512] uint32 words, out_scale_hbm [128, M*K/512] uint8)`` (see the module doc)."""
    rows, cols = tensor.shape
    blocks = jnp.swapaxes(tensor.astype(jnp.float32).reshape(rows, cols // K_BLOCK, K_BLOCK), 0, 1)  # [KB, M, 512]
    elements, scales = mx.quantize_mx(mx.swizzle_mx(blocks))  # [KB, 128, 4M], [KB, 16, M]
    words = mx.pack_x4(elements)  # [KB, 128, M]
    placed = mx.scales_to_quadrants(scales)  # [KB, 128, M]
    return (
        jnp.swapaxes(words, 0, 1).reshape(PARTITIONS, -1),
        jnp.swapaxes(placed, 0, 1).reshape(PARTITIONS, -1),
    )


def _check(call: CallInfo) -> None:
    if call.dims["K"] % K_BLOCK:
        raise ValueError(
            f"{call.function}: tensor must be [M, K] with K % {K_BLOCK} == 0 (swizzled blocks of 128 partitions "
            f"x 4); got K = {call.dims['K']}"
        )


def _outputs(call: CallInfo):
    columns = call.dims["M"] * call.dims["K"] // K_BLOCK
    return (
        ("out_data_hbm", (PARTITIONS, columns), jnp.uint32),
        ("out_scale_hbm", (PARTITIONS, columns), jnp.uint8),
    )


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet = []
    if call.dims["M"] != PARTITIONS:
        unmet.append(f"M must be {PARTITIONS}; got {call.dims['M']}")
    if call.avals["tensor"].dtype != jnp.bfloat16:
        unmet.append(f"tensor must be bfloat16; got {call.avals['tensor'].dtype}")
    return unmet


MXFP_LOAD_PERFORMANCE_WRAPPER_SPEC = KernelSpec(
    name="mxfp_load_performance_wrapper",
    entry_point="nkilib.experimental.mxfp_subkernels.mxfp_load_utils:mxfp_load_performance_wrapper",
    operands=(Operand.of("tensor", "M, K", doc="bfloat16 tile; K % 512 == 0"),),
    params=(),
    outputs=(),
    output_avals=_outputs,
    reference=reference_mxfp_load_performance_wrapper,
    check=_check,
    neuron_limits=_neuron_limits,
    mac_count=lambda call: call.dims["M"] * call.dims["K"],
    nondifferentiable_outputs=("out_data_hbm", "out_scale_hbm"),
    family="quant",
    catalog="row 38",
    support={
        "idiomatic": "",
        "vjp": "none (quantized outputs)",
        "notes": "benchmark wrapper (tested by the library on Trn3 only; 'active development'); [M, K] -> raw "
        "quantize_mx SBUF tiles: x4 words (uint32) and quadrant-placed e8m0 scales [128, M*K/512] (the other "
        "scale rows: zeros here, unwritten by the kernel); "
        "Neuron: M=128, bfloat16",
    },
)

# zero gradients: the outputs are quantized
mxfp_load_performance_wrapper = make_kernel(MXFP_LOAD_PERFORMANCE_WRAPPER_SPEC, zero_cotangents)
