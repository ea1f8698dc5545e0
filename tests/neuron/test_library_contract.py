"""The contract between jax_nkilib's specs and the NKI Library functions they bind, checked against a recorded table.

``library_signatures.json`` holds the real signature of every NKI Library function jax_nkilib calls (names, order,
required ones, defaults), read from nki-library's source (tag 2.29) or, for kernels that came later, the NKI Library
API reference (aws-neuron-sdk, describing 2.32); each entry names its source. A spec bound straight to a library
function must hand it only names it takes, every name it requires, tensors in its order and its defaults; a device
adapter must call library functions (and construct library classes) with arguments their signatures accept.
"""

import ast
import inspect
import json
from pathlib import Path

import numpy as np
import pytest

import jax_nkilib.nki  # noqa: F401  (binds every kernel)
from jax_nkilib._src.framework.registry import bound_kernels
from jax_nkilib._src.framework.spec import DTYPE_KINDS, FOLLOW_LNC
from jax_nkilib._src.neuron.kernel_arguments import forwarded_params

TABLE = json.loads((Path(__file__).parent / "library_signatures.json").read_text())
KERNELS = Path(__file__).parents[2] / "jax_nkilib_kernels"
LIBRARY_SPECS = sorted(
    (kernel.spec for kernel in bound_kernels().values() if kernel.spec.entry_point.startswith("nkilib.")),
    key=lambda spec: spec.name,
)


def signature(entry_point: str) -> list[dict]:
    assert entry_point in TABLE["functions"], f"record the signature of {entry_point} in library_signatures.json"
    return TABLE["functions"][entry_point]["parameters"]


def default_text(value) -> str:
    """A spec default as the library writes it in source (``ActFnType.SiLU``, ``1e-06``, ``None``)."""
    if hasattr(value, "name") and hasattr(type(value), "__members__"):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


def same_default(param, library_default: str) -> bool:
    spec_default = param.default
    if spec_default is FOLLOW_LNC:
        return True  # resolved from the LNC degree and always passed
    if param.kind in DTYPE_KINDS and spec_default is not None:  # nl.float32; a packed x4 format by its element
        suffix = "_x4" if param.kind == "dtype-x4" else ""
        return f"nl.{np.dtype(spec_default).name}{suffix}" == library_default
    try:
        return spec_default == ast.literal_eval(library_default)
    except (ValueError, SyntaxError):
        return default_text(spec_default) == library_default or repr(spec_default).strip("'\"") == library_default


@pytest.mark.parametrize("spec", LIBRARY_SPECS, ids=lambda spec: spec.name)
def test_spec_hands_the_library_function_only_what_it_takes(spec):
    params = {p["name"]: p for p in signature(spec.entry_point)}
    forwarded = [operand.name for operand in spec.operands] + [param.name for param in forwarded_params(spec)]
    unknown = [name for name in forwarded if name not in params]
    assert not unknown, f"{spec.name} passes {unknown}, which {spec.entry_point} does not take"


@pytest.mark.parametrize("spec", LIBRARY_SPECS, ids=lambda spec: spec.name)
def test_spec_gives_every_required_argument(spec):
    operands = {operand.name: operand for operand in spec.operands}
    params = {param.name: param for param in forwarded_params(spec)}
    for p in signature(spec.entry_point):
        if not p["required"]:
            continue
        if p["name"] in operands:
            assert not operands[p["name"]].optional, f"{spec.name}: `{p['name']}` is required by the kernel"
        else:
            assert p["name"] in params, f"{spec.name} never passes `{p['name']}`, which the kernel requires"
            param = params[p["name"]]
            assert param.required or param.default is not None, (
                f"{spec.name}: `{p['name']}` is required by the kernel: declare Param(..., required=True)"
            )


@pytest.mark.parametrize("spec", LIBRARY_SPECS, ids=lambda spec: spec.name)
def test_tensors_and_flags_in_the_kernels_order(spec):
    order = [p["name"] for p in signature(spec.entry_point)]
    operands = [operand.name for operand in spec.operands]
    assert operands == sorted(operands, key=order.index), f"{spec.name}: operands out of the kernel's order"
    params = [param.name for param in forwarded_params(spec)]
    assert params == sorted(params, key=order.index), f"{spec.name}: params out of the kernel's order"


@pytest.mark.parametrize("spec", LIBRARY_SPECS, ids=lambda spec: spec.name)
def test_defaults_are_the_kernels(spec):
    library = {p["name"]: p for p in signature(spec.entry_point)}
    for operand in spec.operands:
        if operand.optional:
            assert library[operand.name]["default"] == "None", f"{spec.name}: `{operand.name}` is optional here"
    for param in forwarded_params(spec):
        record = library[param.name]
        if record["required"]:
            continue
        assert same_default(param, record["default"]), (
            f"{spec.name}: `{param.name}` defaults to {param.default!r}, the kernel to {record['default']}"
        )


def test_every_library_kernel_is_covered():
    assert len(LIBRARY_SPECS) >= 20
    entries = {spec.entry_point for spec in LIBRARY_SPECS}
    assert entries <= set(TABLE["functions"])
    for entry in entries:
        record = TABLE["functions"][entry]
        assert record["source"] in TABLE["sources"], f"{entry}: its source is not described"


# ------------------------------------------------------------------------------------------- adapters' calls
def adapter_calls():
    """``(file, line, library entry, call node)`` for every call an adapter module makes to a name it loads with
    ``load(module, name)``."""
    found = []
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        loaded = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
                call = node.value
                if isinstance(call.func, ast.Name) and call.func.id == "body" and call.args:
                    call = call.args[0]  # name = body(load(...))
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "load":
                    module, name = (arg.value for arg in call.args[:2])
                    loaded[node.targets[0].id] = f"nkilib.{module}:{name}"
        aliases = {}
        for node in ast.walk(tree):  # local aliases of a loaded name: f = body(_library_x)
            if (
                isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and isinstance(node.targets[0], ast.Name)
            ):
                inner = node.value.args[0] if node.value.args else None
                if getattr(node.value.func, "id", None) == "body" and getattr(inner, "id", None) in loaded:
                    aliases[node.targets[0].id] = loaded[inner.id]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            target = node.func
            if isinstance(target, ast.Call) and getattr(target.func, "id", None) == "body":
                target = target.args[0]  # body(_library_x)(...)
            name = getattr(target, "id", None)
            entry = loaded.get(name) or aliases.get(name)
            if entry:
                found.append((path.name, node.lineno, entry, node))
    return found


CALLS = adapter_calls()


def recorded(entry: str) -> list[dict]:
    record = TABLE["functions"].get(entry) or TABLE["classes"].get(entry)
    assert record is not None, f"record the signature of {entry} in library_signatures.json"
    return record.get("parameters") or record.get("fields")


@pytest.mark.parametrize("call", CALLS, ids=lambda c: f"{c[0]}:{c[1]}:{c[2].rsplit(':', 1)[1]}")
def test_adapter_calls_match_the_library(call):
    _, _, entry, node = call
    params = recorded(entry)
    names = [p["name"] for p in params]
    positional = [
        p["name"] for p in params if p["kind"] in ("positional_or_keyword", "positional_only", "dataclass_field")
    ]
    has_var_keyword = any(p["kind"] == "var_keyword" for p in params)
    assert len(node.args) <= len(positional) or any(p["kind"] == "var_positional" for p in params), (
        f"{entry} takes {len(positional)} positional arguments; the adapter passes {len(node.args)}"
    )
    keywords = [k.arg for k in node.keywords if k.arg is not None]
    unknown = [k for k in keywords if k not in names]
    assert has_var_keyword or not unknown, f"{entry} takes no argument {unknown}"
    given = set(positional[: len(node.args)]) | set(keywords)
    splats = any(k.arg is None for k in node.keywords) or any(isinstance(a, ast.Starred) for a in node.args)
    missing = [p["name"] for p in params if p["required"] and p["name"] not in given]
    assert splats or not missing, f"{entry} requires {missing}, which the adapter does not pass"


def test_adapter_calls_are_found():
    entries = {entry for _, _, entry, _ in CALLS}
    for expected in (
        "nkilib.core.utils.allocator:SbufManager",
        "nkilib.core.attention.attention_tkg:attention_tkg",
        "nkilib.core.rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel",
        "nkilib.experimental.collectives.batch_shard:attn_q_batch_shard",
    ):
        assert expected in entries


def test_recorded_signatures_bind_like_python():
    """The table's own consistency: required parameters first among positional ones, names unique."""
    for entry, record in list(TABLE["functions"].items()) + list(TABLE["classes"].items()):
        params = record.get("parameters") or record.get("fields")
        names = [p["name"] for p in params]
        assert len(names) == len(set(names)), entry
        kinds = {
            "positional_or_keyword": inspect.Parameter.POSITIONAL_OR_KEYWORD,
            "keyword_only": inspect.Parameter.KEYWORD_ONLY,
            "dataclass_field": inspect.Parameter.KEYWORD_ONLY,
            "positional_only": inspect.Parameter.POSITIONAL_ONLY,
            "var_positional": inspect.Parameter.VAR_POSITIONAL,
            "var_keyword": inspect.Parameter.VAR_KEYWORD,
        }
        inspect.Signature(
            [
                inspect.Parameter(
                    p["name"], kinds[p["kind"]], default=inspect.Parameter.empty if p["required"] else None
                )
                for p in params
            ]
        )
