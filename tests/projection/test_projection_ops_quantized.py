"""jax_nkilib.output_projection and jax_nkilib.qkv_projection with FP8 weights (QuantizedWeight): a float64 oracle on
the independently dequantized weights (STATIC: with the kernels' activation quantization), both device paths, jit,
vmap, gradients in the activations, shard_map, Neuron lowering and bad inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib import QuantizedWeight, output_projection, qkv_projection, quantize_weight_fp8
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

NQ, NKV, D = 4, 2, 4
WIDTH = (NQ + 2 * NKV) * D
HID = 16
IN_SCALE = 4.5 / 240  # covers the N(0, 1) test activations


def dequantized(q):
    """float64 ``W`` of a QuantizedWeight, from its leaves."""
    data, scale = np.asarray(q.data).astype(np.float64), np.asarray(q.scale, np.float64)
    return data * (scale[None, :] if q.mode == "row" else scale)


def weight(mode, shape, dtype=jnp.float8_e4m3, seed=1):
    w = random(shape, jnp.float32, seed, 0.4)
    return quantize_weight_fp8(w, mode, dtype, **({} if mode == "row" else dict(input_scale=IN_SCALE)))


def activation(a, q):
    """STATIC: the kernels' ``fp8(clip(a / input_scale, +-max)) * input_scale``; ROW: ``a`` unquantized."""
    a = np.asarray(a, np.float64)
    if q.mode == "row":
        return a
    fmt = np.dtype(q.data.dtype)
    top = min(240.0, float(ml_dtypes.finfo(fmt).max))  # the test activations stay inside 240 * input_scale
    s = float(q.input_scale)
    return np.clip(a / s, -top, top).astype(fmt).astype(np.float64) * s


# ------------------------------------------------------------------------------------------- output projection
def out_oracle(attn, q, bias=None):
    b, s, n, d = attn.shape
    out = activation(np.asarray(attn, np.float64).reshape(b, s, n * d), q) @ dequantized(q)
    return out if bias is None else out + np.asarray(bias, np.float64)


@pytest.mark.parametrize("mode, batch, seq", [("row", 2, 3), ("static", 2, 3), ("static", 1, 97), ("row", 3, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_projection_matches_the_oracle(mode, batch, seq, dtype):
    attn = random((batch, seq, 3, 8), dtype, 0)
    q, bias = weight(mode, (24, HID)), random((HID,), jnp.float32, 2)
    out = output_projection(attn, q, bias)
    assert out.shape == (batch, seq, HID) and out.dtype == dtype
    assert_close(out, out_oracle(attn, q, bias.astype(dtype)), dtype, reduction=24, ops=6)


def test_output_projection_e4m3fn_weights():
    attn = random((2, 3, 3, 8), jnp.float32, 0)
    q = weight("static", (24, HID), jnp.float8_e4m3fn)
    assert_close(output_projection(attn, q), out_oracle(attn, q), jnp.float32, reduction=24)


@pytest.mark.parametrize("mode, seq", [("row", 3), ("static", 3), ("static", 97)])
def test_output_projection_gradient_in_attn(mode, seq):
    """float32 (the quantized kernels take no float64): the attention's gradient is that of the projection on the
    dequantized weights; the weights get none."""
    attn = random((1, seq, 2, 8), jnp.float32, 0)
    q, ct = weight(mode, (16, HID)), random((1, seq, HID), jnp.float32, 4)
    got = jax.grad(lambda a: jnp.sum(output_projection(a, q) * ct))(attn)
    w = jnp.asarray(dequantized(q))
    want = jax.grad(lambda a: jnp.sum((a.reshape(1, seq, 16) @ w) * ct))(attn.astype(jnp.float64))
    assert_close(got, want, jnp.float32, reduction=HID)
    wgrad = jax.grad(lambda w_: jnp.sum(output_projection(attn, w_)))(q)
    assert all(not np.any(np.asarray(leaf, np.float64)) for leaf in jax.tree_util.tree_leaves(wgrad))


def test_output_projection_jit_vmap_shard_map():
    attn, q = random((2, 3, 2, 8), jnp.float32, 0), weight("row", (16, HID))
    stack = jnp.stack([attn, -attn, 2 * attn])
    got = jax.jit(jax.vmap(output_projection, in_axes=(0, None)))(stack, q)
    assert_close(got[1], out_oracle(-attn, q), jnp.float32, reduction=16)
    nested = jax.vmap(jax.vmap(lambda a: output_projection(a, q)))(stack[:, :, None])
    assert_close(nested[2, :, 0], out_oracle(2 * attn, q), jnp.float32, reduction=16)
    grad = jax.grad(lambda a: jnp.sum(jnp.sin(output_projection(a, q))))
    np.testing.assert_allclose(jax.vmap(grad)(stack)[1], grad(-attn), rtol=1e-6)
    mesh = mesh_1d()
    big, qs = random((8, 2, 2, 8), jnp.float32, 5), weight("static", (16, HID))
    fn = jax.jit(jax.shard_map(output_projection, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")))
    assert_close(fn(shard(mesh, (P("data"),), big), qs), out_oracle(big, qs), jnp.float32, reduction=16)


@pytest.mark.parametrize(
    "mode, seq, kernel, kind",
    [
        ("row", 1, "output_projection_tkg", "ROW"),
        ("static", 1, "output_projection_tkg", "STATIC"),
        ("static", 128, "output_projection_cte", "STATIC"),
    ],
)
def test_output_projection_neuron_lowering(mode, seq, kernel, kind):
    attn, q = random((2, seq, 2, 64), jnp.bfloat16, 0), weight(mode, (128, 256))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(output_projection, attn, q)
    (cfg,) = kernel_configs(text)
    assert operations(text).count("stablehlo.custom_call") == 1
    assert cfg["func_name"] == kernel and cfg["params"]["quantization_type"] == kind
    scales = [spec[0] for spec in cfg["input_specs"] if spec is not None and spec[1] == "float32"]
    assert sorted(scales) == ([[128, 256]] if mode == "row" else [[128, 1], [128, 1]])


# ---------------------------------------------------------------------------------------------- qkv projection
def qkv_oracle(x, q):
    t = activation(x, q) @ dequantized(q)
    b, s, _ = x.shape
    q_dim, kv_dim = NQ * D, NKV * D
    return (
        t[..., :q_dim].reshape(b, s, NQ, D),
        t[..., q_dim : q_dim + kv_dim].reshape(b, s, NKV, D),
        t[..., q_dim + kv_dim :].reshape(b, s, NKV, D),
    )


@pytest.mark.parametrize("mode, batch, seq", [("row", 2, 3), ("static", 2, 3), ("static", 1, 97), ("row", 3, 5)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_qkv_projection_matches_the_oracle(mode, batch, seq, dtype):
    x, q = random((batch, seq, HID), dtype, 0), weight(mode, (HID, WIDTH))
    got = qkv_projection(x, q, num_q_heads=NQ, num_kv_heads=NKV)
    tkg = seq <= 96  # the CTE path computes float32 inputs in bfloat16
    for a, b in zip(got, qkv_oracle(x, q)):
        assert a.shape == b.shape and a.dtype == dtype
        assert_close(a, b, dtype if tkg else jnp.bfloat16, reduction=HID, ops=6)


def test_qkv_projection_norm_and_kv_cache_tkg_row():
    x, q = random((2, 3, HID), jnp.float32, 0), weight("row", (HID, WIDTH))
    caches = tuple(jnp.zeros((2, NKV, 8, D), jnp.float32) for _ in range(2))
    qh, k_cache, v_cache = qkv_projection(x, q, num_q_heads=NQ, num_kv_heads=NKV, norm="rms", kv_cache=caches)
    x64 = np.asarray(x, np.float64)
    normed = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + 1e-6)
    want = qkv_oracle(normed, q)
    assert_close(qh, want[0], jnp.float32, reduction=HID)
    assert_close(jnp.swapaxes(k_cache[:, :, :3], 1, 2), want[1], jnp.float32, reduction=HID)
    assert_close(jnp.swapaxes(v_cache[:, :, :3], 1, 2), want[2], jnp.float32, reduction=HID)
    assert not np.any(np.asarray(k_cache[:, :, 3:]))


@pytest.mark.parametrize("mode, seq", [("row", 3), ("static", 3), ("static", 97)])
def test_qkv_projection_gradient_in_x(mode, seq):
    x, q = random((1, seq, HID), jnp.float64, 0), weight(mode, (HID, WIDTH))
    cts = [random(a.shape, jnp.float64, 7 + k) for k, a in enumerate(qkv_oracle(np.zeros((1, seq, HID)), q))]

    def loss(fn, a):
        return sum(jnp.sum(o * c) for o, c in zip(fn(a), cts))

    got = jax.grad(lambda a: loss(lambda b: qkv_projection(b, q, num_q_heads=NQ, num_kv_heads=NKV), a))(x)
    w = jnp.asarray(dequantized(q))

    def plain(a):
        t = a @ w
        return (t[..., : NQ * D], t[..., NQ * D : (NQ + NKV) * D], t[..., (NQ + NKV) * D :])

    want = jax.grad(lambda a: loss(lambda b: tuple(p.reshape(c.shape) for p, c in zip(plain(b), cts)), a))(x)
    # the CTE path (seq > 96) computes in bfloat16 as the kernel does, cotangents included
    assert_close(got, want, jnp.bfloat16 if seq > 96 else jnp.float64, reduction=WIDTH)
    if mode == "row":
        check_grads(lambda a: qkv_projection(a, q, num_q_heads=NQ, num_kv_heads=NKV), (x,), order=1, modes=["rev"])


def test_qkv_projection_jit_vmap_shard_map():
    x, q = random((2, 3, HID), jnp.float32, 0), weight("static", (HID, WIDTH))
    heads = dict(num_q_heads=NQ, num_kv_heads=NKV)
    stack = jnp.stack([x, -x])
    got = jax.jit(jax.vmap(lambda a, w: qkv_projection(a, w, **heads), in_axes=(0, None)))(stack, q)
    assert_close(got[0][1], qkv_oracle(-x, q)[0], jnp.float32, reduction=HID)
    mesh = mesh_1d()
    big = random((8, 3, HID), jnp.float32, 5)
    fn = jax.jit(
        jax.shard_map(
            lambda a, w: qkv_projection(a, w, **heads), mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data")
        )
    )
    for a, b in zip(fn(shard(mesh, (P("data"),), big), q), qkv_oracle(big, q)):
        assert_close(a, b, jnp.float32, reduction=HID)


@pytest.mark.parametrize(
    "mode, seq, kernel, kind",
    [("row", 2, "qkv", "ROW"), ("static", 2, "qkv", "STATIC"), ("static", 128, "qkv", "STATIC")],
)
def test_qkv_projection_neuron_lowering(mode, seq, kernel, kind):
    x, q = random((1, seq, 256), jnp.bfloat16, 0), weight(mode, (256, 16 * 64))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda a, w: qkv_projection(a, w, num_q_heads=8, num_kv_heads=4), x, q)
    (cfg,) = kernel_configs(text)
    assert operations(text).count("stablehlo.custom_call") == 1
    assert cfg["func_name"] == kernel and cfg["params"]["quantization_type"] == kind
    scales = [spec[0] for spec in cfg["input_specs"] if spec is not None and spec[1] == "float32"]
    assert scales == ([[128, 1024]] if mode == "row" else [[128, 3], [128, 1]])


# ------------------------------------------------------------------------------------------------- bad inputs
def test_row_weights_on_the_cte_path_are_rejected():
    with pytest.raises(ValueError, match="mode='row' weights run only on the kernel's TKG path"):
        output_projection(random((1, 97, 2, 8)), weight("row", (16, HID)))
    with pytest.raises(ValueError, match="mode='row' weights run only on the kernel's TKG path"):
        qkv_projection(random((1, 97, HID)), weight("row", (HID, WIDTH)), num_q_heads=NQ, num_kv_heads=NKV)
    with pytest.raises(ValueError, match="this call takes the CTE path"):  # fused RoPE runs CTE
        cos = jnp.ones((2, D // 2))  # jax_nkilib.rope's [seq, head_dim/2]
        qkv_projection(
            random((1, 2, HID)), weight("row", (HID, WIDTH)), num_q_heads=NQ, num_kv_heads=NKV, rope=(cos, 0 * cos)
        )


@pytest.mark.parametrize(
    "w, error, fragment",
    [
        (lambda: weight("row", (16, HID)).data, TypeError, "`w` is a raw FP8 array"),
        (lambda: weight("row", (15, HID)), ValueError, "`w` must be [heads * head_dim, hidden] = [16, hidden]"),
        (
            lambda: QuantizedWeight(jnp.zeros((16, HID)), jnp.ones(HID, jnp.float32), None, "row"),
            TypeError,
            "`w`.data must be float8_e4m3 or float8_e4m3fn [in, out]",
        ),
        (
            lambda: QuantizedWeight(weight("row", (16, HID)).data, jnp.ones(HID, jnp.float32), jnp.float32(1), "row"),
            ValueError,
            "has mode='row' and an input_scale",
        ),
        (
            lambda: QuantizedWeight(weight("row", (16, HID)).data, jnp.float32(1), None, "static"),
            ValueError,
            "needs input_scale as a float32 scalar",
        ),
        (
            lambda: QuantizedWeight(weight("row", (16, HID)).data, jnp.ones(3, jnp.float32), None, "row"),
            ValueError,
            "`w`.scale must be float32 [16] for mode='row'",
        ),
        (
            lambda: QuantizedWeight(weight("row", (16, HID)).data, jnp.ones(HID, jnp.float32), None, "tensor"),
            ValueError,
            "`w`.mode must be 'row' or 'static'",
        ),
    ],
)
def test_bad_quantized_weights(w, error, fragment):
    with pytest.raises(error) as info:
        output_projection(random((2, 3, 2, 8)), w())
    assert fragment in str(info.value)
    if "heads * head_dim" not in fragment:
        with pytest.raises(error):
            qkv_projection(random((2, 3, 16)), w(), num_q_heads=2, num_kv_heads=1)
