"""The declarative description of one NKI Library kernel: ``KernelSpec`` and its parts.

A spec says everything the primitive factory needs: the kernel's name and device entry point, its tensor operands
(layouts and dtypes), its static parameters (defaults and accepted values), its outputs, its JAX reference, its
Neuron-kernel limits, how to batch it, which outputs alias inputs, and whether it issues collectives.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

from .layout import Layout
from .mesh_axes import axis_names

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float64))
NEURON_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
DTYPE_KINDS = ("dtype", "dtype-x4")
FOLLOW_LNC = "follow-lnc"  # default of an LNC-sharding flag: True when the LNC degree is > 1


INT_DTYPES = (jnp.dtype(jnp.int32),)
# FP8 caches and weights: Trainium2's E4M3 (max 240), the OCP E4M3 (448) and E5M2
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))


def accumulation_dtype(dtype) -> np.dtype:
    """The kernels' accumulation/statistics dtype for ``dtype`` inputs: float32, or float64 for float64 inputs."""
    return np.dtype(jnp.promote_types(dtype, jnp.float32))


# Layout cases selected by a static param: ("tp_q", ((True, (Layout, ...)), (False, (Layout, ...)))), or by several:
# (("k_pre_transposed", "fp8_packed"), (((False, False), (Layout, ...)), ...))
LayoutSwitch = tuple


def _layouts(texts) -> tuple[Layout, ...]:
    return tuple(Layout.parse(text) for text in ((texts,) if isinstance(texts, str) else texts))


def _switch(param: str, cases: Mapping[Any, Any]) -> LayoutSwitch:
    return (param, tuple((value, _layouts(texts)) for value, texts in cases.items()))


def switch_key(param: str | tuple[str, ...], params: Mapping[str, Any]) -> Any:
    """The value(s) of the flag(s) a layout switch reads."""
    return tuple(params[name] for name in param) if isinstance(param, tuple) else params[param]


def _select(switch: LayoutSwitch, params: Mapping[str, Any]) -> tuple[Layout, ...]:
    param, cases = switch
    key = switch_key(param, params)
    layouts = dict(cases).get(key)
    if layouts is None:
        raise ValueError(f"flags {param}={key} cannot be combined (no layout for that combination)")
    return layouts


# device_dtype(params, dtype) -> the NKI dtype name a library kernel declares for an operand that JAX holds in another
# dtype (packed x4 words arrive as uint32/uint16 and are handed to the kernel as "float8_e4m3fn_x4"...), or None
DeviceDtype = Callable[[Mapping[str, Any], np.dtype], "str | None"]


@dataclasses.dataclass(frozen=True)
class Operand:
    """A tensor argument: accepted layouts (one per rank, or chosen by a static flag such as ``tp_q``), accepted
    dtypes, optional or required, differentiable or not (integer and index operands get no cotangent).
    ``device_dtype`` names the NKI-only dtype (a packed x4 type) a library kernel takes this operand as, where JAX
    holds it as unsigned words."""

    name: str
    layouts: tuple[Layout, ...]
    dtypes: tuple[np.dtype, ...] = FLOAT_DTYPES
    optional: bool = False
    doc: str = ""
    switch: LayoutSwitch | None = None
    device_dtype: DeviceDtype | None = None

    @classmethod
    def of(
        cls,
        name: str,
        *layouts: str,
        dtypes: Sequence = FLOAT_DTYPES,
        optional: bool = False,
        doc: str = "",
        device_dtype: DeviceDtype | None = None,
    ) -> Operand:
        return cls(
            name, _layouts(layouts), tuple(jnp.dtype(d) for d in dtypes), optional, doc, device_dtype=device_dtype
        )

    @classmethod
    def switched(
        cls,
        name: str,
        param: str | tuple[str, ...],
        cases: Mapping[Any, Any],
        *,
        dtypes: Sequence = FLOAT_DTYPES,
        optional: bool = False,
        doc: str = "",
        device_dtype: DeviceDtype | None = None,
    ) -> Operand:
        """An operand whose layout the static flag ``param`` selects: ``cases`` maps flag values to layouts (with a
        tuple of flags, tuples of their values)."""
        switch = _switch(param, cases)
        return cls(name, switch[1][0][1], tuple(jnp.dtype(d) for d in dtypes), optional, doc, switch, device_dtype)

    def layouts_for(self, params: Mapping[str, Any]) -> tuple[Layout, ...]:
        return self.layouts if self.switch is None else _select(self.switch, params)

    @property
    def layout_text(self) -> str:
        if self.switch is None:
            return " or ".join(str(layout) for layout in self.layouts)
        param, cases = self.switch
        return "; ".join(f"{' or '.join(map(str, layouts))} when {param}={value}" for value, layouts in cases)


def enum_member(kind: type[enum.Enum], value: Any, where: str) -> enum.Enum:
    """``value`` as a member of the enum ``kind``: a member, or a member's name (``TypeError`` otherwise, its
    message starting with ``where``)."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str) and value in kind.__members__:
        return kind[value]
    raise TypeError(f"{where} must be a {kind.__name__} member or one of {', '.join(kind.__members__)}; got {value!r}")


def dtype_value(value: Any, where: str) -> np.dtype:
    """``value`` as a NumPy dtype (a JAX/NumPy dtype or its name; ``TypeError`` otherwise)."""
    try:
        return np.dtype(jnp.dtype(value))
    except TypeError:
        raise TypeError(f"{where} must be a dtype (e.g. jnp.float32); got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class Param:
    """A static (compile-time) argument.

    ``kind`` is ``bool``, ``int``, ``float``, ``"dtype"``, ``"dtype-x4"`` (a packed-x4 format such as
    ``float8_e4m3fn_x4``, given by its element dtype), ``"axis"`` (a replica group given as mesh axis names: a
    name or a tuple of names bound by the enclosing ``jax.shard_map``; normalized to a tuple), an ``enum.Enum``
    subclass (members or member-name strings accepted) or a tuple of allowed values. A ``None`` default makes the
    param optional. ``default`` may be :data:`FOLLOW_LNC` for flags that follow the LNC degree.

    ``normalizer``, where the kinds above do not describe the accepted values, is the function that checks and
    normalizes every value given (``None`` included) in their place: ``normalizer(value, where) -> value``, raising
    ``TypeError``/``ValueError`` with a message that starts with ``where`` (``"<function>: parameter `<name>`"``).
    The normalized value must be hashable (it is a primitive param). ``kind`` then still tells the Neuron lowering
    how to pass the value (a ``"dtype"`` becomes an ``nl`` dtype).

    ``required=True`` (with a ``None`` default) marks a parameter the kernel requires: leaving it out is a
    ``TypeError`` naming it. ``to_kernel=False`` marks a parameter of jax_nkilib's own: it shapes validation,
    abstract evaluation or the reference (the element type of packed words), but the kernel does not take it, so it
    never reaches the compiled kernel.
    """

    name: str
    default: Any
    kind: Any = bool
    doc: str = ""
    to_kernel: bool = True
    required: bool = False
    normalizer: Callable[[Any, str], Any] | None = None

    def normalize(self, value: Any, function: str) -> Any:
        """The checked, normalized ``value`` of this param in a call of ``function``."""
        where = f"{function}: parameter `{self.name}`"
        if self.normalizer is not None:
            return self.normalizer(value, where)
        if value is None and self.default is None:
            return None
        kind = self.kind
        if isinstance(kind, type) and issubclass(kind, enum.Enum):
            return enum_member(kind, value, where)
        if kind in DTYPE_KINDS:
            return dtype_value(value, where)
        if kind == "axis":
            return axis_names(function, value, self.name)
        if isinstance(kind, tuple):
            if value in kind:
                return value
            raise ValueError(f"{where} must be one of {kind}; got {value!r}")
        if kind is bool:
            if isinstance(value, (bool, np.bool_)):
                return bool(value)
            raise TypeError(f"{where} must be a Python bool; got {value!r} of type {type(value).__name__}")
        if kind is int:
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                return int(value)
            raise TypeError(f"{where} must be a Python int; got {value!r}")
        if kind is float:
            if isinstance(value, (int, float, np.floating)) and not isinstance(value, bool):
                return float(value)
            raise TypeError(f"{where} must be a Python float; got {value!r}")
        raise AssertionError(f"unsupported parameter kind {kind!r}")  # a spec bug, not a user error


@dataclasses.dataclass(frozen=True)
class Output:
    """A plain kernel output: its shape is ``layout`` over the dimensions the operands bound and the static int
    params; its dtype is that of operand ``dtype_of``, or the dtype named ``dtype_of`` (``"float32"``) when no
    operand has that name. Outputs this cannot describe come from :attr:`KernelSpec.output_avals`."""

    name: str
    layout: Layout
    dtype_of: str

    @classmethod
    def of(cls, name: str, layout: str, dtype_of: str) -> Output:
        return cls(name, Layout.parse(layout), dtype_of)


@dataclasses.dataclass(frozen=True)
class FoldPlan:
    """A way to absorb a vmapped axis into one of the kernel's own dimensions.

    ``axes`` maps each operand to the dimension of its layout that the vmapped axis merges into (as its major part),
    named by its layout token (``"B"``, ``"n_heads"``, ``"4*F"``), or to ``None`` when the plan applies only if that
    operand is not batched. ``outputs`` names, per output (by name, or in the spec's output order), the dimension of
    its layout that carries the merged vmapped axis; an output with no layout gives its axis as an int. Names resolve
    against the layouts the call selects (by rank or flag). ``when`` optionally restricts the plan to some operand
    ranks/presences or flags. Unbatched operands with a dimension are broadcast along the vmapped axis before merging.
    """

    axes: Mapping[str, str | None]
    outputs: tuple[str | int, ...] | Mapping[str, str | int]
    when: Callable[[CallInfo], bool] | None = None

    def output_dims(self, outputs: Sequence[Output]) -> dict[str, str | int]:
        """Output name -> dimension (``outputs`` positional over the spec's outputs, or already by name)."""
        if isinstance(self.outputs, Mapping):
            return dict(self.outputs)
        return {output.name: dim for output, dim in zip(outputs, self.outputs)}


@dataclasses.dataclass(frozen=True)
class CallInfo:
    """What a rule knows about one call: operand avals by name, bound dimensions and static params."""

    function: str
    avals: Mapping[str, Any]
    dims: Mapping[str, int]
    params: Mapping[str, Any]

    @property
    def lnc(self) -> int:
        return self.params["lnc"]

    @property
    def target(self) -> str:
        """The Neuron platform target the call is traced for (``trn2``...)."""
        return self.params["target"]

    def shape(self, layout: str | Layout) -> tuple[int, ...]:
        """The shape that ``layout`` (layout grammar) gives over this call's bound dimensions and static int
        params."""
        layout = Layout.parse(layout) if isinstance(layout, str) else layout
        sizes = {**{k: v for k, v in self.params.items() if isinstance(v, int)}, **self.dims}
        return tuple(dim.expected(sizes) for dim in layout.dims)


# output_avals(call) -> ((name, shape, dtype), ...): the outputs a call produces, in the kernel's order and layout
OutputAvals = Callable[[CallInfo], Sequence[tuple[str, tuple[int, ...], Any]]]
# prepare(function, operands, params) -> (operands, params): operands by name, normalized params
Prepare = Callable[[str, dict[str, Any], dict[str, Any]], tuple[dict[str, Any], dict[str, Any]]]


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """Everything the factory needs to turn one NKI Library kernel into a JAX primitive.

    Attributes:
      name: the kernel's NKI Library name (``RoPE``); also the public layer-1 function name.
      entry_point: ``module:function`` of the device-side ``@nki.jit`` entry point.
      operands: tensor arguments in the kernel's order.
      params: static arguments in the kernel's order.
      outputs: plain outputs in the kernel's order (see :class:`Output`); empty when ``output_avals`` is given.
      output_avals: the hook for outputs the layout grammar cannot describe (sizes computed from several
        dimensions, layouts or dtypes a param selects, outputs like an operand, optional outputs, output sets that
        depend on the call): ``output_avals(call) -> ((name, shape, dtype), ...)``, the outputs this call produces
        in the kernel's order and layout. Such outputs have no layout: fold plans give their axes as ints.
      prepare: the hook for argument preparation: ``prepare(function, operands, params) -> (operands, params)``,
        applied to every call (public, from a layer-2 op or a VJP rule) before validation, with operands by name
        (``None`` when absent) and normalized params: defaults that depend on the operands, workspaces, marking
        the operands of a collective as varying over its mesh axes.
      keywords: ``{keyword: param name}`` for params that the public function also takes under the kernel's own
        keyword where the spec stores them under another name.
      reference: ``reference(**operands, **params) -> tuple`` in JAX, following the kernel's numerics.
      resolve_params: ``resolve_params(params) -> params`` applied when a call's params are normalised, for values
        that resolve from the environment at trace time (``dtype_mode=AUTO``): the resolved value is then part of
        the params, so abstract evaluation, lowering and the jit caches agree on it.
      reference_takes_lnc: the reference also takes ``lnc``, the call's LNC degree (for kernels whose semantics,
        such as an output order, depend on how the kernel splits work over logical cores).
      check: extra semantic validation ``check(call) -> None`` raising ``TypeError``/``ValueError``.
      runtime_checks: ``runtime_checks(call, operands) -> None``, checks of run-time values (indices read from
        operands) through :func:`runtime_checks.check_all`; called only inside ``config(runtime_checks=True)``.
      neuron_limits: ``neuron_limits(call) -> list[str]`` of kernel limits that the call does not meet.
      neuron_notes: ``neuron_notes(call) -> list[str]``: what a user should know about how the NKI kernel computes
        this call where it differs from the reference off Neuron (float32 inputs computed in bfloat16); ``explain``
        reports them for calls that run the kernel.
      fold_plans: batching strategies tried in order before the ``lax.map`` fallback.
      neuron_split_dims: named dimensions along which the kernel is elementwise-independent, in order of
        preference: when a call exceeds a kernel limit (e.g. SBUF capacity), the Neuron lowering splits it along
        one of them (that the call binds) into equal pieces that each meet every limit, one kernel call per piece,
        and concatenates each output along its one axis whose size the split divides (the split dimension must
        be that axis' major part).
      aliases: ``{operand name: output name}`` for outputs written in place (the kernel updates the operand and
        returns it, e.g. a KV cache).
      has_collectives: whether the kernel issues ``nki.collectives``; a function of the call where that depends on
        its flags (``attention_block_tkg`` gathers only with ``KVDP > 1``).
      mac_count: estimate of multiply-accumulates for the Neuron config.
      family: module family, for the support matrix.
      catalog: section of ``nkilib_catalog.md`` that is this kernel's contract.
      derived_params: ``(name, dimension or function of the call)`` config fields of the kernel that the operand
        shapes determine (e.g. ``bs`` = ``B``): accepted as keyword arguments for parity with the kernel's API,
        checked against the shapes, and not part of the primitive's params.
      nondifferentiable_outputs: outputs that carry no gradient (statistics, indices): the public function applies
        ``stop_gradient`` to them, so differentiating through them gives zero, by definition.
      support: support-matrix notes: ``idiomatic`` (layer-2 ops built on it), ``vjp`` (how reverse mode runs),
        ``notes`` (Neuron limits and anything a user should know).
    """

    name: str
    entry_point: str
    operands: tuple[Operand, ...]
    params: tuple[Param, ...]
    outputs: tuple[Output, ...]
    reference: Callable[..., tuple]
    output_avals: OutputAvals | None = None
    prepare: Prepare | None = None
    keywords: Mapping[str, str] = dataclasses.field(default_factory=dict)
    reference_takes_lnc: bool = False
    resolve_params: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    check: Callable[[CallInfo], None] | None = None
    runtime_checks: Callable[[CallInfo, Mapping[str, Any]], None] | None = None
    neuron_limits: Callable[[CallInfo], list[str]] | None = None
    neuron_notes: Callable[[CallInfo], list[str]] | None = None
    fold_plans: tuple[FoldPlan, ...] = ()
    neuron_split_dims: tuple[str, ...] = ()
    aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
    has_collectives: bool | Callable[[CallInfo], bool] = False
    mac_count: Callable[[CallInfo], int] | None = None
    family: str = ""
    catalog: str = ""
    support: Mapping[str, str] = dataclasses.field(default_factory=dict)
    nondifferentiable_outputs: tuple[str, ...] = ()
    derived_params: tuple[tuple[str, str | Callable[[CallInfo], int]], ...] = ()

    def operand(self, name: str) -> Operand:
        for operand in self.operands:
            if operand.name == name:
                return operand
        raise KeyError(name)

    @property
    def public_name(self) -> str:
        return f"jax_nkilib.nki.{self.name}"
