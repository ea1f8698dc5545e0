"""``jax_nkilib.optim``: Adam, AdamW and global-norm clipping as optax ``GradientTransformation`` s whose update runs
the NKI Library's fused kernels (``adam_kernel`` / ``adamw_kernel`` per parameter leaf, ``l2_norm_kernel`` per
gradient leaf) on Neuron, and their JAX references elsewhere.

**Math.** Step ``t = count + 1`` with learning rate ``lr = learning_rate(count)`` (a schedule is evaluated at the
step count before the update, as optax's ``scale_by_learning_rate``). Per leaf, in the leaf's dtype (gradients are
cast to it; moments are stored in it, as optax's defaults do)::

    m = b1 * m + (1 - b1) * g;   v = b2 * v + (1 - b2) * g^2;   [v_max = max(v_max, v)]   (amsgrad)
    new_param = param * wd_factor - lr / (1 - b1^t) * m / (sqrt(v or v_max) / sqrt(1 - b2^t) + eps)

``adamw``: ``wd_factor = 1 - lr * weight_decay`` (decoupled decay; 1 for leaves ``mask`` excludes), which is
``optax.adamw``'s ``param - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * param)`` regrouped. ``adam``:
``wd_factor = 1``, with ``weight_decay`` (default 0) added to the gradient first (torch.optim.Adam's L2 term);
``weight_decay=0`` is ``optax.adam``. The two differ from optax only in rounding. ``amsgrad`` follows torch (the
maximum of the raw ``v``, then bias-corrected), which is *not* ``optax.amsgrad`` (the maximum of the bias-corrected
``v``).

**In place vs. deltas.** The kernel computes the new parameter itself (``param * wd_factor - update``); optax's
interface wants an update to add. ``update(grads, state, params)`` therefore returns ``new_param - param`` per leaf
(``params`` is required), and ``optax.apply_updates(params, updates)`` gives ``new_param`` up to one rounding of the
subtraction and re-addition (exact where they are representable; within float32 tolerance of ``new_param``). On
Neuron, donate the parameters and the state to the jitted step so that XLA reuses their buffers.

**Sharding.** The state holds one array per parameter leaf, created with ``jnp.zeros_like`` (it shards like the
parameters). Under an explicit mesh each leaf's kernel runs inside ``jax.shard_map`` over the mesh axes that split
that leaf (the update is elementwise: no communication); the global norm adds the per-shard squared norms with one
``psum``.

optax is optional: with it installed the transformations are ``optax.GradientTransformation`` s; without it, a
NamedTuple of the same fields ``(init, update)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from ..optim.flat import scalar_tensor
from ..optim.foreach import l2_norm_kernel
from ..optim.fused_adam import adam_kernel, adamw_kernel
from ..sharding import auto

_ELEMENTWISE = auto.ShardingRule("jax_nkilib.optim", free=auto.LEADING, note="elementwise per leaf")


class FusedAdamState(NamedTuple):
    """The state of :func:`adam` / :func:`adamw`: ``count`` (int32 steps taken), the moments ``mu`` and ``nu`` and,
    with amsgrad, ``nu_max`` (else ``None``), each a pytree like the parameters."""

    count: jax.Array
    mu: Any
    nu: Any
    nu_max: Any


class _GradientTransformation(NamedTuple):
    init: Callable
    update: Callable


def gradient_transformation(init: Callable, update: Callable):
    """``optax.GradientTransformation(init, update)``, or a NamedTuple of the same fields without optax."""
    try:
        import optax
    except ImportError:
        return _GradientTransformation(init, update)
    return optax.GradientTransformation(init, update)


def _safe_increment(count):
    return jnp.where(count < jnp.iinfo(jnp.int32).max, count + 1, count)


def _one_minus_power(beta: float, t):
    """``1 - beta^t`` in float32 without cancellation (``-expm1(t * log(beta))``; ``1 - 0.999^1`` computed as a
    float32 difference is off by 1e-5 relative)."""
    return -jnp.expm1(t * jnp.float32(math.log(beta))) if beta > 0 else jnp.ones_like(t)


def _on_shards(body: Callable, operands: list[tuple[str, Any, bool]], out_dims):
    """``body(*values)`` on local shards: operands ``(name, value, elementwise)`` (the others replicated) planned
    over the explicit mesh axes that split the elementwise ones; with none, on whole values."""
    letters = {
        name: auto.leading(jnp.ndim(value)) if elementwise and value is not None else None
        for name, value, elementwise in operands
    }
    arguments = [auto.ShardedArgument(name, value, letters[name]) for name, value, _ in operands]
    plan = auto.plan(_ELEMENTWISE, arguments)
    if plan is None:
        return body(*(value for _, value, _ in operands), axes={})
    return plan.run(body, out_dims(letters))


def _fused_leaf_step(kernel, param, grad, mu, nu, nu_max, scalars, hyper):
    """One kernel call on a flattened leaf (per shard under an explicit mesh): ``(new_param, mu, nu[, nu_max])``."""
    amsgrad = hyper["amsgrad"]

    def body(param, grad, mu, nu, nu_max, *scalars, axes):
        del axes  # elementwise: each shard is updated on its own
        flat = [x.reshape(-1) for x in (param, grad, mu, nu)]
        v_max = nu_max.reshape(-1) if amsgrad else jnp.zeros((1,), param.dtype)  # unread placeholder
        outs = kernel(*flat, v_max, *scalars, numel=param.size, **hyper)
        return tuple(out.reshape(param.shape) for out in outs)

    operands = [
        ("param", param, True),
        ("grad", grad.astype(param.dtype), True),
        ("mu", mu, True),
        ("nu", nu, True),
        ("nu_max", nu_max if amsgrad else None, True),
        *((f"scalar{i}", s, False) for i, s in enumerate(scalars)),
    ]
    return _on_shards(body, operands, lambda letters: (letters["param"],) * (4 if amsgrad else 3))


def _fused_adam(name, learning_rate, b1, b2, eps, weight_decay, mask, amsgrad, decoupled):
    kernel = adamw_kernel if decoupled else adam_kernel
    hyper = {"beta1": float(b1), "beta2": float(b2), "eps": float(eps), "amsgrad": amsgrad}

    def init(params):
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return FusedAdamState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros() if amsgrad else None)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError(
                f"{name}: update(grads, state, params) needs `params`: the fused kernel computes the new parameters "
                "(the returned updates are new_params - params)"
            )
        count = _safe_increment(state.count)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate
        lr = jnp.asarray(lr, jnp.float32)
        t = count.astype(jnp.float32)
        step_size = scalar_tensor(lr / _one_minus_power(b1, t))
        inv_bc2_sqrt = scalar_tensor(jax.lax.rsqrt(_one_minus_power(b2, t)))
        decays = _mask_leaves(mask, params)
        wd_factor = {
            True: scalar_tensor(1 - lr * weight_decay if decoupled else weight_decay),
            False: scalar_tensor(1.0 if decoupled else 0.0),
        }
        leaves, treedef = jax.tree.flatten(params)
        grads = treedef.flatten_up_to(updates)
        mus, nus = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
        maxes = treedef.flatten_up_to(state.nu_max) if amsgrad else [None] * len(leaves)
        stepped = [
            _fused_leaf_step(kernel, p, g, m, v, vm, (step_size, inv_bc2_sqrt, wd_factor[decay]), hyper)
            for p, g, m, v, vm, decay in zip(leaves, grads, mus, nus, maxes, decays)
        ]
        new_updates = treedef.unflatten([out[0] - p for out, p in zip(stepped, leaves)])
        column = lambda i: treedef.unflatten([out[i] for out in stepped])  # noqa: E731
        return new_updates, FusedAdamState(count, column(1), column(2), column(3) if amsgrad else None)

    return gradient_transformation(init, update)


def _mask_leaves(mask, params) -> list[bool]:
    """Per parameter leaf: whether weight decay applies (``mask``: ``None``, a pytree of bools like ``params``, or a
    function of ``params`` returning one)."""
    leaves, treedef = jax.tree.flatten(params)
    if mask is None:
        return [True] * len(leaves)
    flags = treedef.flatten_up_to(mask(params) if callable(mask) else mask)
    for flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"jax_nkilib.optim.adamw: `mask` leaves must be Python bools; got {flag!r}")
    return flags


def adam(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, weight_decay: float = 0.0,
         amsgrad: bool = False):  # fmt: skip
    """Adam (``optax.adam``'s updates; ``adam_kernel`` per leaf). ``learning_rate``: a float or a schedule
    ``count -> lr``; ``weight_decay``: torch's L2 term added to the gradient (0: plain Adam). See the module
    docstring for the math and how the kernel's new parameters become optax updates."""
    return _fused_adam("jax_nkilib.optim.adam", learning_rate, b1, b2, eps, weight_decay, None, amsgrad, False)


def adamw(learning_rate, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, *, weight_decay: float = 1e-4,
          mask=None, amsgrad: bool = False):  # fmt: skip
    """AdamW (``optax.adamw``'s updates; ``adamw_kernel`` per leaf): decoupled weight decay ``weight_decay`` on the
    leaves ``mask`` selects (``None``: all; a pytree of bools or a function of the params returning one)."""
    return _fused_adam("jax_nkilib.optim.adamw", learning_rate, b1, b2, eps, weight_decay, mask, amsgrad, True)


def _leaf_squared_norm(leaf):
    """``sum(leaf^2)`` in float32 through ``l2_norm_kernel`` (per shard, then one psum, under an explicit mesh)."""

    def body(x, *, axes):
        local = l2_norm_kernel(x.reshape(-1), numel=x.size)[0, 0].astype(jnp.float32)
        names = tuple(name for mesh_axes in axes.values() for name in mesh_axes)
        return jax.lax.psum(local * local, names) if names else local * local

    return _on_shards(body, [("x", leaf, True)], lambda letters: None)


def global_norm(tree) -> jax.Array:
    """``sqrt(sum over leaves of sum(leaf^2))`` (float32) through the foreach L2 norm kernel."""
    squares = [_leaf_squared_norm(leaf) for leaf in jax.tree.leaves(tree) if jnp.size(leaf)]
    return jnp.sqrt(sum(squares, jnp.float32(0)))


def clip_by_global_norm(max_norm: float):
    """``optax.clip_by_global_norm``: scale the updates by ``max_norm / global_norm`` when the global L2 norm
    (``l2_norm_kernel`` per leaf) is at least ``max_norm``. Stateless."""

    def init(params):
        del params
        return ()

    def update(updates, state, params=None):
        del params
        norm = global_norm(updates)
        keep = norm < max_norm
        clip = lambda t: jnp.where(keep, t, (t / norm.astype(t.dtype)) * max_norm)  # noqa: E731
        return jax.tree.map(clip, updates), state

    return gradient_transformation(init, update)
