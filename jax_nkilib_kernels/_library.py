"""One way for the device adapters to reach NKI Library functions, each looked up on its own.

The library installs as ``nkilib`` (bundled with neuronx-cc) or ``nkilib_src.nkilib`` (its source tree), and a given
release lacks the kernels that came later. ``load("core.attention.attention_tkg", "attention_tkg")`` returns
the library's function, or a :class:`MissingLibraryFunction` standing in for it, so a module of adapters still loads
and its other adapters still compile when one library module is absent. ``missing_dependencies(adapter)`` names the
absent functions an adapter calls; ``NkiCompiler`` checks it first and falls back to the reference, with a warning
naming them, instead of failing inside NKI's tracer.
"""

import importlib

PACKAGES = ("nkilib", "nkilib_src.nkilib")


class MissingLibraryFunction:
    """Stands in for a library function (or class) the installed NKI Library does not have; calling it raises
    ImportError. ``optional`` marks one that an adapter uses only for a newer feature (a flag left at its default
    never reaches it), so its absence does not disable the adapter."""

    def __init__(self, qualified_name: str, reason: str, optional: bool = False):
        self.qualified_name = qualified_name
        self.reason = reason
        self.optional = optional

    def __call__(self, *args, **kwargs):
        raise ImportError(f"the installed NKI Library has no {self.qualified_name} ({self.reason})")

    def __repr__(self) -> str:
        return f"<missing NKI Library function {self.qualified_name}>"


def load(module: str, name: str, *, optional: bool = False):
    """``nkilib.<module>.<name>`` from whichever install of the library is present, or a stand-in naming it."""
    errors = []
    for package in PACKAGES:
        try:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        except (ImportError, AttributeError) as err:
            errors.append(str(err))
    return MissingLibraryFunction(f"nkilib.{module}.{name}", "; ".join(errors), optional)


def body(kernel):
    """The undecorated function of an ``@nki.jit`` kernel, so that an adapter traces it inline."""
    return getattr(kernel, "func", kernel)


def missing_dependencies(adapter) -> list[str]:
    """The absent, required library names that ``adapter`` (an ``@nki.jit`` adapter or its function) uses, directly
    or through the helper functions of its module."""
    func = getattr(adapter, "func", adapter)
    namespace = getattr(func, "__globals__", {})
    missing, seen, pending = [], set(), [func]
    while pending:
        code = getattr(pending.pop(), "__code__", None)
        for name in getattr(code, "co_names", ()):
            value = namespace.get(name)
            if name in seen or value is None:
                continue
            seen.add(name)
            if isinstance(value, MissingLibraryFunction):
                if not value.optional:
                    missing.append(value.qualified_name)
            elif getattr(value, "__globals__", None) is namespace:  # a helper of the same module
                pending.append(value)
    return missing
