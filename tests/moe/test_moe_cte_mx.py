"""jax_nkilib.nki.moe_cte with implementations shard_on_block_mx and shard_on_i_mx (MXFP4/MXFP8 x4 weights with uint8
scales) against a
float64 NumPy oracle: the experts' words decoded from the formats' definitions and the MXFP8 round trips of the
gathered rows and of the intermediate with the explicit loops of tests/mlp/test_mlp_mx.py, then the blockwise MoE of
the library's MX golden (test_utils.generate_blockwise_numpy_golden) block by block, with the kernel's tiles: rows in
compute_dtype (bfloat16) and act(g) * u in bfloat16 before their MXFP8 round trips, the affinity on the output."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.neuron.lowering import NeuronFallbackWarning
from tests.mlp.test_mlp_mx import bias_vector, decode_down, decode_gate_up, quantize_hidden, quantize_inter
from tests.moe.blockwise_oracles import act, clip, routing
from tests.moe.test_moe_tkg_mx import moe_mx_weights
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

pytestmark = pytest.mark.slow  # CI time: the MX variants; CI runs their arg specs' lowering and bad inputs

T, H, INTER, E, K, B = 9, 512, 64, 3, 2, 4
MX = "shard_on_block_mx"


def problem(dtype=jnp.float32, fmt="fp4", bias=False, tokens=T, block=B, seed=0, inter=INTER):
    rng = np.random.default_rng(seed)
    index = np.stack([rng.permutation(E)[:K] for _ in range(tokens)])
    affinities, slots, owners, _ = routing(index, rng.uniform(0.2, 1.0, (tokens, K)), E, block)
    x = rng.standard_normal((tokens + 1, H))
    x[tokens] = 0
    w = moe_mx_weights(E, H, inter, fmt, bias=bias, dtype=dtype)
    ops = {
        "hidden_states": jnp.asarray(x, dtype),
        "expert_affinities_masked": jnp.asarray(affinities, dtype),
        "gate_up_proj_weight": w["gate_up"],
        "down_proj_weight": w["down"],
        "token_position_to_id": jnp.asarray(slots, jnp.int32),
        "block_to_expert": jnp.asarray(owners, jnp.int32),
        "gate_up_proj_scale": w["gate_up_scale"],
        "down_proj_scale": w["down_scale"],
    }
    if bias:
        ops["gate_and_up_proj_bias"] = w["gate_up_bias"]
        ops["down_proj_bias"] = w["down_bias"]
    return ops, w


def call(ops, block=B, implementation=MX, **kwargs):
    return nki.moe_cte(**ops, block_size=block, implementation=implementation, **kwargs)


def _round(v, dtype):
    return np.asarray(v, np.float64).astype(np.dtype(dtype)).astype(np.float64)


def oracle(ops, w, fmt, block=B, act_name="SiLU", gate_clamp=(None, None), slots=True, accumulate=True, blocks=None):
    """``[2, T+1, H]`` (``slots``): slot 0 the blockwise sum, slot 1 zeros (shard_on_block_mx's reduced per-core
    slots), else ``[T+1, H]`` (shard_on_i_mx), the rows overwritten instead of accumulated without ``accumulate``;
    only the first ``blocks`` blocks (all by default)."""
    io = np.dtype(ops["hidden_states"].dtype)
    x = f64(ops["hidden_states"])
    aff = f64(ops["expert_affinities_masked"]).reshape(x.shape[0], E)
    ids = np.asarray(ops["token_position_to_id"]).reshape(-1, block)
    owners = np.asarray(ops["block_to_expert"]).reshape(-1)[:blocks]
    experts = {}
    for e in range(E):
        c = w["codes"][e]
        experts[e] = (
            decode_gate_up(c["gate"][2], np.asarray(c["gate"][1]), fmt, H, INTER),
            decode_gate_up(c["up"][2], np.asarray(c["up"][1]), fmt, H, INTER),
            decode_down(c["down"][2], np.asarray(c["down"][1]), fmt, INTER, H),
        )
    out = np.zeros_like(x)
    for rows, e in zip(ids, owners):
        wg, wu, wd = experts[e]
        a = _round(aff[rows, e], io)[:, None]
        xb = quantize_hidden(_round(x[rows], ml_dtypes.bfloat16))
        g, u = xb @ wg, xb @ wu
        if "gate_and_up_proj_bias" in ops:
            bias = f64(ops["gate_and_up_proj_bias"])[e]
            g, u = g + bias_vector(bias[:, 0], INTER), u + bias_vector(bias[:, 1], INTER)
        g = clip(g, *gate_clamp)
        h = quantize_inter(_round(act(g, act_name) * u, ml_dtypes.bfloat16))
        d = h @ wd
        if "down_proj_bias" in ops:
            d = d + f64(ops["down_proj_bias"])[e]
        y = a * d
        for r, row in enumerate(rows):
            out[row] = _round(out[row] + _round(y[r], io), io) if accumulate else _round(y[r], io)
    return np.stack([out, np.zeros_like(out)]) if slots else out


@pytest.mark.parametrize(
    "dtype, fmt, bias", [(jnp.float32, "fp4", True), (jnp.bfloat16, "e4m3", False), (jnp.bfloat16, "fp4", True)]
)
def test_output_matches_the_mx_block_oracle(dtype, fmt, bias):
    ops, w = problem(dtype, fmt, bias)
    out = call(ops)
    assert out.shape == (2, T + 1, H) and out.dtype == dtype
    assert_close(out, oracle(ops, w, fmt), dtype, reduction=2, ops=8)


@pytest.mark.parametrize("dtype, fmt, accumulate", [(jnp.float32, "e4m3", True), (jnp.bfloat16, "fp4", False)])
def test_shard_on_i_mx_matches_the_oracle(dtype, fmt, accumulate):
    ops, w = problem(dtype, fmt, bias=True, seed=5)
    out = call(ops, implementation="shard_on_i_mx", is_tensor_update_accumulating=accumulate)
    assert out.shape == (T + 1, H) and out.dtype == dtype
    want = oracle(ops, w, fmt, slots=False, accumulate=accumulate)
    assert_close(out, want, dtype, reduction=2, ops=8)


@pytest.mark.parametrize(
    "num_static_block, used, tokens", [(1, 2, 10), (None, 0, 9)], ids=["static-1-used-2", "default-static-odd"]
)
def test_shard_on_i_mx_hybrid_runs_the_static_blocks_then_the_used_ones(num_static_block, used, tokens):
    """Blocks ``b < max(num_static_block, sum(conditions))``; without ``num_static_block`` the static loop has
    ``N - E`` blocks rounded down to even (the MX kernel's default)."""
    ops, w = problem(jnp.float32, "fp4", tokens=tokens, seed=7)
    n_blocks = ops["block_to_expert"].shape[0]
    if num_static_block is None:
        assert (n_blocks - E) % 2 == 1  # N - E = 3 runs 2 static blocks (the bf16 hybrid would run 3)
    conditions = jnp.asarray(np.arange(n_blocks + 1) < used, jnp.int32)
    static = num_static_block if num_static_block is not None else (n_blocks - E) - (n_blocks - E) % 2
    processed = max(static, used)
    assert 0 < processed < n_blocks - 1  # real blocks are left out, so the count is observable
    out = call(
        dict(ops, conditions=conditions), implementation="shard_on_i_mx_hybrid", num_static_block=num_static_block
    )
    want = oracle(ops, w, "fp4", slots=False, blocks=processed)
    assert_close(out, want, jnp.float32, reduction=2, ops=8)


def test_swish_with_clamp_and_odd_token_count():
    ops, w = problem(jnp.float32, "e4m3", tokens=6, seed=3)
    out = call(ops, activation_function="Swish", gate_clamp_upper_limit=1.5)
    want = oracle(ops, w, "e4m3", act_name="Swish", gate_clamp=(1.5, None))
    assert_close(out, want, jnp.float32, reduction=2, ops=8)


def test_gradients_are_straight_through_the_quantization():
    ops, _ = problem(jnp.float32, "fp4", bias=True, tokens=5)

    def loss(x, aff, gb, db):
        o = call(dict(ops, hidden_states=x, expert_affinities_masked=aff, gate_and_up_proj_bias=gb, down_proj_bias=db))
        return jnp.sum(o**2)

    names = ("hidden_states", "expert_affinities_masked", "gate_and_up_proj_bias", "down_proj_bias")
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(*(ops[n] for n in names))
    for g, n in zip(grads, names):
        assert g.shape == ops[n].shape and bool(jnp.all(jnp.isfinite(g))) and bool(jnp.any(g != 0)), n


@pytest.mark.parametrize(
    "implementation, tokens, block, inter",
    [(MX, 128, 128, INTER), ("shard_on_i_mx", 200, 256, 1024), ("shard_on_i_mx_hybrid", 200, 256, 1024)],
    ids=["block", "i", "i-hybrid"],
)
def test_neuron_lowering_is_one_moe_cte_call_on_trn3_at_lnc2(implementation, tokens, block, inter):
    ops, _ = problem(jnp.bfloat16, "fp4", tokens=tokens, block=block, inter=inter)
    if implementation.endswith("hybrid"):
        ops["conditions"] = jnp.ones((ops["block_to_expert"].shape[0] + 1,), jnp.int32).at[-1].set(0)
    fn = lambda x: call(dict(ops, hidden_states=x), block=block, implementation=implementation)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target="trn3", lnc=2, on_unsupported="error"):
        (config,) = kernel_configs(neuron_text(fn, ops["hidden_states"]))
    assert config["entry_point"] == "jax_nkilib_kernels.moe_cte:moe_cte"
    assert implementation in str(config)


@pytest.mark.parametrize("target, lnc, reason", [("trn2", 2, "trn3"), ("trn3", 1, "LNC=2")], ids=["trn2", "lnc1"])
def test_neuron_falls_back_off_trn3_and_at_lnc1(target, lnc, reason):
    ops, _ = problem(jnp.bfloat16, "fp4", tokens=128, block=128)
    fn = lambda x: call(dict(ops, hidden_states=x), block=128)  # noqa: E731
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target=target, lnc=lnc):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kernel_configs(neuron_text(fn, ops["hidden_states"])) == []
    assert any(issubclass(c.category, NeuronFallbackWarning) and reason in str(c.message) for c in caught)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda o: dict(o, gate_up_proj_scale=None), TypeError, "gate_up_proj_scale"),
        (lambda o: dict(o, down_proj_scale=o["down_proj_scale"].astype(jnp.float32)), TypeError, "down_proj_scale"),
        (lambda o: dict(o, down_proj_weight=o["down_proj_weight"][..., :256]), ValueError, "down_proj_weight"),
        (
            lambda o: dict(o, conditions=jnp.ones((o["block_to_expert"].shape[0] + 2,), jnp.int32)),
            ValueError,
            "conditions",
        ),
        (
            lambda o: dict(o, gate_up_proj_weight=o["gate_up_proj_weight"].astype(jnp.uint32)),
            TypeError,
            "gate_up_proj_weight",
        ),
    ],
    ids=["no-scale", "float-scale", "down-layout", "conditions", "mixed-formats"],
)
def test_bad_inputs_name_the_argument(change, error, match):
    ops, _ = problem(jnp.float32, "fp4")
    with pytest.raises(error, match=match):
        call(change(ops))


def test_post_scale_accumulating_only_and_the_hybrid_needs_conditions():
    ops, _ = problem(jnp.float32, "fp4")
    with pytest.raises(ValueError, match="is_tensor_update_accumulating"):
        call(ops, is_tensor_update_accumulating=False)
    for mode in ("PRE_SCALE", "NO_SCALE"):
        with pytest.raises(ValueError, match="expert_affinities_scaling_mode=POST_SCALE"):
            call(ops, expert_affinities_scaling_mode=mode)
    with pytest.raises(TypeError, match="conditions"):
        nki.moe_cte(**ops, block_size=B, implementation="shard_on_i_mx_hybrid")
    with pytest.raises(TypeError, match="dense float weights"):
        nki.moe_cte(**ops, block_size=B, implementation="shard_on_i")
