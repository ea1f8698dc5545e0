"""The three scan kernels inside one jitted ``jax.shard_map`` program on 8 CPU devices (batch split over ``data``):
each shard's result equals the unsharded call, and the gradient of the sharded program equals the unsharded one.
(The conformance suite's per-kernel jit, vmap and shard_map checks for these kernels run with ``-m slow``.)"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib.nki import linear_scan, selective_scan, ssd
from tests.scan.test_linear_scan import inputs as linear_inputs
from tests.scan.test_selective_scan import inputs as selective_inputs
from tests.scan.test_ssd import inputs as ssd_inputs
from tests.support.sharding import mesh_1d, run_sharded


def all_three(linear, selective, chunked):
    """Sum of squares of every output of the three kernels (one scalar per shard)."""
    outs = linear_scan(*linear) + selective_scan(*selective) + ssd(*chunked[:5], chunk_size=4, D=chunked[5])
    return sum(jnp.sum(out.astype(jnp.float32) ** 2) for out in outs)


def test_the_scan_kernels_inside_shard_map_match_one_device():
    linear = linear_inputs((8, 3, 21), seed=1)
    selective = selective_inputs(8, 3, 10, 2, seed=2)
    chunked = ssd_inputs(8, 2, 12, 3, 2, seed=3)[:6]
    args = (linear, selective, chunked)
    specs = (
        (P("data"),) * 3,
        (P("data"), P("data"), P(), P("data"), P("data"), P(), P("data")),
        (P("data"), P("data"), P(), P("data"), P("data"), P()),
    )

    sizes = [len(group) for group in args]

    def loss_of(*flat):  # the three groups of operands, flattened (shard_map places each array)
        groups = np.split(np.arange(len(flat)), np.cumsum(sizes)[:-1])
        return all_three(*[[flat[i] for i in group] for group in groups])

    flat_args, flat_specs = sum(args, ()), sum(specs, ())
    argnums = tuple(range(len(flat_args)))

    def local(*flat):  # the per-shard loss and its gradient; the loss summed over the shards
        loss, grads = jax.value_and_grad(loss_of, argnums=argnums)(*flat)
        return jax.lax.psum(loss, "data"), grads

    sharded_loss, sharded_grads = run_sharded(local, mesh_1d(), flat_specs, (P(), flat_specs), *flat_args)
    loss, grads = jax.jit(jax.value_and_grad(loss_of, argnums=argnums))(*flat_args)
    np.testing.assert_allclose(sharded_loss, loss, rtol=1e-5)
    for got, want in zip(sharded_grads, grads):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
