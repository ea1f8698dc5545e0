"""jax_nkilib.nki.moe_tkg against a dense float64 NumPy MoE written from the kernel's semantics (nki-library
core/moe/moe_tkg and its torch ref): selective and all-expert modes, affinity scaling, masking, rank slicing, FP8
row scales, biases, clamps, activations; gradients; Neuron lowering; errors."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nkilib
from jax_nkilib.nki import moe_tkg
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

SWISH_BETA = 1.702  # ActFnType.Swish is the sigmoid-approximated GELU, x * sigmoid(1.702 x)


def act_oracle(x, name):
    sigmoid = lambda v: 1.0 / (1.0 + np.exp(-v))
    if name == "SiLU":
        return x * sigmoid(x)
    if name == "Swish":
        return x * sigmoid(SWISH_BETA * x)
    if name == "GELU":
        return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def expert_oracle(x, e, w, act, clamps):
    """One expert on one token ``x [H]`` in float64."""
    gate_up, down = f64(w["gate_up"])[e], f64(w["down"])[e]
    if w.get("gate_up_scale") is not None:
        gate_up = gate_up * f64(w["gate_up_scale"])[e][None]
        down = down * f64(w["down_scale"])[e][None]
    g, u = x @ gate_up[:, 0], x @ gate_up[:, 1]
    if w.get("gate_up_bias") is not None:
        g, u = g + f64(w["gate_up_bias"])[e, 0], u + f64(w["gate_up_bias"])[e, 1]
    g_hi, g_lo, u_hi, u_lo = clamps
    g = np.clip(g, -np.inf if g_lo is None else g_lo, np.inf if g_hi is None else g_hi)
    u = np.clip(u, -np.inf if u_lo is None else u_lo, np.inf if u_hi is None else u_hi)
    y = (act_oracle(g, act) * u) @ down
    return y if w.get("down_bias") is None else y + f64(w["down_bias"])[e]


def moe_oracle(x, w, affinities, index, *, all_expert, post_scale, rank=0, mask=False, act="SiLU", clamps=(None,) * 4):
    """``out[t] = sum over the token's experts of c * expert(x_t)``, by loops."""
    x, affinities, index = f64(x), f64(affinities), np.asarray(index)
    local = w["gate_up"].shape[0]
    out = np.zeros((x.shape[0], x.shape[1]))
    for t in range(x.shape[0]):
        if all_expert:
            for j in range(local):
                expert = rank * local + j
                c = 1.0
                if post_scale:
                    c = affinities[t, expert] * (np.count_nonzero(index[t] == expert) if mask else 1)
                out[t] += c * expert_oracle(x[t], j, w, act, clamps)
        else:
            for e in index[t]:
                c = affinities[t, e] if post_scale else 1.0
                out[t] += c * expert_oracle(x[t], int(e), w, act, clamps)
    return out


def make(t, h, i, e, k, dtype=jnp.float32, experts=None, seed=0, bias=False):
    rng = np.random.default_rng(seed)
    experts = experts or e
    w = {
        "gate_up": random((e, h, 2, i), dtype, seed + 1, h**-0.5),
        "down": random((e, i, h), dtype, seed + 2, i**-0.5),
    }
    if bias:
        w["gate_up_bias"] = random((e, 2, i), dtype, seed + 3, 0.3)
        w["down_bias"] = random((e, h), dtype, seed + 4, 0.3)
    x = random((t, h), dtype, seed + 5)
    affinities = jnp.asarray(rng.uniform(0.1, 1.0, (t, experts)), dtype)
    index = jnp.asarray(np.argsort(rng.uniform(size=(t, experts)), axis=1)[:, :k], jnp.int32)
    return x, w, affinities, index


def call(x, w, affinities, index, rank_id=None, **flags):
    return moe_tkg(
        x,
        w["gate_up"],
        w["down"],
        affinities,
        index,
        rank_id,
        expert_gate_up_bias=w.get("gate_up_bias"),
        expert_down_bias=w.get("down_bias"),
        expert_gate_up_weights_scale=w.get("gate_up_scale"),
        expert_down_weights_scale=w.get("down_scale"),
        **flags,
    )


# ------------------------------------------------------------------------------------------------- selective
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "t, e, k",
    [(5, 6, 3), (1, 16, 4)],  # the dense path (T*K > E_L) and the gathered one (T*K <= E_L)
    ids=["dense", "gathered"],
)
def test_selective_post_scale_with_biases_and_clamps(dtype, t, e, k):
    x, w, affinities, index = make(t, 24, 12, e, k, dtype, bias=True)
    clamps = (0.4, -0.5, 0.6, -0.3)
    names = ("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit", "up_clamp_lower_limit")
    out = call(
        x,
        w,
        affinities,
        index,
        is_all_expert=False,
        expert_affinities_scaling_mode="POST_SCALE",
        **dict(zip(names, clamps)),
    )
    assert out.shape == (t, 24) and out.dtype == dtype
    want = moe_oracle(x, w, affinities, index, all_expert=False, post_scale=True, clamps=clamps)
    assert_close(out, want, dtype, reduction=k, ops=8)


@pytest.mark.parametrize("act", ["SiLU", "GELU", "GELU_Tanh_Approx", "Swish"])
def test_selective_activations_no_scale(act):
    x, w, affinities, index = make(7, 16, 8, 5, 2, seed=3)
    out = call(x, w, affinities, index, is_all_expert=False, activation_fn=act)
    want = moe_oracle(x, w, affinities, index, all_expert=False, post_scale=False, act=act)
    assert_close(out, want, jnp.float32, reduction=16, ops=8)


def test_selective_index_out_of_range_gives_nan_rows_and_a_runtime_error():
    x, w, affinities, index = make(3, 16, 8, 4, 2)
    index = index.at[1, 0].set(4)
    out = call(x, w, affinities, index, is_all_expert=False)
    assert np.isnan(np.asarray(out[1])).all() and np.isfinite(np.asarray(out)[[0, 2]]).all()
    with jax_nkilib.config(runtime_checks=True):
        checked = checkify.checkify(
            lambda i: call(x, w, affinities, i, is_all_expert=False), errors=checkify.user_checks
        )
        err, _ = checked(index)
    with pytest.raises(checkify.JaxRuntimeError, match=r"expert_index.*outside \[0, E_L=4\)"):
        err.throw()


# ------------------------------------------------------------------------------------------------ all-expert
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mask", [False, True])
def test_all_expert_post_scale_slices_this_ranks_affinities(dtype, mask):
    x, w, affinities, index = make(9, 16, 8, 3, 2, dtype, experts=9, bias=True)
    rank = jnp.full((1, 1), 2, jnp.uint32)  # experts 6, 7, 8 of 9
    out = call(
        x,
        w,
        affinities,
        index,
        rank,
        is_all_expert=True,
        expert_affinities_scaling_mode="POST_SCALE",
        mask_unselected_experts=mask,
    )
    want = moe_oracle(x, w, affinities, index, all_expert=True, post_scale=True, rank=2, mask=mask)
    assert_close(out, want, dtype, reduction=3, ops=8)


def test_all_expert_no_scale_sums_every_local_expert():
    x, w, affinities, index = make(4, 16, 8, 3, 1)
    out = call(x, w, affinities, index, is_all_expert=True)
    want = moe_oracle(x, w, affinities, index, all_expert=True, post_scale=False)
    assert_close(out, want, jnp.float32, reduction=48, ops=8)


def test_all_expert_dynamic_does_not_change_the_result():
    x, w, affinities, index = make(32, 16, 8, 2, 1)
    rank = jnp.zeros((1, 1), jnp.int32)
    flags = dict(is_all_expert=True, expert_affinities_scaling_mode="POST_SCALE")
    dynamic = call(x, w, affinities, index, rank, is_all_expert_dynamic=True, block_size=8, **flags)
    np.testing.assert_array_equal(dynamic, call(x, w, affinities, index, rank, **flags))


# ------------------------------------------------------------------------------------------ FP8, output dtype
def test_fp8_row_scales_and_output_dtype():
    x, w, affinities, index = make(6, 32, 16, 4, 2, jnp.bfloat16, seed=5)
    rng = np.random.default_rng(9)
    w["gate_up"], w["down"] = w["gate_up"].astype(jnp.float8_e4m3), w["down"].astype(jnp.float8_e4m3)
    w["gate_up_scale"] = jnp.asarray(rng.uniform(0.5, 2.0, (4, 2, 16)), jnp.float32)
    w["down_scale"] = jnp.asarray(rng.uniform(0.5, 2.0, (4, 32)), jnp.float32)
    out = call(
        x,
        w,
        affinities,
        index,
        is_all_expert=False,
        expert_affinities_scaling_mode="POST_SCALE",
        output_dtype=jnp.float32,
    )
    assert out.dtype == jnp.float32
    want = moe_oracle(x, w, affinities, index, all_expert=False, post_scale=True)
    assert_close(out, want, jnp.bfloat16, reduction=2, ops=8)


# --------------------------------------------------------------------------------------------- transformations
def test_gradients_match_the_oracles_finite_differences():
    x, w, affinities, index = make(3, 8, 4, 3, 2, jnp.float64, seed=7, bias=True)
    flags = dict(is_all_expert=False, expert_affinities_scaling_mode="POST_SCALE")
    loss = lambda x, a: jnp.sum(call(x, w, a, index, **flags) ** 2)
    grads = jax.grad(loss, argnums=(0, 1))(x, affinities)
    oracle = lambda x, a: np.sum(moe_oracle(x, w, a, index, all_expert=False, post_scale=True) ** 2)
    for which, grad in enumerate(grads):
        args = [np.asarray(x), np.asarray(affinities)]
        numeric = np.zeros(args[which].shape)
        for position in np.ndindex(args[which].shape):
            step = np.zeros(args[which].shape)
            step[position] = 1e-6
            plus, minus = list(args), list(args)
            plus[which], minus[which] = args[which] + step, args[which] - step
            numeric[position] = (oracle(*plus) - oracle(*minus)) / 2e-6
        np.testing.assert_allclose(np.asarray(grad), numeric, rtol=1e-5, atol=1e-7)


def test_vmap_folds_into_tokens():
    x, w, affinities, index = make(4, 16, 8, 4, 2)
    xs = jnp.stack([x, x[::-1]])
    fn = lambda x: call(x, w, affinities, index, is_all_expert=False)
    calls = [line for line in str(jax.make_jaxpr(jax.vmap(fn))(xs)).splitlines() if "= moe_tkg[" in line]
    assert len(calls) == 1 and "f32[8,16]" in calls[0]  # one call over 2 x 4 tokens, not a loop
    np.testing.assert_allclose(jax.vmap(fn)(xs)[1], fn(x[::-1]), rtol=1e-6)


# ------------------------------------------------------------------------------------------------ Neuron path
def test_neuron_lowering_calls_the_adapter_and_splits_selective_tokens_over_128():
    shapes = lambda t: (
        jax.ShapeDtypeStruct((t, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 256, 2, 128), jnp.bfloat16),
        jax.ShapeDtypeStruct((4, 128, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((t, 4), jnp.float32),
        jax.ShapeDtypeStruct((t, 2), jnp.int32),
    )
    fn = lambda *a: moe_tkg(*a, is_all_expert=False, expert_affinities_scaling_mode="POST_SCALE", activation_fn="Swish")
    with jax_nkilib.neuron.dry_run():
        (config,) = kernel_configs(neuron_text(fn, *shapes(64)))
        assert config["entry_point"] == "jax_nkilib_kernels.moe_tkg:moe_tkg"
        assert config["params"]["is_all_expert"] is False and config["params"]["activation_fn"] == "Swish"
        assert len(kernel_configs(neuron_text(fn, *shapes(256)))) == 2  # selective mode takes T <= 128


def test_neuron_fallback_names_the_limit():
    x, w, affinities, index = make(4, 24, 8, 4, 2, jnp.bfloat16)  # H=24: not a multiple of 128
    fn = lambda x: call(x, w, affinities, index, is_all_expert=False)
    with jax_nkilib.neuron.dry_run(), pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match="H % 128"):
        assert kernel_configs(neuron_text(fn, x)) == []


# ----------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "flags, error, fragment",
    [
        (dict(is_all_expert=False, expert_affinities_scaling_mode="PRE_SCALE"), ValueError, "NO_SCALE or POST_SCALE"),
        (dict(is_all_expert=False, activation_fn="ReLU"), ValueError, "activation_fn"),
        (dict(is_all_expert=True, expert_affinities_scaling_mode="POST_SCALE"), ValueError, "rank_id"),
        (dict(is_all_expert=False, is_all_expert_dynamic=True, block_size=2), ValueError, "is_all_expert=True"),
        (dict(is_all_expert=True, is_all_expert_dynamic=True, block_size=3), ValueError, "block_size"),
        (dict(is_all_expert=True, is_all_expert_dynamic=True), ValueError, "block_size"),
        (dict(), TypeError, "is_all_expert"),
    ],
)
def test_bad_flags_are_named(flags, error, fragment):
    x, w, affinities, index = make(4, 16, 8, 4, 2)
    with pytest.raises(error, match=fragment):
        call(x, w, affinities, index, **flags)


def test_bad_operands_are_named():
    x, w, affinities, index = make(4, 16, 8, 4, 2)
    with pytest.raises(ValueError, match="expert_affinities"):
        call(x, w, affinities[:3], index, is_all_expert=False)
    with pytest.raises(TypeError, match="expert_index"):
        call(x, w, affinities, index.astype(jnp.float32), is_all_expert=False)
    fp8 = dict(w, gate_up=w["gate_up"].astype(jnp.float8_e4m3), down=w["down"].astype(jnp.float8_e4m3))
    with pytest.raises(ValueError, match="row scales"):
        call(x, fp8, affinities, index, is_all_expert=False)
    one = dict(w, gate_up_scale=jnp.ones((4, 2, 8)))
    with pytest.raises(ValueError, match="expert_down_weights_scale"):
        call(x, one, affinities, index, is_all_expert=False)
