"""The kernel compiler in force: dry run when enabled, else the NKI compiler when the Neuron SDK is installed.

* :class:`~.nki_compiler.NkiCompiler` compiles the real kernel through the ``nki`` package's framework-integration
  API; it needs the Neuron SDK.
* :class:`~.dry_run.DryRunCompiler` needs nothing and emits a deterministic ``"dry-run"`` config.
"""

from __future__ import annotations

from ..framework import config
from .dry_run import DryRunCompiler
from .nki_compiler import NkiCompiler
from .sdk import INSTALL_HINT, NeuronSdkMissingError, nki_available


def active_compiler():
    """The compiler in force: dry run if enabled, else the ``nki`` compiler, else an installation error."""
    if config.dry_run_enabled():
        return DryRunCompiler()
    if nki_available():
        return NkiCompiler()
    raise NeuronSdkMissingError(INSTALL_HINT)
