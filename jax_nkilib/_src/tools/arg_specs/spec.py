"""Named argument specs: for every bound kernel (``jax_nkilib.nki``) and every idiomatic op (``jax_nkilib``), small
but realistic arguments and the properties the shared conformance suite (``tests/conformance``) checks.

An :class:`ArgSpec` says how to call one function (its operands, built deterministically from a seed, and its
static keyword arguments) and what it promises: which operands are differentiable, which vmap may batch, how it runs
inside ``jax.shard_map``, which kernels its Neuron lowering calls, and one bad input with the error it must raise.
Each spec has a ``size``: ``"small"`` ones feed the conformance suite, ``"realistic"`` ones the benchmarks and the
examples. Look specs up with :func:`arg_specs` (all, or one function's, or one size) and :func:`arg_spec` (by name).

The specs use only the public API (``jax_nkilib``, ``jax_nkilib.nki``), JAX and NumPy. Each family's specs are in
the module of that name in this package; they register themselves with :func:`register`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Builder = Callable[[np.random.Generator], tuple]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """How a function runs inside ``jax.shard_map``: the mesh (axis names and sizes), one ``PartitionSpec`` per
    operand and the output specs. ``collective`` functions (kernels that take mesh axes as replica groups) only run
    inside ``shard_map`` over these axes and their results are per rank; the others must give inside ``shard_map``
    what they give outside it."""

    mesh: tuple[tuple[str, int], ...]
    in_specs: tuple
    out_specs: Any
    collective: bool = False

    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.mesh)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.mesh)


@dataclasses.dataclass(frozen=True)
class BadInput:
    """One invalid call: the operand or keyword ``argument`` replaced by ``value(good_value)``, which must raise
    ``error`` with a message naming the argument and containing ``match``."""

    argument: str
    value: Callable[[Any], Any]
    match: str = ""
    error: tuple[type[Exception], ...] = (TypeError, ValueError)


@dataclasses.dataclass(frozen=True, eq=False)
class ArgSpec:
    """Named arguments for one call of ``fn`` and the properties of that call.

    * ``operands``: the names of the array arguments (an array, or a tuple of arrays such as a ``(k_cache,
      v_cache)`` pair), in order; ``build(rng)`` returns them. The first
      ``positional`` are passed by position (``None``: all), the others by keyword.
    * ``kwargs``: static keyword arguments.
    * ``kernels``: the bound kernels the call runs, i.e. the ``func_name`` of each Neuron custom call when lowered
      for ``neuron`` under dry run, in program order. ``only_kernels``: the lowering has nothing but those calls
      (and constants), as for layer-1 kernels.
    * ``grad``: the differentiable operands (``check_grads`` in float64, reverse mode, to ``grad_order``, unless
      ``check_grads`` is false: a VJP that approximates the gradient, e.g. through MX quantization);
      ``grad_output`` picks the differentiable outputs when some are not (integer, quantized).
    * ``batch``: the operands vmap may batch (``None``: every operand).
    * ``sharding``: how it runs inside ``jax.shard_map`` (``None``: not checked for this spec).
    * ``bad``: one invalid input and the error it raises.
    * ``neuron``: operands within the Neuron kernel's limits (a builder like ``build``; ``None``: ``build``'s meet
      them) and ``neuron_kwargs`` (``None``: ``kwargs``), lowered at LNC ``neuron_lnc`` (and for the platform
      target ``neuron_target``; ``None``: the one in force), for the lowering check, which only traces.
      ``neuron_fallback``: for a call no kernel runs, a pattern its ``NeuronFallbackWarning`` matches (the reason
      it names).
    * ``size``: ``"small"`` (conformance) or ``"realistic"`` (benchmarks, examples).
    * ``notes``: what a reader should know, e.g. why a check is left out.
    """

    name: str
    fn: Callable
    operands: tuple[str, ...]
    build: Builder
    kernels: tuple[str, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    positional: int | None = None
    only_kernels: bool = True
    grad: tuple[str, ...] = ()
    grad_order: int = 1
    check_grads: bool = True
    grad_output: Callable[[Any], Any] | None = None
    batch: tuple[str, ...] | None = None
    sharding: Sharding | None = None
    bad: BadInput | None = None
    neuron: Builder | None = None
    neuron_kwargs: Mapping[str, Any] | None = None
    neuron_lnc: int = 1
    neuron_target: str | None = None
    neuron_fallback: str = ""
    size: str = "small"
    notes: str = ""

    def args(self, seed: int = 0) -> tuple:
        """The operands, as JAX arrays, built from ``seed`` (the same seed gives the same arrays)."""
        built = self.build(np.random.default_rng(seed))
        assert len(built) == len(self.operands), f"{self.name}: build gives {len(built)} operands"
        return tuple(jax.tree.map(jnp.asarray, a) for a in built)  # an operand may be a tuple of arrays

    def shapes(self, neuron: bool = False) -> tuple:
        """The operands' ``jax.ShapeDtypeStruct`` s (with ``neuron``: those of the Neuron-sized operands), without
        materializing them where the builder allows (realistic sizes cost no memory)."""
        build = (self.neuron if neuron else None) or self.build
        try:
            built = jax.eval_shape(lambda: build(_AbstractRng()))
        except Exception:  # a builder that needs concrete values (NumPy on random draws)
            built = build(np.random.default_rng(0))
        return tuple(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), a) for a in built)

    def __call__(self, *args):
        """``fn`` on the operands ``args`` and the static ``kwargs``."""
        return self._call(args, self.kwargs)

    def neuron_call(self, *args):
        """``fn`` on the operands ``args`` and ``neuron_kwargs``: the call lowered for Neuron."""
        return self._call(args, self.kwargs if self.neuron_kwargs is None else self.neuron_kwargs)

    def _call(self, args, kwargs):
        n = len(args) if self.positional is None else self.positional
        return self.fn(*args[:n], **dict(zip(self.operands[n:], args[n:])), **kwargs)

    @property
    def batched(self) -> tuple[str, ...]:
        """The operands vmap batches."""
        return self.operands if self.batch is None else self.batch

    @property
    def fn_name(self) -> str:
        """``jax_nkilib.nki.<kernel>`` or ``jax_nkilib.<op>``: where ``fn`` is public."""
        return public_name(self.fn)


class _AbstractRng:
    """Stands in for ``np.random.Generator`` under ``jax.eval_shape``: zeros of the requested shapes (traced, so
    nothing is allocated)."""

    def standard_normal(self, shape):
        return jnp.zeros(shape)

    def uniform(self, low=0.0, high=1.0, size=None):
        return jnp.zeros(size)

    def integers(self, low, high=None, size=None):
        return jnp.zeros(size, jnp.int32)

    def permutation(self, n):
        return jnp.arange(n)


_SPECS: dict[str, ArgSpec] = {}


def register(*specs: ArgSpec) -> None:
    """Add specs (names are unique)."""
    for spec in specs:
        if spec.name in _SPECS:
            raise ValueError(f"arg spec {spec.name} is defined twice")
        _SPECS[spec.name] = spec


def arg_specs(fn: Callable | str | None = None, size: str | None = None) -> list[ArgSpec]:
    """Every spec, or those of ``fn`` (a function or a spec's ``fn_name``), of one ``size``, sorted by name."""
    _load()
    found = [s for s in _SPECS.values() if fn is None or s.fn is fn or s.fn_name == fn]
    return sorted((s for s in found if size is None or s.size == size), key=lambda s: s.name)


def arg_spec(name: str) -> ArgSpec:
    """The spec called ``name``."""
    _load()
    return _SPECS[name]


# ---------------------------------------------------------------------------------------------- building blocks
def normal(rng, shape, dtype=jnp.float32, scale=1.0):
    """Standard-normal values (times ``scale``) rounded to ``dtype``."""
    return jnp.asarray(rng.standard_normal(shape) * scale, dtype)


def uniform(rng, shape, low, high, dtype=jnp.float32):
    return jnp.asarray(rng.uniform(low, high, shape), dtype)


def angles(rng, shape, dtype=jnp.float32):
    """``(cos, sin)`` of random angles."""
    theta = rng.uniform(-np.pi, np.pi, shape)
    return jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)


def integers(value, shape=(1, 1), dtype=jnp.int32):
    """A constant integer array (runtime scalars such as ``prior_used_len``)."""
    return jnp.full(shape, value, dtype)


def drop_last_axis(x):
    """A bad value: ``x`` with one axis fewer."""
    return x[..., 0]


def public_name(fn) -> str:
    """``jax_nkilib.nki.<name>`` or ``jax_nkilib.<name>`` for a public function."""
    import jax_nkilib
    import jax_nkilib.nki

    for module in (jax_nkilib.nki, jax_nkilib):
        for name in module.__all__:
            if getattr(module, name) is fn:
                return f"{module.__name__}.{name}"
    raise ValueError(f"{fn} is neither in jax_nkilib.nki nor in jax_nkilib")


_FAMILIES = (
    "rope",
    "attention",
    "attention_block_tkg",
    "norm",
    "projection",
    "mlp",
    "quant",
    "parallel",
    "moe_a2a",
    "moe_cte",
    "moe_tkg",
    "routing",
    "moe",
    "transformer_tkg",
    "decode_block",
    "optim",
    "indexing",
    "loss",
    "scan",
    "elementwise",
    "deformable",
    "benchmark",
    "mla",
    "qkv_mla",
    "sparse_indexer",
    "conv",
)
_loaded = False


def _load():
    """Import the per-family spec modules (they register their specs)."""
    global _loaded
    if not _loaded:
        _loaded = True
        import importlib

        for family in _FAMILIES:
            importlib.import_module(f"jax_nkilib._src.tools.arg_specs.{family}")
