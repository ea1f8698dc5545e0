"""jax_nkilib.nki.moe_block_tkg (RMSNorm -> router top-k -> experts) against a float64 NumPy oracle written from
the kernel's semantics (nki-library core/moe_block and the router_topk / moe_tkg torch refs it composes); the LNC 2
requirement; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.nki import moe_block_tkg
from tests.moe.test_moe_tkg import moe_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def router_oracle(normed, w_router, bias, top_k, softmax, pre_norm, norm_topk):
    """``(logits, index, affinities [T, E])`` in float64."""
    logits = normed @ f64(w_router) + (0.0 if bias is None else f64(bias))
    index = np.argsort(-logits, axis=1, kind="stable")[:, :top_k]
    rows = np.arange(logits.shape[0])[:, None]

    def act(v):
        if softmax:
            e = np.exp(v - v.max(axis=1, keepdims=True))
            return e / e.sum(axis=1, keepdims=True)
        return 1.0 / (1.0 + np.exp(-v))

    if pre_norm:
        affinities = act(logits)
        if norm_topk:
            kept = np.zeros_like(affinities)
            kept[rows, index] = affinities[rows, index]
            affinities = kept / kept.sum(axis=1, keepdims=True)
    else:
        affinities = np.zeros_like(logits)
        affinities[rows, index] = act(logits[rows, index])
    return logits, index, affinities


def block_oracle(
    inp,
    gamma,
    w_router,
    gate_up,
    down,
    *,
    top_k=1,
    softmax=False,
    pre_norm=True,
    norm_topk=False,
    post_scale=False,
    all_expert=False,
    rank=0,
    bias=None,
    eps=1e-6,
    hidden_actual=None,
    act="SiLU",
):
    x = f64(inp).reshape(-1, inp.shape[-1])
    h = hidden_actual or x.shape[1]
    normed = x * f64(gamma) / np.sqrt(np.sum(x * x, axis=1, keepdims=True) / h + eps)
    logits, index, affinities = router_oracle(normed, w_router, bias, top_k, softmax, pre_norm, norm_topk)
    weights = {"gate_up": gate_up, "down": down}
    out = moe_oracle(
        normed,
        weights,
        affinities,
        index,
        all_expert=all_expert,
        post_scale=post_scale,
        rank=rank,
        mask=pre_norm and not norm_topk,
        act=act,
    )
    return out, logits, index


def make(b, s, h, i, e, dtype=jnp.float32, local=None, seed=0):
    local = local or e
    return (
        random((b, s, h), dtype, seed),
        random((1, h), dtype, seed + 1, 0.3) + 1,
        random((h, e), dtype, seed + 2, 3 * h**-0.5),
        random((local, h, 2, i), dtype, seed + 3, h**-0.5),
        random((local, i, h), dtype, seed + 4, i**-0.5),
    )


def assert_separated(logits, top_k, margin=1e-3):
    """The oracle's top-k choice is not a near tie (so rounding cannot flip it)."""
    ordered = -np.sort(-logits, axis=1)
    assert np.min(ordered[:, top_k - 1] - ordered[:, top_k]) > margin


@pytest.mark.parametrize(
    "flags",
    [
        dict(router_act_fn="SIGMOID", router_pre_norm=True),
        dict(router_act_fn="SOFTMAX", router_pre_norm=False),
        dict(router_act_fn="SOFTMAX", router_pre_norm=True, norm_topk_prob=True),
    ],
    ids=["sigmoid-pre-norm", "softmax-of-top-k", "softmax-normalized-top-k"],
)
def test_selective_block_matches_oracle(flags):
    operands = make(3, 2, 32, 16, 6)
    bias = random((1, 6), jnp.float32, 9, 0.5)
    out, logits = moe_block_tkg(
        *operands,
        router_bias=bias,
        top_k=2,
        expert_affinities_scaling_mode="POST_SCALE",
        hidden_act_fn="Swish",
        router_mm_dtype=jnp.float32,
        eps=1e-5,
        **flags,
    )
    want, want_logits, _ = block_oracle(
        *operands,
        top_k=2,
        softmax=flags["router_act_fn"] == "SOFTMAX",
        pre_norm=flags["router_pre_norm"],
        norm_topk=flags.get("norm_topk_prob", False),
        post_scale=True,
        bias=bias,
        eps=1e-5,
        act="Swish",
    )
    assert_separated(want_logits, 2)
    assert out.shape == (6, 32) and logits.shape == (6, 6)
    assert_close(logits, want_logits, jnp.float32, reduction=32)
    assert_close(out, want, jnp.float32, reduction=64, ops=16)


def test_all_expert_block_uses_this_ranks_experts_masked_by_the_choice():
    operands = make(2, 4, 32, 8, 6, local=2, seed=3)
    rank = jnp.full((1, 1), 1, jnp.uint32)  # experts 2 and 3 of 6
    out = moe_block_tkg(
        *operands,
        rank_id=rank,
        top_k=3,
        is_all_expert=True,
        expert_affinities_scaling_mode="POST_SCALE",
        router_mm_dtype=jnp.float32,
        skip_router_logits=True,
    )
    assert out.shape == (8, 32)  # skip_router_logits: the output alone
    want, want_logits, _ = block_oracle(*operands, top_k=3, post_scale=True, all_expert=True, rank=1)
    assert_separated(want_logits, 3)
    assert_close(out, want, jnp.float32, reduction=32, ops=16)


def test_bfloat16_with_the_kernels_bfloat16_router():
    operands = make(4, 1, 64, 32, 8, jnp.bfloat16, seed=5)
    out, logits = moe_block_tkg(*operands, top_k=2, expert_affinities_scaling_mode="POST_SCALE")
    assert out.dtype == logits.dtype == jnp.bfloat16
    want, want_logits, _ = block_oracle(*operands, top_k=2, post_scale=True)
    assert_separated(want_logits, 2, margin=0.1)
    assert_close(logits, want_logits, jnp.bfloat16)
    assert_close(out, want, jnp.bfloat16, reduction=2, ops=8)


def test_hidden_actual_ignores_the_padding():
    inp, gamma, router, gate_up, down = make(2, 2, 32, 8, 4, seed=7)
    inp = inp.at[..., 20:].set(0.0)
    out, _ = moe_block_tkg(inp, gamma, router, gate_up, down, hidden_actual=20, router_mm_dtype=jnp.float32)
    want, want_logits, _ = block_oracle(inp, gamma, router, gate_up, down, hidden_actual=20)
    assert_separated(want_logits, 1)
    assert_close(out, want, jnp.float32, reduction=32, ops=16)


@pytest.mark.slow  # CI: check_grads of the moe_block_tkg arg spec
def test_gradient_flows_through_affinities_experts_norm_and_router():
    operands = [a.astype(jnp.float64) for a in make(2, 1, 8, 4, 3, seed=11)]
    flags = dict(top_k=2, expert_affinities_scaling_mode="POST_SCALE", router_mm_dtype=jnp.float64)
    grads = jax.grad(lambda *a: jnp.sum(moe_block_tkg(*a, **flags)[0] ** 2), argnums=(0, 1, 2, 3, 4))(*operands)
    assert all(bool(jnp.any(g != 0)) for g in grads)
    check_grads(lambda *a: moe_block_tkg(*a, **flags)[0], operands, order=1, modes=["rev"])


# ------------------------------------------------------------------------------------------------- Neuron: LNC
def test_runs_the_kernel_only_at_lnc_2():
    args = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in make(2, 2, 256, 128, 4)]
    fn = lambda *a: moe_block_tkg(*a, top_k=2)
    with jax_nkilib.neuron.dry_run():
        with jax_nkilib.config(lnc=2):
            (config,) = kernel_configs(neuron_text(fn, *args))
        assert config["grid"] == 2 and config["params"]["top_k"] == 2
        with jax_nkilib.config(lnc=1), pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match="LNC=2"):
            assert kernel_configs(neuron_text(fn, *args)) == []
        with jax_nkilib.config(lnc=1, on_unsupported="error"), pytest.raises(Exception, match="LNC=2"):
            neuron_text(fn, *args)


# ----------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "extra, error, fragment",
    [
        (dict(shared_expert_gate_w=jnp.zeros((16, 4))), ValueError, "shared_expert_gate_w"),
        (dict(hidden_act_scale_factor=1.5), ValueError, "hidden_act_scale_factor"),
        (dict(hidden_act_bias=0.5), ValueError, "hidden_act_bias"),
        (dict(residual=jnp.zeros((2, 2, 16))), ValueError, "residual"),
        (dict(router_act_fn="NOAUX_TC"), ValueError, "router_act_fn"),
        (dict(top_k=5), ValueError, "top_k"),
        (dict(is_all_expert=True), ValueError, "rank_id"),
        (dict(expert_affinities_scaling_mode="PRE_SCALE"), ValueError, "expert_affinities_scaling_mode"),
    ],
)
def test_bad_calls_are_named(extra, error, fragment):
    with pytest.raises(error, match=fragment):
        moe_block_tkg(*make(2, 2, 16, 8, 4), **extra)


def test_selective_mode_needs_every_routed_expert_here():
    inp, gamma, router, gate_up, down = make(2, 2, 16, 8, 4)
    with pytest.raises(ValueError, match="E_L=2"):
        moe_block_tkg(inp, gamma, router, gate_up[:2], down[:2])


# ----------------------------------------------------------------------------------------------------- MX experts
def mx_block_oracle(x, gamma, router, w, fmt, *, top_k, all_expert, rank=0, softmax=False, pre_norm=True):
    """RMSNorm, router, then each chosen (or local) expert's MX datapath (tests/moe/test_moe_tkg_mx.py)."""
    from tests.mlp.test_mlp_mx import quantize_hidden
    from tests.moe.test_moe_tkg_mx import mx_expert_oracle

    rows = f64(x).reshape(-1, x.shape[-1])
    normed = rows * f64(gamma) / np.sqrt(np.mean(rows * rows, axis=1, keepdims=True) + 1e-6)
    logits, index, affinities = router_oracle(normed, router, None, top_k, softmax, pre_norm, False)
    a = quantize_hidden(normed)
    local, (h, i) = w["gate_up"].shape[0], (x.shape[-1], w["gate_up"].shape[-1])
    out = np.zeros_like(normed)
    for t in range(rows.shape[0]):
        if all_expert:
            chosen = [
                (j, affinities[t, rank * local + j] * np.count_nonzero(index[t] == rank * local + j))
                for j in range(local)
            ]
        else:
            chosen = [(int(e), affinities[t, e]) for e in index[t]]
        for e, c in chosen:
            out[t] += c * mx_expert_oracle(a[t : t + 1], e, w, fmt, "SiLU", np.dtype(x.dtype), h, i)[0]
    return out, logits


def test_mx_selective_block_matches_oracle():
    from tests.moe.test_moe_tkg_mx import moe_mx_weights

    inp, gamma, router, _, _ = make(2, 2, 512, 64, 4, seed=13)
    w = moe_mx_weights(4, 512, 64, "fp4", dtype=jnp.float32)
    flags = dict(top_k=2, router_act_fn="SOFTMAX", router_pre_norm=False, expert_affinities_scaling_mode="POST_SCALE")
    out, logits = moe_block_tkg(
        inp,
        gamma,
        router,
        w["gate_up"],
        w["down"],
        expert_gate_up_weights_scale=w["gate_up_scale"],
        expert_down_weights_scale=w["down_scale"],
        router_mm_dtype=jnp.float32,
        **flags,
    )
    want, want_logits = mx_block_oracle(
        inp, gamma, router, w, "fp4", top_k=2, all_expert=False, softmax=True, pre_norm=False
    )
    assert_separated(want_logits, 2)
    assert_close(out, want, jnp.float32, reduction=2, ops=8)


def test_mx_all_expert_block_with_the_fused_residual_add():
    from tests.moe.test_moe_tkg_mx import moe_mx_weights

    inp, gamma, router, _, _ = make(1, 4, 512, 64, 4, seed=17)
    residual = random(inp.shape, jnp.float32, 19, 0.5)
    w = moe_mx_weights(2, 512, 64, "e4m3", dtype=jnp.float32)
    out, residual_out = moe_block_tkg(
        inp,
        gamma,
        router,
        w["gate_up"],
        w["down"],
        expert_gate_up_weights_scale=w["gate_up_scale"],
        expert_down_weights_scale=w["down_scale"],
        rank_id=jnp.ones((1, 1), jnp.uint32),
        residual=residual,
        top_k=2,
        is_all_expert=True,
        expert_affinities_scaling_mode="POST_SCALE",
        router_mm_dtype=jnp.float32,
        skip_router_logits=True,
    )
    x = f64(inp) + f64(residual)
    np.testing.assert_allclose(np.asarray(residual_out), x.reshape(4, 512), rtol=1e-6)
    want, want_logits = mx_block_oracle(
        jnp.asarray(x, jnp.float32), gamma, router, w, "e4m3", top_k=2, all_expert=True, rank=1
    )
    assert_separated(want_logits, 2)
    assert_close(out, want, jnp.float32, reduction=2, ops=8)
    with pytest.raises(ValueError, match="residual"):
        moe_block_tkg(inp, gamma, router, *make(1, 4, 512, 64, 4)[3:], residual=residual, top_k=2)


def test_mx_wrapper_is_the_block_on_unsigned_words():
    from jax_nkilib.nki import mx_moe_block_tkg_wrapper
    from tests.moe.test_moe_tkg_mx import moe_mx_weights

    inp, gamma, router, _, _ = make(2, 2, 512, 64, 4, seed=23)
    w = moe_mx_weights(4, 512, 64, "fp4", dtype=jnp.float32)
    flags = dict(top_k=2, expert_affinities_scaling_mode="POST_SCALE", router_mm_dtype=jnp.float32)
    enums = dict(router_act_fn="SIGMOID", hidden_act_fn="SiLU")
    operands = (inp, gamma, router, w["gate_up"], w["down"])
    scales = dict(expert_gate_up_weights_scale=w["gate_up_scale"], expert_down_weights_scale=w["down_scale"])
    wrapped = mx_moe_block_tkg_wrapper(*operands, **scales, **flags, **enums)
    for got, want in zip(wrapped, moe_block_tkg(*operands, **scales, **flags, **enums)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="router_act_fn"):
        mx_moe_block_tkg_wrapper(*operands, **scales, **flags, hidden_act_fn="SiLU")
    with pytest.raises(TypeError, match="MX x4 words"):
        mx_moe_block_tkg_wrapper(*make(2, 2, 512, 64, 4), **flags, **enums)
    bf16 = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in operands]
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(lambda *a: mx_moe_block_tkg_wrapper(*a, **scales, **flags, **enums), *bf16)
    (config,) = kernel_configs(text)
    assert config["func_name"] == "mx_moe_block_tkg_wrapper"
    assert "tensor<4x128x2x1x64xui16>" in text  # the words reach the wrapper as unsigned words
