"""jax_nkilib.nki.moe_tkg with MX weights (MXFP4 ``float4_e2m1fn_x4`` uint16 words, MXFP8 ``float8_e4m3fn_x4`` uint32
words, uint8 scales) against a float64 NumPy oracle that decodes each expert's words and re-quantizes the hidden
states and the intermediate in the kernel's layouts with explicit loops (the MLP TKG MX oracle of
tests/mlp/test_mlp_mx.py, per expert), then combines the experts as in tests/moe/test_moe_tkg.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import moe_tkg
from tests.mlp.test_mlp_mx import (
    bias_vector,
    decode_down,
    decode_gate_up,
    mx_gate_up_bias,
    mx_weights,
    quantize_hidden,
    quantize_inter,
)
from tests.moe.test_moe_tkg import act_oracle
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

pytestmark = pytest.mark.slow  # CI time: the MX variants; CI runs their arg specs' lowering and bad inputs


def moe_mx_weights(e, h, i, fmt, bias=False, dtype=jnp.bfloat16):
    """Per-expert MX weights stacked in moe_tkg's layouts, and the codes the oracle decodes."""
    per = [mx_weights(h, i, fmt, seed=10 + k) for k in range(e)]
    w = {
        "gate_up": jnp.stack([jnp.stack([p["gate"][0], p["up"][0]], 1) for p in per]),  # [E, 128, 2, H/512, I]
        "gate_up_scale": jnp.stack([jnp.stack([p["gate"][1], p["up"][1]], 1) for p in per]),
        "down": jnp.stack([p["down"][0] for p in per]),  # [E, P_I, N_I, H]
        "down_scale": jnp.stack([p["down"][1] for p in per]),
        "codes": per,
    }
    if bias:
        w["gate_up_bias"] = jnp.stack(
            [jnp.stack([mx_gate_up_bias(i, 20 + k), mx_gate_up_bias(i, 40 + k)], 1) for k in range(e)]
        ).astype(dtype)  # [E, P_I, 2, N_I, 4]
        w["down_bias"] = random((e, h), dtype, 60, 0.5)
    return w


def mx_expert_oracle(a, e, w, fmt, act, io, h, i):
    """One expert on quantized hidden rows ``a [N, H]`` (float64): decode, project, MXFP8 round trip of the
    intermediate, down projection, rounded to io."""
    codes = w["codes"][e]
    gate = a @ decode_gate_up(np.asarray(codes["gate"][2]), np.asarray(codes["gate"][1]), fmt, h, i)
    up = a @ decode_gate_up(np.asarray(codes["up"][2]), np.asarray(codes["up"][1]), fmt, h, i)
    if "gate_up_bias" in w:
        gate = gate + bias_vector(f64(w["gate_up_bias"])[e][:, 0], i)
        up = up + bias_vector(f64(w["gate_up_bias"])[e][:, 1], i)
    inter = (act_oracle(gate, act) * up).astype(io).astype(np.float64)
    inter = quantize_inter(inter)
    out = inter @ decode_down(np.asarray(codes["down"][2]), np.asarray(codes["down"][1]), fmt, i, h)
    if "down_bias" in w:
        out = out + f64(w["down_bias"])[e]
    return out.astype(io).astype(np.float64)


def mx_moe_oracle(x, w, fmt, affinities, index, *, all_expert, act="SiLU"):
    io = np.dtype(x.dtype)
    tokens, h = x.shape
    i = w["gate_up"].shape[-1]
    a = quantize_hidden(f64(x))
    out = np.zeros((tokens, h))
    aff = f64(affinities)
    for t in range(tokens):
        experts = range(w["gate_up"].shape[0]) if all_expert else [int(e) for e in np.asarray(index)[t]]
        for e in experts:
            c = aff[t, e]
            if all_expert:
                c = float(np.asarray(jnp.asarray(c, x.dtype), np.float64))  # the all-expert path rounds it to io
            out[t] += c * mx_expert_oracle(a[t : t + 1], e, w, fmt, act, io, h, i)[0]
    return out


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
        expert_gate_up_weights_scale=w["gate_up_scale"],
        expert_down_weights_scale=w["down_scale"],
        expert_affinities_scaling_mode="POST_SCALE",
        **flags,
    )


def routing(t, e, k, seed=0):
    rng = np.random.default_rng(seed)
    affinities = jnp.asarray(rng.uniform(0.1, 1.0, (t, e)), jnp.float32)
    index = jnp.asarray(np.argsort(rng.uniform(size=(t, e)), axis=1)[:, :k], jnp.int32)
    return affinities, index


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", ["fp4", "e4m3"])
@pytest.mark.parametrize("all_expert", [False, True], ids=["selective", "all-expert"])
def test_mx_matches_oracle(dtype, fmt, all_expert):
    h, i, e = 512, 64, 3
    w = moe_mx_weights(e, h, i, fmt, bias=True, dtype=dtype)
    x = random((4, h), dtype, 1)
    affinities, index = routing(4, e, 2)
    rank = jnp.zeros((1, 1), jnp.int32) if all_expert else None
    out = call(x, w, affinities, index, rank, is_all_expert=all_expert, activation_fn="Swish")
    assert out.dtype == dtype
    want = mx_moe_oracle(x, w, fmt, affinities, index, all_expert=all_expert, act="Swish")
    assert_close(out, want, dtype, reduction=2, ops=8)


def test_mx_partial_intermediate_tile_and_gathered_path():
    h, i, e = 512, 640, 6  # I = 512 + 128: a partial last tile; T*K = 2 <= E: the gathered path
    w = moe_mx_weights(e, h, i, "fp4")
    x = random((1, h), jnp.bfloat16, 2)
    affinities, index = routing(1, e, 2, seed=3)
    out = call(x, w, affinities, index, is_all_expert=False)
    assert_close(out, mx_moe_oracle(x, w, "fp4", affinities, index, all_expert=False), jnp.bfloat16, reduction=2)


def test_mx_vjp_is_straight_through_the_activation_quantization():
    h, i, e = 512, 64, 2
    w = moe_mx_weights(e, h, i, "e4m3")
    x = random((2, h), jnp.float32, 4)
    affinities, index = routing(2, e, 1, seed=5)
    grad = jax.grad(lambda x: jnp.sum(call(x, w, affinities, index, is_all_expert=False) ** 2))(x)
    assert grad.shape == x.shape and bool(jnp.all(jnp.isfinite(grad))) and bool(jnp.any(grad != 0))


def test_mx_lowering_and_errors():
    h, i, e = 512, 64, 2
    w = moe_mx_weights(e, h, i, "fp4")
    x = random((2, h), jnp.bfloat16, 6)
    affinities, index = routing(2, e, 1)
    with jax_nkilib.neuron.dry_run():
        (config,) = kernel_configs(neuron_text(lambda x: call(x, w, affinities, index, is_all_expert=False), x))
    assert config["entry_point"] == "jax_nkilib_kernels.moe_tkg:moe_tkg"
    with pytest.raises(ValueError, match="uint8 scales"):
        moe_tkg(x, w["gate_up"], w["down"], affinities, index, is_all_expert=False)
    with pytest.raises(TypeError, match="expert_down_weights"):
        moe_tkg(x, w["gate_up"], w["down"].astype(jnp.uint32), affinities, index, is_all_expert=False)
    dense_bias = jnp.zeros((e, 2, i), jnp.bfloat16)
    with pytest.raises(ValueError, match="expert_gate_up_bias"):
        call(x, dict(w, gate_up_bias=dense_bias), affinities, index, is_all_expert=False)
