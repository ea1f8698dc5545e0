"""The Neuron path: dry-run switch, compilers and the errors a Neuron lowering can raise."""

from jax_nkilib._src.framework.config import dry_run
from jax_nkilib._src.neuron.compiled import CompiledKernel, NeuronOutputMismatchError, decode_backend_config
from jax_nkilib._src.neuron.dry_run import DryRunCompiler
from jax_nkilib._src.neuron.lowering import (
    CUSTOM_CALL_TARGET,
    EXPORT_DISABLED_CHECKS,
    NeuronFallbackWarning,
    NeuronUnsupportedError,
)
from jax_nkilib._src.neuron.nki_compiler import NkiCompiler
from jax_nkilib._src.neuron.sdk import NeuronSdkMissingError, NkiApiError, installed_versions

__all__ = [
    "CUSTOM_CALL_TARGET",
    "CompiledKernel",
    "EXPORT_DISABLED_CHECKS",
    "DryRunCompiler",
    "NeuronFallbackWarning",
    "NeuronOutputMismatchError",
    "NeuronSdkMissingError",
    "NeuronUnsupportedError",
    "NkiApiError",
    "NkiCompiler",
    "decode_backend_config",
    "dry_run",
    "installed_versions",
]
