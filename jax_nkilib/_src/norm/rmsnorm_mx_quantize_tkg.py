"""``rmsnorm_mx_quantize_tkg`` (catalog row 23, 1.19): optional residual add, RMS norm, then MXFP8 quantization, in
the token-generation layouts. A subkernel writing SBUF buffers; bound through the HBM adapter
``jax_nkilib_kernels/mxfp8.py``, which returns them in the kernel's layouts.

Layouts: ``input [B, S, H]``, ``gamma [1, H]``, ``residual [B, S, H]`` (optional); ``T = B*S`` tokens, ``H % 512 ==
0``, ``n = H/512``. Outputs, in order:

* ``output [128, T, H/128]`` in ``input``'s dtype: ``output[p, t, c] = y[t, 128 c + p]``;
* ``output_quant [128, n, T]`` uint32: float8_e4m3fn x4 words; word ``[p, j, t]`` byte ``q`` holds the element of
  ``y[t, 128 (q n + j) + p]``;
* ``output_scale [128, n, T]`` uint8 e8m0 scales: the block of partitions ``8g..8g+7`` (and the word's 4 bytes) of
  ``[., j, t]`` has its scale at partition ``32 (g // 4) + g % 4``; the other partitions are 0;
* ``output_residual [T, H]`` in ``residual``'s dtype, when ``residual`` is given: ``x``.

Math (float32 unless said; ``in(.)``/``res(.)`` round to the input / residual dtype)::

    x = res(input + residual) (or input);  ss = sum_h x^2
    y = in(in(x * gamma) * rsqrt(ss * (1/hidden_actual) + eps))

``hidden_actual`` (default H) is the unpadded hidden size: padding columns count in ``ss`` but not in the mean.
Quantization follows ``nisa.quantize_mx`` with the OCP emax (the test golden's ``quantize_to_mx``; see
:mod:`.mx`): blocks of 8 partitions x the 4 bytes of a word. ``hidden_dim_tp`` must be True (the only value the kernel
supports).

Gradients: ``output`` and ``output_residual`` are differentiable (JAX math without the roundings); the quantized
outputs are not. Neuron limits (else the reference runs): LNC = 2 (the kernel asserts it), ``T % 4 == 0``,
float16/bfloat16 input; with ``residual``: ``T >= 256`` and ``H % 1024 == 0``. MX quantization needs Trn3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param
from ..quant import mx

P = PARTITIONS
H_BLOCK = 512  # 128 partitions x 4 lanes: one x4 word column per H block
KERNEL_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))
TOKEN_MULTIPLE = 4  # B*S: the kernel's LNC=2 split of the rows
QUANT_DTYPE = jnp.float8_e4m3fn


def _normalized(input, gamma, residual, eps, hidden_actual, rounded: bool):
    """``(y [T, H], x [T, H])``; ``rounded=False`` skips the dtype roundings (for the VJP)."""
    t = input.shape[0] * input.shape[1]
    wide = jnp.float64 if input.dtype == jnp.float64 else jnp.float32
    x = input.reshape(t, -1).astype(wide)
    if residual is not None:
        x = x + residual.reshape(t, -1).astype(wide)
        x = x.astype(residual.dtype).astype(wide) if rounded else x
    scaled = x * gamma.reshape(1, -1).astype(wide)
    scaled = scaled.astype(input.dtype).astype(wide) if rounded else scaled
    ss = jnp.sum(x * x, axis=1, keepdims=True)
    y = scaled * jax.lax.rsqrt(ss * jnp.asarray(1.0 / hidden_actual, wide) + jnp.asarray(eps, wide))
    return y, x


def _kernel_layout(y):
    """``[T, H]`` -> ``[128, T, H/128]``."""
    return jnp.transpose(y.reshape(y.shape[0], -1, P), (2, 0, 1))


def quantize_tkg_tiles(y):
    """``(words [128, n, T] uint32, scales [128, n, T] uint8)`` of ``y [T, H]`` in the kernel's quantize_mx tiles."""
    t, h = y.shape
    n = h // H_BLOCK
    tiles = jnp.transpose(y.reshape(t, 4, n, P), (2, 3, 0, 1)).reshape(n, P, 4 * t)  # [j, p, (t, q)]
    elements, scales = mx.quantize_mx(tiles, QUANT_DTYPE)  # [n, 128, 4T], [n, 16, T]
    words = jnp.transpose(mx.pack_x4(elements), (1, 0, 2))
    return words, jnp.transpose(mx.scales_to_quadrants(scales), (1, 0, 2))


def reference_rmsnorm_mx_quantize_tkg(input, gamma, residual=None, *, eps, hidden_actual, hidden_dim_tp):
    """JAX reference: ``(output, output_quant, output_scale[, output_residual])``."""
    del hidden_dim_tp  # checked: only True
    h = input.shape[-1]
    y, x = _normalized(input, gamma, residual, eps, hidden_actual or h, rounded=True)
    y = y.astype(input.dtype)
    words, scales = quantize_tkg_tiles(y)
    outs = (_kernel_layout(y), words, scales)
    return outs if residual is None else outs + (x.astype(residual.dtype),)


def _check(call: CallInfo) -> None:
    dims, p, function = call.dims, call.params, call.function
    if dims["H"] % H_BLOCK:
        raise ValueError(f"{function}: H={dims['H']} must be a multiple of 512 (output_quant is [128, H/512, B*S])")
    if not p["hidden_dim_tp"]:
        raise ValueError(
            f"{function}: hidden_dim_tp=False is not supported by the kernel (only the [H/128, 128] view of H)"
        )
    actual = p["hidden_actual"]
    if actual is not None and not 0 < actual <= dims["H"]:
        raise ValueError(f"{function}: hidden_actual must be in (0, H={dims['H']}]; got {actual}")


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, avals, unmet = call.dims, call.avals, []
    tokens = dims["B"] * dims["S"]
    if call.lnc != 2:
        unmet.append(f"the kernel runs only with LNC=2; got LNC={call.lnc}")
    if tokens % TOKEN_MULTIPLE:
        unmet.append(f"B*S={tokens} must be a multiple of {TOKEN_MULTIPLE} (the LNC=2 split)")
    if avals["input"].dtype not in KERNEL_DTYPES:
        unmet.append(f"the output dtype (the input's) must be float16 or bfloat16; got {avals['input'].dtype}")
    if avals.get("residual") is not None and (tokens < 256 or dims["H"] % 1024):
        unmet.append(f"a fused residual add needs B*S >= 256 and H % 1024 == 0; got B*S={tokens}, H={dims['H']}")
    return unmet


def _vjp(kernel, operands, params, outs, cotangents):
    """Gradients of ``output`` and ``output_residual`` through the unrounded math."""
    names = [name for name in ("input", "gamma", "residual") if operands[name] is not None]
    h = operands["input"].shape[-1]

    def outputs(named):
        y, x = _normalized(
            named["input"],
            named["gamma"],
            named["residual"],
            params["eps"],
            params["hidden_actual"] or h,
            rounded=False,
        )
        return (_kernel_layout(y),) + (() if named["residual"] is None else (x,))

    wanted = (cotangents[0],) + (() if operands["residual"] is None else (cotangents[3],))
    return pull_back(outputs, operands, names, wanted)


def _outputs(call: CallInfo):
    """Over the ``T = B * S`` tokens: ``output [128, T, H/128]`` (input dtype), ``output_quant`` (uint32 x4 words)
    and ``output_scale`` (uint8) ``[128, H/512, T]``, and ``output_residual [T, H]`` when ``residual`` is given."""
    tokens, hidden = call.dims["B"] * call.dims["S"], call.dims["H"]
    out = [
        ("output", (128, tokens, hidden // 128), call.avals["input"].dtype),
        ("output_quant", (128, hidden // 512, tokens), jnp.uint32),
        ("output_scale", (128, hidden // 512, tokens), jnp.uint8),
    ]
    if call.avals.get("residual") is not None:
        out.append(("output_residual", (tokens, hidden), call.avals["residual"].dtype))
    return out


RMSNORM_MX_QUANTIZE_TKG_SPEC = KernelSpec(
    name="rmsnorm_mx_quantize_tkg",
    entry_point="jax_nkilib_kernels.mxfp8:rmsnorm_mx_quantize_tkg",
    operands=(
        Operand.of("input", "B, S, H", doc="hidden states"),
        Operand.of("gamma", "1, H", doc="RMS norm weights"),
        Operand.of("residual", "B, S, H", optional=True, doc="added to input before the norm; the sum is returned"),
    ),
    params=(
        Param("eps", 1e-6, float, "added to the mean square"),
        Param("hidden_actual", None, int, "unpadded hidden size for the mean (default H)"),
        Param("hidden_dim_tp", True, bool, "the [H/128, 128] view of H (the only one the kernel supports)"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_rmsnorm_mx_quantize_tkg,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {"input": "B", "residual": "B", "gamma": None},
            outputs={"output": 1, "output_quant": 2, "output_scale": 2, "output_residual": 0},
        ),
    ),
    mac_count=lambda call: 4 * call.dims["B"] * call.dims["S"] * call.dims["H"],
    nondifferentiable_outputs=("output_quant", "output_scale"),
    family="norm",
    catalog="1.19",
    support={
        "idiomatic": "",
        "vjp": "JAX for output and output_residual; the MX outputs have zero cotangents",
        "notes": "MXFP8 e4m3fn x4 words as uint32, scales in the quadrant layout; Neuron (Trn3): LNC=2 only, "
        f"B*S % {TOKEN_MULTIPLE} == 0, fp16/bf16; device adapter jax_nkilib_kernels/mxfp8.py",
    },
)

rmsnorm_mx_quantize_tkg = make_kernel(RMSNORM_MX_QUANTIZE_TKG_SPEC, vjp=_vjp)
