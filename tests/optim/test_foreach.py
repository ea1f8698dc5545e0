"""jax_nkilib.nki foreach kernels (elementwise family and L1/L2/Linf norms) against float64 NumPy oracles written
from torch._foreach_* semantics; float32 and bfloat16, odd sizes; shard_map on 8 devices; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from tests.support.data import random
from tests.support.numerics import assert_close, f64
from tests.support.sharding import mesh_1d, run_sharded

S = -0.75  # the scalar every [128, 1] scalar tensor carries here

# kernel -> (number of flat tensors, has a scalar tensor, float64 oracle, indices of operands kept positive)
ELEMENTWISE = {
    "add_scalar_kernel": (1, True, lambda x, s: x + s, ()),
    "sub_scalar_kernel": (1, True, lambda x, s: x - s, ()),
    "mul_scalar_kernel": (1, True, lambda x, s: x * s, ()),
    "div_scalar_kernel": (1, True, lambda x, s: x / s, ()),
    "add_tensor_kernel": (2, True, lambda a, b, alpha: a + alpha * b, ()),
    "sub_tensor_kernel": (2, True, lambda a, b, alpha: a - alpha * b, ()),
    "mul_tensor_kernel": (2, False, lambda a, b: a * b, ()),
    "div_tensor_kernel": (2, False, lambda a, b: a / b, (1,)),
    "addcdiv_kernel": (3, True, lambda x, a, b, v: x + v * (a / b), (2,)),
    "addcmul_kernel": (3, True, lambda x, a, b, v: x + v * a * b, ()),
    "lerp_kernel": (2, True, lambda x, end, w: x + w * (end - x), ()),
    "sqrt_kernel": (1, False, np.sqrt, (0,)),
}
NORMS = {
    "l1_norm_kernel": lambda x: np.sum(np.abs(x)),
    "l2_norm_kernel": lambda x: np.sqrt(np.sum(x * x)),
    "linf_norm_kernel": lambda x: np.max(np.abs(x)),
}


def scalar(value=S):
    return jnp.full((128, 1), value, jnp.float32)


def operands(name, n, dtype, seed=0):
    count, has_scalar, _, positive = ELEMENTWISE[name]
    tensors = [random((n,), dtype, seed=seed + i) for i in range(count)]
    for i in positive:
        tensors[i] = (jnp.abs(tensors[i].astype(jnp.float32)) + 0.5).astype(dtype)
    return tensors + ([scalar()] if has_scalar else [])


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_elementwise_matches_the_oracle(name, dtype):
    n = 1000  # not a multiple of 128: the kernels' tail
    args = operands(name, n, dtype)
    out = getattr(nki, name)(*args, numel=n)
    count, has_scalar, oracle, _ = ELEMENTWISE[name]
    expected = oracle(*(f64(a) for a in args[:count]), *((S,) if has_scalar else ()))
    assert out.shape == (n,) and out.dtype == dtype
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("name", sorted(NORMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("n", [1, 4096 + 77])
def test_norms_match_the_oracle(name, dtype, n):
    x = random((n,), dtype, seed=n)
    out = getattr(nki, name)(x, numel=n)
    assert out.shape == (1, 1) and out.dtype == dtype
    assert_close(out, np.reshape(NORMS[name](f64(x)), (1, 1)), dtype, reduction=n)


def test_norm_gradients():
    x = random((37,), jnp.float64, seed=3)
    xs = np.asarray(x)
    grads = {name: jax.grad(lambda v, k=getattr(nki, name): k(v, numel=37)[0, 0])(x) for name in NORMS}
    np.testing.assert_allclose(grads["l2_norm_kernel"], xs / np.linalg.norm(xs), rtol=1e-12)
    np.testing.assert_allclose(grads["l1_norm_kernel"], np.sign(xs), rtol=1e-12)
    expected = np.zeros(37)
    expected[np.argmax(np.abs(xs))] = np.sign(xs[np.argmax(np.abs(xs))])
    np.testing.assert_allclose(grads["linf_norm_kernel"], expected, rtol=1e-12)


def test_the_elementwise_kernels_run_per_shard_inside_shard_map():
    """Elementwise over a flat vector split 8 ways: each shard calls the kernel with its own numel."""
    mesh, n = mesh_1d(), 8 * 125
    a, b, c = (random((n,), seed=i) for i in range(3))
    c = jnp.abs(c) + 0.5
    fn = lambda x, y, z, v: nki.addcdiv_kernel(x, y, z, v, numel=n // 8)
    out = run_sharded(fn, mesh, (P("data"), P("data"), P("data"), P()), P("data"), a, b, c, scalar())
    assert_close(out, f64(a) + S * f64(b) / f64(c), jnp.float32)


def test_the_global_l2_norm_from_per_shard_norms():
    mesh, n = mesh_1d(), 8 * 100
    x = random((n,), seed=5)

    def global_norm(shard):
        local = nki.l2_norm_kernel(shard, numel=n // 8)
        return jnp.sqrt(jax.lax.psum(local * local, "data"))

    out = run_sharded(global_norm, mesh, (P("data"),), P(), x)
    assert_close(out, np.reshape(np.linalg.norm(f64(x)), (1, 1)), jnp.float32, reduction=n)


def test_bad_inputs_name_the_argument():
    x = random((10,))
    with pytest.raises(ValueError, match="numel"):
        nki.add_scalar_kernel(x, scalar(), numel=11)
    with pytest.raises(TypeError, match="numel"):
        nki.sqrt_kernel(x)
    with pytest.raises(ValueError, match=r"data.*\[N\]"):
        nki.l2_norm_kernel(x.reshape(2, 5), numel=10)
    with pytest.raises(ValueError, match=r"scalar_tensor.*\[128, 1\]"):
        nki.mul_scalar_kernel(x, jnp.ones((1, 1)), numel=10)
    with pytest.raises(TypeError, match="one dtype"):
        nki.add_tensor_kernel(x, x.astype(jnp.bfloat16), scalar(), numel=10)
