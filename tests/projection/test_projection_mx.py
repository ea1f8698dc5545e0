"""MX quantization of the projection kernels: ``qkv`` (CTE path, MXFP8 x4 weights ``[H/4, I]`` in MX_CONTIGUOUS
layout, ``is_h_dim_4h_transposed``) and ``output_projection_cte`` (MXFP4 x4 weights ``[N*D/4, H]``), both
MX-quantizing their activations on the fly, against a float64 oracle that decodes the x4 words bit by bit; jit,
vmap, straight-through gradients, shard_map, Neuron lowering and bad inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import output_projection_cte, qkv
from tests.quant.test_mx import oracle_round_trip
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

E4M3 = ml_dtypes.float8_e4m3fn
FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
NQ, NKV, D = 2, 1, 8
WIDTH = (NQ + 2 * NKV) * D
HEADS = dict(num_q_heads=NQ, num_kv_heads=NKV, d_head=D)
QKV_MX = dict(quantization_type="MX", weight_layout="MX_CONTIGUOUS")


# ----------------------------------------------------------------------------------------------- data and oracle
def mxfp8_weight(h, width, seed=0):
    """(uint32 words [h/4, width], uint8 scales [h/32, width]): random finite e4m3fn bytes, scales around 2**0."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (h // 4, width, 4)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN bytes
    words = sum(codes[..., j].astype(np.uint32) << np.uint32(8 * j) for j in range(4)).astype(np.uint32)
    return jnp.asarray(words), jnp.asarray(rng.integers(117, 124, (h // 32, width)).astype(np.uint8))


def mxfp4_weight(k, width, seed=0):
    """(uint16 words [k/4, width], uint8 scales [k/32, width])."""
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**16, (k // 4, width)).astype(np.uint16)
    return jnp.asarray(words), jnp.asarray(rng.integers(124, 130, (k // 32, width)).astype(np.uint8))


def oracle_weight(words, scales):
    """float64 ``W [K, N]``, element by element: ``W[4k + j, n]`` = lane ``j`` of word ``[k, n]`` (byte for 32-bit
    words, nibble for 16-bit) times ``2**(scales[(4k + j) // 32, n] - 127)``."""
    words = np.asarray(words)
    bits = 8 if words.dtype == np.uint32 else 4
    k4, n = words.shape
    w = np.zeros((4 * k4, n))
    for j in range(4):
        lane = (words.astype(np.uint64) >> np.uint64(bits * j)) & np.uint64(2**bits - 1)
        value = lane.astype(np.uint8).view(E4M3).astype(np.float64) if bits == 8 else FP4_VALUES[lane.astype(int)]
        w[j::4] = value
    return w * 2.0 ** (np.repeat(np.asarray(scales), 32, axis=0).astype(np.float64) - 127)


def stored(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float64)


def qkv_mx_oracle(
    x,
    words,
    scales,
    bias=None,
    store=jnp.bfloat16,
    mlp_prev=None,
    attention_prev=None,
    gamma=None,
    eps=1e-6,
    swizzled=False,
):
    """float64 ``[B, S, I]``: (residual add, RMS norm, each rounded to the buffer dtype) -> MXFP8 round trip of the
    hidden along H (blocks of 32, OCP emax 8) -> @ W -> rounded, + bias -> rounded."""
    h = np.asarray(x).astype(np.float64)
    if swizzled:  # stored [j * H/4 + r] is logical [4r + j]
        b, s, hidden = h.shape
        h = h.reshape(b, s, 4, hidden // 4).transpose(0, 1, 3, 2).reshape(b, s, hidden)
    if mlp_prev is not None:
        h = h + np.asarray(mlp_prev).astype(np.float64) + np.asarray(attention_prev).astype(np.float64)
    h = stored(h, store)
    if gamma is not None:
        h = stored(h / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + eps) * np.asarray(gamma, np.float64)[0], store)
    t = stored(oracle_round_trip(h.astype(np.float32), axis=-1) @ oracle_weight(words, scales), store)
    return t if bias is None else stored(t + np.asarray(bias).astype(np.float64)[0], store)


def oproj_mx_oracle(attention, words, scales, bias=None):
    """float64 ``[B, S, H]``: attention ``[B, N, D, S]`` -> ``[B, S, N*D]`` -> MXFP8 round trip along ``N*D`` -> @ W
    (+ bias), then bfloat16."""
    a = np.asarray(attention).astype(np.float32)
    b, n, d, s = a.shape
    x = oracle_round_trip(a.transpose(0, 3, 1, 2).reshape(b, s, n * d), axis=-1)
    out = x @ oracle_weight(words, scales)
    if bias is not None:
        out = out + np.asarray(bias).astype(np.float64)[0]
    return stored(out, jnp.bfloat16)


def qkv_problem(b=2, s=98, h=64, dtype=jnp.bfloat16, seed=0):
    words, scales = mxfp8_weight(h, WIDTH, seed)
    return random((b, s, h), dtype, seed), words, scales, random((1, WIDTH), dtype, seed + 1)


def oproj_problem(b=2, n=2, d=48, s=5, h=24, dtype=jnp.bfloat16, seed=0):
    words, scales = mxfp4_weight(n * d, h, seed)
    return random((b, n, d, s), dtype, seed), words, scales, random((1, h), dtype, seed + 1)


# ------------------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_qkv_mx_matches_oracle(dtype):
    x, words, scales, bias = qkv_problem(dtype=dtype)
    got = qkv(x, words, bias, scales, **QKV_MX, **HEADS)
    assert got.dtype == dtype and got.shape == (2, 98, WIDTH)
    assert_close(got, qkv_mx_oracle(x, words, scales, bias), jnp.bfloat16, reduction=64)


def test_qkv_mx_with_residual_add_norm_and_odd_sizes():
    x, words, scales, bias = qkv_problem(b=3, s=97, h=96)
    m, a, gamma = random(x.shape, jnp.bfloat16, 5), random(x.shape, jnp.bfloat16, 6), random((1, 96), jnp.bfloat16, 7)
    got = qkv(
        x,
        words,
        None,
        scales,
        None,
        m,
        a,
        gamma,
        fused_residual_add=True,
        fused_norm_type="RMS_NORM",
        **QKV_MX,
        **HEADS,
    )
    expected = qkv_mx_oracle(x, words, scales, mlp_prev=m, attention_prev=a, gamma=gamma)
    assert_close(got, expected, jnp.bfloat16, reduction=96, ops=8)


def test_qkv_mx_h_dim_4h_transposed_and_heads_layout():
    x, words, scales, bias = qkv_problem()
    swizzled = x.reshape(2, 98, 16, 4).transpose(0, 1, 3, 2).reshape(x.shape)  # stored [j * H/4 + r] = x[4r + j]
    got = qkv(swizzled, words, bias, scales, is_h_dim_4h_transposed=True, output_layout="NBSd", **QKV_MX, **HEADS)
    expected = qkv_mx_oracle(x, words, scales, bias).reshape(2, 98, WIDTH // D, D).transpose(2, 0, 1, 3)
    assert_close(got, expected, jnp.bfloat16, reduction=64)
    assert np.array_equal(
        np.asarray(got), np.asarray(qkv(x, words, bias, scales, output_layout="NBSd", **QKV_MX, **HEADS))
    )


def test_qkv_mx_quantizes_the_activations():
    """A block whose values span more than the e4m3 range loses its small elements (the on-the-fly quantization)."""
    x = jnp.zeros((1, 98, 32), jnp.bfloat16).at[..., 0].set(2.0**10).at[..., 1].set(2.0**-10)
    words = jnp.full((8, WIDTH), 0x38383838, jnp.uint32)  # every weight 1.0
    out = qkv(x, words, None, jnp.full((1, WIDTH), 127, jnp.uint8), **QKV_MX, **HEADS)
    assert np.all(np.asarray(out, np.float64) == 2.0**10)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_output_projection_mx_matches_oracle(dtype):
    a, words, scales, bias = oproj_problem(dtype=dtype)
    got = output_projection_cte(a, words, bias, None, scales, quantization_type="MX")
    assert got.dtype == jnp.bfloat16 and got.shape == (2, 5, 24)
    assert_close(got, oproj_mx_oracle(a, words, scales, bias), jnp.bfloat16, reduction=96)
    got = output_projection_cte(a, words, None, None, scales, quantization_type="MX", output_dtype=jnp.bfloat16)
    assert_close(got, oproj_mx_oracle(a, words, scales), jnp.bfloat16, reduction=96)


# ------------------------------------------------------------------------------------------------ transformations
def test_jit_and_vmap():
    x, words, scales, bias = qkv_problem(b=1)
    fn = jax.jit(lambda x: qkv(x, words, bias, scales, **QKV_MX, **HEADS))
    stacked = jnp.stack([x, x * 2])
    got = jax.vmap(fn)(stacked)
    for i in range(2):
        assert_close(got[i], qkv_mx_oracle(stacked[i], words, scales, bias), jnp.bfloat16, reduction=64)
    a, w4, s4, b4 = oproj_problem(b=1)
    batched = jnp.stack([jnp.stack([a, -a]), jnp.stack([a * 4, a])])
    fn = jax.vmap(
        jax.vmap(lambda x, y: output_projection_cte(x, w4, y, None, s4, quantization_type="MX"), in_axes=(0, None)),
        in_axes=(0, None),
    )
    got = jax.jit(fn)(batched, b4)
    for i in range(2):
        for j in range(2):
            assert_close(got[i, j], oproj_mx_oracle(batched[i, j], w4, s4, b4), jnp.bfloat16, reduction=96)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_gradients_pass_the_activation_quantization_straight_through():
    a, words, scales, bias = oproj_problem(dtype=jnp.float32)
    cot = random((2, 5, 24), jnp.float32, 9)

    def loss(x, y):
        return jnp.sum(
            output_projection_cte(x, words, y, None, scales, quantization_type="MX").astype(jnp.float32) * cot
        )

    ga, gb = jax.grad(loss, argnums=(0, 1))(a, bias)
    w, cot_out = oracle_weight(words, scales), stored(cot, jnp.bfloat16)  # the bfloat16 output's cotangent
    expected = (cot_out @ w.T).reshape(2, 5, 2, 48).transpose(0, 2, 3, 1)
    assert_close(ga, expected, jnp.float32, reduction=24)
    assert_close(gb, cot_out.sum((0, 1))[None], jnp.float32, reduction=10)
    x, w8, s8, b8 = qkv_problem(b=1, dtype=jnp.float32)
    gx = jax.grad(lambda x: jnp.sum(qkv(x, w8, b8, s8, **QKV_MX, **HEADS)))(x)
    # (float32 input: the CTE path's bfloat16 buffers round the gradient too)
    assert_close(gx, np.broadcast_to(oracle_weight(w8, s8).sum(1), x.shape), jnp.bfloat16, reduction=WIDTH)
    # vmap of grad
    g = jax.vmap(jax.grad(lambda x: jnp.sum(qkv(x, w8, b8, s8, **QKV_MX, **HEADS))))(jnp.stack([x, 2 * x]))
    assert np.array_equal(np.asarray(g[0]), np.asarray(gx)) and np.array_equal(np.asarray(g[1]), np.asarray(gx))


def test_shard_map_over_the_batch():
    mesh = mesh_1d()
    x, words, scales, bias = qkv_problem(b=8)
    specs = (P("data"), P(), P(), P())
    fn = jax.shard_map(
        lambda x, w, s, b: qkv(x, w, b, s, **QKV_MX, **HEADS), mesh=mesh, in_specs=specs, out_specs=P("data")
    )
    got = jax.jit(fn)(*shard(mesh, specs, x, words, scales, bias))
    assert_close(got, qkv_mx_oracle(x, words, scales, bias), jnp.bfloat16, reduction=64)
    a, w4, s4, b4 = oproj_problem(b=8)
    fn = jax.shard_map(
        lambda x, w, s, b: output_projection_cte(x, w, b, None, s, quantization_type="MX"),
        mesh=mesh,
        in_specs=specs,
        out_specs=P("data"),
    )
    got = jax.jit(fn)(*shard(mesh, specs, a, w4, s4, b4))
    assert_close(got, oproj_mx_oracle(a, w4, s4, b4), jnp.bfloat16, reduction=96)


# ----------------------------------------------------------------------------------------------------- Neuron
def test_neuron_lowering_is_one_call():
    x, words, scales, bias = qkv_problem(b=1, s=128, h=512)
    a, w4, s4, b4 = oproj_problem(b=1, n=2, d=64, s=128, h=256)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, w, s: qkv(x, w, None, s, **QKV_MX, **HEADS), x, words, scales)
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "qkv" and cfg["output_names"] == ["out"] and compute_operations(text) == []
        assert cfg["params"]["quantization_type"] == "MX" and cfg["params"]["weight_layout"] == "MX_CONTIGUOUS"
        assert "tensor<128x32xui32>" in text and "tensor<16x32xui8>" in text
        text = neuron_text(
            lambda x, w, s, b: output_projection_cte(x, w, b, None, s, quantization_type="MX"), a, w4, s4, b4
        )
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "output_projection_cte" and cfg["params"]["quantization_type"] == "MX"
        assert compute_operations(text) == [] and "tensor<32x256xui16>" in text and "tensor<1x128x256xbf16>" in text


def test_neuron_mx_limits_fall_back():
    x, words, scales, _ = qkv_problem(b=1, s=98, h=256)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match="MX needs H % 512 == 0"):
        text = neuron_text(lambda x, w, s: qkv(x, w, None, s, **QKV_MX, **HEADS), x, words, scales)
    assert "AwsNeuronCustomNativeKernel" not in text


# ------------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "case, error, fragment",
    [
        ("tkg_shapes", ValueError, "runs only on qkv's CTE path; B=1, S=4 dispatch to qkv_tkg"),
        ("layout", ValueError, "quantization_type=MX takes weight_layout=MX_CONTIGUOUS"),
        ("interleaved", ValueError, "got MX_INTERLEAVED"),
        ("float_weights", TypeError, "needs `fused_qkv_weights` as uint32 float8_e4m3fn_x4 words [H/4, I]"),
        ("weight_rows", ValueError, "`fused_qkv_weights` [H/4, I] = [16, I]"),
        ("scale_shape", ValueError, "`qkv_w_scale` as uint8 e8m0 scales [H/32, I] = [2, 32]; got uint8 (1, 32)"),
        ("scale_dtype", ValueError, "got float32 (2, 32)"),
        ("no_scale", ValueError, "got none"),
        ("in_scale", ValueError, "does not take `qkv_in_scale`"),
        ("swizzle_norm", ValueError, "is_h_dim_4h_transposed=True does not combine with a fused norm"),
        ("words_without_mx", TypeError, "uint32 `fused_qkv_weights` are MX x4 words"),
    ],
)
def test_qkv_bad_inputs(case, error, fragment):
    x, words, scales, bias = qkv_problem()
    gamma = random((1, 64), jnp.bfloat16)
    calls = {
        "tkg_shapes": lambda: qkv(x[:1, :4], words, None, scales, **QKV_MX, **HEADS),
        "layout": lambda: qkv(x, words, None, scales, quantization_type="MX"),
        "interleaved": lambda: qkv(x, words, None, scales, quantization_type="MX", weight_layout="MX_INTERLEAVED"),
        "float_weights": lambda: qkv(x, random((16, WIDTH), jnp.bfloat16), None, scales, **QKV_MX),
        "weight_rows": lambda: qkv(x, words[:8], None, scales, **QKV_MX),
        "scale_shape": lambda: qkv(x, words, None, scales[:1], **QKV_MX),
        "scale_dtype": lambda: qkv(x, words, None, scales.astype(jnp.float32), **QKV_MX),
        "no_scale": lambda: qkv(x, words, **QKV_MX),
        "in_scale": lambda: qkv(x, words, None, scales, jnp.ones((1, 1), jnp.float32), **QKV_MX),
        "swizzle_norm": lambda: qkv(
            x,
            words,
            None,
            scales,
            None,
            None,
            None,
            gamma,
            fused_norm_type="RMS_NORM",
            is_h_dim_4h_transposed=True,
            **QKV_MX,
        ),
        "words_without_mx": lambda: qkv(x, jnp.zeros((64, WIDTH), jnp.uint32)),
    }
    with pytest.raises(error) as info:
        calls[case]()
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    "case, error, fragment",
    [
        ("rows", ValueError, "`weight` [N * D / 4, H] = [24, H] x4 words; got N * D = 96 and 12 weight rows"),
        ("weight_dtype", TypeError, "needs `weight` as uint16 float4_e2m1fn_x4 words"),
        ("scale_shape", ValueError, "`weight_scales` as uint8 e8m0 scales [N * D / 32, H] = [3, 24]"),
        ("no_scale", ValueError, "got none"),
        ("input_scales", ValueError, "does not take `input_scales`"),
        ("output_dtype", TypeError, "`output_dtype` must be None or bfloat16"),
        ("words_without_mx", TypeError, "uint16 `weight` holds MXFP4 x4 words"),
    ],
)
def test_output_projection_bad_inputs(case, error, fragment):
    a, words, scales, bias = oproj_problem()
    mx = dict(quantization_type="MX")
    calls = {
        "rows": lambda: output_projection_cte(a, words[:12], None, None, scales, **mx),
        "weight_dtype": lambda: output_projection_cte(a, words.astype(jnp.bfloat16), None, None, scales, **mx),
        "scale_shape": lambda: output_projection_cte(a, words, None, None, scales[:1], **mx),
        "no_scale": lambda: output_projection_cte(a, words, **mx),
        "input_scales": lambda: output_projection_cte(a, words, None, jnp.ones((128, 1), jnp.float32), scales, **mx),
        "output_dtype": lambda: output_projection_cte(a, words, None, None, scales, output_dtype=jnp.float32, **mx),
        "words_without_mx": lambda: output_projection_cte(a, jnp.zeros((96, 24), jnp.uint16)),
    }
    with pytest.raises(error) as info:
        calls[case]()
    assert fragment in str(info.value)


def test_qkv_mx_with_the_fused_kv_cache_write():
    x, words, scales, bias = qkv_problem(b=1)
    cache = jnp.zeros((1, 100, NKV * D), jnp.bfloat16)
    one = jnp.ones((128, 1), jnp.float32)
    q, k, v = qkv(x, words, bias, scales, k_cache=cache, v_cache=cache, k_scale=one, v_scale=one, **QKV_MX, **HEADS)
    t = qkv_mx_oracle(x, words, scales, bias)
    assert_close(q, t[..., : NQ * D], jnp.bfloat16, reduction=64)
    assert_close(k[:, :98], t[..., NQ * D : (NQ + NKV) * D], jnp.bfloat16, reduction=64)
    assert_close(v[:, :98], t[..., (NQ + NKV) * D :], jnp.bfloat16, reduction=64)
    assert not np.asarray(k[:, 98:]).any()
