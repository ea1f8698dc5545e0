"""Collective matmuls as ``jax.shard_map`` bodies: a ring of ``ppermute`` steps that overlaps communication with
the matmul of the block in hand, and the dual ring in reverse mode.

* ``all_gather_matmul(x, w)``: ``all_gather(x, gather_axis, tiled=True) @ w``. ``x [..., K]`` has its
  ``gather_axis`` (a token/row axis, not the contraction axis) split over the ring; ``w [K, N]`` is this rank's
  column block (or replicated). Each rank multiplies the ``x`` block it holds, then passes it to its left
  neighbour: ``n - 1`` collective-permutes, no all-gather.
* ``matmul_reduce_scatter(x, w)``: ``psum_scatter(x @ w, scatter_axis, tiled=True)``. ``x [..., K]`` holds this
  rank's slice of the contraction dimension and ``w [K, N]`` the matching rows. A running partial sum travels the
  ring; each rank adds its own product for the block the sum is heading to: ``n - 1`` collective-permutes, no
  reduce-scatter or all-reduce.

On Neuron, ``x [m, K]`` row blocks (``gather_axis=0``, one dtype) gathering over consecutive ranks are the NKI
``allgather_compute_matmul`` kernel (FGCC: the ring runs inside the kernel); other calls, and any call outside its
limits, lower to the ring below (``jax_nkilib.explain`` says which). Reverse mode is the same either way.

Rank ``r`` of the ring is ``lax.axis_index(axis_name)``; blocks of the gathered/scattered axis are in rank order,
as ``lax.all_gather``/``lax.psum_scatter`` with ``tiled=True`` give them. ``axis_name`` is a mesh axis name, or a
tuple of names (one ring over their product), bound by the enclosing ``jax.shard_map``.

Reverse mode (``jax.custom_vjp``) runs the dual rings, saving only ``x`` and ``w`` (named ``<op>.x``/``.w``, and the
output ``<op>.out``, for ``jax_nkilib.checkpoint_policies``):
``d all_gather_matmul / dx = matmul_reduce_scatter(dy, w^T)`` and ``dw = all_gather(x)^T dy`` (a ring circulating
``x``); ``d matmul_reduce_scatter / dx = all_gather_matmul(dy, w^T)`` and ``dw = x^T all_gather(dy)`` (a ring
circulating ``dy``). A ``w`` replicated over the mesh gets the sum of its per-rank cotangents.

Dtypes: the operands are promoted to a common floating dtype; products accumulate in float32 (float64 for float64
inputs), the travelling partial sums of ``matmul_reduce_scatter`` included; the output has ``x``'s dtype.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from ..collectives.allgather import allgather_compute_matmul
from ..collectives.ring import common_dtype, contract_last, gather_matmul, shift, visit_ring
from ..framework import compat, registry
from ..framework.arguments import array_argument
from ..framework.checkpoint_policies import name_operands, name_outputs
from ..framework.mesh_axes import bound_axis, bound_axis_size, lax_axis
from ..framework.spec import accumulation_dtype
from . import auto


# ----------------------------------------------------------------------------------------------------- checks
def _check(function: str, x, w, axis, axis_arg: str):
    """Validate ``x [..., K]``, ``w [K, N]`` and the token axis; return ``(x, w, axis normalized)``."""
    x, w = (array_argument(function, name, value, dtypes="floating") for name, value in (("x", x), ("w", w)))
    if w.ndim != 2:
        raise ValueError(f"{function}: `w` must have layout [K, N] (rank 2); got shape {w.shape}")
    if x.ndim < 2:
        raise ValueError(f"{function}: `x` must have layout [..., tokens, ..., K] (rank >= 2); got shape {x.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(
            f"{function}: the contraction dimensions differ: x [..., K={x.shape[-1]}] but w [K={w.shape[0]}, N]"
        )
    if not isinstance(axis, int) or isinstance(axis, bool):
        raise TypeError(f"{function}: `{axis_arg}` must be an int; got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{function}: `{axis_arg}`={axis} is out of range for x of rank {x.ndim}")
    axis %= x.ndim
    if axis == x.ndim - 1:
        raise ValueError(f"{function}: `{axis_arg}` must be a token axis of x, not its last (contraction) axis")
    return x, w, axis


# ------------------------------------------------------------------------------------------------ ring pieces
def _contract_leading(a, b, acc):
    """``sum over every axis but the last of a[..., K] b[..., N]`` -> ``[K, N]`` in ``acc``."""
    leading = tuple(range(a.ndim - 1))
    return lax.dot_general(a, b, ((leading, leading), ((), ())), preferred_element_type=acc)


def _mesh_devices() -> int | None:
    mesh = jax.sharding.get_abstract_mesh()
    sizes = tuple(getattr(mesh, "axis_sizes", ()) or ())
    return math.prod(sizes) if sizes else None


def _gathered_product(x, w, names, axis):
    """``all_gather(x) @ w``: for row blocks ``x [m, K]`` of ``w``'s dtype, the NKI ``allgather_compute_matmul``
    kernel (FGCC; on CPU/GPU its reference is :func:`gather_matmul`, on Neuron the kernel when its limits hold);
    otherwise the ring directly."""
    devices = _mesh_devices()
    if x.ndim != 2 or axis != 0 or x.dtype != w.dtype or devices is None:
        return gather_matmul(x, w, names, axis)
    n = bound_axis_size(names)
    out = allgather_compute_matmul(x, w, tp_degree=n, num_groups=devices // n, replica_groups=names)
    return out.reshape(n * x.shape[0], w.shape[1])


def _matmul_scatter(x, w, names, axis):
    """``psum_scatter(x @ w, axis, tiled=True)`` by a ring of float32 partial sums; output in ``x``'s dtype."""
    n = bound_axis_size(names)
    out_dtype = x.dtype
    x, w, acc = common_dtype(x, w)
    rows = x.shape[axis] // n
    rank = lax.axis_index(lax_axis(names))

    def product(block):
        return contract_last(lax.dynamic_slice_in_dim(x, block * rows, rows, axis), w, acc)

    # at step s rank r adds its share of block (r + s + 1) % n; the sum arriving from r + 1 is heading there too
    total = product((rank + 1) % n)
    for s in range(1, n):
        total = shift(total, names, n) + product((rank + s + 1) % n)
    return total.astype(out_dtype)


def _weight_grad_ring(travelling, local, names, axis, travelling_first):
    """``dw``: the sum over ranks ``b`` of ``contract(rank b's travelling block, local block b)`` over every axis
    but the last (operands in that order when ``travelling_first``, else swapped). ``travelling`` goes round the
    ring; ``local`` is sliced along ``axis`` at each block's source rank."""
    n = bound_axis_size(names)
    rows = travelling.shape[axis]
    dtype = jnp.promote_types(local.dtype, travelling.dtype)
    acc = accumulation_dtype(dtype)
    local, travelling = local.astype(dtype), travelling.astype(dtype)

    def step(total, block, source):
        mine = lax.dynamic_slice_in_dim(local, source * rows, rows, axis)
        return total + (
            _contract_leading(block, mine, acc) if travelling_first else _contract_leading(mine, block, acc)
        )

    sizes = (travelling.shape[-1], local.shape[-1])
    zero = compat.varying_like(jnp.zeros(sizes if travelling_first else sizes[::-1], acc), local, travelling)
    return visit_ring(travelling, names, n, step, zero)


def _as_cotangent(grad, primal):
    grad = compat.sum_over_extra_varying(grad, primal).astype(primal.dtype)
    return compat.varying_like(grad, primal)


# --------------------------------------------------------------------------------------------- differentiable
_OPERANDS = ("x", "w")
for _name in ("all_gather_matmul", "matmul_reduce_scatter"):
    registry.register_checkpointed(_name, _OPERANDS)


def _named_forward(name: str, product, x, w, names, axis):
    """``product`` with its inputs and output named ``<name>.x/.w/.out`` for remat policies (the named output is
    the one returned, so a policy that saves it keeps the forward ring from running again)."""
    x, w = name_operands(name, dict(zip(_OPERANDS, (x, w)))).values()
    (out,) = name_outputs(name, {"out": product(x, w, names, axis)}, _OPERANDS)
    return out, (x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _all_gather_matmul(x, w, names, axis):
    return _gathered_product(x, w, names, axis)


def _all_gather_matmul_fwd(x, w, names, axis):
    return _named_forward("all_gather_matmul", _gathered_product, x, w, names, axis)


def _all_gather_matmul_bwd(names, axis, residuals, dy):
    x, w = residuals
    dx = _matmul_scatter(dy, w.T, names, axis)
    dw = _weight_grad_ring(x, dy, names, axis, travelling_first=True)  # gather(x)^T dy
    return _as_cotangent(dx, x), _as_cotangent(dw, w)


_all_gather_matmul.defvjp(_all_gather_matmul_fwd, _all_gather_matmul_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _matmul_reduce_scatter(x, w, names, axis):
    return _matmul_scatter(x, w, names, axis)


def _matmul_reduce_scatter_fwd(x, w, names, axis):
    return _named_forward("matmul_reduce_scatter", _matmul_scatter, x, w, names, axis)


def _matmul_reduce_scatter_bwd(names, axis, residuals, dy):
    x, w = residuals
    dx = _gathered_product(dy, w.T, names, axis)
    dw = _weight_grad_ring(dy, x, names, axis, travelling_first=False)  # x^T gather(dy)
    return _as_cotangent(dx, x), _as_cotangent(dw, w)


_matmul_reduce_scatter.defvjp(_matmul_reduce_scatter_fwd, _matmul_reduce_scatter_bwd)


# ------------------------------------------------------------------------------------------------------ public
auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.all_gather_matmul",
        free={},
        collective={
            "m": (
                "gather_axis of x",
                "inside jax.shard_map, over axis_name: a ppermute ring overlapping the "
                "gather with the matmul (n-1 permutes)",
            )
        },
        note="a shard_map building block: call it on local shards with axis_name",
    )
)
auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.matmul_reduce_scatter",
        free={},
        collective={
            "k": (
                "contraction",
                "inside jax.shard_map, over axis_name: a ring of partial sums (n-1 permutes) "
                "scattered along scatter_axis",
            )
        },
        note="a shard_map building block: call it on local shards with axis_name",
    )
)


def all_gather_matmul(x, w, *, axis_name, gather_axis: int = 0):
    """``all_gather(x, gather_axis, tiled=True) @ w`` over mesh axis ``axis_name``, inside ``jax.shard_map``.

    Args:
      x: ``[..., K]``, this rank's block of the ``gather_axis`` (any axis but the last).
      w: ``[K, N]``, this rank's columns (or the whole, replicated, weight).
      axis_name: the mesh axis (or tuple of axes) of the ring.
      gather_axis: the token/row axis of ``x`` that is split over the ring.

    Returns:
      ``x.shape`` with ``gather_axis`` multiplied by the ring size and the last axis ``N``: every rank's rows in
      rank order, times ``w``; float32 accumulation, ``x``'s dtype.
    """
    names, _ = bound_axis("all_gather_matmul", axis_name)
    x, w, axis = _check("all_gather_matmul", x, w, gather_axis, "gather_axis")
    return _all_gather_matmul(x, w, names, axis)


def matmul_reduce_scatter(x, w, *, axis_name, scatter_axis: int = 0):
    """``psum_scatter(x @ w, scatter_axis, tiled=True)`` over mesh axis ``axis_name``, inside ``jax.shard_map``.

    Args:
      x: ``[..., K]``, this rank's slice of the contraction dimension.
      w: ``[K, N]``, the matching rows of the weight.
      axis_name: the mesh axis (or tuple of axes) of the ring.
      scatter_axis: the token/row axis of the result to scatter (any axis of ``x`` but the last); its size must
        divide by the ring size.

    Returns:
      ``x.shape`` with ``scatter_axis`` divided by the ring size and the last axis ``N``: block ``r`` (rank order)
      of the sum over ranks of ``x @ w``; float32 accumulation (the partial sums travel in float32), ``x``'s dtype.
    """
    names, n = bound_axis("matmul_reduce_scatter", axis_name)
    x, w, axis = _check("matmul_reduce_scatter", x, w, scatter_axis, "scatter_axis")
    if x.shape[axis] % n:
        raise ValueError(
            f"matmul_reduce_scatter: x's scatter_axis {axis} has size {x.shape[axis]}, which does not "
            f"divide over the {n} ranks of axis {axis_name!r}"
        )
    return _matmul_reduce_scatter(x, w, names, axis)


__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]
