"""Marking a value that an idiomatic op computes in plain JAX because no NKI kernel implements the call.

``reference_only(x, op=..., reasons=...)`` is the identity everywhere. Lowered for Neuron it also applies the
``on_unsupported`` policy of the kernels' own fallback (:mod:`.lowering`): ``"fallback"`` warns once per call site
with :class:`~.lowering.NeuronFallbackWarning` naming the reasons, ``"error"`` raises
:class:`~.lowering.NeuronUnsupportedError`. So an op whose call does not map onto a kernel (a dense attention bias,
say) reports it exactly as a kernel call that misses a kernel limit does. It adds nothing to the lowered module.
"""

from __future__ import annotations

from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from ..framework import compat, config
from ..framework.primitive import REFERENCE_PLATFORMS
from .lowering import NeuronUnsupportedError, warn_once

_reference_only_p = Primitive("jax_nkilib_reference_only")
_reference_only_p.def_impl(lambda x, **_: x)
_reference_only_p.def_abstract_eval(lambda aval, **_: aval)
batching.primitive_batchers[_reference_only_p] = lambda args, dims, **params: (
    _reference_only_p.bind(*args, **params),
    dims[0],
)
ad.primitive_jvps[_reference_only_p] = lambda primals, tangents, **params: (
    _reference_only_p.bind(*primals, **params),
    tangents[0],
)


def _identity(ctx, x, **_):
    return [x]


def _neuron_rule(ctx, x, *, op: str, reasons: tuple[str, ...]):
    if config.current_on_unsupported() == "error":
        raise NeuronUnsupportedError(f"{op} cannot run as an NKI kernel on Neuron: {'; '.join(reasons)}")
    warn_once(op, compat.call_site(ctx.traceback), list(reasons))
    return [x]


# As for the kernels: the Neuron rule is the default (the rule for a platform JAX does not know, as
# ``lowering_platforms=("neuron",)`` is here) and the identity is registered for every other platform.
mlir.register_lowering(_reference_only_p, _neuron_rule)
for _platform in REFERENCE_PLATFORMS:
    mlir.register_lowering(_reference_only_p, _identity, platform=_platform)
if compat.is_known_platform("neuron"):
    mlir.register_lowering(_reference_only_p, _neuron_rule, platform="neuron")


def reference_only(x, *, op: str, reasons: tuple[str, ...]):
    """``x`` unchanged; lowering it for Neuron warns (or raises) that ``op`` runs as JAX there, for ``reasons``."""
    return _reference_only_p.bind(x, op=op, reasons=tuple(reasons))
