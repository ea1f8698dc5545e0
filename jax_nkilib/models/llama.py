"""A Llama-3-style decoder built from jax_nkilib's idiomatic ops: prefill, cached decoding, generation, training.

Each layer is ``x += attention(x)`` then ``x += mlp(rmsnorm(x))``, with ``attention = o_proj(attn(rope(q), rope(k),
v))`` over ``q, k, v = rmsnorm(x) @ w_qkv`` (GQA, RoPE on halves, llama3 frequency scaling) and a SwiGLU
MLP ``(silu(n w_gate) * (n w_up)) w_down``; logits are ``rmsnorm(x) @ lm_head`` (``embed^T`` when tied).

Parameters are a plain pytree of arrays in ``config.dtype`` (a ``{"params": ...}`` wrapper, as Flax makes, is
accepted everywhere)::

    {"embed": [vocab, hidden], "final_norm": [hidden], "lm_head": [hidden, vocab] (untied only),
     "layers": [{"attn_norm": [hidden], "w_qkv": [hidden, kv_heads, heads / kv_heads + 2, head_dim],
                 "w_o": [heads * head_dim, hidden], "mlp_norm": [hidden], "w_gate", "w_up": [hidden,
                 intermediate], "w_down": [intermediate, hidden]}, ...]}

``w_qkv`` is grouped by kv head (each kv head's query heads, then its key and value; see
:mod:`jax_nkilib.models.qkv_layout`): the fused decode kernel's layout, reached by a reshape.
Projections are ``x @ w`` (``[in, out]``; Hugging Face stores the transpose, see :mod:`jax_nkilib.models.hf`).
The KV cache is a list with one ``(k_cache, v_cache)`` per layer, each ``[batch, kv_heads, max_len, head_dim]``
(the ops' cache layout) holding up to ``max_len - 1`` tokens: the last slot is
:func:`jax_nkilib.decode_block`'s scratch, and on Neuron its kernels need ``max_len`` to be
a multiple of 128. On Neuron each jax_nkilib op is its NKI kernel (the embedding lookup and the LM head are XLA);
elsewhere the kernels' JAX references run. A decode step's per-layer attention half is
:func:`jax_nkilib.decode_block` (:func:`attention_decode`), one fused ``attention_block_tkg`` kernel on Neuron where
a device holds one kv head.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib

from .config import Llama3RopeScaling, LlamaConfig, rope_tables
from .hf import load_hf_checkpoint
from .parallel import param_specs
from .qkv_layout import group_qkv, projection_weight
from .sampling import sample

__all__ = [
    "Llama3RopeScaling",
    "LlamaConfig",
    "decode_step",
    "forward",
    "generate",
    "init_cache",
    "init_params",
    "load_hf_checkpoint",
    "loss",
    "param_specs",
    "prefill",
    "sample",
    "train_step",
]

# ------------------------------------------------------------------------------------------------ parameters


def unwrap(params):
    """The parameter tree itself, also when given as Flax's ``{"params": tree}``."""
    return params["params"] if set(params) == {"params"} else params


def init_params(config: LlamaConfig, key) -> dict:
    """Random parameters: normal weights with std ``fan_in**-0.5`` (embeddings std 1), norm gains 1."""
    dtype = config.param_dtype
    keys = iter(jax.random.split(key, 2 + 7 * config.layers))

    def dense(n_in, n_out):
        return (jax.random.normal(next(keys), (n_in, n_out), jnp.float32) * n_in**-0.5).astype(dtype)

    q_dim, kv_dim = config.heads * config.head_dim, config.kv_heads * config.head_dim
    ones = jnp.ones((config.hidden,), dtype)
    params = {
        "embed": jax.random.normal(next(keys), (config.vocab, config.hidden), jnp.float32).astype(dtype),
        "final_norm": ones,
        "layers": [
            {
                "attn_norm": ones,
                "w_qkv": group_qkv(
                    dense(config.hidden, q_dim),
                    dense(config.hidden, kv_dim),
                    dense(config.hidden, kv_dim),
                    config.kv_heads,
                ),
                "w_o": dense(q_dim, config.hidden),
                "mlp_norm": ones,
                "w_gate": dense(config.hidden, config.intermediate),
                "w_up": dense(config.hidden, config.intermediate),
                "w_down": dense(config.intermediate, config.hidden),
            }
            for _ in range(config.layers)
        ],
    }
    if not config.tie_embeddings:
        params["lm_head"] = dense(config.hidden, config.vocab)
    return params


def init_cache(config: LlamaConfig, batch: int, dtype=None) -> list:
    """An empty KV cache for ``batch`` sequences of up to ``config.max_len - 1`` tokens (the last slot is the
    decode kernel's scratch): per layer ``(k, v)``, each ``[batch, kv_heads, max_len, head_dim]`` zeros in
    ``dtype`` (default ``config.dtype``)."""
    shape = (batch, config.kv_heads, config.max_len, config.head_dim)
    dtype = config.param_dtype if dtype is None else dtype
    return [(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(config.layers)]


# ------------------------------------------------------------------------------------------------ layers


def _qkv(layer, config: LlamaConfig, x, cos, sin):
    """RMSNorm, the q/k/v projections and RoPE of ``x [batch, seq, hidden]``, fused in one op."""
    return jax_nkilib.qkv_projection(
        x,
        projection_weight(layer["w_qkv"]),
        num_q_heads=config.heads,
        num_kv_heads=config.kv_heads,
        norm="rms",
        norm_weight=layer["attn_norm"],
        eps=config.rms_eps,
        rope=(cos, sin),
    )


def attention_prefill(layer, config: LlamaConfig, x, cos, sin):
    """A layer's attention half over a whole sequence: ``(o_proj(causal attention) [batch, seq, hidden], k, v)``,
    with the new keys (after RoPE) and values ``[batch, seq, kv_heads, head_dim]`` for the cache."""
    q, k, v = _qkv(layer, config, x, cos, sin)
    out = jax_nkilib.attention(q, k, v, causal=True)
    return jax_nkilib.output_projection(out, layer["w_o"]), k, v


def attention_decode(layer, config: LlamaConfig, x, cos, sin, kv_cache, position):
    """A layer's attention half for one new token per sequence, against its cache: :func:`jax_nkilib.decode_block`
    (RMSNorm -> QKV -> RoPE -> cache update -> attention -> output projection; on Neuron one fused
    ``attention_block_tkg`` kernel per layer where a device holds one kv head). ``x [batch, 1, hidden]``,
    ``position [batch]`` (the tokens already cached); returns ``(out [batch, 1, hidden], (k_cache, v_cache))`` with
    the new key/value written at ``position``."""
    return jax_nkilib.decode_block(
        x,
        kv_cache,
        position,
        qkv_weight=layer["w_qkv"],
        out_weight=layer["w_o"],
        num_q_heads=config.heads,
        num_kv_heads=config.kv_heads,
        rope=(cos, sin),
        norm_weight=layer["attn_norm"],
        eps=config.rms_eps,
    )


def mlp_residual(layer, config: LlamaConfig, x, attn_out):
    """``s = x + attn_out``; returns ``s + mlp(rmsnorm(s))`` (the norm fused into the MLP op).

    The residual add is written here rather than through ``mlp(residual=, return_residual=True)``: with the MLP's
    intermediate split over a mesh axis, that op's returned residual fails ``shard_map``'s replication check."""
    s = x + attn_out
    weights = (layer["w_gate"], layer["w_up"], layer["w_down"])
    out = jax_nkilib.mlp(s, *weights, norm="rms", norm_weight=layer["mlp_norm"], eps=config.rms_eps)
    return s + out


def _embed(params, config: LlamaConfig, tokens):
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"jax_nkilib.models.llama: tokens must be integers; got {tokens.dtype}")
    table = params["embed"]
    sharding = getattr(jax.typeof(tokens), "sharding", None)
    spec = tuple(getattr(sharding, "spec", ()))
    if any(entry is not None for entry in spec):  # explicit mesh axes: the rows follow the tokens' sharding
        rows = table.at[tokens].get(out_sharding=NamedSharding(sharding.mesh, P(*spec, None)))
    else:
        rows = jnp.take(table, tokens, axis=0)
    return rows.astype(config.param_dtype)


def _logits(params, config: LlamaConfig, x):
    """``rmsnorm(x) @ lm_head`` in float32 (float64 for a float64 model; ``embed^T`` when the embeddings are
    tied)."""
    h = jax_nkilib.rms_norm(x, params["final_norm"], eps=config.rms_eps)
    head = params["embed"].T if config.tie_embeddings else params["lm_head"]
    return jnp.matmul(h, head.astype(h.dtype), preferred_element_type=jnp.promote_types(h.dtype, jnp.float32))


def _check_tokens(tokens, config: LlamaConfig, where: str):
    if jnp.ndim(tokens) != 2:
        raise ValueError(f"{where}: tokens must be [batch, seq]; got shape {jnp.shape(tokens)}")
    if jnp.shape(tokens)[1] > config.max_len - 1:
        raise ValueError(
            f"{where}: {jnp.shape(tokens)[1]} tokens exceed the cache's max_len - 1 = {config.max_len - 1} tokens"
        )


# ------------------------------------------------------------------------------------------------ model


def forward(params, config: LlamaConfig, tokens):
    """Logits ``[batch, seq, vocab]`` (float32) of ``tokens [batch, seq]`` at positions ``0 .. seq-1``, no cache."""
    logits, _ = _run_sequence(unwrap(params), config, tokens, cache=None)
    return logits


def prefill(params, config: LlamaConfig, tokens, cache):
    """Run ``tokens [batch, seq]`` at positions ``0 .. seq-1``, writing their keys and values into ``cache``
    (from :func:`init_cache`). Returns ``(logits [batch, seq, vocab] float32, cache)``."""
    _check_tokens(tokens, config, "jax_nkilib.models.llama.prefill")
    return _run_sequence(unwrap(params), config, tokens, cache)


def _run_sequence(params, config, tokens, cache):
    x = _embed(params, config, tokens)
    cos, sin = rope_tables(config, jnp.arange(x.shape[1]))
    new_cache = []
    for i, layer in enumerate(params["layers"]):
        attn, k, v = attention_prefill(layer, config, x, cos, sin)
        if cache is not None:
            new_cache.append(tuple(_write_prefix(c, new) for c, new in zip(cache[i], (k, v))))
        x = mlp_residual(layer, config, x, attn)
    return _logits(params, config, x), (new_cache if cache is not None else None)


def _write_prefix(cache, new):
    """``new [batch, seq, kv_heads, d]`` into ``cache [batch, kv_heads, L, d]`` at positions ``0 .. seq-1``."""
    return jax.lax.dynamic_update_slice(cache, jnp.swapaxes(new, 1, 2).astype(cache.dtype), (0, 0, 0, 0))


def decode_step(params, config: LlamaConfig, token, position, cache):
    """One decoding step: ``token [batch]`` (int) at ``position`` (an int or ``[batch]``: the tokens already in
    the cache, ``< config.max_len - 1``). Returns ``(logits [batch, vocab] float32, cache)`` with the token's keys and
    values written at ``position`` (a functional update: ``jax.jit(decode_step, donate_argnums=4)`` updates the
    cache in place)."""
    params = unwrap(params)
    token = jnp.asarray(token)
    if token.ndim != 1:
        raise ValueError(f"jax_nkilib.models.llama.decode_step: token must be [batch]; got shape {token.shape}")
    position = jnp.broadcast_to(jnp.asarray(position, jnp.int32), token.shape)
    x = _embed(params, config, token[:, None])
    cos, sin = rope_tables(config, position[:, None])  # [batch, 1, head_dim/2]
    new_cache = []
    for layer, kv_cache in zip(params["layers"], cache):
        attn, kv_cache = attention_decode(layer, config, x, cos, sin, kv_cache, position)
        new_cache.append(kv_cache)
        x = mlp_residual(layer, config, x, attn)
    return _logits(params, config, x)[:, 0], new_cache


@functools.partial(jax.jit, static_argnames=("config", "steps", "temperature", "top_k", "top_p"))
def generate(params, config: LlamaConfig, prompt, steps: int, *, key=None, temperature=1.0, top_k=None, top_p=None):
    """``steps`` new tokens ``[batch, steps]`` (int32) after ``prompt [batch, seq]``: one prefill, then a
    ``lax.scan`` of cached decode steps.

    Greedy (:func:`jax_nkilib.argmax`) without ``key``; with a ``key``, sampling at ``temperature`` from the
    ``top_k`` most likely tokens and/or the smallest set whose probability reaches ``top_p`` (through
    :func:`jax_nkilib.topk`, see :func:`jax_nkilib.models.sampling.sample`). ``seq + steps <= config.max_len``
    (the last token generated is not cached).
    """
    _check_tokens(prompt, config, "jax_nkilib.models.llama.generate")
    batch, seq = prompt.shape
    if steps < 1 or seq + steps > config.max_len:
        raise ValueError(
            f"jax_nkilib.models.llama.generate: need 1 <= steps and seq + steps <= max_len; got seq={seq}, "
            f"steps={steps}, max_len={config.max_len}"
        )
    keys = jax.random.split(key, steps) if key is not None else [None] * steps
    pick = functools.partial(sample, temperature=temperature, top_k=top_k, top_p=top_p)
    logits, cache = prefill(params, config, prompt, init_cache(config, batch))
    first = pick(logits[:, -1], keys[0])

    def step(carry, step_key):
        token, position, cache = carry
        logits, cache = decode_step(params, config, token, position, cache)
        nxt = pick(logits, step_key)
        return (nxt, position + 1, cache), nxt

    if steps == 1:
        return first[:, None]
    rest_keys = keys[1:] if key is not None else None
    _, rest = jax.lax.scan(step, (first, jnp.int32(seq), cache), rest_keys, length=steps - 1)
    return jnp.concatenate([first[:, None], rest.T], axis=1)


# ------------------------------------------------------------------------------------------------ training


def loss(params, config: LlamaConfig, tokens, targets):
    """Mean next-token cross entropy of ``forward(tokens)`` against ``targets [batch, seq]`` (int):
    :func:`jax_nkilib.cross_entropy` (on Neuron ``cross_entropy_forward``, and ``cross_entropy_backward`` in the
    gradient)."""
    return jax_nkilib.cross_entropy(forward(params, config, tokens), targets)


@functools.partial(jax.jit, static_argnames=("config", "optimizer"))
def train_step(params, opt_state, tokens, targets, *, config: LlamaConfig, optimizer):
    """One optax step: ``(params, opt_state, loss)`` after the gradient of :func:`loss` through ``optimizer`` (an
    ``optax.GradientTransformation``, static: reuse one object to reuse the compilation). With
    ``jax_nkilib.optim.adamw`` the update runs the NKI Library's fused AdamW kernel on each parameter."""
    import optax  # optional dependency: pip install 'jax-nkilib[models]'

    value, grads = jax.value_and_grad(loss)(params, config, tokens, targets)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value
