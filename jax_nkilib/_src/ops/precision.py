"""The idiomatic ops' ``precision``: JAX's convention (float32 math for float32 inputs) unless bfloat16 compute, the
kernels' own, is asked for, by argument or by ``jax.default_matmul_precision``.

The NKI ``qkv`` and ``mlp`` kernels compute float32 inputs in bfloat16 on their CTE paths. ``jax_nkilib.nki`` keeps
exactly that; ``jax_nkilib.qkv_projection`` and ``jax_nkilib.mlp`` pass the kernels' ``float32_compute`` param (read
by the JAX reference only, never by the kernel) so that off Neuron a float32 call computes in float32, as ``x @ w``
would, and in bfloat16 only when asked: ``precision="bfloat16"``, ``jax.lax.DotAlgorithmPreset.BF16_BF16_F32`` or
``BF16_BF16_BF16``, or, with ``precision=None``, the same values of ``jax.default_matmul_precision`` (read at trace
time; it is part of JAX's jit cache key). On Neuron the kernel runs either way (one custom call, unchanged) and
computes in bfloat16; ``jax_nkilib.explain`` notes it.
"""

from __future__ import annotations

import jax

# The values of jax.default_matmul_precision (the same in jax 0.7 and 0.10): the legacy names, then the algorithm
# presets (jax.lax.DotAlgorithmPreset member names).
_LEGACY = ("default", "high", "highest", "bfloat16", "tensorfloat32", "float32")
_PRESETS = tuple(preset.name for preset in jax.lax.DotAlgorithmPreset)
BFLOAT16_REQUESTS = ("bfloat16", "BF16_BF16_F32", "BF16_BF16_BF16")


def _name(where: str, precision) -> str:
    if isinstance(precision, jax.lax.Precision):  # DEFAULT (also what Precision("bfloat16") returns), HIGH, HIGHEST
        return precision.name.lower()
    if isinstance(precision, jax.lax.DotAlgorithmPreset):
        return precision.name
    if isinstance(precision, str) and (precision in _LEGACY or precision in _PRESETS):
        return precision
    raise ValueError(
        f"{where}: `precision` must be None (follow jax.default_matmul_precision), one of "
        f"{', '.join(repr(name) for name in _LEGACY)}, a jax.lax.Precision or a jax.lax.DotAlgorithmPreset (or its "
        f"name); 'bfloat16', BF16_BF16_F32 and BF16_BF16_BF16 ask for the kernel's bfloat16 compute; got "
        f"{precision!r}"
    )


def float32_compute(where: str, precision) -> str:
    """The kernels' ``float32_compute`` for the op's ``precision`` (``None``: ``jax.default_matmul_precision``):
    ``"bfloat16"`` when bfloat16 compute is asked for, else ``"float32"``."""
    if precision is None:
        precision = jax.default_matmul_precision.value
        if precision is None:
            return "float32"
    return "bfloat16" if _name(where, precision) in BFLOAT16_REQUESTS else "float32"
