"""Library settings: the Neuron platform target, the LNC degree, the policy for Neuron-kernel limits, the Neuron
dry-run switch and the run-time index checks.

Each setting is a thread-local JAX config state included in JAX's jit cache key, so a function traced under one
setting is never reused under another. ``config(...)`` is a context manager. Outside any context the platform target
and the LNC degree are what the environment said when jax_nkilib was imported (see :mod:`platform`: the LNC degree
follows the platform, 2 on Trainium2 and later) and the policy is ``"fallback"``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from . import compat, platform
from .platform import LNC_DEGREES, PLATFORM_TARGETS

ON_UNSUPPORTED_POLICIES = ("fallback", "error")

_target_state = compat.jit_keyed_state(
    "enum",
    "jax_nkilib_platform_target",
    platform.target_from_environment(),
    "Neuron platform target of jax_nkilib kernels (default: $NEURON_PLATFORM_TARGET_OVERRIDE at import, else trn2).",
    enum_values=list(PLATFORM_TARGETS),
)
_lnc_state = compat.jit_keyed_state(
    "int",
    "jax_nkilib_lnc",
    0,
    "Logical NeuronCore degree used by jax_nkilib kernels (0: $NEURON_LOGICAL_NC_CONFIG at import, else the "
    "platform target's default).",
)
_environment_lnc = platform.lnc_from_environment()
_on_unsupported_state = compat.jit_keyed_state(
    "enum",
    "jax_nkilib_on_unsupported",
    "fallback",
    "What jax_nkilib does when lowering for Neuron and a kernel limit is not met: 'fallback' lowers the JAX "
    "reference and warns, 'error' raises.",
    enum_values=list(ON_UNSUPPORTED_POLICIES),
)
_dry_run_state = compat.jit_keyed_state(
    "bool",
    "jax_nkilib_neuron_dry_run",
    False,
    "Lower jax_nkilib kernels for Neuron with the dry-run compiler (no `nki` package needed; not runnable).",
)
_runtime_checks_state = compat.jit_keyed_state(
    "bool",
    "jax_nkilib_runtime_checks",
    False,
    "Emit jax.experimental.checkify checks of run-time index values (decode_attention's cache_len and block_table, "
    "...); they report errors under checkify.checkify and are dropped otherwise.",
)


def current_target() -> str:
    """The Neuron platform target in force (``trn2``, ``trn1``, ``trn3``...)."""
    return _target_state.value


def current_lnc() -> int:
    """The LNC degree in force: ``config(lnc=...)`` if set, else ``$NEURON_LOGICAL_NC_CONFIG`` as it was at import,
    else the platform target's default (2 on Trainium2 and later, 1 on Trainium1 and Inferentia2)."""
    return _lnc_state.value or _environment_lnc or platform.platform_default_lnc(current_target())


def current_on_unsupported() -> str:
    """``"fallback"`` or ``"error"``: the policy for unmet Neuron-kernel limits."""
    return _on_unsupported_state.value


def dry_run_enabled() -> bool:
    return bool(_dry_run_state.value)


def runtime_checks_enabled() -> bool:
    """Whether ops emit checkify checks of their run-time index values (see :mod:`runtime_checks`)."""
    return bool(_runtime_checks_state.value)


@contextlib.contextmanager
def config(
    *,
    lnc: int | None = None,
    on_unsupported: str | None = None,
    target: str | None = None,
    runtime_checks: bool | None = None,
) -> Iterator[None]:
    """Temporarily change jax_nkilib settings.

    Args:
      target: the Neuron platform target (``"trn1"``, ``"inf2"``, ``"trn2"``, ``"trn3pre"``, ``"trn3"``): what the
        kernels are compiled for, what target-dependent semantics follow (the FP8 format of ``dtype_mode=AUTO``) and,
        unless ``lnc`` is given, the default LNC degree.
      lnc: logical NeuronCore degree (1 or 2). Kernels' LNC-sharding flags follow it, output shapes that depend on
        it use it, and the Neuron custom call's ``grid`` equals it.
      on_unsupported: ``"fallback"`` (lower the JAX reference on Neuron and warn once per call site when a kernel
        limit is not met) or ``"error"`` (raise ``NeuronUnsupportedError``).
      runtime_checks: ``True`` makes ops check run-time index values that cannot be checked while tracing
        (``decode_attention``'s ``cache_len`` and ``block_table``, ``attention``'s traced prefix length,
        ``nki.attention_tkg``'s ``active_blocks_table``) with ``jax.experimental.checkify.debug_check``: wrap the
        function in ``checkify.checkify(f, errors=checkify.user_checks)`` and call ``err.throw()`` to get an error
        naming the op, the argument and the bad value. Without ``checkify`` the checks are dropped on CPU/GPU (JAX
        has no lowering for an undischarged check on ``neuron``: there, use them under ``checkify`` only); either
        way an invalid index gives NaN in the rows it affects. Off by default: a check makes every call of a jitted
        function pay JAX's effect handling (tens of microseconds of dispatch).
    """
    if lnc is not None and (isinstance(lnc, bool) or lnc not in LNC_DEGREES):
        raise ValueError(f"jax_nkilib.config: lnc must be one of {LNC_DEGREES}, got {lnc!r}")
    if on_unsupported is not None and on_unsupported not in ON_UNSUPPORTED_POLICIES:
        raise ValueError(
            f"jax_nkilib.config: on_unsupported must be one of {ON_UNSUPPORTED_POLICIES}, got {on_unsupported!r}"
        )
    if target is not None:
        target = platform.normalize_target(target, "jax_nkilib.config: target")
    if runtime_checks is not None and not isinstance(runtime_checks, bool):
        raise TypeError(f"jax_nkilib.config: runtime_checks must be a bool, got {runtime_checks!r}")
    with contextlib.ExitStack() as stack:
        if target is not None:
            stack.enter_context(_target_state(target))
        if lnc is not None:
            stack.enter_context(_lnc_state(lnc))
        if on_unsupported is not None:
            stack.enter_context(_on_unsupported_state(on_unsupported))
        if runtime_checks is not None:
            stack.enter_context(_runtime_checks_state(runtime_checks))
        yield


@contextlib.contextmanager
def dry_run(enabled: bool = True) -> Iterator[None]:
    """Lower kernels for Neuron with the dry-run compiler inside this context.

    The dry-run compiler needs no Neuron SDK. It emits the same ``AwsNeuronCustomNativeKernel`` call with a
    deterministic config whose ``kernel_format`` is ``"dry-run"``: for inspection and tests, never for running.
    """
    with _dry_run_state(bool(enabled)):
        yield
