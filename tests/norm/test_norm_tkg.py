"""jax_nkilib.nki.rmsnorm_tkg / layernorm_tkg: the [128, B*S, H/128] output order at LNC 1 and 2 against float64
oracles; transformations; gradients; Neuron lowering; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.nki import layernorm_tkg, rmsnorm_tkg
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close


def rms_oracle(x, gamma, eps=1e-6, hidden_actual=None):
    x = np.asarray(x, np.float64)
    h = hidden_actual or x.shape[-1]
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) / h + eps) * np.asarray(gamma, np.float64).ravel()


def layer_oracle(x, gamma, beta=None, eps=1e-6):
    x = np.asarray(x, np.float64)
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    y = (x - mean) / np.sqrt(var + eps) * np.asarray(gamma, np.float64).ravel()
    return y if beta is None else y + np.asarray(beta, np.float64).ravel()


def kernel_order(y, lnc=1, hidden_dim_tp=False):
    """[B, S, H] -> [128, B*S, H/128] as the kernels' torch references lay it out (halves interleaved at LNC2)."""
    y = y.reshape(-1, y.shape[-1])
    rows, h = y.shape
    if hidden_dim_tp:
        return y.reshape(rows, h // 128, 128).transpose(2, 0, 1)
    halves = np.split(y, lnc, axis=1)
    return np.concatenate([part.reshape(rows, 128, h // 128 // lnc).transpose(1, 0, 2) for part in halves], axis=2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "lnc, flags",
    [
        (1, {}),
        (2, {}),
        (1, dict(hidden_dim_tp=True)),
        (2, dict(hidden_dim_tp=True)),
        (2, dict(single_core_forced=True)),
        (2, dict(shard_on_h=True)),
        (1, dict(eps=0.1, hidden_actual=300)),
    ],
)
def test_rmsnorm_tkg_matches_oracle(dtype, lnc, flags):
    x, gamma = random((2, 3, 512), dtype, 0), random((1, 512), dtype, 1)
    if "hidden_actual" in flags:
        x = x.at[..., 300:].set(0)
    with jax_nkilib.config(lnc=lnc):
        out = rmsnorm_tkg(x, gamma, **flags)
    assert out.shape == (128, 6, 4) and out.dtype == dtype
    layout_lnc = 1 if flags.get("single_core_forced") else lnc
    want = kernel_order(
        rms_oracle(x, gamma, flags.get("eps", 1e-6), flags.get("hidden_actual")),
        layout_lnc,
        flags.get("hidden_dim_tp", False),
    )
    assert_close(out, want, dtype, reduction=512)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("with_beta", [True, False])
def test_layernorm_tkg_matches_oracle(dtype, lnc, with_beta):
    x, gamma, beta = (
        random((3, 1, 256), dtype, 2, scale=2.0) + 0.5,
        random((1, 256), dtype, 3),
        random((1, 256), dtype, 4),
    )
    with jax_nkilib.config(lnc=lnc):
        out = layernorm_tkg(x, gamma, beta if with_beta else None, eps=1e-5)
    assert out.shape == (128, 3, 2) and out.dtype == dtype
    want = kernel_order(layer_oracle(x, gamma, beta if with_beta else None, eps=1e-5), lnc)
    assert_close(out, want, dtype, reduction=256, ops=8)


def test_odd_shards_take_the_remainder_in_the_last_shard():
    """H/128 = 3 at LNC 2: shards of 1 and 2 column tiles (the loader's unbalanced split)."""
    x, gamma = random((1, 2, 384)), jnp.ones((1, 384))
    y = rms_oracle(x, gamma).reshape(2, 384)
    want = np.concatenate([y[:, :128].reshape(2, 128, 1), y[:, 128:].reshape(2, 128, 2)], axis=2).transpose(1, 0, 2)
    with jax_nkilib.config(lnc=2):
        assert_close(rmsnorm_tkg(x, gamma), want, jnp.float32, reduction=384)


def test_gradients_at_lnc2_without_beta_and_with_hidden_actual():
    """LNC 2 changes the layout, not the math; the conformance suite checks the defaults (LNC 1, second order)."""
    x, gamma, beta = (
        random((2, 3, 256), jnp.float64, 5),
        random((1, 256), jnp.float64, 6),
        random((1, 256), jnp.float64, 7),
    )
    for lnc, order in ((1, 2), (2, 1)):
        with jax_nkilib.config(lnc=lnc):
            check_grads(lambda a, g: rmsnorm_tkg(a, g, hidden_actual=200), (x, gamma), order=order, modes=["rev"])
            check_grads(lambda a, g: layernorm_tkg(a, g), (x, gamma), order=1, modes=["rev"])
    with jax_nkilib.config(lnc=2):
        check_grads(lambda a, g, b: layernorm_tkg(a, g, b), (x, gamma, beta), order=1, modes=["rev"])


def test_neuron_lowering_one_call_and_split_past_sbuf():
    x, gamma = random((2, 3, 256)), random((1, 256))
    with jax_nkilib.neuron.dry_run():
        for kernel, args in ((rmsnorm_tkg, (x, gamma)), (layernorm_tkg, (x, gamma, gamma))):
            text = neuron_text(lambda *a: kernel(*a, eps=1e-5), *args)
            (cfg,) = kernel_configs(text)
            assert cfg["entry_point"] == f"jax_nkilib_kernels.norm:{kernel.__name__}" and cfg["params"]["eps"] == 1e-5
            assert "tensor<128x6x2xf32>" in text
        with jax_nkilib.config(lnc=2):
            (cfg,) = kernel_configs(neuron_text(lambda a, g: rmsnorm_tkg(a, g, shard_on_h=True), x, gamma))
            assert cfg["grid"] == 2 and cfg["params"]["shard_on_h"] is True
        big = jax.ShapeDtypeStruct((2048, 1, 4096), jnp.float32)  # ~384 KiB per partition: 8 calls along B
        configs = kernel_configs(neuron_text(rmsnorm_tkg, big, jax.ShapeDtypeStruct((1, 4096), jnp.float32)))
        assert len(configs) == 8 and configs[0]["input_specs"][0][0] == [256, 1, 4096]


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x, g: rmsnorm_tkg(x[..., :200], g[:, :200]), ValueError, "H % 128 == 0"),
        (lambda x, g: layernorm_tkg(x[..., :200], g[:, :200]), ValueError, "H % 128 == 0"),
        (lambda x, g: rmsnorm_tkg(x, g[0]), ValueError, "`gamma`"),
        (lambda x, g: rmsnorm_tkg(x, g, hidden_actual=300), ValueError, "hidden_actual"),
        (lambda x, g: rmsnorm_tkg(x, g, shard_on_h=True, hidden_dim_tp=True), ValueError, "shard_on_h"),
        (lambda x, g: layernorm_tkg(x, g, g[:, :128]), ValueError, "`beta`"),
        (lambda x, g: rmsnorm_tkg(x.astype(jnp.int32), g), TypeError, "`input`"),
        (lambda x, g: rmsnorm_tkg(x[0], g), ValueError, "[B, S, H]"),
        (lambda x, g: rmsnorm_tkg(x, g, eps="small"), TypeError, "`eps`"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(random((2, 3, 256)), random((1, 256)))
    assert fragment in str(info.value)
