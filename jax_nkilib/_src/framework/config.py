"""Library settings: the LNC degree, the policy for Neuron-kernel limits, and the Neuron dry-run switch.

Each setting is a thread-local JAX config state included in JAX's jit cache key, so a function traced under one
setting is never reused under another. ``config(...)`` is a context manager; outside any context the LNC degree comes
from ``NEURON_LOGICAL_NC_CONFIG`` (default 1) and the policy is ``"fallback"``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

from . import compat

ON_UNSUPPORTED_POLICIES = ("fallback", "error")
LNC_DEGREES = (1, 2)
LNC_ENV_VAR = "NEURON_LOGICAL_NC_CONFIG"

_lnc_state = compat.jit_keyed_state(
    "int", "jax_nkilib_lnc", 0,
    "Logical NeuronCore degree used by jax_nkilib kernels (0: read NEURON_LOGICAL_NC_CONFIG, default 1).")
_on_unsupported_state = compat.jit_keyed_state(
    "enum", "jax_nkilib_on_unsupported", "fallback",
    "What jax_nkilib does when lowering for Neuron and a kernel limit is not met: 'fallback' lowers the JAX "
    "reference and warns, 'error' raises.", enum_values=list(ON_UNSUPPORTED_POLICIES))
_dry_run_state = compat.jit_keyed_state(
    "bool", "jax_nkilib_neuron_dry_run", False,
    "Lower jax_nkilib kernels for Neuron with the dry-run compiler (no `nki` package needed; not runnable).")


def _lnc_from_environment() -> int:
    raw = os.environ.get(LNC_ENV_VAR, "1").strip() or "1"
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{LNC_ENV_VAR} must be 1 or 2, got {raw!r}") from None
    if value not in LNC_DEGREES:
        raise ValueError(f"{LNC_ENV_VAR} must be 1 or 2, got {value}")
    return value


def current_lnc() -> int:
    """The LNC degree in force: ``config(lnc=...)`` if set, else ``NEURON_LOGICAL_NC_CONFIG``, else 1."""
    return _lnc_state.value or _lnc_from_environment()


def current_on_unsupported() -> str:
    """``"fallback"`` or ``"error"``: the policy for unmet Neuron-kernel limits."""
    return _on_unsupported_state.value


def dry_run_enabled() -> bool:
    return bool(_dry_run_state.value)


@contextlib.contextmanager
def config(*, lnc: int | None = None, on_unsupported: str | None = None) -> Iterator[None]:
    """Temporarily change jax_nkilib settings.

    Args:
      lnc: logical NeuronCore degree (1 or 2). Kernels' LNC-sharding flags follow it, output shapes that depend on
        it use it, and the Neuron custom call's ``grid`` equals it.
      on_unsupported: ``"fallback"`` (lower the JAX reference on Neuron and warn once per call site when a kernel
        limit is not met) or ``"error"`` (raise ``NeuronUnsupportedError``).
    """
    if lnc is not None and (isinstance(lnc, bool) or lnc not in LNC_DEGREES):
        raise ValueError(f"jax_nkilib.config: lnc must be one of {LNC_DEGREES}, got {lnc!r}")
    if on_unsupported is not None and on_unsupported not in ON_UNSUPPORTED_POLICIES:
        raise ValueError(
            f"jax_nkilib.config: on_unsupported must be one of {ON_UNSUPPORTED_POLICIES}, got {on_unsupported!r}")
    with contextlib.ExitStack() as stack:
        if lnc is not None:
            stack.enter_context(_lnc_state(lnc))
        if on_unsupported is not None:
            stack.enter_context(_on_unsupported_state(on_unsupported))
        yield


@contextlib.contextmanager
def dry_run(enabled: bool = True) -> Iterator[None]:
    """Lower kernels for Neuron with the dry-run compiler inside this context.

    The dry-run compiler needs no Neuron SDK. It emits the same ``AwsNeuronCustomNativeKernel`` call with a
    deterministic config whose ``kernel_format`` is ``"dry-run"``: for inspection and tests, never for running.
    """
    with _dry_run_state(bool(enabled)):
        yield
