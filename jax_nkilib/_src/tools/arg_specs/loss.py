"""Arg specs of ``cross_entropy_forward`` / ``cross_entropy_backward`` and ``jax_nkilib.cross_entropy``."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)
N, V = 24, 40  # V = 2.5 chunks of 16: the last chunk is partial


def _targets(rng, shape, vocab=V):
    return jnp.asarray(rng.integers(0, vocab, size=shape), jnp.int32)


def _forward(rng):
    return normal(rng, (N, V), scale=2.0), _targets(rng, (N,))


def _backward(rng):
    logits, targets = _forward(rng)
    wide = np.asarray(logits, np.float64)
    top = wide.max(axis=1)
    lse = top + np.log(np.exp(wide - top[:, None]).sum(axis=1))
    return logits, targets, jnp.asarray(lse, jnp.float32)


def _labels(shape, ignored=False):
    def build(rng):
        labels = np.asarray(rng.integers(0, V, size=shape), np.int32)
        if ignored:
            labels.reshape(-1)[::5] = -100
        return normal(rng, (*shape, V), scale=2.0), jnp.asarray(labels)

    return build


_TUNED = {"chunk_size": 16, "dtype": jnp.float32}

register(
    ArgSpec(
        "cross_entropy_forward",
        nki.cross_entropy_forward,
        ("logits_hbm", "targets_hbm"),
        _forward,
        kwargs=_TUNED,
        kernels=("cross_entropy_forward",),
        grad=("logits_hbm",),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P("data")), (P("data"), P("data"))),
        bad=BadInput("logits_hbm", lambda x: x[0], "N, V"),
    ),
    ArgSpec(
        "cross_entropy_forward.bfloat16_defaults",
        nki.cross_entropy_forward,
        ("logits_hbm", "targets_hbm"),
        lambda rng: (normal(rng, (N, V), jnp.bfloat16, 2.0), _targets(rng, (N,))),
        kwargs={"chunk_size": V},  # the kernel's default 32768 exceeds V, which the kernel refuses
        kernels=("cross_entropy_forward",),
        bad=BadInput("chunk_size", lambda _: 0, "chunk_size"),
    ),
    ArgSpec(
        "cross_entropy_backward",
        nki.cross_entropy_backward,
        ("logits_hbm", "targets_hbm", "lse_state_hbm"),
        _backward,
        kwargs={"reduction": "sum", **_TUNED},
        kernels=("cross_entropy_backward",),
        grad=("logits_hbm", "lse_state_hbm"),
        sharding=Sharding(_DATA, (P("data"), P("data"), P("data")), P("data")),
        bad=BadInput("lse_state_hbm", lambda lse: lse[:-1], "lse_state_hbm"),
        notes="reduction='sum': rows are independent, so shard_map over the rows gives the global result",
    ),
    ArgSpec(
        "cross_entropy_backward.mean_out_of_place",
        nki.cross_entropy_backward,
        ("logits_hbm", "targets_hbm", "lse_state_hbm"),
        _backward,
        kwargs={"reduction": "mean", "inplace": False, "chunk_size": 16},
        kernels=("cross_entropy_backward",),
        grad=("logits_hbm", "lse_state_hbm"),
        bad=BadInput("reduction", lambda _: "none", "reduction"),
        notes="no shard_map check: 'mean' scales by 1/N of each call, so per-shard calls scale by 1/N_local",
    ),
    ArgSpec(
        "cross_entropy",
        jax_nkilib.cross_entropy,
        ("logits", "labels"),
        _labels((8, 3), ignored=True),
        kwargs={"reduction": "none", "ignore_index": -100, "z_loss": 1e-2},
        kernels=("cross_entropy_forward",),
        only_kernels=False,
        grad=("logits",),
        sharding=Sharding(_DATA, (P("data"), P("data")), P("data")),
        bad=BadInput("labels", drop_last_axis, "labels"),
        notes="reduction='none' here: inside a user's shard_map a mean or sum is over the local rows (the explicit "
        "mesh plan adds the all-reduce: tests/parallel)",
    ),
    ArgSpec(
        "cross_entropy.mean",
        jax_nkilib.cross_entropy,
        ("logits", "labels"),
        _labels((8, 3)),
        kernels=("cross_entropy_forward",),
        only_kernels=False,
        grad=("logits",),
        bad=BadInput("reduction", lambda _: "avg", "reduction"),
    ),
)
