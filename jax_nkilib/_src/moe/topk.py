"""``topk`` and ``rotational_topk`` (catalog row 18, section 1.18) and the docs-only ``gpsimd_topk`` (row 81,
section 3): the k largest values along the last axis and their indices.

Source: nki-library ``src/nkilib_src/nkilib/core/topk/rotational_topk.py`` (``topk``, ``rotational_topk``),
``rotational_topk_utils.py`` (``RotationalTopkConfig``, ``create_topk_config``, ``create_rotational_topk_config``)
and the torch reference ``topk/torch_ref.py`` (``torch.topk``); tests ``test/integration/nkilib/core/topk``.

* ``topk(inp [B, S, V] or [R, V], k, sorted_flag=True, method=ROTATIONAL)`` -> ``(topk_values [B, S, k] (or
  [R, k]) in inp's dtype, topk_indices [..., k] uint32)``. The library's ``topk`` is a host-side launcher that
  builds the rotational config for the input shape and the LNC degree and launches ``rotational_topk[lnc]``; the
  device adapter ``jax_nkilib_kernels/routing.py:topk`` does the same inside one ``@nki.jit`` kernel.
* ``rotational_topk(inp [R, V], config=RotationalTopkConfig(orig_k, sorted))`` -> ``[R, k]`` values and uint32
  indices. The library's config also holds fields derived from the input shape and the LNC degree (``BxS``,
  ``vocab_size``, ``n_stages``, ``stage_free_size``, ``tile_size``, ``padded_k``, ...), built by its factory; here
  the config holds the caller's choices and the adapter runs the library's factory on the traced shape, so the two
  always agree.
* ``gpsimd_topk(inp [R, V], config=GpsimdTopkConfig(k, sorted))`` (docs-only, row 81: nki-library 2.32
  ``experimental/topk/gpsimd_topk.py``, read from the NKI Library API reference and the newer source in the public
  code index) -> ``[R, k]`` values and uint32 indices through the GpSimd ``nisa.topk`` instruction. Its config is
  built by ``create_gpsimd_topk_config(inp_shape, inp_dtype, k, sorted, num_programs)``, which the adapter runs on
  the traced shape and the LNC degree. The kernel folds NaN inputs to the most negative finite bfloat16 (so a NaN
  ranks last and comes back as that value); this reference does the same. Neuron limits: bfloat16,
  ``8 <= V``, ``16 * ceil(V / 16) < 65536``, ``k < 32768``.

Semantics: the values are exactly the k largest of each row, in descending order; the indices are their positions
(ties are broken towards the lower index here; the kernel's order on ties is unspecified, as its torch reference
says). With ``sorted_flag=False`` / ``sorted=False`` the kernel returns the same set in an unspecified order; this
reference returns it sorted. Reverse mode: like ``jax.lax.top_k``, the values' cotangents go to the selected
positions; the indices carry none. Neuron limits: ``k < V`` (with ``k == V`` the kernel returns its input buffer
as the values output, an alias this binding does not set up), ``method=ROTATIONAL`` (the library's launcher maps
SCANNING to a helper it calls with another signature and has no CASCADED implementation), float32/bfloat16/float16.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import NEURON_FLOAT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param


class SupportedTopkMethods(enum.Enum):
    """The library's ``topk`` algorithms (``core/topk/rotational_topk.py``)."""

    SCANNING = 0
    CASCADED = 1
    ROTATIONAL = 2


@dataclasses.dataclass(frozen=True)
class RotationalTopkConfig:
    """The caller's part of the library's frozen ``RotationalTopkConfig``: ``orig_k`` (k, the number of values
    kept) and ``sorted`` (descending order; the kernel forces it when it pads k). The shape- and LNC-derived fields
    of the library's config are computed by its factory in the device adapter."""

    orig_k: int
    sorted: bool = True


@dataclasses.dataclass(frozen=True)
class GpsimdTopkConfig:
    """The caller's part of the library's frozen ``GpsimdTopkConfig`` (docs-only, 2.32): ``k`` and ``sorted``
    (descending order; else the same set in an unspecified order). Its shape- and LNC-derived fields (``BxS``,
    ``vocab_size``, ``n_prgs``, ``per_lnc_BxS``, ...) come from ``create_gpsimd_topk_config`` in the adapter."""

    k: int
    sorted: bool = True


def _config_normalizer(kind: type, k_field: str):
    def normalize(value, where: str):
        if not isinstance(value, kind):
            raise TypeError(
                f"{where} must be a jax_nkilib.nki.{kind.__name__}({k_field}, sorted=True); got {type(value).__name__}"
            )
        k = getattr(value, k_field)
        if not isinstance(k, (int, np.integer)) or isinstance(k, bool) or k < 1:
            raise ValueError(f"{where}: {k_field} must be a Python int >= 1; got {k!r}")
        if not isinstance(value.sorted, (bool, np.bool_)):
            raise TypeError(f"{where}: sorted must be a Python bool; got {value.sorted!r}")
        return kind(int(k), bool(value.sorted))

    return normalize


def top_values(inp, k: int):
    """``(values, indices int32)`` of the k largest along the last axis, descending, lower index first on ties."""
    return jax.lax.top_k(inp, k)


def _k(params) -> int:
    if "k" in params:
        return params["k"]
    config = params["config"]
    return config.orig_k if isinstance(config, RotationalTopkConfig) else config.k


def reference_topk(inp, **params):
    """JAX reference of topk and rotational_topk: ``(topk_values, topk_indices uint32)``."""
    values, indices = top_values(inp, _k(params))
    return values, indices.astype(jnp.uint32)


BFLOAT16_LOWEST = float(jnp.finfo(jnp.bfloat16).min)  # gpsimd_topk's NaN fold target


def _nan_folded(inp):
    return jnp.where(jnp.isnan(inp), jnp.asarray(BFLOAT16_LOWEST, inp.dtype), inp)


def reference_gpsimd_topk(inp, *, config):
    """JAX reference of gpsimd_topk: NaN ranks (and reads back) as the lowest finite bfloat16."""
    values, indices = top_values(_nan_folded(inp), config.k)
    return values, indices.astype(jnp.uint32)


def _values_vjp(kernel, operands, params, outs, cotangents):
    """The values' cotangents scattered to the selected positions (``jax.lax.top_k``'s rule)."""
    return pull_back(lambda named: kernel.reference(named, params)[:1], operands, ["inp"], cotangents[:1])


def _check_k(call: CallInfo) -> None:
    k, v = _k(call.params), call.dims["V"]
    if not 1 <= k <= v:
        raise ValueError(f"{call.function}: k must be in [1, V={v}] (the last axis of `inp`); got {k}")


def _outputs(call: CallInfo):
    shape = tuple(call.avals["inp"].shape[:-1]) + (_k(call.params),)
    return [("topk_values", shape, call.avals["inp"].dtype), ("topk_indices", shape, jnp.uint32)]


def _common_limits(call: CallInfo) -> list[str]:
    unmet = []
    if _k(call.params) == call.dims["V"]:
        unmet.append("k == V (the kernel then returns its input buffer as the values, an alias not set up here)")
    if np.dtype(call.avals["inp"].dtype) not in NEURON_FLOAT_DTYPES:
        unmet.append(f"dtype {call.avals['inp'].dtype} is not a Neuron dtype")
    return unmet


def _topk_limits(call: CallInfo) -> list[str]:
    unmet = _common_limits(call)
    if call.params["method"] != SupportedTopkMethods.ROTATIONAL:
        unmet.append(f"method={call.params['method'].name}: only ROTATIONAL runs in the library's launcher")
    return unmet


_OUT_AXES = {"topk_values": 0, "topk_indices": 0}
_SUPPORT = {
    "idiomatic": "topk",
    "vjp": "JAX (values like jax.lax.top_k; indices carry no gradient)",
    "notes": "uint32 indices; k < V and method ROTATIONAL on Neuron; ties: order unspecified; "
    "device adapter jax_nkilib_kernels/routing.py",
}

TOPK_SPEC = KernelSpec(
    name="topk",
    entry_point="jax_nkilib_kernels.routing:topk",
    operands=(Operand.of("inp", "B, S, V", "R, V", doc="values; top-k along the last axis"),),
    params=(
        Param("k", None, int, "number of values kept", required=True),
        Param("sorted_flag", True, bool, "descending order (else the same set in an unspecified order)"),
        Param("method", "ROTATIONAL", SupportedTopkMethods, "the algorithm"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_topk,
    check=_check_k,
    neuron_limits=_topk_limits,
    fold_plans=(
        FoldPlan({"inp": "B"}, outputs=_OUT_AXES, when=lambda call: call.avals["inp"].ndim == 3),
        FoldPlan({"inp": "R"}, outputs=_OUT_AXES, when=lambda call: call.avals["inp"].ndim == 2),
    ),
    mac_count=lambda call: int(np.prod(call.avals["inp"].shape)),
    nondifferentiable_outputs=("topk_indices",),
    family="topk",
    catalog="1.18",
    support=_SUPPORT,
)


def _config_spec(name: str, config_class, key: str, reference, limits, catalog: str, support: dict) -> KernelSpec:
    """The spec of a top-k kernel taking ``inp [B*S, V]`` and a ``config`` dataclass (``key`` its k field)."""
    fields = ", ".join(field.name for field in dataclasses.fields(config_class))
    return KernelSpec(
        name=name,
        entry_point=f"jax_nkilib_kernels.routing:{name}",
        operands=(Operand.of("inp", "R, V", doc="values [B*S, V]; top-k along the last axis"),),
        params=(
            Param(
                "config",
                None,
                "config",
                f"{config_class.__name__}({fields})",
                required=True,
                normalizer=_config_normalizer(config_class, key),
            ),
        ),
        outputs=(),
        output_avals=_outputs,
        reference=reference,
        check=_check_k,
        neuron_limits=limits,
        fold_plans=(FoldPlan({"inp": "R"}, outputs=_OUT_AXES),),
        mac_count=lambda call: int(np.prod(call.avals["inp"].shape)),
        nondifferentiable_outputs=("topk_indices",),
        family="topk",
        catalog=catalog,
        support=support,
    )


ROTATIONAL_TOPK_SPEC = _config_spec(
    "rotational_topk",
    RotationalTopkConfig,
    "orig_k",
    reference_topk,
    _common_limits,
    "1.18",
    {**_SUPPORT, "idiomatic": ""},
)

GPSIMD_MAX_SNAKE = 65536  # nisa.topk: the 16-padded vocab must stay below this
GPSIMD_MAX_K = 32768


def _gpsimd_limits(call: CallInfo) -> list[str]:
    v, k, unmet = call.dims["V"], _k(call.params), []
    if np.dtype(call.avals["inp"].dtype) != np.dtype(jnp.bfloat16):
        unmet.append(f"the kernel takes bfloat16 only; got {call.avals['inp'].dtype}")
    if v < 8 or 16 * -(-v // 16) >= GPSIMD_MAX_SNAKE:
        unmet.append(f"V={v} must be >= 8 with 16*ceil(V/16) < {GPSIMD_MAX_SNAKE}")
    if k >= GPSIMD_MAX_K:
        unmet.append(f"k={k} must be < {GPSIMD_MAX_K}")
    return unmet


GPSIMD_TOPK_SPEC = _config_spec(
    "gpsimd_topk",
    GpsimdTopkConfig,
    "k",
    reference_gpsimd_topk,
    _gpsimd_limits,
    "3",
    {
        "idiomatic": "",
        "vjp": _SUPPORT["vjp"],
        "notes": "docs-only (2.32); NaN ranks last as the lowest finite bf16; Neuron: bfloat16, 8 <= V, "
        "16*ceil(V/16) < 65536, k < 32768; device adapter jax_nkilib_kernels/routing.py",
    },
)

topk = make_kernel(TOPK_SPEC, _values_vjp)
gpsimd_topk = make_kernel(GPSIMD_TOPK_SPEC, _values_vjp)
rotational_topk = make_kernel(ROTATIONAL_TOPK_SPEC, _values_vjp)
