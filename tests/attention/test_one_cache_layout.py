"""One KV-cache layout, [batch, kv_heads, max_len, head_dim], through a model's whole serving loop (issue 13 item 8):
qkv_projection(kv_cache=) writes it, attention(prefix=) reads it for a chunked prefill, decode_attention reads and
extends it; no conversion between the ops, alone and on an explicit (data, model) mesh."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from tests.attention.oracle import idiomatic_attention
from tests.support.data import angles, random
from tests.support.hlo import compiled_collectives, kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, use_mesh

B, H, N, K, D, MAX_LEN, CHUNK = 2, 32, 8, 4, 8, 64, 5  # two prefill chunks, then one decode token


def weights():
    return tuple(random((H, n * D), seed=1 + i, scale=0.2) for i, n in enumerate((N, K, K)))


def serve(x, w_q, w_k, w_v, cos, sin, max_len=MAX_LEN):
    """Prefill ``x [batch, 2 * chunk + 1, hidden]``'s first ``2 * chunk`` tokens in two chunks, then decode its last
    token; returns the attention outputs of every token and the final caches."""
    batch, tokens, _ = x.shape
    d = 2 * cos.shape[-1]
    heads = dict(num_q_heads=w_q.shape[1] // d, num_kv_heads=w_k.shape[1] // d)
    chunk = (tokens - 1) // 2

    def project(lo, hi, **kw):
        return jax_nkilib.qkv_projection(x[:, lo:hi], (w_q, w_k, w_v), **heads, rope=(cos[lo:hi], sin[lo:hi]), **kw)

    caches = (jnp.zeros((batch, heads["num_kv_heads"], max_len, d), x.dtype),) * 2  # the one layout
    outs = []
    for lo in (0, chunk):
        q, k, v = project(lo, lo + chunk)
        prefix = None if lo == 0 else (*caches, lo)
        outs.append(jax_nkilib.attention(q, k, v, causal=True, prefix=prefix))
        positions = jnp.broadcast_to(jnp.arange(lo, lo + chunk, dtype=jnp.int32), (batch, chunk))
        _, *caches = project(lo, lo + chunk, kv_cache=caches, cache_positions=positions)
    q, k, v = project(2 * chunk, 2 * chunk + 1)
    out, *caches = jax_nkilib.decode_attention(q, k, v, *caches, jnp.full((batch,), 2 * chunk, jnp.int32))
    return jnp.concatenate([*outs, out], axis=1), caches


def problem():
    tokens = 2 * CHUNK + 1
    return (random((B, tokens, H), seed=0), *weights(), *angles((tokens, D // 2)))


def test_on_neuron_the_loop_is_kernels_and_moves_no_cache():
    """Lowered for Neuron (sizes the kernels take): every op is its kernel, and no cache is ever transposed."""
    batch, kv_heads, max_len, d, chunk = 1, 2, 512, 64, 128
    tokens = 2 * chunk + 1
    x = random((batch, tokens, 128), jnp.bfloat16, 0)
    ws = (random((128, n * d), jnp.bfloat16, 1 + i, 0.1) for i, n in enumerate((4, kv_heads, kv_heads)))
    tables = angles((tokens, d // 2), jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(functools.partial(serve, max_len=max_len), x, *ws, *tables)
    assert [cfg["func_name"] for cfg in kernel_configs(text)] == ["qkv", "attention_cte", "qkv"] * 2 + [
        "qkv",
        "attention_tkg",
    ]
    cache = f"{batch}x{kv_heads}x{max_len}x{d}"
    transposed = re.findall(r"stablehlo.transpose .* -> tensor<(\S+)>", text)
    assert transposed and not [shape for shape in transposed if shape.startswith(cache)]


def test_chunked_prefill_and_decode_through_one_cache_layout():
    x, w_q, w_k, w_v, cos, sin = problem()
    out, (k_cache, v_cache) = jax.jit(serve)(x, w_q, w_k, w_v, cos, sin)
    q, k, v = jax_nkilib.qkv_projection(x, (w_q, w_k, w_v), num_q_heads=N, num_kv_heads=K, rope=(cos, sin))
    assert_close(out, idiomatic_attention(q, k, v), jnp.float32, reduction=D)  # all tokens at once, float64
    tokens = x.shape[1]
    for cache, fresh in ((k_cache, k), (v_cache, v)):
        assert_close(cache[:, :, :tokens], jnp.swapaxes(fresh, 1, 2), jnp.float32)  # every token's key and value
        assert not np.any(np.asarray(cache[:, :, tokens:]))


@pytest.mark.parametrize("cache_spec", [P("data", "model"), P("data")])  # kv heads split, or only the batch
def test_the_loop_on_a_mesh_needs_no_collective(cache_spec):
    x, w_q, w_k, w_v, cos, sin = problem()
    mesh = make_mesh((2, 4), ("data", "model"))
    specs = (P("data"), P(None, "model"), P(None, "model"), P(None, "model"), P(), P())
    if cache_spec == P("data"):
        specs = (P("data"),) + (P(),) * 5
    single = serve(x, w_q, w_k, w_v, cos, sin)
    with use_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for s, a in zip(specs, (x, w_q, w_k, w_v, cos, sin))]
        jitted = jax.jit(serve)
        out, caches = jitted(*placed)
        compiled = jitted.lower(*placed).compile().as_text()
    assert compiled_collectives(compiled) == {}
    assert caches[0].sharding.spec[:2] == tuple(cache_spec) + (None,) * (2 - len(cache_spec))
    for got, want in zip(jax.tree.leaves((out, caches)), jax.tree.leaves(single)):
        assert_close(got, want, jnp.float32, reduction=H)
