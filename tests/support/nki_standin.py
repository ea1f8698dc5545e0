"""A stand-in for the Neuron SDK's ``nki`` package (and the NKI Library functions jax_nkilib calls), for CI.

The real SDK cannot be installed here (it comes only from the Neuron pip repository), so ``NkiCompiler`` is tested
against this stand-in. It mirrors the real classes as NKI's own source has them (nki >= 0.4; read through the
search tool, see ``neuron_protocol.md``), not what jax_nkilib would like them to be:

* ``nki/framework/kernel.py``: ``Kernel`` is a **frozen** dataclass (``func``, ``lnc``, ``schedule``,
  ``address_rotation``, ``barrier_check``, ``_invocation_frame``); ``__post_init__`` rejects an LNC other than 1 or 2;
  ``_bind_args`` binds with ``inspect.signature(self.func).bind`` (``TypeError`` on unknown or missing arguments).
  ``@nki.jit`` returns a ``Kernel``.
* ``nki/framework/compiled.py``: ``CompileKernel(Kernel)`` is frozen, adds ``artifacts_dir``, ``target``...; its
  ``__post_init__`` stores a compile cache on ``self.func`` (so an ``@nki.jit`` object as ``func`` raises
  ``FrozenInstanceError``); ``_compile_opts()`` builds ``CompileOptions`` and disables backend optimizations;
  ``compile(*args, **kwargs) -> (FrameworkConfig, cache_key)``; ``compile_kernel_to_nir(kernel_func, *, inputs,
  compile_opts, frontend=None, enable_cache=True, trace_cache=None) -> NirResult``.
* ``nki/compiler/ncc_driver.py``: ``CompileOptions`` (frozen; targets trn1/trn2/trn3pre/trn3 after normalizing,
  LNC 1 or 2), ``KernelDescriptor``, ``NirResult`` (``is_tuple_return``; ``build_config()`` builds the config dict
  exactly as the real one: ``func_name``, ``platform_target``, ``kernel_format: "bir"``, ``kernel_version``,
  ``klir_binary``, ``grid``, ``has_collectives``, ``mac_count``), ``FrameworkConfig`` (frozen;
  ``backend_config_b64`` is **bytes**). Output specs carry an NKI dtype *name* (a string).
* ``nki.language`` dtypes are names (the SDK's stub declares ``DType = str``); ``nki.language.tensor.NkiTensor``
  and ``nki.language.buffers.shared_hbm`` as vllm-neuron uses them; ``nki.collectives.ReplicaGroup`` takes one list
  of rank lists.

What it cannot do is trace a kernel: the real frontend runs the kernel's body on NKI tensors. The stand-in's
"frontend" checks the inputs the way the real one would receive them (NumPy arrays or ``NkiTensor``, never JAX
objects; the values bind to the kernel's signature) and takes the outputs from an output rule a test registers for
the kernel, written from the catalog's semantics. A rule returns placeholders (``np.empty``/``NkiTensor``); a rule
that returns one of its inputs declares an in-place (aliased) output. A call that passes a ``ReplicaGroup`` counts
as issuing collectives. Stand-in library functions get the signatures recorded in
``tests/neuron/library_signatures.json``.
"""

from __future__ import annotations

import ast
import base64
import enum
import hashlib
import inspect
import json
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

SIGNATURES = json.loads((Path(__file__).parents[1] / "neuron" / "library_signatures.json").read_text())
NKI_DTYPES = (
    "bool_",
    "int8",
    "int16",
    "int32",
    "uint8",
    "uint16",
    "uint32",
    "float16",
    "float32",
    "bfloat16",
    "tfloat32",
    "float8_e4m3",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e5m2_x4",
    "float8_e4m3fn_x4",
    "float8_e8m0fnu",
    "float4_e2m1fn_x4",
)
_NC_VERSION = {"trn1": "gen2", "trn2": "gen3", "trn3pre": "gen4", "trn3": "gen4"}
OutputRule = Callable[..., Any]


# ---------------------------------------------------------------------------------------------- nki.language
@dataclass
class NkiTensor:
    """``nki.language.tensor.NkiTensor`` as vllm-neuron constructs it (name, shape, dtype, storage, buffer)."""

    name: str
    shape: tuple
    dtype: str
    storage: Any = None
    buffer: Any = None


@dataclass
class ReplicaGroup:
    """``nki.collectives.ReplicaGroup``: one positional list of rank lists (stored as ``_value``)."""

    _value: list


# ---------------------------------------------------------------------------------------- nki.compiler.ncc_driver
@dataclass(frozen=True)
class CompileOptions:
    target: str = "trn1"
    lnc: int = 1
    artifacts_dir: str | None = None
    output_path: str = "file.neff"
    nki_opt_pipeline_options: tuple = ()
    emit_reg_compute_as_affine_expr: bool = False
    address_rotation: bool = True
    enable_barrier_checker: bool = False

    def __post_init__(self):
        canonical = {"inf2": "trn1", "gen2": "trn1", "gen3": "trn2", "gen4": "trn3"}.get(self.target, self.target)
        object.__setattr__(self, "target", canonical)
        if self.target not in ("trn1", "trn2", "trn3pre", "trn3"):
            raise ValueError(f"Invalid target: {self.target}. Must be 'trn1', 'inf2', 'trn2', or 'trn3'")
        if self.lnc not in (1, 2):
            raise ValueError(f"lnc must be 1 or 2, got {self.lnc}")

    def disable_backend_optimizations(self) -> CompileOptions:
        options = replace(
            self,
            nki_opt_pipeline_options=self.nki_opt_pipeline_options
            + ("enable-linear-scan-allocation=false", "enable-instruction-scheduling=false"),
        )
        return replace(options, emit_reg_compute_as_affine_expr=True)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple
    dtype: str
    element_size_bytes: int = 0


@dataclass(frozen=True)
class KernelDescriptor:
    kernel_json_path: str
    input_specs: tuple
    output_specs: tuple
    version: str
    func_name: str
    kernel_format: str = "bir"
    aliases: tuple = ()


@dataclass(frozen=True)
class FrameworkConfig:
    backend_config: dict
    backend_config_b64: bytes
    output_specs: tuple
    operand_output_aliases: dict
    has_collectives: bool


@dataclass(eq=False)
class NirResult:
    descriptor: KernelDescriptor
    sg00_dir: str
    work_dir: str
    mlir_time: float
    is_tuple_return: bool = False
    has_collectives: bool = False
    mac_count: int = 0
    cache_hash: str = ""
    lnc: int = 1
    target: str = ""

    def build_config(self) -> FrameworkConfig:
        backend_config = {
            "func_name": self.descriptor.func_name,
            "platform_target": _NC_VERSION[self.target],
            "kernel_format": self.descriptor.kernel_format,
            "kernel_version": 1,
            "klir_binary": {
                "binary": self.descriptor.kernel_json_path,
                "input_names": [s.name for s in self.descriptor.input_specs],
                "output_names": [s.name for s in self.descriptor.output_specs],
                "version_identifier": "",
                "aliases": [list(pair) for pair in self.descriptor.aliases],
            },
            "grid": self.lnc,
            "has_collectives": self.has_collectives,
            "mac_count": self.mac_count,
        }
        return FrameworkConfig(
            backend_config=backend_config,
            backend_config_b64=base64.b64encode(json.dumps(backend_config).encode()),
            output_specs=tuple(self.descriptor.output_specs),
            operand_output_aliases={i: o for i, o in self.descriptor.aliases},
            has_collectives=self.has_collectives,
        )


# ------------------------------------------------------------------------------------------ nki.framework
@dataclass(frozen=True)
class Kernel:
    func: Callable
    lnc: int = 1
    schedule: tuple = ()
    address_rotation: bool = True
    barrier_check: bool = False
    _invocation_frame: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.lnc not in (1, 2):
            raise ValueError(f"NKI only supports LNC 1 or 2, but got {self.lnc}")
        object.__setattr__(self, "__wrapped__", self.func)
        object.__setattr__(self, "__doc__", self.func.__doc__)

    def __getitem__(self, lnc):
        return replace(self, lnc=lnc)

    @property
    def __name__(self):
        return self.func.__name__

    def _bind_args(self, args, kwargs):
        return inspect.signature(self.func).bind(*args, **kwargs).arguments

    def _to_subclass(self, cls, **kwargs):
        k_fields = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "func"}
        k_fields.update(kwargs)
        return cls(self.func, **k_fields)


def jit(func=None, **options):
    """``@nki.jit`` / ``@nki.jit(mode=...)``: a :class:`Kernel` around the function."""
    if func is None:
        return lambda f: Kernel(f)
    return Kernel(func)


class StandIn:
    """The stand-in SDK's state: output rules by kernel name, and every compilation it was asked for."""

    def __init__(self):
        self.rules: dict[str, OutputRule] = {}
        self.compilations: list[dict] = []
        self.artifacts: list[str] = []

    def rule(self, name: str, outputs: OutputRule) -> None:
        self.rules[name] = outputs

    # -------------------------------------------------------------- compile_kernel_to_nir, the only entry point
    def compile_kernel_to_nir(
        self, kernel_func, *, inputs, compile_opts, frontend=None, enable_cache=True, trace_cache=None
    ) -> NirResult:
        func = getattr(kernel_func, "func", kernel_func)
        name = func.__name__
        inspect.signature(func).bind(**inputs)  # the real frontend binds the inputs to the kernel's parameters
        tensors = []
        for arg_name, value in inputs.items():
            kind = type(value).__module__ + "." + type(value).__qualname__
            if kind.startswith(("jax.", "jaxlib.")):
                raise TypeError(
                    f"{name}: input `{arg_name}` is a {kind}; NKI's frontend takes NumPy arrays or NKI tensors"
                )
            if isinstance(value, (np.ndarray, NkiTensor)):
                tensors.append((arg_name, value))
        if name not in self.rules:
            raise NotImplementedError(f"the stand-in NKI cannot trace {name}: register an output rule for it")
        result = self.rules[name](**inputs)
        is_tuple = isinstance(result, (list, tuple))
        outputs = list(result) if is_tuple else [result]
        aliases = tuple(
            (index, out_index)
            for out_index, out in enumerate(outputs)
            for index, (_, value) in enumerate(tensors)
            if out is value
        )
        descriptor = KernelDescriptor(
            kernel_json_path=os.path.join(compile_opts.artifacts_dir or "", f"{name}.json"),
            input_specs=tuple(TensorSpec(n, tuple(v.shape), _dtype_name(v.dtype)) for n, v in tensors),
            output_specs=tuple(
                TensorSpec(f"output_{i}", tuple(o.shape), _dtype_name(o.dtype)) for i, o in enumerate(outputs)
            ),
            version="0.4.0-standin",
            func_name=name,
            aliases=aliases,
        )
        has_collectives = any(isinstance(value, ReplicaGroup) for value in inputs.values())
        self.compilations.append({"func": func, "inputs": dict(inputs), "options": compile_opts, "kernel": kernel_func})
        key = hashlib.sha256(repr((name, [(n, v.shape, str(v.dtype)) for n, v in tensors])).encode()).hexdigest()
        return NirResult(
            descriptor=descriptor,
            sg00_dir="",
            work_dir=compile_opts.artifacts_dir or "",
            mlir_time=0.0,
            is_tuple_return=is_tuple,
            has_collectives=has_collectives,
            cache_hash=key,
            lnc=compile_opts.lnc,
            target=compile_opts.target,
        )

    def compile_kernel_class(self):
        standin = self

        @dataclass(frozen=True)
        class CompileKernel(Kernel):
            artifacts_dir: str = ""
            target: str | None = None
            _enable_backend_opt: bool = False

            def __post_init__(self):
                super().__post_init__()
                if not hasattr(self.func, "_nki_compile_cache"):
                    self.func._nki_compile_cache = {}  # FrozenInstanceError when func is an @nki.jit Kernel

            def _compile_opts(self):
                options = CompileOptions(
                    target=self.target or "trn3",
                    lnc=self.lnc,
                    artifacts_dir=self.artifacts_dir,
                    output_path="kernel.neff",
                    address_rotation=self.address_rotation,
                    enable_barrier_checker=self.barrier_check,
                )
                return options if self._enable_backend_opt else options.disable_backend_optimizations()

            def compile(self, *args, **kwargs):
                inputs = dict(self._bind_args(args, kwargs))
                nir = standin.compile_kernel_to_nir(self, inputs=inputs, compile_opts=self._compile_opts())
                return nir.build_config(), nir.cache_hash

        return CompileKernel


def _dtype_name(dtype) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


# ------------------------------------------------------------------------------- stand-in library functions
ENUMS = {
    name: enum.Enum(name, [(member, index) for index, member in enumerate(record["members"])])
    for name, record in SIGNATURES["enums"].items()
}  # the stand-in library's own enum classes


def recorded_signature(entry_point: str) -> inspect.Signature:
    """The signature ``tests/neuron/library_signatures.json`` records for a library function (enum-annotated
    parameters annotated with the stand-in library's enum class, as the real source annotates them)."""
    kinds = {
        "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
        "keyword_only": inspect.Parameter.KEYWORD_ONLY,
        "positional_only": inspect.Parameter.POSITIONAL_ONLY,
        "var_positional": inspect.Parameter.VAR_POSITIONAL,
        "var_keyword": inspect.Parameter.VAR_KEYWORD,
    }
    parameters = []
    for p in SIGNATURES["functions"][entry_point]["parameters"]:
        default = inspect.Parameter.empty if p["required"] else _literal(p["default"])
        annotation = ENUMS.get(p.get("annotation"), inspect.Parameter.empty)
        parameters.append(inspect.Parameter(p["name"], kinds[p["kind"]], default=default, annotation=annotation))
    return inspect.Signature(parameters)


def _literal(text):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return f"<{text}>"  # an enum member or expression default: a value the stand-in never compares


def library_function(entry_point: str):
    """A stand-in library kernel with the recorded signature (``@nki.jit`` where the library decorates it);
    calling its body is a test error."""
    name = entry_point.rsplit(":", 1)[1]

    def body(*args, **kwargs):
        raise AssertionError(f"the stand-in never runs {name}'s body")

    body.__name__ = body.__qualname__ = name
    body.__signature__ = recorded_signature(entry_point)
    decorated = SIGNATURES["functions"][entry_point].get("decorator")
    return jit(body) if decorated else body


def library_class(entry_point: str):
    """A stand-in library class (a config or argument object) whose constructor has the recorded signature."""
    record = SIGNATURES["classes"][entry_point]
    parameters = [
        inspect.Parameter(
            p["name"],
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=inspect.Parameter.empty if p["required"] else _literal(p["default"]),
        )
        for p in record["parameters"]
    ]
    signature = inspect.Signature(parameters)

    def __init__(self, *args, **kwargs):
        self.arguments = dict(signature.bind(*args, **kwargs).arguments)

    return type(entry_point.rsplit(":", 1)[1], (), {"__init__": __init__})


def install(monkeypatch, standin: StandIn, library: dict[str, Any] = ()) -> None:
    """Put the stand-in ``nki`` package (and stand-in library modules: ``{entry point: function}``) in
    ``sys.modules`` for the duration of a test; the test's ``StandIn`` records what was compiled."""
    modules: dict[str, types.ModuleType] = {}

    def module(name: str) -> types.ModuleType:
        if name not in modules:
            modules[name] = types.ModuleType(name)
            modules[name].__path__ = []  # a package, so submodules import
            parent, _, child = name.rpartition(".")
            if parent:
                setattr(module(parent), child, modules[name])
        return modules[name]

    nki = module("nki")
    nki.jit = jit
    language = module("nki.language")
    for dtype in NKI_DTYPES:
        setattr(language, dtype, dtype)
    module("nki.language.tensor").NkiTensor = NkiTensor
    module("nki.language.buffers").shared_hbm = "shared_hbm"
    language.shared_hbm = "shared_hbm"
    module("nki.isa")
    module("nki.collectives").ReplicaGroup = ReplicaGroup
    module("nki.framework.kernel").Kernel = Kernel
    compiled = module("nki.framework.compiled")
    compiled.CompileKernel = standin.compile_kernel_class()
    compiled.compile_kernel_to_nir = standin.compile_kernel_to_nir
    driver = module("nki.compiler.ncc_driver")
    driver.CompileOptions, driver.FrameworkConfig, driver.NirResult = CompileOptions, FrameworkConfig, NirResult
    driver.KernelDescriptor = KernelDescriptor
    for name, cls in ENUMS.items():
        setattr(module(SIGNATURES["enums"][name]["module"]), name, cls)
    for entry_point, function in dict(library).items():
        module_name, _, attribute = entry_point.partition(":")
        setattr(module(module_name), attribute, function)
    for name in [n for n in sys.modules if n == "nki" or n.startswith(("nki.", "nkilib", "jax_nkilib_kernels"))]:
        monkeypatch.delitem(sys.modules, name)
    for name, value in modules.items():
        monkeypatch.setitem(sys.modules, name, value)
    from jax_nkilib._src.neuron import sdk

    sdk.entry_point_missing.cache_clear()
    monkeypatch.setattr(sdk, "installed_versions", lambda: {"nki": "0.4.0 (stand-in)"})
