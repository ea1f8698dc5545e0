"""jax_nkilib.nki.rmsnorm_router_topk_a2av / rmsnorm_router_topk_tkg (docs-only, NKI Library 2.32) against a float64
NumPy oracle: RMSNorm, then the top-k of the router logits and the activation of those k alone ("ACT2"); dtypes,
LNC requirement, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import rmsnorm_router_topk_a2av, rmsnorm_router_topk_tkg
from tests.moe.test_moe_block_tkg import assert_separated, router_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def make(b, s, h, e, dtype=jnp.float32, seed=0):
    return (
        random((b, s, h), dtype, seed),
        random((1, h), dtype, seed + 1, 0.3) + 1,
        random((h, e), dtype, seed + 2, 3 * h**-0.5),
        random((1, e), dtype, seed + 3, 0.5),
    )


def oracle(hidden, gamma, router, bias, top_k, softmax, eps=1e-6, hidden_actual=None):
    x = f64(hidden).reshape(-1, hidden.shape[-1])
    h = hidden_actual or x.shape[1]
    normed = x * f64(gamma) / np.sqrt(np.sum(x * x, axis=1, keepdims=True) / h + eps)
    logits, index, affinities = router_oracle(normed, router, bias, top_k, softmax, pre_norm=False, norm_topk=False)
    return normed, logits, index, affinities


@pytest.mark.parametrize("dtype, margin", [(jnp.float32, 1e-3), (jnp.bfloat16, 0.05)])
@pytest.mark.parametrize("act", ["SIGMOID", "SOFTMAX"])
def test_a2av_matches_oracle(dtype, margin, act):
    operands = make(3, 5, 48, 7, dtype, seed=1)
    norm, index, affinities = rmsnorm_router_topk_a2av(*operands, top_k=3, router_act_fn=act, eps=1e-5)
    want_norm, logits, want_index, want_affinities = oracle(*operands, 3, act == "SOFTMAX", eps=1e-5)
    assert_separated(logits, 3, margin)
    assert (norm.dtype, index.dtype, affinities.dtype) == (dtype, jnp.int32, jnp.bfloat16)
    assert_close(norm, want_norm, dtype)
    np.testing.assert_array_equal(index, want_index)
    assert_close(affinities, want_affinities, jnp.bfloat16)


def test_tkg_norm_output_in_router_dtype_with_hidden_actual():
    hidden, gamma, router, bias = make(2, 3, 32, 5, jnp.bfloat16, seed=2)
    hidden = hidden.at[..., 24:].set(0)
    norm, index, affinities = rmsnorm_router_topk_tkg(
        hidden, gamma, router, bias, top_k=2, hidden_actual=24, router_mm_dtype=jnp.float32
    )
    want_norm, logits, want_index, want_affinities = oracle(hidden, gamma, router, bias, 2, False, hidden_actual=24)
    assert_separated(logits, 2, 0.1)
    assert norm.dtype == jnp.float32  # the norm output is in router_mm_dtype
    assert_close(norm, want_norm, jnp.bfloat16)  # the router reads the bf16-rounded norm
    np.testing.assert_array_equal(index, want_index)
    assert_close(affinities, want_affinities, jnp.bfloat16)


def test_expert_ids_carry_no_gradient_and_affinities_do():
    operands = [a.astype(jnp.float64) for a in make(2, 2, 16, 4, seed=3)]
    grads = jax.grad(
        lambda *a: jnp.sum(rmsnorm_router_topk_a2av(*a, top_k=2)[2].astype(jnp.float64)), argnums=(0, 2, 3)
    )(*operands)
    assert all(bool(jnp.any(g != 0)) for g in grads)


def test_lowering_lnc():
    shapes = lambda b, s: [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in make(b, s, 256, 16)]
    a2av = lambda *a: rmsnorm_router_topk_a2av(*a, top_k=4)
    with jax_nkilib.neuron.dry_run():
        (config,) = kernel_configs(neuron_text(a2av, *shapes(1, 128)))
        assert config["grid"] == 1 and config["params"]["top_k"] == 4
        assert len(kernel_configs(neuron_text(a2av, *shapes(2, 128)))) == 2  # T <= 128 per call: split along B
        args = shapes(2, 128)
        tkg = lambda *a: rmsnorm_router_topk_tkg(*a, top_k=4)
        with jax_nkilib.config(lnc=2):
            (config,) = kernel_configs(neuron_text(tkg, *args))
            assert config["grid"] == 2
        with pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match="LNC=2"):
            assert kernel_configs(neuron_text(tkg, *args)) == []


@pytest.mark.parametrize(
    "fn, flags, fragment",
    [
        (rmsnorm_router_topk_tkg, dict(quantization_type="MX"), "quantization_type"),
        (rmsnorm_router_topk_a2av, dict(router_act_fn="NOAUX_TC"), "router_act_fn"),
        (rmsnorm_router_topk_a2av, dict(top_k=9), "top_k"),
        (rmsnorm_router_topk_tkg, dict(hidden_actual=100), "hidden_actual"),
    ],
)
def test_bad_flags_are_named(fn, flags, fragment):
    with pytest.raises(ValueError, match=fragment):
        fn(*make(2, 2, 16, 8), **flags)
