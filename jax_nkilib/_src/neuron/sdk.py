"""What the installed Neuron SDK provides: the ``nki`` framework-integration API, the NKI Library's kernels and the
installed versions.

The ``nki`` names used here were read in NKI's own source (nki >= 0.4, Neuron SDK 2.30+): ``nki/framework/
compiled.py`` (``CompileKernel``, a frozen dataclass around the raw kernel function with ``lnc``, ``target`` and
``artifacts_dir``; ``compile_kernel_to_nir(kernel_func, *, inputs, compile_opts, ...) -> NirResult``), ``nki/
compiler/ncc_driver.py`` (``CompileOptions``; ``NirResult.build_config() -> FrameworkConfig``, ``NirResult.
is_tuple_return``) and ``nki/framework/kernel.py`` (``Kernel.func``); see ``neuron_protocol.md``. The framework API
is young, so every name is probed and a missing one raises :class:`NkiApiError` naming it.

The NKI Library ships inside neuronx-cc as ``nkilib`` or, from its source tree, as ``nkilib_src.nkilib``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from typing import Any

ADAPTER_PACKAGE = "jax_nkilib_kernels."
LIBRARY_PACKAGES = ("nkilib", "nkilib_src.nkilib")  # neuronx-cc's bundle, then the nki-library source tree
DISTRIBUTIONS = ("nki", "neuronx-cc", "nki-library", "libneuronxla", "jax-neuronx")  # nki-library: source installs

INSTALL_HINT = (
    "Lowering jax_nkilib kernels for the `neuron` platform needs the Neuron SDK's `nki` package, which is not "
    "installed. Install `nki`, `neuronx-cc`, `libneuronxla` and `jax-neuronx` from the Neuron SDK's own pip "
    "repository (pip install --extra-index-url https://pip.repos.neuron.amazonaws.com ...; see the README's "
    '"Running on Trainium"): the packages of the same names on PyPI are empty placeholders. To inspect the '
    "lowering without the SDK, use `with jax_nkilib.neuron.dry_run(): ...`."
)


class NeuronSdkMissingError(RuntimeError):
    """Lowering for Neuron was requested but neither the ``nki`` package nor dry run is available."""


class NkiApiError(RuntimeError):
    """The installed ``nki`` package or NKI Library lacks a name jax_nkilib needs (the API is young and moves)."""


def nki_available() -> bool:
    try:
        importlib.import_module("nki")
    except ImportError:
        return False
    return True


def probe(module: str, name: str, needed_for: str) -> Any:
    """``module.name`` from the installed SDK, or :class:`NkiApiError` naming what is missing and why it is needed."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise NkiApiError(
            f"the installed Neuron SDK has no `{module}.{name}` ({err}), which jax_nkilib needs for "
            f"{needed_for}; it supports the framework-integration API of nki >= 0.4 (Neuron SDK "
            f"2.30+). Installed: {describe_versions()}"
        ) from None


def module_candidates(module_name: str) -> list[str]:
    """Where ``module_name`` may be installed: ``nkilib.x`` is also looked up as ``nkilib_src.nkilib.x``."""
    if module_name == "nkilib" or module_name.startswith("nkilib."):
        return [package + module_name[len("nkilib") :] for package in LIBRARY_PACKAGES]
    return [module_name]


def _lookup(entry_point: str) -> tuple[Any, list[str]]:
    """The object named by ``module:attribute`` (library modules under either install name), or ``None`` and why."""
    module_name, _, attribute = entry_point.partition(":")
    errors = []
    for candidate in module_candidates(module_name):
        try:
            return getattr(importlib.import_module(candidate), attribute), []
        except (ImportError, AttributeError) as err:
            errors.append(f"{candidate}:{attribute}: {err}")
    return None, errors


def import_entry_point(entry_point: str):
    """The kernel function named by ``module:attribute``; :class:`NkiApiError` when it cannot be imported."""
    found, errors = _lookup(entry_point)
    if errors:
        raise NkiApiError(
            f"cannot import the kernel entry point {entry_point} ({'; '.join(errors)}). The NKI "
            f"Library ships with neuronx-cc (as `nkilib`) or as the `nki-library` source tree "
            f"(`nkilib_src`). Installed: {describe_versions()}"
        )
    return found


@functools.cache
def entry_point_missing(entry_point: str) -> str | None:
    """Why ``entry_point`` cannot be compiled with the installed SDK (``None`` when it can): its module or function
    is absent (a kernel the installed NKI Library does not ship yet), or, for a device adapter, a library function
    it calls is (see ``jax_nkilib_kernels._library``)."""
    found, errors = _lookup(entry_point)
    if errors:
        return f"the installed NKI Library has no {entry_point} ({'; '.join(errors)})"
    if entry_point.startswith(ADAPTER_PACKAGE):
        from jax_nkilib_kernels._library import missing_dependencies

        missing = missing_dependencies(found)
        if missing:
            return f"the installed NKI Library lacks {', '.join(missing)}, which {entry_point} calls"
    return None


def installed_versions() -> dict[str, str]:
    """Versions of the Neuron SDK distributions that are installed (by distribution name)."""
    versions = {}
    for name in DISTRIBUTIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def describe_versions() -> str:
    versions = installed_versions()
    return ", ".join(f"{name} {version}" for name, version in versions.items()) or "no Neuron SDK distributions"
