"""jax_nkilib.nki.transformer_tkg: a Llama-3 decode step (all layers, all-reduces, KV-cache writes) against a NumPy
float64 oracle written here from the kernel's semantics; FP8 ROW MLP; tensor parallelism on 8 CPU devices against
the unsharded model; vmap; gradients; Neuron lowering (dry run); refused and bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import transformer_tkg
from tests.support.hlo import compiled_collectives, kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, place

SKIP = np.iinfo(np.uint32).max  # the library's "do not write this row" position


# ------------------------------------------------------------------------------------------------------ oracle
def f64(x):
    return np.asarray(np.asarray(x).astype(np.float32) if x.dtype == jnp.bfloat16 else x, np.float64)


def rms_norm(x, gamma, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * gamma.reshape(-1)


def rope_halves(x, cos, sin):
    """Rotate pairs (x[i], x[i + d/2]) of ``x [..., d]`` by angles with ``cos, sin [..., d/2]``."""
    half = x.shape[-1] // 2
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def silu(x):
    return x / (1.0 + np.exp(-x))


def llama_decode_oracle(ops, *, ranks=1, num_layers=None, eps=1e-6):
    """One decode step of a Llama-3 stack in float64: ``ranks`` tensor-parallel ranks side by side (rank r owns
    query heads ``[r q, (r + 1) q)``, one KV head, its weight columns/rows and cache rows ``[r B, (r + 1) B)``); the
    two per-layer sums over ranks are the all-reduces. Returns ``(out, K_caches, V_caches)``."""
    x = f64(ops["X"])
    batch, seq, _ = x.shape
    k_caches, v_caches = f64(ops["K_caches"]).copy(), f64(ops["V_caches"]).copy()
    mask = np.asarray(ops["mask_cache"]) != 0  # [S_ctx, B, ranks q, S]
    s_ctx, d = mask.shape[0], k_caches.shape[2]
    q = mask.shape[2] // ranks
    cos = np.transpose(f64(ops["RoPE_cos"]), (1, 2, 0))  # [B, S, d/2]
    sin = np.transpose(f64(ops["RoPE_sin"]), (1, 2, 0))
    scales = ops.get("W_gate_scales")
    for layer in range(num_layers or ops["W_qkvs"].shape[0]):
        w_qkv, w_out = f64(ops["W_qkvs"][layer]), f64(ops["W_outs"][layer])
        normed = rms_norm(x, f64(ops["W_gamma_qkvs"][layer]), eps)
        attn_sum = np.zeros_like(x)
        for r in range(ranks):
            qkv = (normed @ w_qkv[:, r * (q + 2) * d : (r + 1) * (q + 2) * d]).reshape(batch, seq, q + 2, d)
            queries = rope_halves(qkv[:, :, :q], cos[:, :, None], sin[:, :, None]) / np.sqrt(d)
            k_new, v_new = rope_halves(qkv[:, :, q], cos, sin), qkv[:, :, q + 1]  # [B, S, d]
            rows = slice(r * batch, (r + 1) * batch)
            keys = np.swapaxes(k_caches[layer, rows, :, :s_ctx], 1, 2).copy()  # [B, S_ctx, d]
            values = v_caches[layer, rows, :s_ctx].copy()
            keys[:, s_ctx - seq :], values[:, s_ctx - seq :] = k_new, v_new  # the active tail of the window
            scores = np.einsum("bshd,btd->bhst", queries, keys)
            visible = np.transpose(mask[:, :, r * q : (r + 1) * q], (1, 2, 3, 0))  # [B, q, S, S_ctx]
            scores = np.where(visible, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            heads = np.einsum("bhst,btd->bshd", probs, values).reshape(batch, seq, q * d)
            attn_sum += heads @ w_out[r * q * d : (r + 1) * q * d]
            if ops.get("position_ids") is not None:
                for b in range(batch):
                    start = int(np.asarray(ops["position_ids"][b, 0]).astype(np.uint32))
                    fit = max(0, min(seq, k_caches.shape[-1] - start))  # a row starting past the end: none
                    k_caches[layer, r * batch + b, :, start : start + fit] = k_new[b, :fit].T
                    v_caches[layer, r * batch + b, start : start + fit] = v_new[b, :fit]
        x = x + attn_sum
        normed = rms_norm(x, f64(ops["W_gamma_mlps"][layer]), eps)
        gate, up, down = (f64(ops[name][layer]) for name in ("W_gates", "W_ups", "W_downs"))
        if scales is not None:  # FP8 ROW: per output column dequantization scales (row 0 of the [128, n] tiles)
            gate = gate * f64(ops["W_gate_scales"][layer][0])
            up = up * f64(ops["W_up_scales"][layer][0])
            down = down * f64(ops["W_down_scales"][layer][0])
        inter = gate.shape[1] // ranks
        mlp_sum = np.zeros_like(x)
        for r in range(ranks):
            cols = slice(r * inter, (r + 1) * inter)
            mlp_sum += (silu(normed @ gate[:, cols]) * (normed @ up[:, cols])) @ down[cols]
        x = x + mlp_sum
    return x, k_caches, v_caches


# ------------------------------------------------------------------------------------------------------ inputs
def decode_inputs(
    seed, layers=2, batch=3, seq=2, hidden=40, d=6, q=3, inter=20, s_max=9, s_ctx=7, ranks=1, dtype=jnp.float32
):
    """Odd-sized operands: each row sees its own context length plus a causal active tail; row 1 is not written,
    row 2 (with several tokens) runs past the cache's end."""
    rng = np.random.default_rng(seed)

    def normal(shape, scale, as_dtype=dtype):
        return jnp.asarray(rng.standard_normal(shape) * scale, as_dtype)

    lengths = rng.integers(1, s_ctx - seq + 1, size=batch)
    visible = np.arange(s_ctx)[:, None] < lengths[None, :]  # [S_ctx, B]
    mask = np.broadcast_to(visible[:, :, None, None], (s_ctx, batch, ranks * q, seq)).astype(np.int32)
    mask[s_ctx - seq :] = np.tril(np.ones((seq, seq), np.int32)).T[:, None, None, :]  # slot i: queries s >= i
    positions = np.minimum(lengths, s_max - seq).astype(np.uint32)[:, None]
    if batch > 1:
        positions[1, 0] = SKIP
    if batch > 2 and seq > 1:
        positions[2, 0] = s_max - seq + 1  # straddles the end: only the slots that fit are written
    angles = rng.uniform(-np.pi, np.pi, (d // 2, batch, seq))
    return dict(
        X=normal((batch, seq, hidden), 0.5),
        W_qkvs=normal((layers, hidden, ranks * (q + 2) * d), 0.5 / np.sqrt(hidden)),
        W_outs=normal((layers, ranks * q * d, hidden), 0.5 / np.sqrt(q * d)),
        W_gates=normal((layers, hidden, ranks * inter), 0.5 / np.sqrt(hidden)),
        W_ups=normal((layers, hidden, ranks * inter), 0.5 / np.sqrt(hidden)),
        W_downs=normal((layers, ranks * inter, hidden), 0.5 / np.sqrt(inter)),
        W_gamma_qkvs=jnp.asarray(1.0 + rng.standard_normal((layers, 1, hidden)) * 0.1, dtype),
        W_gamma_mlps=jnp.asarray(1.0 + rng.standard_normal((layers, 1, hidden)) * 0.1, dtype),
        K_caches=normal((layers, ranks * batch, d, s_max), 1.0),
        V_caches=normal((layers, ranks * batch, s_max, d), 1.0),
        RoPE_cos=jnp.asarray(np.cos(angles), dtype),
        RoPE_sin=jnp.asarray(np.sin(angles), dtype),
        mask_cache=jnp.asarray(mask),
        position_ids=jnp.asarray(positions),
    )


TENSORS = tuple(decode_inputs(0))


def call(ops, **flags):
    return transformer_tkg(
        *(ops[name] for name in TENSORS[:13]), **{k: ops[k] for k in ops if k not in TENSORS[:13]}, **flags
    )


def check_step(result, ops, dtype, **oracle_flags):
    out, k_caches, v_caches = result
    expected = llama_decode_oracle(ops, **oracle_flags)
    hidden = ops["X"].shape[-1]
    ops_count = 4 if dtype == jnp.float32 else 1  # measured: 1e-7 (float32), 6e-3 (bfloat16)
    assert out.dtype == dtype and k_caches.dtype == dtype and v_caches.dtype == dtype
    assert_close(out, expected[0], dtype, reduction=hidden, ops=ops_count)
    assert_close(k_caches, expected[1], dtype, reduction=hidden, ops=ops_count)
    assert_close(v_caches, expected[2], dtype, reduction=hidden, ops=ops_count)


# ----------------------------------------------------------------------------------------------------- numerics
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_step_matches_the_float64_llama_oracle(dtype):
    ops = decode_inputs(1, dtype=dtype)
    result = jax.jit(call)(ops)
    check_step(result, ops, dtype)
    # row 1's position is the library's skip value: its cache rows are untouched
    np.testing.assert_array_equal(np.asarray(result[1][:, 1]), np.asarray(ops["K_caches"][:, 1]))
    np.testing.assert_array_equal(np.asarray(result[2][:, 1]), np.asarray(ops["V_caches"][:, 1]))


def test_without_position_ids_the_caches_are_unchanged_and_num_layers_runs_the_first_layers():
    ops = decode_inputs(2, layers=3)
    del ops["position_ids"]
    out, k_caches, v_caches = jax.jit(lambda o: call(o, num_layers=2))(ops)
    assert_close(out, llama_decode_oracle(ops, num_layers=2)[0], jnp.float32, reduction=40, ops=4)
    assert (k_caches == ops["K_caches"]).all() and (v_caches == ops["V_caches"]).all()


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3, pytest.param(jnp.float8_e4m3fn, marks=pytest.mark.slow)])
def test_fp8_row_mlp_weights_and_clamp_bound_unused_on_the_tkg_path(fp8):
    ops = decode_inputs(3)
    rng = np.random.default_rng(4)
    for name, width in (("W_gate", "W_gates"), ("W_up", "W_ups"), ("W_down", "W_downs")):
        scale = rng.uniform(0.5, 1.5, ops[width].shape[-1]) / 16
        ops[width] = (ops[width] / scale).astype(fp8)  # dequantizes to about the float weights
        ops[name + "_scales"] = jnp.asarray(np.broadcast_to(scale, (2, 128, scale.size)), jnp.float32)
    result = jax.jit(call)(ops)
    check_step(result, ops, jnp.float32)
    # clamp_bound is the MLP's CTE-path activation clip: B*S <= 96 runs the TKG path, which ignores it
    clamped = jax.jit(lambda o: call(o, clamp_bound=0.01))(ops)
    np.testing.assert_array_equal(np.asarray(clamped[0]), np.asarray(result[0]))


@pytest.mark.slow
def test_mask_active_is_unused_and_caches_may_carry_the_unit_kv_head_axis():
    """The library test's layouts: mask_active given (the kernel never reads it), caches [L, B, 1, ...]."""
    ops = decode_inputs(5)
    expected = llama_decode_oracle(ops)
    library_layout = dict(
        ops,
        mask_active=jnp.zeros((3, 3, 2, 2), jnp.int32),
        K_caches=ops["K_caches"][:, :, None],
        V_caches=ops["V_caches"][:, :, None],
    )
    out, k_caches, v_caches = jax.jit(call)(library_layout)
    assert k_caches.shape == (2, 3, 1, 6, 9) and v_caches.shape == (2, 3, 1, 9, 6)
    check_step((out, k_caches[:, :, 0], v_caches[:, :, 0]), ops, jnp.float32)
    assert_close(out, expected[0], jnp.float32, reduction=40, ops=4)


# ----------------------------------------------------------------------------------------------- transformations
def test_tensor_parallel_on_8_devices_matches_the_unsharded_oracle():
    """Each of 8 ranks holds 2 query heads, one KV head and an MLP slice; the two all-reduces per layer sum over
    ``tp``. Every rank's output is the whole model's decode step."""
    ops = decode_inputs(6, batch=2, seq=1, hidden=24, d=4, q=2, inter=4, s_max=6, s_ctx=5, ranks=8)
    sharded = (P(), P(None, None, "tp"), P(None, "tp"), P(None, None, "tp"), P(None, None, "tp"), P(None, "tp"))
    sharded += (P(), P(), P(None, "tp"), P(None, "tp"), P(), P(), P(None, None, "tp"), P())
    mesh = make_mesh((8,), ("tp",))
    fn = lambda *a: transformer_tkg(*a[:13], position_ids=a[13], replica_groups="tp")
    body = jax.shard_map(fn, mesh=mesh, in_specs=sharded, out_specs=(P("tp"), P(None, "tp"), P(None, "tp")))
    placed = place(mesh, sharded, *(ops[name] for name in TENSORS))
    compiled = jax.jit(body).lower(*placed).compile()
    # the two all-reduces of a layer, once in the scan body over the layers
    assert compiled_collectives(compiled.as_text()).get("all-reduce") == 2
    out, k_caches, v_caches = compiled(*placed)
    expected = llama_decode_oracle(ops, ranks=8)
    for rank_out in np.split(np.asarray(out), 8):  # one copy per rank: all equal the unsharded model
        assert_close(rank_out, expected[0], jnp.float32, reduction=24, ops=4)
    assert_close(k_caches, expected[1], jnp.float32, reduction=24, ops=4)
    assert_close(v_caches, expected[2], jnp.float32, reduction=24, ops=4)


def test_vmap_over_independent_decode_states_matches_a_loop():
    ops = decode_inputs(7)
    xs = jnp.stack([ops["X"], 2 * ops["X"]])
    caches = jnp.stack([ops["K_caches"], -ops["K_caches"]])
    step = lambda x, k: call(dict(ops, X=x, K_caches=k))
    batched = jax.jit(jax.vmap(step))(xs, caches)
    for i in range(2):
        single = step(xs[i], caches[i])
        for got, want in zip(batched, single):
            np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=2e-6, atol=2e-6)


def test_gradients_in_float64_for_the_norm_weights_and_the_caches():
    """(The conformance checklist covers X and the projections.)"""
    ops = {
        k: (v.astype(jnp.float64) if jnp.issubdtype(v.dtype, jnp.floating) else v)
        for k, v in decode_inputs(8, layers=1, batch=2, seq=1, hidden=16, inter=8).items()
    }
    names = ("W_gamma_qkvs", "W_gamma_mlps", "K_caches", "V_caches")
    fn = lambda *v: call(dict(ops, **dict(zip(names, v))))[0]
    check_grads(jax.jit(fn), tuple(ops[n] for n in names), order=1, modes=["rev"])
    # the updated caches carry no gradient
    grad = jax.grad(lambda k: call(dict(ops, K_caches=k))[1].sum())(ops["K_caches"])
    assert not np.asarray(grad).any()


# ------------------------------------------------------------------------------------------------ Neuron lowering
def kernel_sized(layers=1, dtype=jnp.bfloat16):
    return decode_inputs(
        9, layers=layers, batch=2, seq=1, hidden=256, d=64, q=2, inter=128, s_max=16, s_ctx=8, dtype=dtype
    )


@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_lowering_is_one_call_with_the_caches_aliased(lnc):
    ops = kernel_sized()
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = neuron_text(lambda o: call(o, eps=1e-5), ops)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "transformer_tkg" and cfg["grid"] == lnc
    assert cfg["entry_point"] == "jax_nkilib_kernels.transformer_tkg:transformer_tkg"
    assert cfg["output_names"] == ["out", "K_caches", "V_caches"] and cfg["aliases"] == [[8, 1], [9, 2]]
    assert cfg["params"]["eps"] == 1e-5 and cfg["params"]["replica_groups"] is None
    assert "output_operand_aliases" in text and text.count("AwsNeuronCustomNativeKernel") == 1


def test_neuron_lowering_inside_shard_map_passes_the_rank_lists():
    ops = kernel_sized()
    mesh = make_mesh((2, 4), ("dp", "tp"))
    fn = lambda *a: transformer_tkg(*a[:13], position_ids=a[13], replica_groups="tp")
    body = jax.shard_map(fn, mesh=mesh, in_specs=(P(),) * 14, out_specs=(P(("dp", "tp")), P(), P()), check_vma=False)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(body, *(ops[name] for name in TENSORS)))
    assert cfg["params"]["replica_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and cfg["has_collectives"] is True


def test_more_than_one_layer_per_call_falls_back_on_neuron():
    ops = kernel_sized(layers=2)
    with jax_nkilib.neuron.dry_run():
        with pytest.warns(NeuronFallbackWarning, match="num_layers > 1"):
            text = neuron_text(call, ops)
        assert "AwsNeuronCustomNativeKernel" not in text
        assert "AwsNeuronCustomNativeKernel" in neuron_text(lambda o: call(o, num_layers=1), ops)
        with jax_nkilib.config(on_unsupported="error"), pytest.raises(Exception, match="num_layers > 1"):
            neuron_text(call, ops)


# ---------------------------------------------------------------------------------------------------- bad inputs
def _fp8_without_scales(ops):
    ops["W_gates"] = ops["W_gates"].astype(jnp.float8_e4m3)


@pytest.mark.parametrize(
    "edit, flags, error, fragment",
    [
        (None, dict(sbuf_residual_and_cc=True), ValueError, "attention_mask=mask"),
        (lambda o: o.update(W_outs=o["W_outs"][:, :-1]), {}, ValueError, "W_outs"),
        (lambda o: o.update(mask_cache=o["mask_cache"][:, :, :2]), {}, ValueError, "(q + 2) * d"),
        (lambda o: o.update(RoPE_cos=o["RoPE_cos"][:2], RoPE_sin=o["RoPE_sin"][:2]), {}, ValueError, "RoPE_cos"),
        (lambda o: o.update(W_gate_scales=jnp.ones((2, 128, 20), jnp.float32)), {}, ValueError, "or none"),
        (_fp8_without_scales, {}, ValueError, "FP8 `W_gates`"),
        (lambda o: o.update(K_caches=o["K_caches"].astype(jnp.bfloat16)), {}, TypeError, "`K_caches`"),
        (
            lambda o: o.update(K_caches=o["K_caches"][..., :5], V_caches=o["V_caches"][:, :, :5]),
            {},
            ValueError,
            "S_ctx <= S_max",
        ),
        (lambda o: o.update(position_ids=o["position_ids"].astype(jnp.float32)), {}, TypeError, "`position_ids`"),
        (None, dict(num_layers=3), ValueError, "num_layers=3"),
        (None, dict(replica_groups="tp"), ValueError, "shard_map"),
    ],
)
def test_bad_inputs_name_the_argument(edit, flags, error, fragment):
    ops = decode_inputs(10)
    if edit is not None:
        edit(ops)
    with pytest.raises(error) as info:
        call(ops, **flags)
    assert fragment in str(info.value)
