"""jax_nkilib.moe_block (RMSNorm -> router -> experts): a float64 oracle, gradients, and on Neuron one
moe_block_tkg kernel for a decode call at LNC 2, the three ops' kernels otherwise."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from tests.moe.test_moe_op import experts, moe_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close


def block_oracle(x, norm_weight, w_router, w_gate_up, w_down, *, top_k, activation, normalize, eps=1e-6):
    x64 = np.asarray(x, np.float64)
    h = x64 / np.sqrt(np.mean(x64**2, -1, keepdims=True) + eps) * np.asarray(norm_weight, np.float64)
    logits = h @ np.asarray(w_router, np.float64)
    if activation == "softmax":
        scores = np.exp(logits - logits.max(-1, keepdims=True))
        scores /= scores.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    idx = np.argsort(-scores, axis=-1, kind="stable")[..., :top_k]
    weights = np.take_along_axis(scores, idx, -1)
    if normalize:
        weights = weights / weights.sum(-1, keepdims=True)
    return moe_oracle(h, idx, weights, w_gate_up, w_down), logits


def problem(tokens, hidden=16, inter=8, num_experts=8, dtype=jnp.float32):
    return (
        random((tokens, hidden), dtype, 0),
        random((hidden,), dtype, 1, 0.2) + 1,
        random((hidden, num_experts), dtype, 2),
        *experts(num_experts, hidden, inter, dtype),
    )


@pytest.mark.parametrize("activation, normalize, top_k", [("softmax", True, 2), ("sigmoid", False, 3)])
def test_matches_the_float64_oracle(activation, normalize, top_k):
    args = problem(13)
    out, logits = jax.jit(lambda *a: jax_nkilib.moe_block(*a, top_k=top_k, activation=activation, normalize=normalize))(
        *args
    )
    want, want_logits = block_oracle(*args, top_k=top_k, activation=activation, normalize=normalize)
    assert out.shape == args[0].shape and logits.shape == (13, 8)
    assert_close(logits, want_logits, jnp.float32, reduction=16)
    assert_close(out, want, jnp.float32, reduction=16 + 8, ops=8)


@pytest.mark.slow  # CI: the conformance checklist's check_grads of the `moe_block` arg spec
def test_gradients_float64():
    args = tuple(a.astype(jnp.float64) for a in problem(6, hidden=8, inter=4, num_experts=8))
    check_grads(lambda *a: jax_nkilib.moe_block(*a, top_k=2, normalize=True), args, order=1, modes=["rev"])


@pytest.mark.parametrize(
    "tokens, lnc, kernels",
    [
        (4, 2, ["moe_block_tkg"]),
        (4, 1, ["rmsnorm_tkg", "router_topk", "moe_tkg"]),
        (256, 2, ["rmsnorm_tkg", "router_topk", "moe_cte"]),
    ],
)
def test_on_neuron_a_decode_block_at_lnc2_is_one_kernel(tokens, lnc, kernels):
    args = problem(tokens, hidden=512, inter=256, dtype=jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = neuron_text(lambda *a: jax_nkilib.moe_block(*a, top_k=2, normalize=True), *args)
    assert [cfg["func_name"] for cfg in kernel_configs(text)] == kernels


def test_bad_inputs():
    x, gamma, w_router, w_gu, w_d = problem(4)
    cases = [
        (lambda: jax_nkilib.moe_block(x, gamma[:5], w_router, w_gu, w_d, top_k=2), "`norm_weight`"),
        (lambda: jax_nkilib.moe_block(x, gamma, w_router.T, w_gu, w_d, top_k=2), "`w_router`"),
        (lambda: jax_nkilib.moe_block(x, gamma, w_router, w_gu, w_d, top_k=2, expert_activation="x"), "expert_"),
        (lambda: jax_nkilib.moe_block(x, gamma, w_router, w_gu, w_d, top_k=9), "top_k"),
    ]
    for call, fragment in cases:
        with pytest.raises((TypeError, ValueError)) as info:
            call()
        assert "jax_nkilib." in str(info.value) and fragment in str(info.value), str(info.value)


@pytest.mark.parametrize("activation, normalize", [("softmax", True), ("sigmoid", False)])
def test_the_fused_kernel_computes_what_the_three_ops_do(activation, normalize):
    """What the Neuron branch binds (moe_block_tkg with these flags), run as the kernel's reference here."""
    x, gamma, w_router, w_gu, w_d = problem(5)
    hidden = x.shape[-1]
    out, logits = jax_nkilib.nki.moe_block_tkg(
        x.reshape(1, 5, hidden),
        gamma.reshape(1, hidden),
        w_router,
        w_gu,
        w_d,
        top_k=2,
        router_act_fn=activation.upper(),
        router_pre_norm=True,
        norm_topk_prob=normalize,
        expert_affinities_scaling_mode="POST_SCALE",
        hidden_act_fn="SiLU",
        router_mm_dtype=jnp.float32,
    )
    want_out, want_logits = jax_nkilib.moe_block(
        x, gamma, w_router, w_gu, w_d, top_k=2, activation=activation, normalize=normalize
    )
    assert_close(logits, want_logits, jnp.float32, reduction=hidden)
    assert_close(out.reshape(x.shape), want_out, jnp.float32, reduction=hidden + 8, ops=8)
