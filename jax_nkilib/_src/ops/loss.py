"""``jax_nkilib.cross_entropy``: softmax cross-entropy with integer labels over ``logits [..., V]``, on the NKI
Library's fused kernels.

Math, per position ``i`` (float32, or float64 for float64 logits): ``lse_i = log sum_j exp(x_ij)``,
``loss_i = lse_i - x_{i, y_i} + z_loss * lse_i^2``; a position whose label equals ``ignore_index`` has loss 0 and
gradient 0. ``reduction``: ``"mean"`` (over the positions not ignored; 0 when every one is), ``"sum"``, or ``"none"``
(``[...]``).

Forward: ``cross_entropy_forward`` (``dtype=float32``, chunks of 16384 columns: the kernel tests' float32 setting;
the kernels' default ``dtype=bfloat16`` would round the saved ``lse`` to 8 bits, and the backward's
``exp(x - lse)`` would then be off by up to ``|lse| 2^-9`` relative, about 2% at a 128k vocabulary).
Reverse mode (a ``jax.custom_vjp`` here): ``cross_entropy_backward`` with ``reduction="sum"``, i.e. ``G = softmax -
onehot`` for a cotangent of 1 on every row, written over the logits buffer (``inplace=True``, the logits' dtype);
then ``dlogits = c_i (1 + 2 z lse_i) G + 2 z c_i lse_i onehot`` with ``c_i`` the row's real cotangent (``1/count``
for the mean, the upstream scalar for the sum, the upstream row for ``"none"``, 0 for ignored rows). The one-hot term
exists only with ``z_loss``. Glue around the two kernels: the reshape to ``[N, V]``, the labels as int32 (ignored
labels replaced by 0 so the kernel never reads outside a row), the ``[N]`` mask and reduction, and one row-scaling
multiply of the ``[N, V]`` gradient (the kernel takes no upstream gradient).

Off Neuron the kernels' JAX references run: chunked over the vocabulary (``lax.fori_loop``), they never materialise a
float32 softmax of the whole logits; the gradient is ``[..., V]`` in the logits' dtype.

Sharding: the leading (token) axes may be split (explicit mesh axes): each device computes its rows; ``"mean"`` and
``"sum"`` add one all-reduce (psum) of the partial sum (and, for the mean with ``ignore_index``, one of the count of
rows not ignored). The vocabulary axis must be replicated.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument
from ..framework.spec import accumulation_dtype
from ..framework.validation import static_float, static_int
from ..loss.cross_entropy import cross_entropy_backward, cross_entropy_forward
from ..sharding import auto

WHERE = "jax_nkilib.cross_entropy"
REDUCTIONS = ("mean", "sum", "none")
KERNEL_CHUNK = 16384  # float32 chunk of the kernels' own tests (and within the backward's SBUF limit)
INT32_MIN = -(2**31)

CROSS_ENTROPY_SHARDING = auto.register_rule(
    auto.ShardingRule(
        WHERE,
        free={},
        collective={
            letter: (
                "leading (token) axes",
                "local row losses; mean/sum: one psum of the partial sum (and of the count, with ignore_index)",
            )
            for letter in auto.LEADING
        },
        note="the vocabulary axis must be replicated",
    )
)


def _kernel_params(logits):
    vocab = logits.shape[-1]
    return dict(positions_per_batch=32, chunk_size=min(vocab, KERNEL_CHUNK), dtype=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _row_losses(logits, targets, counted, z_loss):
    """``[N]`` losses of ``logits [N, V]`` for ``targets [N]`` int32 (0 where not ``counted``)."""
    return _row_losses_forward(logits, targets, counted, z_loss)[0]


def _row_losses_forward(logits, targets, counted, z_loss):
    params = cross_entropy_forward.params(**_kernel_params(logits))
    loss, lse = cross_entropy_forward.call({"logits_hbm": logits, "targets_hbm": targets}, params)
    rows = loss + z_loss * jnp.square(lse) if z_loss else loss
    if counted is not None:
        rows = jnp.where(counted, rows, 0)
    return rows, (logits, targets, counted, lse)


def _row_losses_backward(z_loss, residuals, cotangent):
    logits, targets, counted, lse = residuals
    wide = accumulation_dtype(logits.dtype)
    row = cotangent.astype(wide) if counted is None else jnp.where(counted, cotangent.astype(wide), 0)
    params = cross_entropy_backward.params(reduction="sum", inplace=True, **_kernel_params(logits))
    (grad,) = cross_entropy_backward.call(
        {"logits_hbm": logits, "targets_hbm": targets, "lse_state_hbm": lse}, params
    )  # softmax - onehot, the gradient of sum(loss)
    lse = lse.astype(wide)
    dlogits = (row * (1 + 2 * z_loss * lse) if z_loss else row)[:, None] * grad.astype(wide)
    if z_loss:  # softmax = grad + onehot
        onehot = jnp.arange(logits.shape[1], dtype=jnp.int32)[None, :] == targets[:, None]
        dlogits = dlogits + jnp.where(onehot, (2 * z_loss * row * lse)[:, None], 0)
    return dlogits.astype(logits.dtype), None, None


_row_losses.defvjp(_row_losses_forward, _row_losses_backward)


def _local_losses(logits, labels, ignore_index, z_loss):
    """``(row losses [N], count of rows not ignored)`` of the local ``logits [..., V]``."""
    flat = logits.reshape(-1, logits.shape[-1])
    targets = labels.reshape(-1).astype(jnp.int32)
    counted = None
    if ignore_index is not None:
        counted = targets != ignore_index
        targets = jnp.where(counted, targets, 0)
    rows = _row_losses(flat, targets, counted, z_loss)
    return rows, (rows.shape[0] if counted is None else jnp.sum(counted, dtype=rows.dtype))


def _reduce(rows, count, reduction, leading_shape, psum_axes=(), shards=1):
    """``rows`` reduced; inside a plan, over the ``shards`` devices of ``psum_axes`` (``count``: the local count of
    rows not ignored, a Python int when every row counts)."""
    if reduction == "none":
        return rows.reshape(leading_shape)
    total = jnp.sum(rows)
    if psum_axes:
        total = jax.lax.psum(total, psum_axes)
    if reduction == "sum":
        return total
    if isinstance(count, int):
        return total / max(count * shards, 1)
    if psum_axes:
        count = jax.lax.psum(count, psum_axes)
    return total / jnp.maximum(count, 1)


def cross_entropy(logits, labels, *, reduction: str = "mean", ignore_index: int | None = None, z_loss: float = 0.0):
    """Softmax cross-entropy of ``logits [..., V]`` against integer ``labels [...]``.

    Equal to ``optax.softmax_cross_entropy_with_integer_labels(logits, labels)`` reduced by ``reduction``
    (``"mean"`` default, ``"sum"``, ``"none"``), plus ``z_loss * logsumexp(logits)^2`` per position when ``z_loss``
    is given (PaLM's z-loss). Positions whose label is ``ignore_index`` count 0 and are left out of the mean.

    Args:
      logits: ``[..., V]`` float32 or bfloat16 (float16 computes as float32; float64 off Neuron only).
      labels: ``[...]`` integers in ``[0, V)`` (or ``ignore_index``); another label gives an undefined loss.
      reduction: ``"mean"``, ``"sum"`` or ``"none"``.
      ignore_index: a static int label to ignore, or ``None``.
      z_loss: static float >= 0.

    Returns a float32 scalar (``[...]`` for ``"none"``); float64 for float64 logits. Differentiable in ``logits``
    (the gradient in ``logits``' dtype). On Neuron: ``cross_entropy_forward``, and its reverse mode
    ``cross_entropy_backward`` (see the module docstring for the glue).
    """
    logits = array_argument(WHERE, "logits", logits, layout="[..., vocab]")
    if logits.ndim < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{WHERE}: `logits` must be [..., vocab] with vocab >= 1; got shape {logits.shape}")
    labels = array_argument(WHERE, "labels", labels, layout="[...]", dtypes="integer")
    if labels.shape != logits.shape[:-1]:
        raise ValueError(
            f"{WHERE}: `labels` must have the shape of logits [..., vocab] without vocab, {logits.shape[:-1]}; got "
            f"{labels.shape}"
        )
    if reduction not in REDUCTIONS:
        raise ValueError(f"{WHERE}: `reduction` must be one of {', '.join(REDUCTIONS)}; got {reduction!r}")
    if ignore_index is not None:
        ignore_index = static_int(WHERE, "ignore_index", ignore_index, minimum=INT32_MIN)
    z_loss = static_float(WHERE, "z_loss", z_loss, minimum=0.0)
    if logits.dtype == np.dtype(jnp.float16):
        logits = logits.astype(jnp.float32)  # the kernels take bfloat16 or float32
    lead = auto.leading(logits.ndim - 1, WHERE, "logits")
    sharded = auto.plan(
        CROSS_ENTROPY_SHARDING,
        [auto.ShardedArgument("logits", logits, lead + "v"), auto.ShardedArgument("labels", labels, lead)],
    )
    if sharded:

        def local(logits, labels, axes):
            names = tuple(name for letter in lead for name in axes.get(letter, ()))
            shards = math.prod(sharded.axis_size(letter) for letter in lead)
            rows, count = _local_losses(logits, labels, ignore_index, z_loss)
            return _reduce(rows, count, reduction, labels.shape, names, shards)

        return sharded.run(local, lead if reduction == "none" else None)
    if math.prod(labels.shape) == 0:
        return jnp.zeros(labels.shape if reduction == "none" else (), accumulation_dtype(logits.dtype))
    rows, count = _local_losses(logits, labels, ignore_index, z_loss)
    return _reduce(rows, count, reduction, labels.shape)
