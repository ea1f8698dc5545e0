"""The checkpoint names of the residuals saved by jax_nkilib's VJPs, and the remat policies that read them (public as
``jax_nkilib.checkpoint_policies``, whose docstring is the user documentation).

A name is ``<prefix>.<suffix>``: the prefix is a kernel's name (or a JAX-level op's, see
:func:`registry.register_checkpointed`), the suffix an operand's name (an input of the VJP) or anything else (an
output or statistic of the forward). An output that shares an operand's name gets ``_out`` appended, so a name's
suffix alone says which of the two it is.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from jax.ad_checkpoint import checkpoint_name

from . import compat, registry

OPERAND = "operand"
OUTPUT = "output"


def operand_name(prefix: str, operand: str) -> str:
    """The checkpoint name of the input ``operand`` of ``prefix``'s VJP."""
    return f"{prefix}.{operand}"


def output_name(prefix: str, output: str, operands: Collection[str]) -> str:
    """The checkpoint name of the output ``output`` of ``prefix``'s forward (``operands``: its operand names)."""
    return f"{prefix}.{output}_out" if output in operands else f"{prefix}.{output}"


def name_operands(prefix: str, operands: Mapping[str, Any]) -> dict[str, Any]:
    """``operands`` (by name) ``checkpoint_name``-d ``"<prefix>.<operand>"``; absent ones (``None``) stay ``None``."""
    return {
        name: None if value is None else checkpoint_name(value, operand_name(prefix, name))
        for name, value in operands.items()
    }


def name_outputs(prefix: str, outputs: Mapping[str, Any], operands: Collection[str]) -> tuple:
    """The values of ``outputs`` (by name) ``checkpoint_name``-d as :func:`output_name` says, in order. A forward
    returns these named values, so the rest of the program uses the ones a policy saves."""
    return tuple(checkpoint_name(value, output_name(prefix, name, operands)) for name, value in outputs.items())


def residual_role(name: str) -> str | None:
    """:data:`OPERAND` or :data:`OUTPUT` for a checkpoint name jax_nkilib gives a residual, else ``None``."""
    prefix, dot, suffix = name.partition(".")
    operands = registry.checkpointed_operands(prefix) if dot and suffix else None
    if operands is None:
        return None
    return OPERAND if suffix in operands else OUTPUT


def save_kernel_outputs(prim, *_, **params) -> bool:
    """Remat policy: save the outputs of every jax_nkilib kernel (statistics included) and recompute everything else.

    Saveable: the values named ``<kernel>.<output>`` (the outputs of a differentiable kernel's forward, the
    statistics such as ``attention_cte.neg_max`` and ``recip`` included, and ``ring_attention.out`` / ``lse``) and the
    results of kernels bound without a VJP. The backward then reruns no forward kernel; the JAX code that computes
    the kernels' inputs (projections, reshapes, casts) is rerun.
    """
    if prim is compat.checkpoint_name_p:
        return residual_role(params["name"]) == OUTPUT
    return registry.kernel_for_primitive(prim) is not None


def save_kernel_residuals(prim, *_, **params) -> bool:
    """Remat policy: save exactly the residuals of jax_nkilib's VJPs and recompute everything else.

    Saveable: every value named ``<kernel>.<name>``: what the kernels' backward passes read, their inputs as well as
    their outputs and statistics. Unlike :func:`save_kernel_outputs`, the kernels' inputs are kept, so the JAX code
    computing them is not rerun for the kernels' backward passes; kernels without a VJP are not special (their
    results are saved where a differentiable kernel takes them as inputs, recomputed otherwise).
    """
    return prim is compat.checkpoint_name_p and residual_role(params["name"]) is not None
