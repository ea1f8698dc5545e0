"""jax_nkilib.nki.rmsnorm_mx_quantize_tkg against a float64 oracle of the kernel (its test golden's layouts, the
kernel's roundings); gradients; transformations; Neuron lowering (LNC=2 only); errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from jax_nkilib.nki import rmsnorm_mx_quantize_tkg
from tests.mlp_mxfp8.test_mlp_mxfp8_forward import assert_matches
from tests.quant.test_mx import oracle_quantize_groups
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import f64


def oracle(inp, gamma, residual=None, eps=1e-6, hidden_actual=None):
    """float64 ``(output [128, T, H/128], output_residual [T, H] or None)``: x = input (+ residual, rounded to the
    residual's dtype); y = in(in(x * gamma) / sqrt(sum x^2 / hidden_actual + eps)); output[p, t, c] = y[t, 128c + p]."""
    b, s, h = inp.shape
    rnd = lambda v, like: np.asarray(v).astype(like.dtype).astype(np.float64)  # noqa: E731
    x = f64(inp).reshape(b * s, h)
    if residual is not None:
        x = rnd(x + f64(residual).reshape(b * s, h), residual)
    y = rnd(rnd(x * f64(gamma), inp) / np.sqrt((x * x).sum(axis=1, keepdims=True) / (hidden_actual or h) + eps), inp)
    out = np.zeros((128, b * s, h // 128))
    for c in range(h // 128):
        out[:, :, c] = y[:, 128 * c : 128 * c + 128].T
    return out, (None if residual is None else x)


def oracle_quantize(output):
    """``(words [128, n, T] uint32, scales [128, n, T] uint8)`` of the kernel-layout ``output [128, T, H/128]``: the
    block of partitions 8g..8g+7, column j, token t holds ``output[p, t, q*n + j]`` (byte q of word [p, j, t]); its
    scale sits at partition 32 (g // 4) + g % 4, the other partitions are 0."""
    output = np.asarray(jnp.asarray(output, jnp.float32))
    _, t, h1 = output.shape
    n = h1 // 4
    words, scales = np.zeros((128, n, t), np.uint32), np.zeros((128, n, t), np.uint8)
    for j in range(n):
        for token in range(t):
            for g in range(16):
                block = output[8 * g : 8 * g + 8, token, [q * n + j for q in range(4)]]  # [8 partitions, 4 bytes]
                elements, scale = oracle_quantize_groups(block.reshape(32))
                codes = elements.view(np.uint8).reshape(8, 4).astype(np.uint32)
                words[8 * g : 8 * g + 8, j, token] = sum(codes[:, q] << np.uint32(8 * q) for q in range(4))
                scales[32 * (g // 4) + g % 4, j, token] = scale
    return words, scales


def problem(b=2, s=3, h=1024, dtype=jnp.bfloat16, seed=0, residual=True):
    rng = np.random.default_rng(seed)
    inp = jnp.asarray(rng.standard_normal((b, s, h)) * 3, dtype)
    gamma = jnp.asarray(rng.standard_normal((1, h)), dtype)
    res = jnp.asarray(rng.standard_normal((b, s, h)), dtype) if residual else None
    return inp, gamma, res


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_oracle(dtype, with_residual):
    inp, gamma, res = problem(dtype=dtype, residual=with_residual)
    outs = rmsnorm_mx_quantize_tkg(inp, gamma, res, hidden_actual=1000, eps=1e-5)
    assert len(outs) == (4 if with_residual else 3)
    assert outs[0].shape == (128, 6, 8) and outs[0].dtype == dtype
    assert outs[1].shape == outs[2].shape == (128, 2, 6) and outs[1].dtype == jnp.uint32 and outs[2].dtype == jnp.uint8
    want, want_residual = oracle(inp, gamma, res, eps=1e-5, hidden_actual=1000)
    assert_matches(outs[0], want, dtype)
    words, scales = oracle_quantize(outs[0])  # the quantization of the returned output, bit for bit
    np.testing.assert_array_equal(np.asarray(outs[1]), words)
    np.testing.assert_array_equal(np.asarray(outs[2]), scales)
    if with_residual:
        assert outs[3].shape == (6, 1024) and outs[3].dtype == dtype
        np.testing.assert_array_equal(f64(outs[3]), want_residual)


def test_quantized_outputs_carry_no_gradient():
    """(check_grads of the output and the residual, in and outside shard_map, is the conformance suite's: arg spec
    rmsnorm_mx_quantize_tkg.)"""
    inp, gamma, _ = problem(b=1, s=2, h=512, dtype=jnp.float64, seed=1)
    quantized = jax.grad(lambda a: jnp.sum(rmsnorm_mx_quantize_tkg(a, gamma)[1].astype(jnp.float64)))
    assert not np.any(np.asarray(quantized(inp)))


def test_vmap_of_gamma():
    inp, gamma, _ = problem(b=8, s=1, h=512, seed=2)
    fn = lambda a, g, r: rmsnorm_mx_quantize_tkg(a, g, r)  # noqa: E731
    gammas = jax.vmap(lambda g: fn(inp, g, None)[1])(jnp.stack([gamma, 2 * gamma]))  # batched gamma: lax.map
    np.testing.assert_array_equal(np.asarray(gammas[1]), np.asarray(fn(inp, 2 * gamma, None)[1]))


def test_neuron_lowering():
    inp, gamma, res = problem(b=64, s=4, h=1024, seed=3)
    call = lambda a, g, r: rmsnorm_mx_quantize_tkg(a, g, r)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(call, inp, gamma, res)
        (cfg,) = kernel_configs(text)
        assert compute_operations(text) == []
        assert cfg["entry_point"] == "jax_nkilib_kernels.mxfp8:rmsnorm_mx_quantize_tkg" and cfg["grid"] == 2
        assert cfg["output_names"] == ["output", "output_quant", "output_scale", "output_residual"]
        small = problem(b=2, s=3, h=512, residual=False, seed=4)
        with pytest.warns(NeuronFallbackWarning, match="B\\*S=6 must be a multiple of 4"):
            neuron_text(call, *small)
        with pytest.warns(NeuronFallbackWarning, match="a fused residual add needs B\\*S >= 256 and H % 1024 == 0"):
            neuron_text(call, *problem(b=4, s=1, h=1024, seed=5))
        with pytest.warns(NeuronFallbackWarning, match="float16 or bfloat16; got float32"):
            neuron_text(call, *problem(b=4, s=1, h=512, dtype=jnp.float32, residual=False))
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match="only with LNC=2; got LNC=1"):
        assert kernel_configs(neuron_text(call, inp, gamma, res)) == []
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error"):  # the policy: raise instead
        with pytest.raises(NeuronUnsupportedError, match="only with LNC=2; got LNC=1"):
            neuron_text(call, inp, gamma, res)


@pytest.mark.parametrize(
    "args, kwargs, error, fragment",
    [
        ((jnp.zeros((1, 4, 768)), jnp.zeros((1, 768))), {}, ValueError, "H=768 must be a multiple of 512"),
        ((jnp.zeros((1, 4, 512)), jnp.zeros((1, 512))), dict(hidden_dim_tp=False), ValueError, "hidden_dim_tp=False"),
        ((jnp.zeros((1, 4, 512)), jnp.zeros((512,))), {}, ValueError, r"argument `gamma` must have layout \[1, H\]"),
        ((jnp.zeros((1, 4, 512)), jnp.zeros((1, 512)), jnp.zeros((1, 2, 512))), {}, ValueError, "argument `residual`"),
        ((jnp.zeros((1, 4, 512)), jnp.zeros((1, 512))), dict(hidden_actual=0), ValueError, r"hidden_actual must be in"),
        ((jnp.zeros((1, 4, 512), jnp.int32), jnp.zeros((1, 512))), {}, TypeError, "argument `input` must have dtype"),
    ],
)
def test_bad_inputs(args, kwargs, error, fragment):
    with pytest.raises(error, match=fragment):
        rmsnorm_mx_quantize_tkg(*args, **kwargs)
