"""``NkiCompiler``: compile the real NKI kernel for a call's shapes through NKI's framework-integration API.

It follows what NKI's own integrations do (nkipy ``nki_op.py``'s beta-3 path, vllm-neuron's ``compile_nki``; see
``neuron_protocol.md``):

1. ``CompileKernel(func, lnc=, target=, artifacts_dir=)`` around the **raw** kernel function
   (``getattr(kernel, "func", kernel)``: its ``__post_init__`` stores a compile cache on ``func``, which an
   ``@nki.jit`` object, a frozen dataclass, refuses);
2. the arguments bound by the kernel's signature, in its order: tensors as NumPy arrays of the operand's shape and
   dtype (``np.empty``, ml_dtypes for bfloat16/FP8, as nkipy passes them), or as an ``nki.language.tensor.NkiTensor``
   in shared HBM for packed x4 types NumPy cannot hold (as vllm-neuron passes tensors); static arguments as values;
3. ``compile_kernel_to_nir(kernel, inputs=..., compile_opts=kernel._compile_opts())`` (the options
   ``CompileKernel.compile`` itself uses, as vllm-neuron takes them; ``CompileOptions(target, lnc, artifacts_dir,
   output_path)`` as nkipy builds them where that method is missing), "the single compilation entry point" for
   framework integrations, returning a ``NirResult`` (``CompileKernel.compile`` would drop its ``is_tuple_return``);
   ``NirResult.build_config()`` gives the ``FrameworkConfig`` (``backend_config_b64`` bytes, ``output_specs``,
   ``operand_output_aliases``, ``has_collectives``) and ``NirResult.is_tuple_return`` says whether the kernel
   returned a sequence.

Artifacts (the kernel's BIR file the config points to) must outlive compilation of the whole JAX program by
neuronx-cc, so they go to one process-wide directory (``$JAX_NKILIB_ARTIFACTS_DIR``, else a temporary directory
kept until the process exits), one subdirectory per compiled call; NKI's content-hashed cache then keeps the path
(and the HLO text) deterministic.
"""

from __future__ import annotations

import atexit
import itertools
import os
import shutil
import tempfile
import threading
from typing import Any

import numpy as np

from ..framework.spec import CallInfo, KernelSpec
from .compiled import CompiledKernel
from .kernel_arguments import (
    TensorArgument,
    adapter_values,
    call_arguments,
    in_signature_order,
    is_adapter,
    library_values,
    nki_dtype,
)
from .sdk import NkiApiError, import_entry_point, probe

ARTIFACTS_ENV_VAR = "JAX_NKILIB_ARTIFACTS_DIR"

_artifacts_lock = threading.Lock()
_artifacts_root: str | None = None
_artifacts_counter = itertools.count()


def artifacts_dir(kernel: str) -> str:
    """A fresh directory for one kernel compilation that lives as long as the process."""
    global _artifacts_root
    with _artifacts_lock:
        if _artifacts_root is None:
            configured = os.environ.get(ARTIFACTS_ENV_VAR)
            if configured:
                _artifacts_root = os.path.abspath(configured)
            else:
                _artifacts_root = tempfile.mkdtemp(prefix="jax_nkilib_nki_")
                atexit.register(shutil.rmtree, _artifacts_root, ignore_errors=True)
        path = os.path.join(_artifacts_root, f"{next(_artifacts_counter):05d}_{kernel}")
    os.makedirs(path, exist_ok=True)
    return path


def placeholder(argument: TensorArgument):
    """What the NKI frontend receives for a tensor argument: a NumPy array of its shape and dtype (contents never
    read; ``np.empty`` reserves but does not touch the pages), or, for a packed type NumPy cannot hold, an
    ``NkiTensor`` in shared HBM with the NKI dtype (the form vllm-neuron's ``_convert_input`` builds)."""
    if argument.device_dtype is None:
        return np.empty(argument.shape, dtype=argument.dtype)
    nki_tensor = probe("nki.language.tensor", "NkiTensor", f"the {argument.device_dtype} operand `{argument.name}`")
    shared_hbm = probe("nki.language.buffers", "shared_hbm", f"the {argument.device_dtype} operand `{argument.name}`")
    return nki_tensor(
        name=argument.name,
        shape=tuple(argument.shape),
        dtype=nki_dtype(argument.device_dtype, argument.name),
        storage=None,
        buffer=shared_hbm,
    )


def _output_spec(spec) -> tuple[tuple[int, ...], str]:
    dtype = getattr(spec, "dtype", None)
    return tuple(int(d) for d in spec.shape), str(getattr(dtype, "name", dtype))


def kernel_inputs(spec: KernelSpec, call: CallInfo) -> tuple[Any, dict[str, Any], list[str]]:
    """The raw kernel function, the values it is compiled with (by name, in its signature's order) and the names of
    the tensor arguments among them, in that order."""
    entry = import_entry_point(spec.entry_point)
    function = getattr(entry, "func", entry)  # the raw function: CompileKernel's __post_init__ writes to it
    arguments = in_signature_order(function, call_arguments(spec, call), spec.entry_point)
    values = (
        adapter_values(arguments, placeholder)
        if is_adapter(spec)
        else library_values(spec, function, arguments, placeholder)
    )
    return function, values, [name for name, value in arguments.items() if isinstance(value, TensorArgument)]


class NkiCompiler:
    """Compiles the real NKI kernel for the call's shapes through ``nki``'s framework-integration API."""

    name = "nki"

    def compile(self, spec: KernelSpec, call: CallInfo, output_avals) -> CompiledKernel:
        compile_kernel = probe("nki.framework.compiled", "CompileKernel", "compiling kernels")
        compile_kernel_to_nir = probe("nki.framework.compiled", "compile_kernel_to_nir", "compiling kernels")
        function, values, tensors = kernel_inputs(spec, call)
        directory = artifacts_dir(spec.name)
        kernel = compile_kernel(function, lnc=call.lnc, target=call.target, artifacts_dir=directory)
        nir = compile_kernel_to_nir(kernel, inputs=values, compile_opts=self._options(kernel, call, directory))
        framework_config = nir.build_config()
        missing = [
            attr
            for attr in ("backend_config_b64", "output_specs", "operand_output_aliases", "has_collectives")
            if not hasattr(framework_config, attr)
        ]
        if missing:
            raise NkiApiError(f"nki's FrameworkConfig lacks {', '.join(missing)}; this nki version is not supported")
        encoded = framework_config.backend_config_b64
        given = [operand.name for operand in spec.operands if call.avals.get(operand.name) is not None]
        return CompiledKernel(
            backend_config=encoded.decode("ascii") if isinstance(encoded, bytes) else str(encoded),
            output_specs=tuple(_output_spec(s) for s in framework_config.output_specs),
            aliases={int(i): int(o) for i, o in (framework_config.operand_output_aliases or {}).items()},
            has_collectives=bool(framework_config.has_collectives),
            operand_order=tuple(given.index(name) for name in tensors),
            tuple_result=bool(getattr(nir, "is_tuple_return", False)),
        )

    @staticmethod
    def _options(kernel, call: CallInfo, directory: str):
        """The compile options NKI's own ``CompileKernel.compile`` uses (``_compile_opts``, as vllm-neuron takes
        them), or, where an nki release lacks that method, ``CompileOptions`` built as nkipy builds them."""
        own = getattr(kernel, "_compile_opts", None)
        if own is not None:
            return own()
        compile_options = probe("nki.compiler.ncc_driver", "CompileOptions", "compiling kernels")
        return compile_options(
            target=call.target,
            lnc=call.lnc,
            artifacts_dir=directory,
            output_path=os.path.join(directory, "kernel.neff"),
        )
