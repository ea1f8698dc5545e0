"""Spec parts for outputs that a static ``Output`` cannot describe.

* :class:`PlusDim` (``H+4``) and :class:`ProductDim` (``B*S``, splittable along ``B``) — output dimensions derived
  from one or two bound sizes;
* :class:`FormulaDim` — an output dimension computed from bound sizes, e.g. ``B*S`` or ``H/lnc/128`` (products and
  exact quotients of dimension names, int params and integers).
* :class:`ParamLayoutOutput` — an output whose layout text is a function of the static params (e.g. ``[I/d_head, B,
  S, d_head]`` with ``d_head`` a param).
* :class:`SelectedOutputsSpec` — a :class:`KernelSpec` whose present outputs are chosen by a function of the params
  and the present operands (e.g. ``out`` unless a KV cache is written, then ``q, k_cache, v_cache``), with an
  optional public name shown in errors when two specs serve one public function.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .layout import Dim, Layout, parse_dim
from .spec import KernelSpec, Output

_FACTOR = re.compile(r"([*/]?)\s*([A-Za-z_]\w*|\d+)")


@dataclasses.dataclass(frozen=True)
class FormulaDim(Dim):
    """``text`` is ``a*b/c...`` over names and integers; the size is the exact quotient (``None`` if inexact or a
    name is unbound)."""

    def expected(self, dims: Mapping[str, int]) -> int | None:
        numerator, denominator = 1, 1
        for op, factor in _FACTOR.findall(self.text):
            value = int(factor) if factor.isdigit() else dims.get(factor)
            if value is None:
                return None
            if op == "/":
                denominator *= int(value)
            else:
                numerator *= int(value)
        return numerator // denominator if denominator and numerator % denominator == 0 else None


@dataclasses.dataclass(frozen=True)
class PlusDim(Dim):
    """``name+offset``: the bound dimension ``name`` plus a constant."""

    offset: int = 0

    @property
    def binds(self) -> bool:
        return False

    def expected(self, dims: Mapping[str, int]) -> int | None:
        return dims[self.name] + self.offset if self.name in dims else None


@dataclasses.dataclass(frozen=True)
class ProductDim(Dim):
    """``M*N``: the product of the bound dimensions ``M`` (major) and ``N`` (minor), flattened ``M``-major.

    It reports ``name = M`` and ``binds``, so a call split along ``M`` into equal pieces is split along this axis
    too, in order (the Neuron planner concatenates the pieces' outputs along it).
    """

    minor: str = ""

    @property
    def binds(self) -> bool:
        return True

    def expected(self, dims: Mapping[str, int]) -> int | None:
        if self.name in dims and self.minor in dims:
            return dims[self.name] * dims[self.minor]
        return None


def _token(token: str) -> Dim:
    if "+" in token:
        name, offset = token.split("+")
        return PlusDim(token, name.strip(), offset=int(offset))
    parts = [part.strip() for part in token.split("*")]
    if len(parts) == 2 and all(part.isidentifier() for part in parts):
        return ProductDim(token, parts[0], minor=parts[1])
    if token.count("/") > 1 or ("*" in token and not re.fullmatch(r"\d+\*[A-Za-z_]\w*", token)):
        return FormulaDim(token, None)
    return parse_dim(token)


def parse_layout(text: str) -> Layout:
    """Like ``Layout.parse``, with output-only tokens: ``name+k`` (:class:`PlusDim`), ``M*N`` (:class:`ProductDim`,
    splittable along ``M``) and other products/quotients such as ``H/lnc/128`` (:class:`FormulaDim`)."""
    return Layout(text, tuple(_token(token.strip()) for token in text.split(",")))


@dataclasses.dataclass(frozen=True)
class ParamLayoutOutput(Output):
    """An output whose layout text is ``layout_fn(params)`` (see :func:`parse_layout`)."""

    layout_fn: Callable[[Mapping[str, Any]], str] | None = None

    @classmethod
    def from_params(cls, name: str, layout_fn: Callable[[Mapping[str, Any]], str], dtype_of: str,
                    present_if: str | None = None) -> ParamLayoutOutput:
        return cls(name, None, dtype_of, present_if=present_if, layout_fn=layout_fn)

    def layout_for(self, params: Mapping[str, Any]) -> Layout | None:
        return parse_layout(self.layout_fn(params))


@dataclasses.dataclass(frozen=True)
class SelectedOutputsSpec(KernelSpec):
    """A spec whose present outputs are ``outputs[i] for i in select_outputs(params, present)``."""

    select_outputs: Callable[[Mapping[str, Any], Sequence[str]], Sequence[int]] | None = None
    shown_name: str | None = None

    def present_outputs(self, params: Mapping[str, Any], present: Sequence[str]) -> tuple[Output, ...]:
        if self.select_outputs is None:
            return super().present_outputs(params, present)
        return tuple(self.outputs[index] for index in self.select_outputs(params, present))

    @property
    def public_name(self) -> str:
        return f"jax_nkilib.nki.{self.shown_name or self.name}"
