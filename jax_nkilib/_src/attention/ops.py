"""``jax_nkilib.attention``: prefill attention in JAX layouts on the NKI ``attention_cte`` kernel."""

from __future__ import annotations

import math

import jax.numpy as jnp

from .cte import attention_cte

_WHERE = "jax_nkilib.attention"


def _heads_into_batch(x):
    """[batch, S, H, d] -> [batch * H, S, d] (row b * H + h)."""
    batch, seq, heads, d = x.shape
    return jnp.transpose(x, (0, 2, 1, 3)).reshape(batch * heads, seq, d)


def _check(q, k, v, sinks, prefix, causal, sliding_window) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")) or x.ndim != 4:
            raise ValueError(f"{_WHERE}: `{name}` must be an array [batch, seq, heads, head_dim]; got "
                             f"{getattr(x, 'shape', type(x).__name__)}")
    if k.shape != v.shape:
        raise ValueError(f"{_WHERE}: `k` and `v` must have the same shape [batch, seq_kv, kv_heads, head_dim]; got "
                         f"{k.shape} and {v.shape}")
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{_WHERE}: `q` {q.shape} and `k` {k.shape} must agree on batch and head_dim")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{_WHERE}: query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    if sinks is not None and jnp.shape(sinks) not in ((q.shape[2],), (q.shape[0], q.shape[2])):
        raise ValueError(f"{_WHERE}: `sinks` must be [heads] or [batch, heads] = ({q.shape[2]},) or "
                         f"{q.shape[:1] + q.shape[2:3]}; got {jnp.shape(sinks)}")
    if sliding_window is not None and (not causal or sliding_window <= 0):
        raise ValueError(f"{_WHERE}: sliding_window must be a positive int and needs causal=True; got "
                         f"sliding_window={sliding_window}, causal={causal}")
    if prefix is not None:
        if not (isinstance(prefix, (tuple, list)) and len(prefix) == 3):
            raise TypeError(f"{_WHERE}: `prefix` must be (k_prior, v_prior, prior_len)")
        k_prior, v_prior, _ = prefix
        if jnp.shape(k_prior) != jnp.shape(v_prior) or jnp.ndim(k_prior) != 4 or \
                (jnp.shape(k_prior)[0],) + tuple(jnp.shape(k_prior)[2:]) != (k.shape[0],) + k.shape[2:]:
            raise ValueError(f"{_WHERE}: prefix k_prior/v_prior must be [batch, prior_len_max, kv_heads, head_dim] "
                             f"matching k {k.shape}; got {jnp.shape(k_prior)} and {jnp.shape(v_prior)}")


def attention(q, k, v, *, causal: bool = True, scale: float | None = None, sliding_window: int | None = None,
              sinks=None, prefix=None):
    """Multi-head attention ``softmax(scale * q k^T + mask [‖ sinks]) v`` for prefill.

    Args:
      q: ``[batch, seq_q, heads, head_dim]``.
      k, v: ``[batch, seq_kv, kv_heads, head_dim]``; ``heads % kv_heads == 0`` (GQA/MQA: query head ``h`` uses kv
        head ``h // (heads / kv_heads)``).
      causal: query ``i`` sees keys at positions ``<= i``.
      scale: defaults to ``1/sqrt(head_dim)``.
      sliding_window: with ``causal``, query ``i`` sees only keys at positions ``> i - sliding_window``.
      sinks: ``[heads]`` or ``[batch, heads]`` extra softmax logits (attention sinks), differentiable.
      prefix: ``(k_prior, v_prior, prior_len)``: cached keys/values ``[batch, max_prior, kv_heads, head_dim]`` of
        which the first ``prior_len`` (an int, possibly traced) precede ``k``/``v``; they sit at positions
        ``-prior_len .. -1``, so every query sees them (within the sliding window).

    Returns ``[batch, seq_q, heads, head_dim]`` in ``q``'s dtype; differentiable in ``q``, ``k``, ``v``, ``sinks``
    and the prefix keys/values. Rows that see no key give 0. On Neuron this is the ``attention_cte`` kernel (and
    ``attention_bwd`` in reverse mode); elsewhere a blockwise reference that never forms the score matrix.
    """
    _check(q, k, v, sinks, prefix, causal, sliding_window)
    batch, seq_q, heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    q_rows = _heads_into_batch(q)
    kernel_scale = scale
    if sliding_window or prefix is not None:  # the kernel's contract: pre-scale q, pass scale=1.0
        q_rows, kernel_scale = (q_rows * scale).astype(q.dtype), 1.0
    sink = None
    if sinks is not None:
        sink = jnp.broadcast_to(jnp.asarray(sinks), (batch, heads)).reshape(batch * heads, 1).astype(q.dtype)
    k_prior = v_prior = prior_used_len = None
    if prefix is not None:
        k_prior, v_prior = _heads_into_batch(jnp.asarray(prefix[0])), _heads_into_batch(jnp.asarray(prefix[1]))
        prior_used_len = jnp.asarray(prefix[2], jnp.int32).reshape(1)
    out = attention_cte(q_rows, _heads_into_batch(k), _heads_into_batch(v), k_prior, v_prior, prior_used_len, sink,
                        scale=kernel_scale, causal_mask=causal, sliding_window=sliding_window, tp_q=True, tp_k=True,
                        tp_out=False)
    return jnp.transpose(out.reshape(batch, heads, seq_q, head_dim), (0, 2, 1, 3))
