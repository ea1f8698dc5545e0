"""``float32_compute``: a param of jax_nkilib's own (``Param.to_kernel=False``, never passed to a kernel) of the
kernels whose CTE path computes float32 inputs in bfloat16 (``qkv``, ``mlp``). It says how the JAX reference (CPU,
GPU, a Neuron fallback) computes such inputs: ``"bfloat16"`` as the kernel does (the default: layer 1 is the
kernel's numerics) or ``"float32"`` (what the idiomatic ops ask for unless bfloat16 compute is requested, see
``ops.precision``). The NKI kernel on Neuron computes them in bfloat16 either way; ``explain`` says so."""

from __future__ import annotations

import jax.numpy as jnp

from .spec import Param

FLOAT32_COMPUTE = ("bfloat16", "float32")

FLOAT32_COMPUTE_PARAM = Param(
    "float32_compute",
    "bfloat16",
    FLOAT32_COMPUTE,
    "the JAX reference's compute for float32 inputs on the CTE path: bfloat16 as the kernel (default) or "
    "float32; the kernel on Neuron always computes them in bfloat16",
    to_kernel=False,
)


def computes_in_bfloat16(dtype, tkg: bool) -> bool:
    """Does the kernel (``qkv``, ``mlp``) compute ``dtype`` inputs in bfloat16? Float32 on the CTE path."""
    return not tkg and jnp.dtype(dtype) == jnp.float32


def reference_compute_dtype(dtype, tkg: bool, float32_compute: str = "bfloat16"):
    """The dtype the reference keeps intermediates in: the input's, but bfloat16 where the kernel computes in it
    (unless ``float32_compute="float32"``: the reference then keeps float32, off the kernel's numerics)."""
    bf16 = computes_in_bfloat16(dtype, tkg) and float32_compute == "bfloat16"
    return jnp.dtype(jnp.bfloat16) if bf16 else jnp.dtype(dtype)


def bfloat16_compute_note(where: str, float32_compute: str) -> str:
    """``explain``'s note for a float32 call of a kernel path that computes in bfloat16."""
    reference = "bfloat16 too" if float32_compute == "bfloat16" else "float32 (float32_compute='float32')"
    return (
        f"float32 inputs compute in bfloat16 in the NKI kernel ({where}; 8 significant bits); the JAX "
        f"reference off Neuron computes in {reference}"
    )
