"""Arg specs of the row gather / scatter-add kernels and of ``jax_nkilib.embedding_lookup``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)


def _rows(rng, n, shape):
    """Row indices in ``[0, n)`` (repeats included), int32."""
    return jnp.asarray(rng.integers(0, n, size=shape), jnp.int32)


def _gather(n, d, k):
    return lambda rng: (normal(rng, (n, d)), _rows(rng, n, (k,)))


def _scatter_add(n, d, k):
    return lambda rng: (normal(rng, (n, d)), _rows(rng, n, (k,)), normal(rng, (k, d)))


def _lookup(vocab, d, ids_shape):
    return lambda rng: (normal(rng, (vocab, d)), _rows(rng, vocab, ids_shape))


register(
    ArgSpec(
        "gather",
        nki.gather,
        ("input", "index"),
        _gather(11, 16, 16),
        kernels=("gather",),
        grad=("input",),
        grad_order=2,
        sharding=Sharding(_DATA, (P(), P("data")), P("data")),
        bad=BadInput("input", drop_last_axis, "input"),
    ),
    ArgSpec(
        "scatter_add",
        nki.scatter_add,
        ("input", "index", "src"),
        _scatter_add(11, 16, 24),
        kwargs={"unique_indices": False},
        kernels=("scatter_add",),
        grad=("input", "src"),
        grad_order=2,
        sharding=Sharding(_DATA, (P(None, "data"), P(), P(None, "data")), P(None, "data")),
        bad=BadInput("src", drop_last_axis, "src"),
        notes="repeated indices, so unique_indices=False (the embedding-gradient case)",
    ),
    ArgSpec(
        "embedding_lookup",
        jax_nkilib.embedding_lookup,
        ("table", "ids"),
        _lookup(13, 16, (4, 6)),
        kernels=("gather",),
        only_kernels=False,
        grad=("table",),
        grad_order=2,
        sharding=Sharding(_DATA, (P(None, "data"), P()), P(None, None, "data")),
        bad=BadInput("ids", lambda ids: ids.astype(jnp.float32), "ids"),
    ),
)
