"""``mxfp_load_performance_wrapper`` (row 38) against a NumPy oracle written from the kernel's test golden
(``golden_mxfp_load``: swizzle each 512-column block to ``[128, 4M]``, ``quantize_mx`` in 8 x 4 blocks, scales at
partitions 0..3 of each quadrant) and the e4m3 MX scale rule; compared exactly (bit patterns)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import mxfp_load_performance_wrapper
from tests.support.hlo import kernel_configs, neuron_text


def oracle(tensor):
    x = np.asarray(jnp.asarray(tensor, jnp.float32), np.float32)
    rows, cols = x.shape
    data, scales = [], []
    for k in range(cols // 512):
        swizzled = x[:, 512 * k : 512 * (k + 1)].reshape(rows, 128, 4).transpose(1, 0, 2).reshape(128, 4 * rows)
        blocks = swizzled.reshape(16, 8, rows, 4)
        exponent = ((blocks.view(np.uint32) >> 23) & 0xFF).max(axis=(1, 3)).astype(np.int64)  # [16, M]
        factor = np.exp2(135.0 - exponent)[:, None, :, None]
        elements = np.clip(blocks.astype(np.float64) * factor, -448, 448).astype(np.float32)
        codes = elements.astype(ml_dtypes.float8_e4m3fn).view(np.uint8).reshape(128, 4 * rows)
        data.append(np.ascontiguousarray(codes).view("<u4"))
        placed = np.zeros((128, rows), np.uint8)
        for quadrant in range(4):
            placed[32 * quadrant : 32 * quadrant + 4] = np.clip(exponent[4 * quadrant : 4 * quadrant + 4] - 8, 0, 255)
        scales.append(placed)
    return np.concatenate(data, axis=1), np.concatenate(scales, axis=1)


@pytest.mark.parametrize(
    "rows, cols, dtype", [(128, 1024, jnp.bfloat16), pytest.param(24, 512, jnp.float32, marks=pytest.mark.slow)]
)
def test_matches_the_oracle(rows, cols, dtype):
    rng = np.random.default_rng(rows)
    tensor = jnp.asarray(rng.standard_normal((rows, cols)) * np.exp2(rng.integers(-20, 20, (rows, 1))), dtype)
    data, scales = mxfp_load_performance_wrapper(tensor)
    want_data, want_scales = oracle(tensor)
    assert data.dtype == jnp.uint32 and scales.dtype == jnp.uint8
    np.testing.assert_array_equal(data, want_data)
    np.testing.assert_array_equal(scales, want_scales)


@pytest.mark.slow  # conformance checks jit and vmap in CI
def test_jit_and_vmap():
    tensors = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 512)), jnp.bfloat16)
    for tensor, data, scales in zip(tensors, *jax.vmap(jax.jit(mxfp_load_performance_wrapper))(tensors)):
        want_data, want_scales = oracle(tensor)
        np.testing.assert_array_equal(data, want_data)
        np.testing.assert_array_equal(scales, want_scales)


def test_lowers_to_the_kernel_and_falls_back_outside_its_limits():
    call = jax.jit(mxfp_load_performance_wrapper)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target="trn3"):
        (cfg,) = kernel_configs(neuron_text(call, jnp.zeros((128, 1024), jnp.bfloat16)))
        assert cfg["output_names"] == ["out_data_hbm", "out_scale_hbm"]
        with pytest.warns(NeuronFallbackWarning, match="M must be 128; got 64; tensor must be bfloat16"):
            text = neuron_text(call, jnp.zeros((64, 512), jnp.float32))
    assert "AwsNeuronCustomNativeKernel" not in text


def test_refuses_k_not_a_multiple_of_512():
    with pytest.raises(ValueError, match="K % 512 == 0"):
        mxfp_load_performance_wrapper(jnp.zeros((128, 1000), jnp.bfloat16))
