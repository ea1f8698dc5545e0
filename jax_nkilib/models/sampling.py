"""Next-token choice from logits: greedy through ``jax_nkilib.argmax``, top-k / top-p sampling through
``jax_nkilib.topk``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_nkilib


def sample(logits, key=None, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """A token per row of ``logits [batch, vocab]`` (int32 ``[batch]``).

    Without ``key``: the most likely token (``jax_nkilib.argmax``). With a ``key``: the candidates are the
    ``top_k`` largest logits (all ``vocab``, fully sorted, when only ``top_p`` is given; no sort without either),
    sorted by ``jax_nkilib.topk``; ``top_p`` then
    keeps the fewest leading candidates whose probabilities (softmax of ``logits / temperature`` over the
    candidates, as Hugging Face's warpers renormalise) sum to at least ``top_p`` (always the first), and one is
    drawn with probability proportional to ``exp(logit / temperature)``. ``temperature`` > 0, ``top_k`` >= 1 and
    ``0 < top_p <= 1`` are static. On Neuron the ``topk`` kernel needs ``k < vocab`` and ``vocab < 65536`` and
    ``argmax``'s kernels ``vocab <= 16384`` (``cascaded_max``) or the same ``topk`` limits: other calls run XLA's
    sort with a ``NeuronFallbackWarning`` (Llama 3's 128256-token vocabulary is past both).
    """
    if key is None:
        return jax_nkilib.argmax(logits)
    if not temperature > 0:
        raise ValueError(f"jax_nkilib.models.sample: temperature must be > 0; got {temperature}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"jax_nkilib.models.sample: top_p must be in (0, 1]; got {top_p}")
    scaled = logits.astype(jnp.float32) / temperature
    if top_k is None and top_p is None:  # no truncation: no sort either
        return jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    vocab = logits.shape[-1]
    k = vocab if top_k is None else min(int(top_k), vocab)
    values, indices = jax_nkilib.topk(scaled, k)  # descending
    if top_p is not None:
        probs = jax.nn.softmax(values, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass of the better candidates
        values = jnp.where((before < top_p) | (jnp.arange(k) == 0), values, -jnp.inf)
    choice = jax.random.categorical(key, values, axis=-1)
    return jnp.take_along_axis(indices, choice[:, None], axis=-1)[:, 0]
