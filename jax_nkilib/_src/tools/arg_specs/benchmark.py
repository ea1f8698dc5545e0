"""Arg specs of the benchmark kernels ``find_nonzero_indices_with_count`` and ``mxfp_load_performance_wrapper``
(kernel-native)."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, register


def sparse_row(rng, tokens=37, density=0.3, dtype=jnp.float32):
    """``[1, tokens]`` with about ``density`` of its entries nonzero (standard normal), the rest exactly zero."""
    values = rng.standard_normal((1, tokens)) * (rng.uniform(size=(1, tokens)) < density)
    return jnp.asarray(values, dtype)


register(
    ArgSpec(
        "find_nonzero_indices_with_count",
        nki.find_nonzero_indices_with_count,
        ("input_tensor",),
        lambda rng: (sparse_row(rng),),
        kernels=("find_nonzero_indices_with_count",),
        sharding=Sharding((("data", 8),), (P(),), P()),
        bad=BadInput("input_tensor", lambda x: np.zeros((2, x.shape[1]), np.float32), "input_tensor"),
        notes="the whole row is one kernel call (the count is global): inside shard_map every rank runs it on the "
        "replicated row",
    ),
)


register(
    ArgSpec(
        "mxfp_load_performance_wrapper",
        nki.mxfp_load_performance_wrapper,
        ("tensor",),
        lambda rng: (jnp.asarray(rng.standard_normal((128, 1024)), jnp.bfloat16),),
        kernels=("mxfp_load_performance_wrapper",),
        sharding=Sharding((("data", 8),), (P(),), (P(), P())),
        bad=BadInput("tensor", lambda x: x[:, :1000], "K % 512"),
    ),
)
