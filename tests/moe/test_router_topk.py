"""jax_nkilib.nki.router_topk against a float64 oracle: both x layouts, SOFTMAX / SIGMOID, the three pipelines
(pre-norm, pre-norm + L1 norm, post-top-K activation), bias, eager affinities, float32 and bfloat16, odd sizes; the
kernel's quirks; errors; the Neuron lowering (dry run), its split along T and its fallbacks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from jax_nkilib.nki import router_topk
from tests.moe import oracles
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, assert_no_worse_than_plain

T, H, E = 13, 256, 24  # odd token and expert counts


def inputs(dtype, layout=1, bias=True, t=T, h=H, e=E, seed=0):
    x = random((t, h) if layout == 1 else (h, t), dtype, seed)
    w = random((h, e), dtype, seed + 1, scale=0.2)
    b = random((e,), dtype, seed + 2, scale=0.5) if bias else None
    return x, w, b


def flags(act, k, layout, pre_norm, norm, **extra):
    return dict(
        act_fn=act, k=k, x_hbm_layout=layout, x_sb_layout=0, router_pre_norm=pre_norm, norm_topk_prob=norm, **extra
    )


PIPELINES = [(True, False), (True, True), (False, False)]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("act", ["SOFTMAX", "SIGMOID"])
@pytest.mark.parametrize("pre_norm, norm", PIPELINES)
def test_matches_the_float64_oracle(dtype, act, pre_norm, norm):
    layout = 0 if act == "SIGMOID" else 1
    bias = not (pre_norm and norm)
    x, w, b = inputs(dtype, layout, bias)
    k = 5
    logits, index, affinities = router_topk(x, w, b, **flags(act, k, layout, pre_norm, norm))
    want_logits, want_index, want_affinities, _ = oracles.router_topk(x, w, b, act, k, layout, pre_norm, norm)
    assert logits.shape == (T, E) and logits.dtype == dtype
    assert index.shape == (T, k) and index.dtype == jnp.uint32
    assert affinities.shape == (T, E) and affinities.dtype == dtype
    np.testing.assert_array_equal(np.asarray(index), want_index)
    assert_close(logits, want_logits, dtype, reduction=H)
    assert_close(affinities, want_affinities, dtype, reduction=E)


def test_both_x_layouts_give_the_same_outputs():
    x, w, b = inputs(jnp.float32)
    row_major = router_topk(x, w, b, **flags("SOFTMAX", 3, 1, True, True))
    column_major = router_topk(x.T, w, b, **flags("SOFTMAX", 3, 0, True, True))
    for got, want in zip(column_major, row_major):
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("act, pre_norm, norm", [("SIGMOID", False, False), ("SOFTMAX", True, True)])
def test_eager_affinities_are_the_selected_ones(act, pre_norm, norm):
    x, w, b = inputs(jnp.bfloat16, bias=True, t=7)
    outs = router_topk(x, w, b, **flags(act, 4, 1, pre_norm, norm, return_eager_affi=True))
    assert len(outs) == 4 and outs[3].shape == (7, 4) and outs[3].dtype == jnp.float32
    _, _, _, eager = oracles.router_topk(x, w, b, act, 4, 1, pre_norm, norm)
    assert_close(outs[3], eager, jnp.float32, reduction=E)


def test_pre_norm_without_norm_returns_the_full_activation():
    """The kernel's (ACT1, topK) pipeline stores the activation of every expert, nothing scattered."""
    x, w, b = inputs(jnp.float32)
    _, _, affinities = router_topk(x, w, b, **flags("SOFTMAX", 2, 1, True, False))
    np.testing.assert_allclose(np.asarray(affinities).sum(-1), 1.0, rtol=1e-5)
    assert np.all(np.asarray(affinities) > 0)


def test_norm_topk_prob_is_ignored_after_top_k():
    x, w, b = inputs(jnp.float32)
    with_norm = router_topk(x, w, b, **flags("SIGMOID", 3, 1, False, True, use_indirect_dma_scatter=True))
    without = router_topk(x, w, b, **flags("SIGMOID", 3, 1, False, False, use_indirect_dma_scatter=True))
    for got, want in zip(with_norm, without):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.allclose(np.asarray(with_norm[2]).sum(-1), 1.0)  # sigmoid weights, not renormalised


def test_bias_moves_the_selection_and_the_affinities():
    x, w, _ = inputs(jnp.float32, bias=False)
    bias = jnp.zeros((E,)).at[7].set(50.0)
    _, index, affinities = router_topk(x, w, bias, **flags("SOFTMAX", 2, 1, True, True))
    assert np.all(np.asarray(index)[:, 0] == 7)
    assert np.all(np.asarray(affinities)[:, 7] > 0.99)


def test_gradients_match_the_oracle_derivative():
    """d(sum(affinities * g))/dx by central differences of the float64 oracle, against the VJP."""
    x, w, b = (a.astype(jnp.float64) for a in inputs(jnp.float32, t=4, h=128, e=8))
    g = random((4, 8), jnp.float64, 9)
    f = dict(flags("SOFTMAX", 3, 1, True, True))
    grad = jax.jit(jax.grad(lambda x: jnp.sum(router_topk(x, w, b, **f)[2] * g)))(x)
    eps, numeric = 1e-6, np.zeros(x.shape)
    for i in range(x.shape[0]):
        for j in range(0, x.shape[1], 17):
            bump = np.zeros(x.shape)
            bump[i, j] = eps
            plus = oracles.router_topk(np.asarray(x) + bump, w, b, "SOFTMAX", 3, 1, True, True)[2]
            minus = oracles.router_topk(np.asarray(x) - bump, w, b, "SOFTMAX", 3, 1, True, True)[2]
            numeric[i, j] = np.sum((plus - minus) * np.asarray(g)) / (2 * eps)
    np.testing.assert_allclose(np.asarray(grad)[:, ::17], numeric[:, ::17], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(skip_store_router_logits=True), "skip_store_router_logits"),
        (dict(skip_store_expert_index=True), "skip_store_expert_index"),
        (dict(return_eager_affi=True), "return_eager_affi"),
        (dict(act_fn="NOAUX_TC"), "act_fn"),
        (dict(k=E + 1), "`k`"),
        (dict(x_hbm_layout=2), "x_hbm_layout"),
    ],
)
def test_bad_flags_raise_naming_them(change, match):
    x, w, b = inputs(jnp.float32)
    with pytest.raises((TypeError, ValueError), match=match):
        router_topk(x, w, b, **{**flags("SOFTMAX", 2, 1, True, False), **change})


def test_bad_operands_raise_naming_them():
    x, w, b = inputs(jnp.float32)
    with pytest.raises(TypeError, match="same dtype"):
        router_topk(x, w.astype(jnp.bfloat16), b, **flags("SOFTMAX", 2, 1, True, False))
    with pytest.raises(ValueError, match="`w` must have layout"):
        router_topk(x.T, w, b, **flags("SOFTMAX", 2, 1, True, False))  # [H, T] given as layout 1
    with pytest.raises(ValueError, match="`x`"):
        router_topk(x[0], w, b, **flags("SOFTMAX", 2, 1, True, False))
    with pytest.raises(ValueError, match="w_bias"):
        router_topk(x, w, b[:5], **flags("SOFTMAX", 2, 1, True, False))
    with pytest.raises(TypeError, match="act_fn"):
        router_topk(x, w, b, k=2, x_hbm_layout=1, x_sb_layout=0)


def test_neuron_lowering_is_one_kernel_call_with_the_flags():
    x, w, b = inputs(jnp.bfloat16, layout=0, t=128, h=256, e=64)
    f = flags("SIGMOID", 8, 0, False, False, use_indirect_dma_scatter=True)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, w, b: router_topk(x, w, b, **f), x, w, b)
    (config,) = kernel_configs(text)
    assert config["func_name"] == "router_topk"
    assert config["input_names"] == ["x", "w", "w_bias"]
    assert config["output_names"] == ["router_logits", "expert_index", "expert_affinities"]
    assert config["params"]["act_fn"] == "SIGMOID" and config["params"]["k"] == 8
    assert config["params"]["use_indirect_dma_scatter"] is True


def test_neuron_lowering_splits_long_token_counts():
    x, w, _ = inputs(jnp.bfloat16, t=4096, h=128, e=16, bias=False)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, w: router_topk(x, w, **flags("SOFTMAX", 2, 1, True, False)), x, w)
    configs = kernel_configs(text)
    assert [c["input_specs"][0][0] for c in configs] == [[2048, 128], [2048, 128]]


@pytest.mark.parametrize(
    "lnc, change, reason",
    [
        (1, dict(k=9), "k=9 must be <= 8"),
        (1, dict(shard_on_tokens=True), "shard_on_tokens needs LNC=2"),
        (2, dict(act_fn="SIGMOID", router_pre_norm=False), "use_indirect_dma_scatter=True"),
    ],
)
def test_neuron_limits_fall_back_with_the_reason(monkeypatch, lnc, change, reason):
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    x, w, _ = inputs(jnp.bfloat16, t=16, h=128, e=16, bias=False)
    f = {**flags("SOFTMAX", 2, 1, True, False), **change}
    fn = lambda x, w: router_topk(x, w, **f)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        with pytest.warns(NeuronFallbackWarning, match=reason):
            assert kernel_configs(neuron_text(fn, x, w)) == []
        with jax_nkilib.config(on_unsupported="error"), pytest.raises(NeuronUnsupportedError, match=reason):
            neuron_text(fn, x, w)


@pytest.mark.parametrize("layout", [0, 1])
def test_vmap_over_tokens_folds_into_t(layout):
    """A vmapped x (w and the bias shared) becomes one kernel call over n*T tokens, equal to a loop."""
    xs = jnp.stack([inputs(jnp.float32, layout, seed=s)[0] for s in range(3)])
    _, w, b = inputs(jnp.float32, layout)
    f = flags("SOFTMAX", 3, layout, True, True)
    batched = jax.vmap(lambda x: router_topk(x, w, b, **f))
    text = str(jax.make_jaxpr(batched)(xs))
    assert "router_topk[" in text and f"f32[{3 * T},{E}]" in text and "scan" not in text
    for got, want in zip(batched(xs), [jnp.stack(o) for o in zip(*(router_topk(x, w, b, **f) for x in xs))]):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_bfloat16_gradients_are_no_worse_than_plain_jax():
    """The VJP (which recomputes bf16 logits wide rather than differentiate their rounded copies) is within a small
    multiple of plain bf16 JAX autodiff's error against the float64 gradient."""
    x, w, b = inputs(jnp.bfloat16, t=64, h=256, e=32)
    g = random((64, 32), jnp.float32, 5)

    def plain(x, w, b):  # the same math, written directly in JAX at x's precision
        logits = jnp.dot(x, w, preferred_element_type=jnp.float32) + b.astype(jnp.float32)
        probs = jax.nn.softmax(logits, axis=-1)
        top, index = jax.lax.top_k(probs, 4)
        kept = jnp.zeros_like(probs).at[jnp.arange(64)[:, None], index].set(top / top.sum(-1, keepdims=True))
        return jnp.sum(kept.astype(x.dtype).astype(jnp.float32) * g)

    ours = lambda x, w, b: jnp.sum(router_topk(x, w, b, **flags("SOFTMAX", 4, 1, True, True))[2] * g)
    wide = [a.astype(jnp.float64) for a in (x, w, b)]
    want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(*wide)
    got = jax.jit(jax.grad(ours, argnums=(0, 1, 2)))(x, w, b)
    baseline = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(x, w, b)
    for ours_grad, plain_grad, oracle in zip(got, baseline, want):
        assert_no_worse_than_plain(ours_grad, plain_grad, oracle, factor=3.0)
