"""The Neuron path: dry-run switch, compilers, the errors a Neuron lowering can raise, and the op census of a
function's Neuron graph."""

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
from jax_nkilib._src.tools.census import OpCensus, op_census

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
    "OpCensus",
    "decode_backend_config",
    "dry_run",
    "installed_versions",
    "op_census",
]
