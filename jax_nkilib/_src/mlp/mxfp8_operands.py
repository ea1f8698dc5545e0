"""The matmul operands of the MXFP8 MLP kernels: how each is given, its dimensions and its values.

Every matmul operand of these kernels is an ``[F, K]`` matrix (K contracted) given in one of three forms:

* raw: ``[F, K]`` in a float dtype (the kernel loads it with a DMA transpose and quantizes it);
* pre-swizzled (``*_is_swizzled=True``): the wrapX swizzle ``[K/4, 4F]`` of the raw matrix
  (:func:`jax_nkilib._src.quant.mx.swizzle_wrapx`);
* pre-quantized (its ``*_scales`` operand given): x4 words ``[K/4, F]`` uint32 with e8m0 scale bytes ``[K/4, F]``
  or packed ``[ceil(K/2048)*128, F]`` uint8 (:func:`~jax_nkilib._src.quant.mx.quantize_matmul_operand`).

The forms share the operand's rank, so the spec declares free dimension names for these operands and the kernels'
``check`` decodes the named dimensions (S, H, I) here, validates them and records them for the output shapes.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from ..framework.spec import FLOAT_DTYPES, CallInfo
from ..quant import mx

WORD_DTYPES = (jnp.dtype(jnp.uint32),)
SCALE_DTYPES = (jnp.dtype(jnp.uint8),)
RAW, SWIZZLED, PREQUANTIZED = "raw", "swizzled", "pre-quantized"


@dataclasses.dataclass(frozen=True)
class MatmulOperand:
    """An ``[F, K]`` operand: its name, the names of F and K (sizes ``f_times * F`` and ``k_times * K``, e.g. 2 for
    the fused ``[2I, H]`` gate/up weights), its scales operand and its pre-swizzled flag (``None``: not available)."""

    name: str
    f: str
    k: str
    scales: str | None = None
    swizzled: str | None = None
    f_times: int = 1
    k_times: int = 1

    @property
    def f_text(self) -> str:
        return f"{self.f_times}*{self.f}" if self.f_times > 1 else self.f

    @property
    def k_text(self) -> str:
        return f"{self.k_times}*{self.k}" if self.k_times > 1 else self.k

    def layout_text(self, mode: str) -> str:
        f, k = self.f_text, self.k_text
        if mode == RAW:
            return f"[{f}, {k}]"
        if mode == SWIZZLED:
            return f"[{k}/4, 4*{f}] (wrapX swizzled)"
        return (
            f"[{k}/4, {f}] uint32 x4 words, with `{self.scales}` [{k}/4, {f}] or packed [ceil({k}/2048)*128, {f}] uint8"
        )


def free_layout(name: str) -> str:
    """The spec layout of an operand whose form decides its dimensions (decoded by :func:`bind_dims`)."""
    return f"{name}_rows, {name}_cols"


def mode_of(spec: MatmulOperand, avals, params) -> str:
    if spec.scales is not None and avals.get(spec.scales) is not None:
        return PREQUANTIZED
    if spec.swizzled is not None and params[spec.swizzled]:
        return SWIZZLED
    return RAW


def operand_dims(spec: MatmulOperand, call: CallInfo) -> tuple[int, int] | None:
    """``(F, K)`` of a present operand (in units of ``f_times`` / ``k_times``), validated for its form; ``None`` if
    absent."""
    avals, function = call.avals, call.function
    aval = avals.get(spec.name)
    if aval is None:
        return None
    mode = mode_of(spec, avals, call.params)
    if mode == PREQUANTIZED and spec.swizzled is not None and call.params[spec.swizzled]:
        raise ValueError(
            f"{function}: give either `{spec.scales}` (pre-quantized `{spec.name}`) or "
            f"{spec.swizzled}=True (pre-swizzled bfloat16), not both"
        )
    dtype, rows, cols = np.dtype(aval.dtype), *aval.shape
    allowed = WORD_DTYPES if mode == PREQUANTIZED else FLOAT_DTYPES
    if dtype not in allowed:
        raise TypeError(
            f"{function}: argument `{spec.name}` ({mode}, layout {spec.layout_text(mode)}) must have dtype "
            f"in ({', '.join(map(str, allowed))}); got {dtype}"
        )
    if mode == RAW:
        f_rows, k = rows, cols
    elif mode == SWIZZLED:
        f_rows, k = cols / 4, 4 * rows
    else:
        f_rows, k = cols, 4 * rows
    if f_rows != int(f_rows) or int(f_rows) % spec.f_times or k % spec.k_times:
        raise ValueError(
            f"{function}: argument `{spec.name}` must have layout {spec.layout_text(mode)}; got shape "
            f"{tuple(aval.shape)}"
        )
    if mode != RAW and k % mx.BLOCK_SIZE:
        raise ValueError(
            f"{function}: the contraction {spec.k_text}={k} of the {mode} `{spec.name}` (layout "
            f"{spec.layout_text(mode)}) must be a multiple of 32 (one MX scale per 32 elements)"
        )
    f, k = int(f_rows) // spec.f_times, int(k) // spec.k_times
    if mode == PREQUANTIZED:
        scales = avals[spec.scales]
        if np.dtype(scales.dtype) not in SCALE_DTYPES:
            raise TypeError(
                f"{function}: argument `{spec.scales}` must have dtype uint8 (e8m0 scale bytes); got {scales.dtype}"
            )
        shapes = {(mx.matmul_scale_rows(k * spec.k_times, packed), f * spec.f_times) for packed in (False, True)}
        if tuple(scales.shape) not in shapes:
            raise ValueError(
                f"{function}: argument `{spec.scales}` must be [{spec.k_text}/4, {spec.f_text}] or packed "
                f"[ceil({spec.k_text}/2048)*128, {spec.f_text}] = one of {sorted(shapes)} for "
                f"`{spec.name}` {tuple(aval.shape)}; got {tuple(scales.shape)}"
            )
    return f, k


def bind_dims(call: CallInfo, operands, fixed: dict[str, int] | None = None) -> dict[str, int]:
    """Decode the named dimensions of ``operands`` (``MatmulOperand``s), check that they agree, and record them in
    ``call.dims`` for the output shapes."""
    dims: dict[str, int] = dict(fixed or {})
    source: dict[str, str] = {name: "the other operands" for name in dims}
    for spec in operands:
        found = operand_dims(spec, call)
        if found is None:
            continue
        mode = mode_of(spec, call.avals, call.params)
        for name, size in zip((spec.f, spec.k), found):
            if name in dims and dims[name] != size:
                raise ValueError(
                    f"{call.function}: argument `{spec.name}` must have layout {spec.layout_text(mode)} "
                    f"with {name}={dims[name]} (from {source[name]}); got shape "
                    f"{tuple(call.avals[spec.name].shape)}, i.e. {name}={size}"
                )
            dims.setdefault(name, size)
            source.setdefault(name, f"`{spec.name}`")
    call.dims.update(dims)  # the output layouts name these dimensions
    return dims


def bf16_operand_limits(call: CallInfo, operands) -> list[str]:
    """Both kernels load raw and pre-swizzled operands as bfloat16."""
    wrong = [
        f"{spec.name} ({call.avals[spec.name].dtype})"
        for spec in operands
        if call.avals.get(spec.name) is not None
        and mode_of(spec, call.avals, call.params) != PREQUANTIZED
        and np.dtype(call.avals[spec.name].dtype) != jnp.dtype(jnp.bfloat16)
    ]
    return [f"the kernel loads bfloat16 operands; got {', '.join(wrong)}"] if wrong else []


def lnc2_limits(call: CallInfo, sizes: dict[str, int]) -> list[str]:
    """``run_with_lnc2`` needs LNC=2 and even ``sizes`` (the dimensions the kernel splits over the two cores)."""
    if not call.params["run_with_lnc2"]:
        return []
    unmet = (
        []
        if call.lnc == 2
        else [f"run_with_lnc2=True needs LNC=2; got LNC={call.lnc} (pass run_with_lnc2=False to run on one core)"]
    )
    return unmet + [
        f"{name}={size} must be even to split over the two cores" for name, size in sizes.items() if size % 2
    ]


def values(spec: MatmulOperand, operands, params):
    """``(value [f_times*F, k_times*K], quantize)``: the raw values (still to be quantized), or the dequantized
    values of a pre-quantized operand (``quantize=False``)."""
    value = operands[spec.name]
    if spec.scales is not None and operands.get(spec.scales) is not None:
        return mx.dequantize_matmul_operand(value, operands[spec.scales]), False
    if spec.swizzled is not None and params[spec.swizzled]:
        return mx.unswizzle_wrapx(value), True
    return value, True
