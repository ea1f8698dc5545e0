"""``jax_nkilib.flax_attention_fn``: :func:`jax_nkilib.dot_product_attention` behind Flax's ``attention_fn``
signature, for ``flax.nnx.MultiHeadAttention(attention_fn=...)`` and ``flax.linen.MultiHeadDotProductAttention``.

This module imports no Flax: Flax stays optional, and the function is plain JAX (jit, grad, vmap, shard_map).

What the Flax modules pass (read from flax 0.12.8; flax 0.11 passes the same minus ``is_causal``):

* ``flax/nnx/nn/attention.py``, ``MultiHeadAttention.__call__``::

      self.attention_fn(query, key, value, mask=mask, dropout_rng=dropout_rng, dropout_rate=self.dropout_rate,
                        broadcast_dropout=self.broadcast_dropout, deterministic=deterministic, dtype=self.dtype,
                        precision=self.precision, module=self if sow_weights else None, is_causal=is_causal)

  with ``query [batch..., q_length, num_heads, head_dim]``, ``key``/``value [batch..., kv_length, num_kv_heads,
  head_dim]`` (grouped-query attention when ``num_kv_heads < num_heads``), a ``mask`` broadcastable to
  ``[batch..., num_heads, q_length, kv_length]`` (``nnx.make_causal_mask`` and friends build float32 1/0 masks;
  decoding adds its cache mask with ``nnx.combine_masks``), and ``deterministic`` forced to ``True`` when
  ``dropout_rate == 0``. The keywords are passed whatever ``attention_fn``'s signature is.
* ``flax/linen/attention.py``, ``MultiHeadDotProductAttention.__call__``: the same ``query, key, value, mask,
  dropout_rng, dropout_rate, broadcast_dropout, deterministic, dtype, precision`` plus ``force_fp32_for_softmax``,
  ``qk_attn_weights_einsum`` and ``attn_weights_value_einsum`` (AQT's quantized einsums), keeping only the keywords
  that ``inspect.signature(attention_fn)`` names (hence every one is named here, none hidden in ``**kwargs``), and
  ``module=self`` only with ``sow_weights=True``.

Flax's own ``dot_product_attention(query, key, value, bias=None, mask=None, broadcast_dropout=True,
dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None, ...)`` is the
contract mirrored here.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from .dot_product_attention import dot_product_attention

_WHERE = "jax_nkilib.flax_attention_fn"


def _compute_dtype(dtype, *arrays):
    """Flax's ``promote_dtype``: ``dtype`` when given, else the arrays' result type, made floating (float32)."""
    if dtype is None:
        dtype = jnp.result_type(*arrays)
        if not jnp.issubdtype(dtype, jnp.inexact):
            dtype = jnp.promote_types(jnp.float32, dtype)
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"{_WHERE}: `dtype` must be a floating dtype; got {dtype}")
    return dtype


def _is_default_precision(precision) -> bool:
    """``None``, ``Precision.DEFAULT`` or its names (``"default"``, ``"fastest"``, ``"bfloat16"``), or a pair."""
    if precision is None:
        return True
    if isinstance(precision, (tuple, list)) and len(precision) == 2:
        return all(_is_default_precision(p) for p in precision)
    if isinstance(precision, str):
        try:
            precision = lax.Precision(precision)
        except ValueError:
            return False
    return isinstance(precision, lax.Precision) and precision == lax.Precision.DEFAULT


def _flatten_batch(x, batch_shape, name):
    """A bias or mask ``[batch..., N, T, S]`` (leading axes possibly missing or 1) as ``[prod(batch) or 1, N, T,
    S]`` for a query whose batch axes ``batch_shape`` are flattened into one."""
    if x is None:
        return None
    rank = len(batch_shape) + 3
    if x.ndim > rank:
        raise ValueError(
            f"{_WHERE}: `{name}` must broadcast to [batch..., num_heads, q_length, kv_length] (rank {rank}); "
            f"got shape {tuple(x.shape)}"
        )
    x = jnp.reshape(x, (1,) * (rank - x.ndim) + x.shape)
    lead = x.shape[: len(batch_shape)]
    if all(size == 1 for size in lead):
        return jnp.reshape(x, (1,) + x.shape[len(batch_shape) :])
    if any(size not in (1, full) for size, full in zip(lead, batch_shape)):
        raise ValueError(
            f"{_WHERE}: the batch axes of `{name}` {tuple(lead)} do not broadcast to the query's {tuple(batch_shape)}"
        )
    x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[len(batch_shape) :])
    return jnp.reshape(x, (math.prod(batch_shape),) + x.shape[len(batch_shape) :])


def flax_attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
):
    """Flax's ``attention_fn`` on :func:`jax_nkilib.dot_product_attention`: pass it as
    ``flax.nnx.MultiHeadAttention(..., attention_fn=jax_nkilib.flax_attention_fn)`` or
    ``flax.linen.MultiHeadDotProductAttention(..., attention_fn=jax_nkilib.flax_attention_fn)``.

    Args (those of ``flax.nnx.dot_product_attention`` / ``flax.linen.dot_product_attention``):
      query: ``[batch..., q_length, num_heads, head_dim]``; key, value: ``[batch..., kv_length, num_kv_heads,
        head_dim]`` (``num_heads % num_kv_heads == 0``). Any number of batch axes, none included; more than one
        are flattened into one (and restored).
      bias: floating, broadcastable to ``[batch..., num_heads, q_length, kv_length]``, added to the logits.
      mask: broadcastable likewise; attend where nonzero / ``True`` (Flax's float32 1/0 masks and boolean ones).
      is_causal: a causal mask, as ``flax.nnx``'s argument; passed to ``dot_product_attention``. With no ``mask``
        and no ``bias`` this call is the ``attention_cte`` kernel on Neuron; a dense mask or bias is not (the
        blockwise engine runs, with a ``NeuronFallbackWarning``): prefer ``is_causal=True`` to a causal mask.
      dtype: the computation dtype: query, key and value are cast to it, or to their promoted floating dtype when
        ``None`` (Flax's ``promote_dtype``); the output has it.
      dropout_rate, deterministic: the kernels have no attention dropout: ``dropout_rate > 0`` with
        ``deterministic=False`` raises a ``ValueError``. With no dropout active, ``dropout_rng`` and
        ``broadcast_dropout`` are unused.
      precision: only the default (``None``, ``lax.Precision.DEFAULT`` or its names) is accepted: the scores and
        accumulations run at the kernels' precision (float32 accumulation), which a ``HIGH`` or ``HIGHEST`` request
        cannot change, so those raise a ``ValueError`` rather than being silently dropped.
      module: set by Flax for ``sow_weights=True``; the attention weights are never formed (blockwise softmax),
        so a module raises a ``ValueError``.
      force_fp32_for_softmax: accepted and satisfied: the softmax statistics are always float32 (float64 for
        float64 inputs).
      qk_attn_weights_einsum, attn_weights_value_einsum: custom (quantized) einsums cannot replace the kernels'
        matmuls: anything but ``None`` raises a ``ValueError``.

    Returns ``[batch..., q_length, num_heads, head_dim]`` in the computation dtype.

    As in :func:`jax_nkilib.dot_product_attention`, a query row whose mask allows no key gives 0 (Flax's and
    JAX's finite masking value gives the mean of the values there).
    """
    if dropout_rate and not deterministic:
        raise ValueError(
            f"{_WHERE}: attention dropout is not supported (the NKI attention kernels have none); got "
            f"dropout_rate={dropout_rate!r} with deterministic={deterministic!r}. Use dropout_rate=0, or "
            "deterministic=True, or Flax's own attention_fn where attention dropout is needed"
        )
    if module is not None:
        raise ValueError(
            f"{_WHERE}: cannot sow the attention weights (`module` is set by sow_weights=True): the blockwise "
            "attention never forms them; call the Flax module with sow_weights=False"
        )
    if not _is_default_precision(precision):
        raise ValueError(
            f"{_WHERE}: `precision` must be None or lax.Precision.DEFAULT; got {precision!r}. The attention runs at "
            "the kernels' precision (float32 accumulation), which a per-call precision cannot raise"
        )
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise ValueError(
            f"{_WHERE}: custom einsums (`qk_attn_weights_einsum`, `attn_weights_value_einsum`, e.g. AQT's) cannot "
            "replace the attention kernels' matmuls"
        )
    del broadcast_dropout, dropout_rng, force_fp32_for_softmax  # unused once no dropout is active (see above)
    query, key, value = (jnp.asarray(x) for x in (query, key, value))
    dtype = _compute_dtype(dtype, query, key, value)
    query, key, value = (x.astype(dtype) for x in (query, key, value))
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"{_WHERE}: `query`, `key` and `value` must have one rank >= 3 ([batch..., length, heads, head_dim]); "
            f"got shapes {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    batch_shape = query.shape[:-3]
    if key.shape[:-3] != batch_shape or value.shape[:-3] != batch_shape:
        raise ValueError(
            f"{_WHERE}: `query`, `key` and `value` must have the same batch axes; got shapes {tuple(query.shape)}, "
            f"{tuple(key.shape)}, {tuple(value.shape)}"
        )
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            mask = mask != 0
    if bias is not None:
        bias = jnp.asarray(bias)
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            bias = bias.astype(dtype)
    if len(batch_shape) <= 1:  # [B, T, N, H] or unbatched [T, N, H]: dot_product_attention's own layouts
        return dot_product_attention(query, key, value, bias, mask, is_causal=is_causal)
    flat = lambda x: jnp.reshape(x, (math.prod(batch_shape),) + x.shape[-3:])  # noqa: E731
    out = dot_product_attention(
        flat(query),
        flat(key),
        flat(value),
        _flatten_batch(bias, batch_shape, "bias"),
        _flatten_batch(mask, batch_shape, "mask"),
        is_causal=is_causal,
    )
    return jnp.reshape(out, batch_shape + out.shape[1:])
