"""Automatic sharding of the idiomatic ops: each op plans its own ``jax.shard_map`` from its inputs' shardings.

Under an explicit mesh (``jax.make_mesh(..., axis_types=(AxisType.Explicit, ...))`` and ``jax.set_mesh``), an array's
type carries its sharding (``jax.typeof(x).sharding.spec``). An op names each dimension of each operand with a
letter (``"bsnd"`` for ``[batch, seq, heads, head_dim]``) and declares which letters may be sharded:

* **free** letters (batch, heads, tokens): every device computes on its shards with no communication. Operands that
  share a letter are split the same way (a replicated operand is sliced locally, which needs no collective);
* **collective** letters (a contraction dimension, the sequence axis of attention): the op's body receives the mesh
  axes and runs the matching collective algorithm (an all-reduce after a row-parallel matmul, ring attention);
* anything else raises a ``ValueError`` naming the operand, the dimension and the mesh axis.

The plan's body runs inside ``jax.shard_map`` over the mesh axes that split its operands, where the op sees local
shards and plain (manual) types for them, so calling the op again from the body computes on the shards: there the
operands are split over no explicit axis (other mesh axes may stay explicit), so it plans nothing and each op call
is one manual computation. Ops called inside a user's ``shard_map`` (every axis manual) see no explicit axes and
run unchanged. Inside ``jax.vmap`` over an explicitly split axis the op runs with that axis Auto (see
``Plan._run_unmapped``). Under an auto mesh (``AxisType.Auto``: the default of ``jax.sharding.Mesh``, while
``jax.make_mesh`` makes Explicit axes in JAX 0.10) the sharding is not visible while tracing, so the op computes
globally; on Neuron a custom call cannot be partitioned (see ``neuron_protocol.md``), so wrap the op in
``jax.shard_map`` or use explicit axes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from ..framework import compat


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    """How an idiomatic op may be sharded (also the op's entry in the README's sharding table).

    Attributes:
      op: public name, e.g. ``"jax_nkilib.rope"``.
      free: letter -> dimension name, for dimensions that shard with no communication.
      collective: letter -> (dimension name, what the op does when it is sharded).
      granule: letter -> the multiple a shard's size must have along that dimension (e.g. MX blocks of 32).
      note: anything else a user should know (shown in the table).
      shared: letter -> letters whose mesh axes it may also split (the op's body handles that: MoE experts split
        over the mesh axis that splits the tokens, an all-to-all dispatch); otherwise a mesh axis splits one letter.
    """

    op: str
    free: Mapping[str, str]
    collective: Mapping[str, tuple[str, str]] = dataclasses.field(default_factory=dict)
    granule: Mapping[str, int] = dataclasses.field(default_factory=dict)
    note: str = ""
    shared: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def may_share(self, a: str, b: str) -> bool:
        """Whether one mesh axis may split both letters ``a`` and ``b``."""
        return b in self.shared.get(a, "") or a in self.shared.get(b, "")

    def dimension_name(self, letter: str) -> str:
        if letter in self.free:
            return self.free[letter]
        if letter in self.collective:
            return self.collective[letter][0]
        return _OTHER_NAMES.get(letter, f"dimension '{letter}'")


LEADING = {str(i): "leading axes" for i in range(10)}  # letters for an op's arbitrary leading (batch) axes


def leading(count: int, op: str | None = None, operand: str = "x") -> str:
    """Letters for ``count`` leading batch-like axes (``"0"``, ``"1"``, ...); ``op`` and ``operand`` name the
    caller in the error for too many."""
    if count > len(LEADING):
        where = f"{op}: `{operand}` has" if op else "got"
        raise ValueError(
            f"{where} {count} leading axes; at most {len(LEADING)} are supported (reshape the leading axes together)"
        )
    return "".join(map(str, range(count)))


_OTHER_NAMES = {
    "d": "head_dim",
    "h": "hidden",
    "k": "contraction",
    "c": "cache length",
    "e": "features",
    "v": "vocabulary",
    "f": "fused q|k|v columns (pass w as (w_q, w_k, w_v) to shard the heads)",
}
RULES: dict[str, ShardingRule] = {}


def register_rule(rule: ShardingRule) -> ShardingRule:
    RULES[rule.op] = rule
    return rule


@dataclasses.dataclass(frozen=True)
class ShardedArgument:
    """An argument of an idiomatic op, for the sharding planner: ``value`` (an array, ``None`` or a pytree of
    arrays) and ``dims``, one letter per axis (``None``: every leaf must be replicated; a letter ``'_'`` names an
    axis that never shards). For a tuple ``value``, ``dims`` may be a tuple giving each element's dims."""

    name: str
    value: Any
    dims: str | tuple | None = None

    def leaves(self) -> list[tuple[str, Any, str | None]]:
        """``(label, leaf, dims)`` for every array leaf."""
        split = isinstance(self.dims, tuple) and self.value is not None
        parts = tuple(zip(self.value, self.dims)) if split else ((self.value, self.dims),)
        found = []
        for index, (value, dims) in enumerate(parts):
            prefix = self.name + (f"[{index}]" if split else "")
            for path, leaf in jax.tree.flatten_with_path(value)[0]:
                found.append((prefix + jax.tree_util.keystr(path), leaf, dims))
        return found


def _explicit_axes(x) -> tuple[Any, tuple] | None:
    """``(mesh, per-dimension mesh axes)`` for an array sharded over explicit axes, else ``None``."""
    if not hasattr(x, "ndim"):
        return None
    try:
        sharding = jax.typeof(x).sharding
    except (AttributeError, TypeError):
        return None
    if not isinstance(sharding, NamedSharding):
        return None
    mesh = sharding.mesh
    explicit = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind == AxisType.Explicit}
    if not explicit:
        return None
    entries = tuple(sharding.spec) + (None,) * (x.ndim - len(sharding.spec))
    axes = tuple(
        () if e is None else tuple(a for a in ((e,) if isinstance(e, str) else e) if a in explicit) for e in entries
    )
    return mesh, axes


@dataclasses.dataclass(frozen=True)
class Plan:
    """A planned ``shard_map``: ``axes`` maps each sharded letter to its mesh axes.

    Inside a ``jax.vmap`` over explicit mesh axes (``mapped``), the plan is instead to run the op on whole values
    with those axes made Auto (``jax.sharding.auto_axes``), where it plans again: ``axes`` is then empty (the body
    sees whole values) and ``split`` holds the split the outputs keep.
    """

    rule: ShardingRule
    mesh: Any
    axes: Mapping[str, tuple[str, ...]]
    operands: tuple[ShardedArgument, ...]
    mapped: tuple[str, ...] = ()
    split: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def spec(self, dims: str | None) -> P:
        if dims is None:
            return P()
        return P(*[spec_entry(self.axes.get(letter, ())) for letter in dims])

    def axis_size(self, letter: str) -> int:
        size = 1
        for name in self.axes.get(letter, ()):
            size *= self.mesh.shape[name]
        return size

    def run(self, body: Callable[..., Any], out_dims) -> Any:
        """Run ``body(*operand values, axes=self.axes)`` on local shards; ``out_dims`` is a pytree of dims strings
        (or ``None`` for replicated outputs) matching the body's result."""
        leaves, treedefs, in_specs = [], [], []
        for operand in self.operands:
            flat = operand.leaves()
            treedefs.append((jax.tree.structure(operand.value), len(flat)))
            leaves.extend(leaf for _, leaf, _ in flat)
            in_specs.extend(self.spec(dims) for _, _, dims in flat)

        def local(*local_leaves):
            values, start = [], 0
            for treedef, count in treedefs:
                values.append(jax.tree.unflatten(treedef, local_leaves[start : start + count]))
                start += count
            return body(*values, axes=self.axes)

        if self.mapped:
            return self._run_unmapped(local, leaves, out_dims)
        out_specs = jax.tree.map(self.spec, out_dims, is_leaf=lambda d: d is None or isinstance(d, str))
        used = {name for mesh_axes in self.axes.values() for name in mesh_axes}  # other explicit axes stay explicit
        # a replicated operand of a split dimension is sliced locally (no communication)
        leaves = [
            jax.sharding.reshard(leaf, NamedSharding(self.mesh, spec)) if _needs_reshard(leaf, spec) else leaf
            for leaf, spec in zip(leaves, in_specs)
        ]
        sharded = jax.shard_map(local, mesh=self.mesh, in_specs=tuple(in_specs), out_specs=out_specs, axis_names=used)
        try:
            return sharded(*leaves)
        except ValueError as err:
            if "`vma`" not in str(err) or compat.shard_map_batches_explicit_axes():
                raise
            raise NotImplementedError(
                f"jax_nkilib: jax.vmap over an axis that is split over an explicit mesh axis needs jax>=0.8 (JAX "
                f"{jax.__version__} cannot vmap the jax.shard_map this op plans); replicate the mapped axis first "
                "(jax.sharding.reshard) or map over an unsharded axis."
            ) from err

    def _run_unmapped(self, local: Callable[..., Any], leaves: list, out_dims) -> Any:
        """Run ``local`` (the body, with no axes) on whole values with the vmapped axes Auto.

        JAX cannot do what a plan does to an axis that an enclosing ``jax.vmap`` maps over: ``jax.shard_map`` may
        not name it, and the op's own unsharded computation meets JAX's sharding-in-types rules for that axis
        (e.g. a reshape merging it with other axes is rejected). With the axis Auto the type rules no longer apply
        and XLA partitions the computation (on Neuron a kernel call is not partitioned, so the mapped axis is
        gathered for it, as the README says); the op plans again inside over the axes that stay explicit. It runs
        under ``jax.jit``: an eager ``jax.shard_map`` inside ``auto_axes`` under ``vmap`` rejects its inputs.
        """
        # on the context mesh (auto_axes wants the two equal), else on the operands' (jit sets no context mesh)
        placed = (
            (lambda spec: spec)
            if not jax.sharding.get_abstract_mesh().empty
            else (lambda spec: NamedSharding(self.mesh, spec))
        )
        split = dataclasses.replace(self, axes=self.split)
        out_sharding = jax.tree.map(
            lambda dims: placed(split.spec(dims)), out_dims, is_leaf=lambda d: d is None or isinstance(d, str)
        )
        return jax.jit(jax.sharding.auto_axes(local, axes=self.mapped, out_sharding=out_sharding))(*leaves)


def _needs_reshard(leaf, spec: P) -> bool:
    found = _explicit_axes(leaf)
    current = () if found is None else tuple(spec_entry(axes) for axes in found[1])
    wanted = tuple(spec) + (None,) * (len(current) - len(spec))
    return current != wanted[: len(current)] if current else any(entry is not None for entry in spec)


def spec_entry(axes: tuple[str, ...]):
    """A PartitionSpec entry for mesh axes: ``None``, one name, or a tuple of names."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def plan(
    rule: ShardingRule, operands: Sequence[ShardedArgument], *, granule: Mapping[str, int] | None = None
) -> Plan | None:
    """The ``shard_map`` plan for these operands, or ``None`` when nothing is sharded over explicit mesh axes (and
    no enclosing ``jax.vmap`` maps over one: then the plan runs the op with those axes Auto, see :class:`Plan`).

    Raises ``ValueError`` when a dimension the rule does not allow is sharded, when operands split one dimension
    over different mesh axes, when one mesh axis splits two dimensions, or when a shard's size is not a multiple of
    what the op needs (``granule`` overrides the rule's multiples for this call).
    """
    granule = {**rule.granule, **(granule or {})}
    where = rule.op
    mesh, axes, owner = None, {}, {}
    for operand in operands:
        for label, leaf, dims in operand.leaves():
            found = _explicit_axes(leaf)
            if found is None:
                continue
            leaf_mesh, leaf_axes = found
            if mesh is None:
                mesh = leaf_mesh
            elif leaf_mesh != mesh:
                raise ValueError(f"{where}: operands are placed on different meshes ({mesh} and {leaf_mesh})")
            for position, mesh_axes in enumerate(leaf_axes):
                if not mesh_axes:
                    continue
                letter = None if dims is None else dims[position]
                if letter is None or letter == "_" or (letter not in rule.free and letter not in rule.collective):
                    name = "this dimension" if letter in (None, "_") else rule.dimension_name(letter)
                    raise ValueError(
                        f"{where}: `{label}` is sharded along axis {position} ({name}) over mesh axis "
                        f"{spec_entry(mesh_axes)!r}; {where} shards only {_supported(rule)}. Replicate that axis first "
                        "(e.g. jax.sharding.reshard) or call the op inside jax.shard_map on local shards."
                    )
                if axes.setdefault(letter, mesh_axes) != mesh_axes:
                    raise ValueError(
                        f"{where}: {rule.dimension_name(letter)} is split over mesh axis "
                        f"{spec_entry(axes[letter])!r} in `{owner[letter]}` but over {spec_entry(mesh_axes)!r} in "
                        f"`{label}`; shard them alike"
                    )
                owner.setdefault(letter, label)
    mapped = compat.vmapped_explicit_axes(mesh) if mesh is not None else ()
    if mesh is None or not (axes or mapped):
        # Nothing is split over an explicit axis (e.g. the op's own body inside a plan on a 2-D mesh, where the
        # other axis is still explicit but every local shard is replicated over it): no shard_map. Planning one
        # here would nest a second shard_map inside the first with no axes, and jax.shard_map reads empty
        # `axis_names` as *every* mesh axis (jax/_src/shard_map.py, _shmap_checks: ``if not axis_names:
        # axis_names = mesh_axis_names_wo_vmap``), so the inner one re-binds the outer one's manual axes: its
        # transpose fails to verify ('sdy.manual_computation' ... already bound by a parent), or hangs in lowering.
        return None
    used: dict[str, str] = {}
    for letter, mesh_axes in axes.items():
        for name in mesh_axes:
            if used.setdefault(name, letter) != letter and not rule.may_share(used[name], letter):
                raise ValueError(
                    f"{where}: mesh axis {name!r} splits both {rule.dimension_name(used[name])} and "
                    f"{rule.dimension_name(letter)}; one mesh axis can shard only one of them"
                )
    result = Plan(rule, mesh, dict(axes), tuple(operands))
    for operand in operands:
        for _, leaf, dims in operand.leaves():
            for position, letter in enumerate(dims or ""):
                parts = result.axis_size(letter)
                multiple = parts * granule.get(letter, 1)
                if parts > 1 and leaf.shape[position] % multiple:
                    raise ValueError(
                        f"{where}: `{operand.name}` axis {position} ({rule.dimension_name(letter)}) has size "
                        f"{leaf.shape[position]}, which {parts} shards over mesh axis "
                        f"{spec_entry(axes[letter])!r} cannot split into equal parts"
                        + (f" of a multiple of {granule[letter]}" if letter in granule else "")
                    )
    if mapped:
        return Plan(rule, mesh, {}, tuple(operands), mapped=mapped, split=dict(axes))
    return result


def _supported(rule: ShardingRule) -> str:
    names = list(rule.free.values()) + [name for name, _ in rule.collective.values()]
    return ", ".join(dict.fromkeys(names)) or "nothing (every operand must be replicated)"
