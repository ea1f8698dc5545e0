"""The Neuron path: dry-run switch, compilers and the errors a Neuron lowering can raise."""

from jax_nkilib._src.framework.config import dry_run
from jax_nkilib._src.neuron.compilers import (
    CompiledKernel,
    DryRunCompiler,
    NeuronOutputMismatchError,
    NeuronSdkMissingError,
    NkiApiError,
    NkiCompiler,
    decode_backend_config,
)
from jax_nkilib._src.neuron.lowering import CUSTOM_CALL_TARGET, NeuronFallbackWarning, NeuronUnsupportedError

__all__ = [
    "CUSTOM_CALL_TARGET", "CompiledKernel", "DryRunCompiler", "NeuronFallbackWarning", "NeuronOutputMismatchError",
    "NeuronSdkMissingError", "NeuronUnsupportedError", "NkiApiError", "NkiCompiler", "decode_backend_config",
    "dry_run",
]
