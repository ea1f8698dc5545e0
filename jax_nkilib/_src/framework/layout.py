"""Layout strings: named dimensions that bind across a kernel's operands.

A layout is a comma-separated list of dimension tokens, e.g. ``"d_head, B, n_heads, S"``. A token is

* a name (``S``): the first operand that uses it binds it, every later use must agree;
* ``name/k`` (``d_head/2``): this dimension times ``k`` must equal ``name``;
* ``k*name`` (``2*D``): this dimension must equal ``k`` times ``name``;
* an integer (``128``): a fixed size;
* ``...``, only as the first token (``"..., H"``): any number (zero or more) of leading dimensions, of any sizes,
  bound to nothing; the named tokens after it match the trailing dimensions. The idiomatic ops declare their JAX
  layouts this way (``x [..., H]``); kernel layouts have fixed ranks.

An operand may accept several layouts of different ranks (``"B, S, D"`` or ``"S, D"``); the rank picks one (the
first layout that fits: a ``...`` layout fits every rank at least the number of its other tokens).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence

_NAME = re.compile(r"^[A-Za-z_]\w*$")
_DIVIDED = re.compile(r"^([A-Za-z_]\w*)/(\d+)$")
_SCALED = re.compile(r"^(\d+)\*([A-Za-z_]\w*)$")


@dataclasses.dataclass(frozen=True)
class Dim:
    """One parsed layout token."""

    text: str
    name: str | None  # the symbol it refers to, if any
    numerator: int = 1  # size * denominator == numerator * symbol
    denominator: int = 1
    fixed: int | None = None

    @property
    def binds(self) -> bool:
        return self.fixed is None and self.numerator == 1 and self.denominator == 1

    def expected(self, dims: Mapping[str, int]) -> int | None:
        """The size this token requires given the bound symbols (None if unbound or not integral)."""
        if self.fixed is not None:
            return self.fixed
        if self.name not in dims:
            return None
        total = self.numerator * dims[self.name]
        return total // self.denominator if total % self.denominator == 0 else None


def parse_dim(token: str) -> Dim:
    token = token.strip()
    if token.isdigit():
        return Dim(token, None, fixed=int(token))
    if _NAME.match(token):
        return Dim(token, token)
    if match := _DIVIDED.match(token):
        return Dim(token, match.group(1), numerator=1, denominator=int(match.group(2)))
    if match := _SCALED.match(token):
        return Dim(token, match.group(2), numerator=int(match.group(1)), denominator=1)
    raise ValueError(f"invalid layout token {token!r}")


ELLIPSIS = "..."


@dataclasses.dataclass(frozen=True)
class Layout:
    text: str
    dims: tuple[Dim, ...]  # the tokens after a leading ``...``, if any
    leading: bool = False  # a leading ``...``: any number of unnamed leading dimensions

    @classmethod
    def parse(cls, text: str) -> Layout:
        tokens = [token.strip() for token in text.split(",")]
        leading = tokens[0] == ELLIPSIS
        if ELLIPSIS in tokens[leading:]:
            raise ValueError(f"invalid layout {text!r}: `...` may only be the first token")
        return cls(text, tuple(parse_dim(token) for token in tokens[leading:]), leading)

    @property
    def rank(self) -> int:
        """The number of named (or fixed) dimensions: the rank, or with a leading ``...`` the least rank."""
        return len(self.dims)

    def fits(self, ndim: int) -> bool:
        """Whether a shape of rank ``ndim`` can have this layout."""
        return ndim >= self.rank if self.leading else ndim == self.rank

    def describe_rank(self) -> str:
        return f">= {self.rank}" if self.leading else str(self.rank)

    def __str__(self) -> str:
        return "[" + ", ".join(([ELLIPSIS] if self.leading else []) + [dim.text for dim in self.dims]) + "]"


class LayoutMismatch(Exception):
    """Raised by :func:`bind_layouts` with the operand name and a human-readable reason."""

    def __init__(self, operand: str, reason: str):
        super().__init__(reason)
        self.operand = operand
        self.reason = reason


def bind_layouts(
    shapes: Sequence[tuple[str, tuple[int, ...], Sequence[Layout]]],
    known: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, Layout]]:
    """Match each operand's shape against its layouts, binding named dimensions.

    ``shapes`` lists ``(operand name, shape, accepted layouts)`` in argument order; ``known`` gives sizes bound
    before any operand (dimensions that static arguments fix). Returns the bound dimension sizes and the layout
    chosen for each operand; raises :class:`LayoutMismatch` naming the first offending operand.
    """
    dims: dict[str, int] = dict(known or {})
    chosen: dict[str, Layout] = {}
    for name, shape, layouts in shapes:
        by_rank = [layout for layout in layouts if layout.fits(len(shape))]
        if not by_rank:
            accepted = " or ".join(str(layout) for layout in layouts)
            ranks = " or ".join(layout.describe_rank() for layout in layouts)
            raise LayoutMismatch(
                name, f"must have layout {accepted} (rank {ranks}); got rank {len(shape)} with shape {tuple(shape)}"
            )
        layout = by_rank[0]
        chosen[name] = layout
        for dim, size in zip(layout.dims, _trailing(layout, shape)):
            if dim.binds and dim.name not in dims:
                dims[dim.name] = int(size)
    for name, shape, _ in shapes:
        layout = chosen[name]
        skipped = len(shape) - layout.rank  # the dimensions a leading ``...`` covers
        for position, (dim, size) in enumerate(zip(layout.dims, _trailing(layout, shape)), skipped):
            expected = dim.expected(dims)
            if expected is None and dim.name is not None and dim.name in dims:
                raise LayoutMismatch(
                    name, f"must have layout {layout}, but {dim.text} is not an integer for {dim.name}={dims[dim.name]}"
                )
            if expected is not None and expected != size:
                context = ", ".join(f"{key}={value}" for key, value in dims.items())
                raise LayoutMismatch(
                    name,
                    f"must have layout {layout}: dimension {position} ({dim.text}) should be "
                    f"{expected} given {context}; got shape {tuple(shape)}",
                )
    return dims, chosen


def _trailing(layout: Layout, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The dimensions of ``shape`` that ``layout``'s tokens name (all but those a leading ``...`` covers)."""
    return tuple(shape[len(shape) - layout.rank :])
