"""Every touch of JAX internals (``jax._src``) lives here, behind feature probes.

The rest of jax_nkilib uses only public JAX APIs plus the names exported from this module. When a JAX release moves
one of these internals, the probe fails with a message naming the missing piece instead of an obscure
``AttributeError`` deep in a lowering.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.interpreters import mlir
from jax.sharding import AxisType, NamedSharding, PartitionSpec


class JaxCompatibilityError(ImportError):
    """A JAX internal that jax_nkilib relies on is missing from the installed JAX."""


def _probe(module: str, name: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:  # pragma: no cover - depends on the JAX version
        raise JaxCompatibilityError(
            f"jax_nkilib needs `{module}.{name}`, which JAX {jax.__version__} does not provide. "
            "Please report this with your JAX version."
        ) from err


_apply_primitive = _probe("jax._src.dispatch", "apply_primitive")
ShapedArray = getattr(jax.core, "ShapedArray", None) or _probe("jax._src.core", "ShapedArray")
_config_module = importlib.import_module("jax._src.config")
_source_info_util = importlib.import_module("jax._src.source_info_util")
# the primitive of ``jax.ad_checkpoint.checkpoint_name``: remat policies see its equations with ``params["name"]``
checkpoint_name_p = _probe("jax._src.ad_checkpoint", "name_p")
_xla_bridge = importlib.import_module("jax._src.xla_bridge")


def apply_primitive(primitive, *args, **params):
    """Eager implementation of a primitive: compile it alone with XLA and run it."""
    return _apply_primitive(primitive, *args, **params)


def is_known_platform(platform: str) -> bool:
    """Whether JAX already knows ``platform`` (plugins such as ``neuron`` register lazily)."""
    return bool(_xla_bridge.is_known_platform(platform))


def jit_keyed_state(kind: str, name: str, default, help: str, **extra):
    """A thread-local JAX config state that is part of JAX's jit and trace cache keys.

    Values that change what a kernel call lowers to (the LNC degree, the compiler, the fallback policy) must be in
    the cache key, or a function traced under one setting would be reused under another.
    ``kind`` is ``"int"``, ``"bool"`` or ``"enum"``.
    """
    factory = _probe("jax._src.config", f"{kind}_state")
    existing = getattr(_config_module, "config_states", {}).get(name)
    if existing is not None:  # re-import of the module (e.g. importlib.reload in tests)
        return existing
    if "include_in_trace_context" in inspect.signature(factory).parameters:  # JAX >= 0.8
        return factory(
            name, default=default, help=help, include_in_jit_key=True, include_in_trace_context=True, **extra
        )
    # JAX 0.7.x: jax/_src/config.py's `trace_context()` is a fixed tuple of JAX's own states, and the tracing and
    # lowering caches (`lu.cache`, `util.cache`, `util.weakref_lru_cache`, e.g. pjit's `_infer_params_cached` and
    # pxla's `_cached_lowering_to_hlo`) capture that function when JAX is imported, so a library state cannot join
    # their keys. `include_in_jit_key` still keys the C++ jit cache; the tracing and lowering caches are emptied
    # (public `jax.clear_caches()`) whenever the state's value changes, through the `update_global_hook` and
    # `update_thread_local_hook` callbacks every `*_state` factory of 0.7 takes. (Caches are process-wide: another
    # thread tracing at the same moment under a different value may still share a trace.)
    hook = _ClearCachesOnChange(default)
    return factory(
        name,
        default=default,
        help=help,
        include_in_jit_key=True,
        update_global_hook=hook.global_value,
        update_thread_local_hook=hook.local_value,
        **extra,
    )


class _ClearCachesOnChange:
    """Calls ``jax.clear_caches()`` when a config state takes a value other than the one caches were filled under."""

    def __init__(self, default):
        self._global = self._current = default

    def global_value(self, value) -> None:
        self._global = value
        self._switch_to(value)

    def local_value(self, value) -> None:  # ``None``: the thread-local override was removed
        self._switch_to(self._global if value is None else value)

    def _switch_to(self, value) -> None:
        if value != self._current:
            self._current = value
            jax.clear_caches()


def ir_type(ctx, aval):
    """The MLIR type of ``aval`` (``aval_to_ir_type`` gained a module-context argument in JAX 0.10)."""
    if len(inspect.signature(mlir.aval_to_ir_type).parameters) == 2:
        return mlir.aval_to_ir_type(ctx.module_context, aval)
    return mlir.aval_to_ir_type(aval)  # pragma: no cover - older JAX


def _varying_axes(value) -> frozenset:
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # JAX 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # earlier JAX


def varying_like(x, *refs):
    """``x`` marked as varying over every manual mesh axis any of ``refs`` varies over (inside ``shard_map``).

    Loop carries created from constants (zeros, ``-inf``) must carry the same varying-axes type as the values that
    later flow into them; outside ``shard_map``, or on JAX versions without varying axes, ``x`` is returned as is.
    """
    axes = frozenset().union(*(_varying_axes(ref) for ref in refs))
    missing = tuple(sorted(axes - _varying_axes(x)))
    return _mark_varying(x, missing) if missing else x


def _mark_varying(x, axes: tuple):
    if hasattr(jax.lax, "pcast"):  # JAX >= 0.8 (0.10 removed jax.lax.pvary)
        return jax.lax.pcast(x, axes, to="varying")
    return jax.lax.pvary(x, axes)  # JAX 0.7: jax/_src/lax/parallel.py `pvary(x, axis_name)`


def sum_over_extra_varying(cotangent, primal):
    """``cotangent`` summed over the manual mesh axes it varies over and ``primal`` does not (the transpose of using
    a replicated value in every shard); unchanged outside ``shard_map``."""
    extra = tuple(sorted(_varying_axes(cotangent) - _varying_axes(primal)))
    return jax.lax.psum(cotangent, extra) if extra else cotangent


def align_varying(values):
    """Mark every value varying over the union of the manual axes any of them varies over (a kernel's inputs must
    agree inside ``shard_map``, like the operands of any JAX primitive)."""
    return [varying_like(value, *values) for value in values]


def typed_like(aval, refs):
    """``aval`` with the manual-axes type (and abstract mesh) of the first of ``refs`` that has one, so that a
    kernel's outputs inside ``shard_map`` vary over the axes its inputs vary over."""
    for ref in refs:
        manual = getattr(ref, "manual_axis_type", None)
        if manual is not None and _varying_axes_of_type(manual):
            sharding = jax.sharding.NamedSharding(
                ref.sharding.mesh, jax.sharding.PartitionSpec(*([None] * len(aval.shape)))
            )
            return ShapedArray(aval.shape, aval.dtype, sharding=sharding, manual_axis_type=manual)
        # JAX 0.7-0.9: the varying axes are a frozenset field, `ShapedArray(..., sharding=..., vma=...)`, checked
        # against the mesh's Manual axes (jax/_src/core.py `ShapedArray.__init__` and `get_vma`).
        vma = getattr(ref, "vma", None) if manual is None else None
        if vma:
            sharding = jax.sharding.NamedSharding(
                ref.sharding.mesh, jax.sharding.PartitionSpec(*([None] * len(aval.shape)))
            )
            return ShapedArray(aval.shape, aval.dtype, sharding=sharding, vma=frozenset(vma))
    return aval


def _varying_axes_of_type(manual) -> frozenset:
    return frozenset(getattr(manual, "varying", ()) or ())


def astype_float8(x, dtype):
    """``x.astype(dtype)``; when ``dtype`` is an FP8 format and ``x`` float32/float64, rounded once to nearest even.

    XLA's CPU conversion in jaxlib 0.7 rounds float32/float64 to ``float8_e4m3fn`` and ``float8_e5m2`` through
    float16, so a value that float16 rounds onto an FP8 midpoint is rounded twice (openxla/xla#17324: f32
    1.0625 + 2**-12 gives 1.0, not 1.125). Where :func:`_cast_rounds_once` finds that, ``x`` is first rounded to the
    format's precision in its own type, exactly; the cast of that FP8 value is then exact. Elsewhere this is
    ``x.astype(dtype)``.
    """
    source, dtype = jnp.dtype(x.dtype), jnp.dtype(dtype)
    if (
        source not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64))
        or dtype.itemsize != 1
        or not jnp.issubdtype(dtype, jnp.floating)
        or _cast_rounds_once(source, dtype)
    ):
        return x.astype(dtype)
    target = jnp.finfo(dtype)
    _, exponent = jnp.frexp(x)  # |x| = f * 2**exponent, f in [0.5, 1)
    quantum = jnp.maximum(exponent - 1, target.minexp) - target.nmant  # log2 of the FP8 spacing at x
    rounded = jnp.round(x * _power_of_two(-quantum, source)) * _power_of_two(quantum, source)  # exact scalings
    return jnp.where(jnp.isfinite(x), rounded, x).astype(dtype)


def _power_of_two(k, dtype):
    """Exactly ``2**k`` for integer ``k`` in ``dtype``'s normal range, built from the exponent bits."""
    info = jnp.finfo(dtype)
    unsigned = jnp.uint32 if dtype.itemsize == 4 else jnp.uint64
    return jax.lax.bitcast_convert_type((k + (info.maxexp - 1)).astype(unsigned) << info.nmant, dtype)


@functools.cache
def _cast_rounds_once(source, dtype) -> bool:
    """Whether XLA's CPU conversion from ``source`` to ``dtype`` rounds once, probed on a value that float16 rounds
    onto an FP8 midpoint. Run eagerly on the CPU backend (the one the JAX references execute on); where the CPU
    backend is not available the cast is trusted."""
    mantissa = jnp.finfo(dtype).nmant

    def probe() -> bool:
        value = jax.device_put(np.asarray([1 + 2.0 ** -(mantissa + 1) + 2.0**-12], source), jax.devices("cpu")[0])
        return float(np.asarray(value.astype(dtype)).astype(np.float64)[0]) == 1 + 2.0**-mantissa

    try:
        return _outside_any_trace(probe)
    except RuntimeError:  # pragma: no cover - no CPU backend (jax_platforms without cpu)
        return True


def _outside_any_trace(probe: Callable[[], bool]) -> bool:
    """``probe()`` run in a new thread: JAX's trace state and mesh context are thread-local, so a probe made while
    tracing a user's function (or under ``jax.set_mesh``) sees neither."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(probe).result()


def _probe_mesh(*names: str):
    """A one-device mesh with explicit axes ``names``, for probing what JAX can trace (no compilation)."""
    return jax.make_mesh((1,) * len(names), names, axis_types=(AxisType.Explicit,) * len(names))


@functools.cache
def scatter_add_has_sharding_rule() -> bool:
    """Whether a scatter-add of explicitly sharded updates into an array with no mesh infers its output sharding.

    JAX 0.7's ``_scatter_sharding_rule`` (jax/_src/lax/slicing.py) raises ``NotImplementedError`` unless it is given
    an ``out_sharding``, and ``_gather_transpose_rule`` passes the operand's sharding, which is dropped when the
    operand has no mesh: a gather of an unsharded array whose cotangent is sharded cannot be transposed there.
    """

    def probe() -> bool:
        updates = jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(_probe_mesh("probe"), PartitionSpec()))
        numbers = jax.lax.ScatterDimensionNumbers(
            update_window_dims=(), inserted_window_dims=(0,), scatter_dims_to_operand_dims=(0,)
        )
        try:
            jax.make_jaxpr(lambda u: jax.lax.scatter_add(jnp.zeros(2, jnp.float32), np.array([[1], [0]]), u, numbers))(
                updates
            )
        except NotImplementedError:
            return False
        return True

    return _outside_any_trace(probe)


@functools.cache
def shard_map_batches_explicit_axes() -> bool:
    """Whether ``jax.vmap`` of a ``jax.shard_map`` can map an axis split over an explicit mesh axis the shard_map
    leaves alone.

    JAX 0.7 cannot: ``_shard_map_batch`` (jax/_src/shard_map.py) keeps the mapped value's explicit sharding, and
    ``_shard_shaped_array`` then lists that explicit axis among the varying axes, which ``core.get_vma`` rejects
    ("Axes mentioned in `vma` field of ShapedArray should be of type `Manual`").
    """

    def probe() -> bool:
        mesh = _probe_mesh("batch", "probe")
        body = jax.shard_map(
            lambda a: a,
            mesh=mesh,
            in_specs=PartitionSpec("probe"),
            out_specs=PartitionSpec("probe"),
            axis_names={"probe"},
        )
        mapped = jax.ShapeDtypeStruct(
            (1, 1), jnp.float32, sharding=NamedSharding(mesh, PartitionSpec("batch", "probe"))
        )
        try:
            jax.make_jaxpr(jax.vmap(body))(mapped)
        except ValueError as err:
            return "`vma`" not in str(err)
        return True

    return _outside_any_trace(probe)


_PACKAGE_DIR = __file__.rsplit("/_src/", 1)[0]


def call_site(traceback) -> str:
    """``file:line`` of the innermost frame outside JAX and jax_nkilib in a lowering rule's traceback."""
    for frame in _source_info_util.user_frames(traceback) if traceback is not None else ():
        if not frame.file_name.startswith(_PACKAGE_DIR):
            return f"{frame.file_name}:{frame.start_line}"
    return "<unknown>"


def custom_call(
    target: str,
    *,
    result_types,
    operands,
    backend_config: str,
    operand_output_aliases=None,
    frontend_attributes: dict[str, str] | None = None,
    tuple_result: bool = False,
) -> list:
    """Emit a ``stablehlo.custom_call`` and return its result values (``mlir.custom_call`` is public in
    jax.interpreters.mlir only privately).

    ``tuple_result`` makes the call return one tuple of ``result_types`` (even of one element, as nkipy emits calls to
    kernels that return a list), unpacked with ``get_tuple_element``; aliases then name tuple indices.
    """
    build: Callable = _probe("jax._src.interpreters.mlir", "custom_call")
    result_types = list(result_types)
    types = [mlir.ir.TupleType.get_tuple(result_types)] if tuple_result else result_types
    op = build(
        target,
        result_types=types,
        operands=list(operands),
        backend_config=backend_config,
        has_side_effect=False,
        operand_output_aliases=None if tuple_result else operand_output_aliases or None,
    )
    attributes = op.operation.attributes
    if tuple_result and operand_output_aliases:
        hlo = _probe("jax._src.lib.mlir.dialects", "hlo")
        attributes["output_operand_aliases"] = mlir.ir.ArrayAttr.get(
            [
                hlo.OutputOperandAlias.get(
                    output_tuple_indices=[output], operand_index=operand, operand_tuple_indices=[]
                )
                for operand, output in operand_output_aliases.items()
            ]
        )
    if frontend_attributes:
        attributes["mhlo.frontend_attributes"] = mlir.ir.DictAttr.get(
            {key: mlir.ir.StringAttr.get(value) for key, value in frontend_attributes.items()}
        )
    if not tuple_result:
        return list(op.results)
    hlo = _probe("jax._src.lib.mlir.dialects", "hlo")
    return [hlo.get_tuple_element(op.result, index) for index in range(len(result_types))]


def replica_groups(ctx, names: tuple[str, ...]) -> list[list[int]] | None:
    """Rank lists of the groups that communicate over mesh axes ``names`` inside the enclosing ``shard_map``.

    Ranks are positions in the mesh's flattened device order, not device ids: the SPMD program's partition ids,
    which XLA's own collectives in the same ``shard_map`` use (``replica_groups`` with ``use_global_device_ids``
    and one replica, built by ``jax._src.lax.parallel`` from mesh positions), and which the Neuron runtime runs as
    the collective ranks of one program (``neuron_protocol.md``). On a mesh with permuted devices they differ from
    ``device.id``. ``None`` outside a manual (``shard_map``) lowering context.
    """
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)
    if mesh is None or any(name not in mesh.shape for name in names):
        return None
    axis_names = tuple(mesh.shape)
    ranks = np.arange(int(np.prod(list(mesh.shape.values()), dtype=int))).reshape(tuple(mesh.shape.values()))
    moved = np.moveaxis(ranks, [axis_names.index(name) for name in names], range(-len(names), 0))
    group = int(np.prod([mesh.shape[name] for name in names], dtype=int))
    return moved.reshape(-1, group).tolist()


def _probe_axis_env() -> Callable[[], frozenset]:
    """``core.get_axis_env().explicit_mesh_axis_names``: the explicit mesh axes that enclosing ``jax.vmap`` calls map
    over (``jax.vmap`` of an argument split over an explicit axis adds it, jax/_src/interpreters/batching.py,
    ``core.add_explicit_mesh_axis_names(axis_data.explicit_mesh_axis)``; ``jax.shard_map`` leaves such an axis out
    of its axes, jax/_src/shard_map.py ``_shmap_checks``)."""
    get_axis_env = _probe("jax._src.core", "get_axis_env")
    if not hasattr(get_axis_env(), "explicit_mesh_axis_names"):
        # JAX 0.7 (jax/_src/core.py's AxisEnv has no such field): its vmap cannot map an explicitly split axis through
        # the plan's shard_map at all, which Plan.run reports as needing jax>=0.8 (shard_map_batches_explicit_axes)
        return frozenset
    return lambda: frozenset(get_axis_env().explicit_mesh_axis_names)


_vmapped_axis_names = _probe_axis_env()


def vmapped_explicit_axes(mesh=None) -> tuple[str, ...]:
    """Mesh axes, Explicit in the current (abstract) mesh (else in ``mesh``, the operands' mesh, when no mesh is
    set), that an enclosing ``jax.vmap`` maps over.

    Inside such a vmap an array's type hides its mapped dimension (``jax.typeof`` shows the unbatched shape), but
    every primitive still sees that dimension split over these axes, and ``jax.shard_map`` may not name them (its
    batching rule raises "vmapped away explicit mesh axis cannot appear in shard_map in_specs",
    jax/_src/shard_map.py ``_shard_map_batch``). Inside ``jax.sharding.auto_axes`` over them they are Auto, so this
    returns ``()`` there.
    """
    names = _vmapped_axis_names()
    if not names:
        return ()
    context = jax.sharding.get_abstract_mesh()
    mesh = mesh if context.empty else context
    if mesh is None or mesh.empty:
        return ()
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    return tuple(name for name in mesh.axis_names if name in names and kinds[name] == jax.sharding.AxisType.Explicit)
