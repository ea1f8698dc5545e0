"""``jax_nkilib.support_matrix()``: what each NKI Library kernel can do here, and the README table made from it.

Run ``python -m jax_nkilib._src.tools.readme README.md`` to rewrite the README's table between its markers; a test
keeps the two equal.
"""

from __future__ import annotations

import dataclasses

from ..framework import registry
from ..sharding.auto import RULES
from .catalog import CATALOG

README_START = "<!-- support-matrix:start -->"
README_END = "<!-- support-matrix:end -->"
NOT_BOUND = "not bound yet"


@dataclasses.dataclass(frozen=True)
class KernelSupport:
    """One kernel's coverage. ``status`` is ``"bound"`` or ``"not bound yet"``; the other fields are empty then."""

    kernel: str
    catalog_row: int
    family: str
    status: str
    layer1: str = ""
    idiomatic: str = ""
    vjp: str = ""
    vmap: str = ""
    shard_map: str = ""
    neuron: str = ""
    notes: str = ""


def _describe_vmap(spec) -> str:
    plans = len(spec.fold_plans)
    if not plans:
        return "lax.map"
    return f"fold into kernel axes ({plans} plan{'s' if plans > 1 else ''}), else lax.map"


def _bound_row(entry, name: str, kernel) -> KernelSupport:
    spec = kernel.spec
    return KernelSupport(
        kernel=name,
        catalog_row=entry.row,
        family=entry.family,
        status="bound",
        layer1=spec.public_name,
        idiomatic=", ".join(f"jax_nkilib.{op}" for op in spec.support.get("idiomatic", "").split(", ") if op),
        vjp=spec.support.get("vjp", "custom_vjp" if kernel.vjp else "not differentiable"),
        vmap=_describe_vmap(spec),
        shard_map=spec.support.get("shard_map", "per-shard (inside jax.shard_map)"),
        neuron="one AwsNeuronCustomNativeKernel call (checked with dry run; not yet run on Trainium)",
        notes=spec.support.get("notes", ""),
    )


def support_matrix() -> list[KernelSupport]:
    """One row per kernel function of the NKI Library catalog, in catalog order."""
    bound = registry.bound_kernels()
    rows = []
    for entry in CATALOG:
        for name in entry.names:
            if name in bound:
                rows.append(_bound_row(entry, name, bound[name]))
            else:
                planned = f" (planned in issue {entry.issue})" if entry.issue else ""
                rows.append(
                    KernelSupport(
                        kernel=name,
                        catalog_row=entry.row,
                        family=entry.family,
                        status=NOT_BOUND + planned,
                        notes=entry.reason,
                    )
                )
    return rows


def markdown_table(rows: list[KernelSupport] | None = None) -> str:
    rows = support_matrix() if rows is None else rows
    bound = [row for row in rows if row.status == "bound"]
    header = [
        "| kernel | row | layer 1 | layer 2 | reverse mode | vmap | shard_map | Neuron | notes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines = [
        f"| `{r.kernel}` | {r.catalog_row} | `{r.layer1}` | {r.idiomatic or '—'} | {r.vjp} | {r.vmap} | "
        f"{r.shard_map} | {r.neuron} | {r.notes} |"
        for r in bound
    ]
    pending = [row for row in rows if row.status != "bound" and not row.notes]
    explained = [row for row in rows if row.status != "bound" and row.notes]
    waiting = (
        "Not bound yet: " + ", ".join(f"`{r.kernel}`" for r in pending) + "."
        if pending
        else "Every other one is explained below."
    )
    summary = f"\n{len(bound)} of {len(rows)} catalog kernels are bound. {waiting}" + "".join(
        f"\n\nNot bound: `{r.kernel}`: {r.notes}." for r in explained
    )
    return "\n".join(header + lines) + "\n" + summary + "\n\n" + sharding_table()


def sharding_table() -> str:
    """The idiomatic ops' automatic sharding (``jax_nkilib._src.sharding.auto``), one row per op."""
    header = [
        'Automatic sharding of the idiomatic ops (explicit mesh axes; see "Sharding" below):',
        "",
        "| op | sharded with no communication | sharded with a collective | notes |",
        "|---|---|---|---|",
    ]
    lines = []
    for name in sorted(RULES):
        rule = RULES[name]
        free = ", ".join(dict.fromkeys(rule.free.values())) or "—"
        collective = "; ".join(f"{dim}: {how}" for dim, how in dict.fromkeys(rule.collective.values())) or "—"
        lines.append(f"| `{name}` | {free} | {collective} | {rule.note or '—'} |")
    return "\n".join(header + lines)


def _section_span(readme_text: str) -> tuple[int, int]:
    start = readme_text.find(README_START)
    end = readme_text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"README has no {README_START} ... {README_END} section")
    return start + len(README_START) + 1, end - 1  # the lines strictly between the markers


def readme_section(readme_text: str) -> str:
    start, end = _section_span(readme_text)
    return readme_text[start:end]


def write_readme(path: str) -> None:
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    start, end = _section_span(text)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text[:start] + markdown_table() + text[end:])
