"""``jax_nkilib.mla_attention`` against the float64 NumPy oracle of DeepSeek MLA (``tests/mla/oracle.py``): dense
causal and with the top-k indexer, float32 and bfloat16, odd sizes; jit, vmap and shard_map on 8 CPU devices (the
conformance variants of this op run with ``-m slow``); its Neuron lowering at DeepSeek-V3's head dims; bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.mla import oracle
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close, f64

OPERANDS = ("x", "wq_a", "q_norm_weight", "wq_b", "wkv_a", "kv_norm_weight", "wkv_b", "wo", "cos", "sin")


def operands(b, s, d, h, rq, rkv, dn, dr, dv, dtype=jnp.float32, seed=0, batched_tables=False, indexer=None):
    """MLA operands with weights scaled so the logits are O(1); ``indexer``: ``(Hi, Di)``."""
    rng = np.random.default_rng(seed)
    w = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), dtype)  # noqa: E731
    gain = lambda n: jnp.asarray(1 + 0.1 * rng.standard_normal(n), dtype)  # noqa: E731
    x = jnp.asarray(rng.standard_normal((b, s, d)), dtype)
    theta = rng.uniform(-np.pi, np.pi, (b, s, dr // 2) if batched_tables else (s, dr // 2))
    args = [x, w(d, rq), gain(rq), w(rq, h, dn + dr), w(d, rkv + dr), gain(rkv), w(rkv, h, dn + dv), w(h, dv, d)]
    args += [jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)]
    extra = ()
    if indexer:
        hi, di = indexer
        extra = (w(rq, hi, di), w(d, di), w(d, hi))
    return tuple(args), extra


@pytest.mark.parametrize(
    "dtype, dims",
    [
        (jnp.float32, (2, 7, 12, 3, 10, 6, 4, 4, 6)),  # odd sizes, dv != dn + dr
        (jnp.bfloat16, (1, 9, 16, 2, 8, 8, 6, 2, 5)),
    ],
)
def test_dense_causal_matches_the_oracle(dtype, dims):
    args, _ = operands(*dims, dtype=dtype)
    out = jax.jit(jax_nkilib.mla_attention)(*args)
    assert out.shape == args[0].shape and out.dtype == dtype
    assert_close(out, oracle.mla(*map(f64, args)), dtype, reduction=dims[2], ops=16)


def test_interleaved_pairs_batched_tables_and_a_scale_match_the_oracle():
    args, _ = operands(2, 5, 8, 2, 6, 4, 2, 4, 3, batched_tables=True, seed=1)
    fn = functools.partial(jax_nkilib.mla_attention, interleaved=True, softmax_scale=0.3, eps=1e-5)
    want = oracle.mla(*map(f64, args), interleaved=True, scale=0.3, eps=1e-5)
    assert_close(jax.jit(fn)(*args), want, jnp.float32, reduction=8, ops=16)


@pytest.mark.parametrize(
    "topk, rkv", [(1, 8), pytest.param(3, 8, marks=pytest.mark.slow), (3, 6)]
)  # kv_lora_rank 6: the JAX route (not 4-packed)
def test_sparse_top_k_matches_the_oracle(topk, rkv):
    args, indexer = operands(2, 8, 12, 2, 8, rkv, 4, 4, 6, seed=2, indexer=(3, 6))
    out = jax.jit(functools.partial(jax_nkilib.mla_attention, index_topk=topk))(*args, indexer=indexer)
    want = oracle.mla(*map(f64, args), indexer=tuple(map(f64, indexer)), topk=topk)
    assert_close(out, want, jnp.float32, reduction=12, ops=16)
    dense = oracle.mla(*map(f64, args))
    assert np.abs(want - dense).max() > 1e-2  # the selection matters for these queries


@pytest.mark.slow
def test_top_k_covering_every_causal_key_is_dense_attention():
    args, indexer = operands(1, 6, 8, 2, 6, 4, 2, 2, 4, seed=3, indexer=(2, 4))
    sparse = jax.jit(functools.partial(jax_nkilib.mla_attention, index_topk=6))(*args, indexer=indexer)
    assert_close(sparse, oracle.mla(*map(f64, args)), jnp.float32, reduction=8, ops=16)


def test_values_wider_than_queries_and_keys_match_the_oracle():
    args, _ = operands(1, 5, 8, 2, 6, 4, 2, 2, 7, seed=4)  # dv = 7 > dn + dr = 4: masked-attention route
    assert_close(
        jax.jit(jax_nkilib.mla_attention)(*args), oracle.mla(*map(f64, args)), jnp.float32, reduction=8, ops=16
    )


@pytest.mark.slow  # the conformance suite checks these gradients in float64 in CI
def test_gradients_flow_to_every_weight_through_the_sparse_selection():
    args, indexer = operands(1, 6, 8, 2, 6, 4, 2, 2, 4, seed=5, indexer=(2, 4))
    loss = lambda *a: jnp.sum(jax_nkilib.mla_attention(*a, indexer=indexer, index_topk=2) ** 2)  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=tuple(range(10))))(*args)
    assert all(g.shape == a.shape and bool(jnp.all(jnp.isfinite(g))) for g, a in zip(grads, args))
    assert all(float(jnp.abs(g).max()) > 0 for g in grads[:8])


def test_vmap_over_x_matches_a_loop():
    args, _ = operands(1, 5, 8, 2, 6, 4, 2, 2, 4, seed=6)
    xs = jnp.stack([args[0], 2 * args[0], -args[0]])
    one = jax.jit(lambda x: jax_nkilib.mla_attention(x, *args[1:]))
    want = jnp.stack([one(x) for x in xs])
    fn = jax.jit(jax.vmap(lambda x: jax_nkilib.mla_attention(x, *args[1:])))
    np.testing.assert_allclose(fn(xs), want, rtol=1e-5, atol=1e-5)


def test_inside_shard_map_on_8_devices_the_batch_splits():
    args, _ = operands(8, 4, 8, 2, 6, 4, 2, 2, 4, seed=7)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    fn = jax.shard_map(jax_nkilib.mla_attention, mesh=mesh, in_specs=(P("data"),) + (P(),) * 9, out_specs=P("data"))
    np.testing.assert_allclose(jax.jit(fn)(*args), jax.jit(jax_nkilib.mla_attention)(*args), rtol=1e-5, atol=1e-5)


def _neuron_kernels(fn, args):
    with jax_nkilib.neuron.dry_run():
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("neuron",)).as_text()
    return [config["func_name"] for config in kernel_configs(text)]


def test_deepseek_head_dims_fall_back_for_attention_with_a_warning():
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in operands(1, 128, 256, 2, 64, 64, 128, 64, 128)[0]]
    with pytest.warns(NeuronFallbackWarning, match="head dim d=192"):
        kernels = _neuron_kernels(jax_nkilib.mla_attention, shapes)
    assert kernels == ["rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE"]


def test_sparse_path_lowers_to_the_sparse_kernel_or_warns():
    packed = operands(1, 256, 256, 2, 256, 512, 64, 64, 128, dtype=jnp.bfloat16, indexer=(2, 128))
    odd = operands(1, 128, 128, 2, 128, 6, 64, 64, 64, dtype=jnp.bfloat16, indexer=(2, 64))
    for (args, indexer), kernel in ((packed, True), (odd, False)):
        shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (*args, *indexer)]
        fn = lambda *a: jax_nkilib.mla_attention(*a[:10], indexer=a[10:], index_topk=128)  # noqa: E731
        if kernel:
            assert _neuron_kernels(fn, shapes)[-1] == "mla_sparse_attention_cte_kernel"
        else:
            with pytest.warns(NeuronFallbackWarning, match="kv_lora_rank=6"):
                assert "mla_sparse_attention_cte_kernel" not in _neuron_kernels(fn, shapes)


def _bad(**changes):
    args, indexer = operands(1, 4, 8, 2, 6, 4, 2, 2, 4, indexer=(2, 4))
    kwargs = dict(zip(OPERANDS, args))
    return {**kwargs, **changes}, indexer


@pytest.mark.parametrize(
    "change, error, fragments",
    [
        ({"x": jnp.zeros((4, 8))}, ValueError, ["`x`", "[B, S, D]"]),
        ({"wq_a": jnp.zeros((9, 6))}, ValueError, ["`wq_a`", "[D, Rq]"]),
        ({"wkv_a": jnp.zeros((8, 5))}, ValueError, ["`wkv_a`", "Rkv + dr"]),
        ({"wkv_b": jnp.zeros((4, 2, 5))}, ValueError, ["`wkv_b`", "[Rkv, H, dn + dv]"]),
        ({"cos": jnp.zeros((4, 2, 1))}, ValueError, ["`cos`"]),
        ({"wo": jnp.zeros((2, 4, 8), jnp.bfloat16)}, TypeError, ["dtype"]),
        ({"index_topk": 2}, ValueError, ["`indexer`", "`index_topk`"]),
    ],
)
def test_bad_inputs_name_the_argument(change, error, fragments):
    kwargs, _ = _bad(**change)
    with pytest.raises(error) as info:
        jax_nkilib.mla_attention(**kwargs)
    assert "jax_nkilib.mla_attention" in str(info.value)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_bad_indexer_names_its_layout():
    kwargs, (wq, wk, ww) = _bad()
    with pytest.raises(ValueError, match=r"`index_wk`.*\[D, Di\]"):
        jax_nkilib.mla_attention(**kwargs, indexer=(wq, wk[:3], ww), index_topk=2)
    with pytest.raises(TypeError, match="`index_topk`"):
        jax.jit(lambda k: jax_nkilib.mla_attention(**kwargs, indexer=(wq, wk, ww), index_topk=k))(2)
