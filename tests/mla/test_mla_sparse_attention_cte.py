"""``jax_nkilib.nki.mla_sparse_attention_cte_kernel`` against the float64 NumPy oracle written from its torch
reference's semantics (gathered top-k rows, future rows masked, MX 4-pack output columns), float32 and bfloat16 with
odd sizes and repeated indices; its Neuron limits; bad inputs (jit, vmap, gradients, shard_map and the lowering run
in the conformance suite)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.attention.mla_sparse_attention_cte import from_mx_pack_columns, to_mx_pack_columns
from jax_nkilib._src.tools.arg_specs.mla import topk_indices
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.mla import oracle
from tests.support.numerics import assert_close, f64


def operands(b, s, h, latent, r, s_kv, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * shape[-1] ** -0.25, dtype)  # noqa: E731
    q_lift, q_pe = normal(b, s, h, latent), normal(b, s, h, r)
    c_kv, k_pe = normal(b, s_kv, latent), normal(b, s_kv, r)
    return q_lift, q_pe, c_kv, k_pe, topk_indices(rng, b, s, s_kv, k)


@pytest.mark.parametrize("dtype, dims", [(jnp.float32, (2, 7, 3, 12, 4, 9, 5)), (jnp.bfloat16, (1, 9, 2, 16, 6, 9, 4))])
def test_matches_the_oracle(dtype, dims):
    args = operands(*dims, dtype=dtype)
    out = jax.jit(lambda *a: nki.mla_sparse_attention_cte_kernel(*a, softmax_scale=0.7))(*args)
    b, s, h, latent = dims[:4]
    assert out.shape == (b, s, h * latent) and out.dtype == dtype
    want = oracle.sparse_latent_attention(*map(f64, args[:4]), np.asarray(args[4]), 0.7)
    assert_close(out, want, dtype, reduction=latent, ops=8)


def test_repeated_indices_count_once_per_occurrence():
    args = operands(1, 4, 1, 8, 2, 4, 3, jnp.float32, seed=1)
    idx = jnp.asarray([[[0, 0, 0], [1, 0, 0], [2, 2, 1], [3, 3, 3]]], jnp.int32)
    out = nki.mla_sparse_attention_cte_kernel(*args[:4], idx, softmax_scale=1.0)
    assert_close(out, oracle.sparse_latent_attention(*map(f64, args[:4]), np.asarray(idx), 1.0), jnp.float32, ops=8)


def test_mx_pack_columns_are_the_documented_permutation_and_invertible():
    latent = jnp.arange(2 * 8, dtype=jnp.float32).reshape(1, 2, 8)  # [.., H=2, L=8]
    packed = to_mx_pack_columns(latent)
    # head 0: natural l = 4g + u at column u * 2 + g
    assert packed[0, :8].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert jnp.array_equal(from_mx_pack_columns(packed, 2), latent)


def test_neuron_limits_name_what_the_kernel_needs():
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands(2, 6, 2, 8, 4, 6, 3, jnp.float32)]
    fn = lambda *a: nki.mla_sparse_attention_cte_kernel(*a, softmax_scale=1.0)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning) as record:
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",))
    message = str(record[0].message)
    for fragment in ("bfloat16", "B=2 must be 1", "L=8", "K=3"):
        assert fragment in message


@pytest.mark.parametrize(
    "change, fragments",
    [
        (lambda a: (a[0][..., :6], a[1], a[2][..., :6], *a[3:]), ["q_lift_hbm", "L % 4"]),
        (lambda a: (*a[:4], a[4].astype(jnp.float32)), ["topk_indices_hbm", "int32"]),
        (lambda a: (a[0].astype(jnp.bfloat16), *a[1:]), ["q_lift_hbm", "dtype"]),
    ],
)
def test_bad_inputs_name_the_argument(change, fragments):
    args = change(operands(1, 4, 2, 8, 4, 4, 2, jnp.float32))
    with pytest.raises((TypeError, ValueError)) as info:
        nki.mla_sparse_attention_cte_kernel(*args, softmax_scale=1.0)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_softmax_scale_is_required_and_positive():
    args = operands(1, 4, 2, 8, 4, 4, 2, jnp.float32)
    with pytest.raises(TypeError, match="softmax_scale"):
        nki.mla_sparse_attention_cte_kernel(*args)
    with pytest.raises(ValueError, match="softmax_scale"):
        nki.mla_sparse_attention_cte_kernel(*args, softmax_scale=-1.0)
