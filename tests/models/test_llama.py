"""jax_nkilib.models.llama against a float64 NumPy Llama written here from Hugging Face's modeling code's math.

The tiny checkpoints are written by the tests with ``safetensors.numpy.save_file`` under HF's tensor names and
layouts (``Linear`` weights ``[out, in]``); the oracle reads those tensors directly, so the loader's name mapping and
transposes are under test too. The oracle: embeddings, per layer ``x += o_proj(attn)`` with RMSNorm (``x /
sqrt(mean(x^2) + eps) * w``), q/k/v projections, HF's ``rotate_half`` RoPE with ``cat(freqs, freqs)`` tables and the
llama3 frequency rule (as ``_compute_llama3_parameters`` states it), GQA by repeating kv heads, causal softmax, then
``x += down(silu(gate(n)) * up(n))``, final norm and ``lm_head`` (the embedding when tied).
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

pytest.importorskip("safetensors")
optax = pytest.importorskip("optax")
from safetensors.numpy import save_file  # noqa: E402

import jax_nkilib  # noqa: E402
from jax_nkilib.models import llama  # noqa: E402
from jax_nkilib.models.sampling import sample  # noqa: E402
from tests.support.hlo import kernel_configs, neuron_text, operations  # noqa: E402
from tests.support.numerics import relative_error, tolerance  # noqa: E402
from tests.support.sharding import use_mesh  # noqa: E402

HF_CONFIG = {
    "vocab_size": 96,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    # original context 32: with head_dim 16 and theta 1e4 the wavelengths (6.3, 20, 63, ...) span all three bands
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "tie_word_embeddings": False,
    "max_position_embeddings": 64,
    "torch_dtype": "float32",
}


# -------------------------------------------------------------------------------------------- the NumPy oracle
def hf_tensors(hf: dict, seed: int = 0) -> dict:
    """Random float32 tensors under HF Llama's names and shapes."""
    rng = np.random.default_rng(seed)
    h, inter, d = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    q, kv = hf["num_attention_heads"] * d, hf["num_key_value_heads"] * d
    linear = lambda n_out, n_in: (rng.standard_normal((n_out, n_in)) * n_in**-0.5).astype(np.float32)
    gain = lambda: (1 + 0.2 * rng.standard_normal(h)).astype(np.float32)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((hf["vocab_size"], h)).astype(np.float32)}
    for i in range(hf["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "input_layernorm.weight": gain(),
                p + "self_attn.q_proj.weight": linear(q, h),
                p + "self_attn.k_proj.weight": linear(kv, h),
                p + "self_attn.v_proj.weight": linear(kv, h),
                p + "self_attn.o_proj.weight": linear(h, q),
                p + "post_attention_layernorm.weight": gain(),
                p + "mlp.gate_proj.weight": linear(inter, h),
                p + "mlp.up_proj.weight": linear(inter, h),
                p + "mlp.down_proj.weight": linear(h, inter),
            }
        )
    tensors["model.norm.weight"] = gain()
    if not hf["tie_word_embeddings"]:
        tensors["lm_head.weight"] = linear(hf["vocab_size"], h)
    return tensors


def oracle_inv_freq(hf: dict) -> np.ndarray:
    d = hf["head_dim"]
    inv_freq = 1.0 / hf["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float64) / d)
    rs = hf.get("rope_scaling")
    if not rs:
        return inv_freq
    old = rs["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / rs["low_freq_factor"], old / rs["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / rs["factor"], inv_freq)
    smooth = (old / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
    smoothed = (1 - smooth) * scaled / rs["factor"] + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled)


def oracle_logits(tensors: dict, hf: dict, tokens) -> np.ndarray:
    """float64 logits ``[batch, seq, vocab]`` of HF Llama's math on ``tokens [batch, seq]``."""
    t = {name: np.asarray(value, np.float64) for name, value in tensors.items()}
    eps, d = hf["rms_norm_eps"], hf["head_dim"]
    nq, nkv = hf["num_attention_heads"], hf["num_key_value_heads"]
    tokens = np.asarray(tokens)
    b, s = tokens.shape
    norm = lambda x, w: x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w
    angles = np.arange(s)[:, None] * oracle_inv_freq(hf)[None]
    emb = np.concatenate([angles, angles], -1)
    cos, sin = np.cos(emb)[None, :, None], np.sin(emb)[None, :, None]
    rotate_half = lambda x: np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    mask = np.tril(np.ones((s, s), bool))
    x = t["model.embed_tokens.weight"][tokens]
    for i in range(hf["num_hidden_layers"]):
        w = lambda name: t[f"model.layers.{i}.{name}.weight"]
        n = norm(x, w("input_layernorm"))
        q = (n @ w("self_attn.q_proj").T).reshape(b, s, nq, d)
        k = (n @ w("self_attn.k_proj").T).reshape(b, s, nkv, d)
        v = (n @ w("self_attn.v_proj").T).reshape(b, s, nkv, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = np.repeat(k, nq // nkv, axis=2), np.repeat(v, nq // nkv, axis=2)
        scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        scores = np.where(mask, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, nq * d)
        x = x + attn @ w("self_attn.o_proj").T
        n = norm(x, w("post_attention_layernorm"))
        gate, up = n @ w("mlp.gate_proj").T, n @ w("mlp.up_proj").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w("mlp.down_proj").T
    head = t["model.embed_tokens.weight"] if hf["tie_word_embeddings"] else t["lm_head.weight"]
    return norm(x, t["model.norm.weight"]) @ head.T


# ------------------------------------------------------------------------------------------------- helpers
def write_checkpoint(tmp_path, hf: dict, seed: int = 0):
    tensors = hf_tensors(hf, seed)
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return tensors, path


def tokens_without_ties(seed: int, shape, vocab: int):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


# logits: two roundings per layer on sums of at most `intermediate` terms (measured: float32 4.5e-7 of a 4.7e-6
# bound, bfloat16 5e-3 of 0.15, float64 below 1e-15 of 8.7e-15)
def logits_bound(dtype, hf=HF_CONFIG):
    return tolerance(dtype, reduction=hf["intermediate_size"], ops=2 * hf["num_hidden_layers"])


# ---------------------------------------------------------------------------------------------------- tests
def test_from_hf_config_reads_every_field_and_refuses_what_it_cannot_run():
    config = llama.LlamaConfig.from_hf_config(HF_CONFIG)
    assert config == llama.LlamaConfig(
        vocab=96,
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=96,
        head_dim=16,
        rms_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling=llama.Llama3RopeScaling(4.0, 1.0, 4.0, 32),
        tie_embeddings=False,
        max_len=64,
        dtype="float32",
    )
    minimal = {k: HF_CONFIG[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")}
    plain = llama.LlamaConfig.from_hf_config({**minimal, "num_attention_heads": 8}, max_len=32, dtype="bfloat16")
    assert (plain.kv_heads, plain.head_dim, plain.rope_scaling, plain.max_len, plain.dtype) == (
        8,
        8,
        None,
        32,
        "bfloat16",
    )
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        llama.LlamaConfig.from_hf_config({**HF_CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}})
    with pytest.raises(ValueError, match="attention_bias"):
        llama.LlamaConfig.from_hf_config({**HF_CONFIG, "attention_bias": True})
    with pytest.raises(ValueError, match="multiple of `kv_heads`"):
        llama.LlamaConfig.from_hf_config({**HF_CONFIG, "num_key_value_heads": 3})


def test_llama3_rope_frequencies_match_the_hf_rule():
    config = llama.LlamaConfig.from_hf_config(HF_CONFIG)
    freqs = llama.rope_tables(config, jnp.arange(1))[0]  # smoke: tables build
    assert freqs.shape == (1, HF_CONFIG["head_dim"] // 2)
    from jax_nkilib.models.config import rope_frequencies

    want = oracle_inv_freq(HF_CONFIG)
    np.testing.assert_allclose(rope_frequencies(config), want, rtol=1e-14)
    plain = 1.0 / HF_CONFIG["rope_theta"] ** (np.arange(0, 16, 2) / 16)
    kept, scaled = want == plain, want == plain / 4
    assert kept.any() and scaled.any() and (~kept & ~scaled).any()  # the three bands: kept, blended, scaled


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_checkpoint_logits_match_float64_hf_llama(tmp_path, tied):
    hf = {**HF_CONFIG, "tie_word_embeddings": tied}
    tensors, path = write_checkpoint(tmp_path, hf, seed=int(tied))
    config = llama.LlamaConfig.from_hf_config(hf)
    params = llama.load_hf_checkpoint(path, config)
    assert ("lm_head" in params) == (not tied)
    tokens = tokens_without_ties(1, (2, 11), hf["vocab_size"])
    want = oracle_logits(tensors, hf, tokens)
    logits, cache = jax.jit(llama.prefill, static_argnums=1)(params, config, tokens, llama.init_cache(config, 2))
    assert logits.dtype == jnp.float32
    error = relative_error(logits, want)
    assert error <= logits_bound(jnp.float32), f"relative error {error:.2e}"
    assert relative_error(llama.forward({"params": params}, config, tokens), want) <= logits_bound(jnp.float32)
    # the cache holds the prompt's keys at positions 0..10 and nothing after
    assert np.all(np.asarray(cache[0][0])[:, :, 11:] == 0) and np.any(np.asarray(cache[0][0])[:, :, :11] != 0)


def test_bfloat16_checkpoint_logits_match_float64_hf_llama(tmp_path):
    hf = {**HF_CONFIG, "torch_dtype": "bfloat16"}
    tensors = hf_tensors(hf, seed=3)
    tensors = {name: value.astype(jnp.bfloat16) for name, value in tensors.items()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = llama.LlamaConfig.from_hf_config(hf)
    params = llama.load_hf_checkpoint(tmp_path, config)  # a directory
    assert params["embed"].dtype == jnp.bfloat16
    tokens = tokens_without_ties(2, (1, 9), hf["vocab_size"])
    error = relative_error(llama.forward(params, config, tokens), oracle_logits(tensors, hf, tokens))
    assert error <= logits_bound(jnp.bfloat16), f"relative error {error:.2e}"


@pytest.mark.parametrize("kv_heads", [2, 1])  # split q/k/v weights; one kv head: the grouped weight is qkv's own
def test_float64_model_matches_the_oracle_to_float64_rounding(tmp_path, kv_heads):
    """In float64 (RoPE tables and logits too) every mapping mistake would show far above rounding."""
    hf = {**HF_CONFIG, "tie_word_embeddings": True, "num_key_value_heads": kv_heads}
    tensors, path = write_checkpoint(tmp_path, hf, seed=5)
    config = llama.LlamaConfig.from_hf_config(hf, dtype="float64")
    params = llama.load_hf_checkpoint(path, config)
    tokens = tokens_without_ties(3, (2, 7), hf["vocab_size"])
    logits = llama.forward(params, config, tokens)
    assert logits.dtype == jnp.float64
    error = relative_error(logits, oracle_logits(tensors, hf, tokens))
    assert error <= logits_bound(jnp.float64), f"relative error {error:.2e}"


def test_cached_decode_steps_match_the_oracle_at_every_position(tmp_path):
    """Prefill 5 tokens, then decode the next 6 one at a time (positions per sequence as a [batch] array): the
    logits of each step are the oracle's at that position."""
    tensors, path = write_checkpoint(tmp_path, HF_CONFIG, seed=4)
    config = llama.LlamaConfig.from_hf_config(HF_CONFIG, max_len=16)
    params = llama.load_hf_checkpoint(path, config)
    tokens = tokens_without_ties(5, (2, 11), HF_CONFIG["vocab_size"])
    want = oracle_logits(tensors, HF_CONFIG, tokens)
    logits, cache = llama.prefill(params, config, tokens[:, :5], llama.init_cache(config, 2))
    got = [logits]
    step = jax.jit(llama.decode_step, static_argnums=1)
    for position in range(5, 11):
        logits, cache = step(params, config, tokens[:, position], jnp.full((2,), position), cache)
        got.append(logits[:, None])
    error = relative_error(jnp.concatenate(got, axis=1), want)
    assert error <= logits_bound(jnp.float32), f"relative error {error:.2e}"


def test_greedy_generate_equals_rerunning_the_whole_prefix_without_cache():
    """Each token is the argmax of the cache-free forward over the whole sequence so far (run on a buffer of the
    final length: with causal attention, the tokens after the prefix do not change its logits)."""
    config = llama.LlamaConfig(
        vocab=128, hidden=64, layers=2, heads=4, kv_heads=1, intermediate=128, max_len=16, rope_theta=10000.0
    )
    params = llama.init_params(config, jax.random.key(0))
    prompt = tokens_without_ties(6, (2, 4), config.vocab)
    generated = llama.generate(params, config, prompt, 8)
    assert generated.shape == (2, 8) and generated.dtype == jnp.int32
    forward = jax.jit(llama.forward, static_argnums=1)
    sequence = jnp.concatenate([prompt, jnp.zeros((2, 8), jnp.int32)], axis=1)
    for length in range(4, 12):
        nxt = jnp.argmax(forward(params, config, sequence)[:, length - 1], axis=-1).astype(jnp.int32)
        sequence = sequence.at[:, length].set(nxt)
    np.testing.assert_array_equal(generated, sequence[:, 4:])
    assert len(set(np.asarray(generated).ravel().tolist())) > 2  # a real sequence, not one repeated token


def test_top_k_and_top_p_sampling_draw_only_allowed_tokens():
    probs = np.array([0.05, 0.4, 0.02, 0.25, 0.15, 0.08, 0.05])  # sorted: 1 (.4), 3 (.25), 4 (.15), 5 (.08), ...
    logits = jnp.asarray(np.log(probs)[None].repeat(4, 0), jnp.float32)
    keys = jax.random.split(jax.random.key(7), 400)
    draw = jax.jit(
        lambda keys, top_k=None, top_p=None: jax.vmap(lambda key: sample(logits, key, top_k=top_k, top_p=top_p))(keys),
        static_argnames=("top_k", "top_p"),
    )
    counts = lambda tokens: set(np.asarray(tokens).ravel().tolist())
    assert counts(draw(keys, top_k=2)) == {1, 3}
    assert counts(draw(keys, top_p=0.6)) == {1, 3}  # 0.4 < 0.6 <= 0.65
    assert counts(draw(keys, top_p=0.3)) == {1}  # the first always stays
    assert counts(draw(keys, top_k=3, top_p=0.99)) == {1, 3, 4}
    assert len(counts(draw(keys))) == 7  # no truncation: every token is drawn
    # the draws follow the renormalised distribution: top_k=2 gives token 1 with probability 0.4 / 0.65
    share = float(np.mean(np.asarray(draw(keys, top_k=2)) == 1))
    assert abs(share - 0.4 / 0.65) < 0.05


@pytest.mark.slow  # three generate compilations; the sampler's own test runs in CI
def test_sampled_generate_stays_in_the_top_k_and_greedy_at_top_k_1():
    config = llama.LlamaConfig(vocab=128, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, max_len=16)
    params = llama.init_params(config, jax.random.key(1))
    prompt = tokens_without_ties(8, (2, 3), config.vocab)
    greedy = llama.generate(params, config, prompt, 5)
    one = llama.generate(params, config, prompt, 5, key=jax.random.key(0), top_k=1)
    np.testing.assert_array_equal(one, greedy)
    sampled = llama.generate(params, config, prompt, 5, key=jax.random.key(0), temperature=2.0, top_k=4, top_p=0.9)
    # each sampled token is among the 4 most likely after the same prefix
    sequence = jnp.concatenate([prompt, sampled], axis=1)
    logits = llama.forward(params, config, sequence)[:, 2:-1]
    top4 = np.asarray(jax.lax.top_k(logits, 4)[1])
    assert all(np.asarray(sampled)[b, i] in top4[b, i] for b in range(2) for i in range(5))


def test_loss_matches_the_oracle(tmp_path):
    tensors, path = write_checkpoint(tmp_path, HF_CONFIG, seed=9)
    config = llama.LlamaConfig.from_hf_config(HF_CONFIG)
    params = llama.load_hf_checkpoint(path, config)
    data = tokens_without_ties(10, (4, 9), HF_CONFIG["vocab_size"])
    tokens, targets = data[:, :-1], data[:, 1:]
    logits = oracle_logits(tensors, HF_CONFIG, tokens)
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    want = -np.mean(np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1))
    got = llama.loss(params, config, tokens, targets)
    assert abs(float(got) - want) <= logits_bound(jnp.float32) * abs(want)


@pytest.mark.slow  # CI: tests/examples/test_llama_examples.py trains with optax (SGD) and checks the loss falls
def test_loss_decreases_under_optax_adam():
    config = llama.LlamaConfig.from_hf_config(HF_CONFIG)
    params = llama.init_params(config, jax.random.key(2))
    data = tokens_without_ties(10, (4, 9), HF_CONFIG["vocab_size"])
    tokens, targets = data[:, :-1], data[:, 1:]
    optimizer = optax.adam(3e-3)
    state = optimizer.init(params)
    losses = []
    for _ in range(4):
        params, state, value = llama.train_step(params, state, tokens, targets, config=config, optimizer=optimizer)
        losses.append(float(value))
    assert losses == sorted(losses, reverse=True) and losses[-1] < losses[0] - 0.05, losses


def test_decode_step_under_donation_updates_the_cache_in_place():
    """The compiled step aliases every cache array to an output and copies none of them."""
    config = llama.LlamaConfig(vocab=128, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, max_len=24)
    params = llama.init_params(config, jax.random.key(0))
    cache = llama.init_cache(config, 2)
    step = jax.jit(llama.decode_step, static_argnums=1, donate_argnums=4)
    compiled = step.lower(params, config, jnp.zeros(2, jnp.int32), 3, cache).compile()
    text = compiled.as_text()
    leaves = len(jax.tree.leaves(params))
    first_cache = leaves + 2  # parameters: params' leaves, token, position, then the cache arrays
    aliased = {int(p) for p in re.findall(r"\{\d+\}: \((\d+), \{\}, may-alias\)", text)}
    assert aliased == set(range(first_cache, first_cache + 2 * config.layers)), aliased
    cache_shape = "f32[2,2,24,16]"
    copies = [line for line in text.splitlines() if f"{cache_shape}" in line and " copy(" in line]
    assert copies == [], copies
    # and it computes the same as without donation
    token = jnp.array([5, 7], jnp.int32)
    want, want_cache = jax.jit(llama.decode_step, static_argnums=1)(params, config, token, 3, cache)
    got, got_cache = step(params, config, token, 3, llama.init_cache(config, 2))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got_cache[1][0], want_cache[1][0])


def test_decode_step_on_neuron_is_four_kernels_per_layer_and_never_moves_the_cache():
    """Lowered for Neuron (dry run), a decode step is per layer qkv (RMSNorm and RoPE fused), attention_tkg,
    output_projection_tkg and mlp (RMSNorm fused), then the final rmsnorm_tkg; the caches reach attention_tkg by a
    reshape and are written by one scatter each (the new token), with no transpose, copy or select of a cache."""
    config = llama.LlamaConfig(vocab=256, hidden=256, layers=2, heads=8, kv_heads=2, intermediate=512, max_len=128)
    params = llama.init_params(config, jax.random.key(0))
    step = lambda p, t, c: llama.decode_step(p, config, t, 5, c)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(step, params, jnp.zeros(2, jnp.int32), llama.init_cache(config, 2))
    kernels = [cfg["func_name"] for cfg in kernel_configs(text)]
    assert kernels == ["qkv", "attention_tkg", "output_projection_tkg", "mlp"] * 2 + ["rmsnorm_tkg"], kernels
    assert operations(text).count("stablehlo.scatter") == 2 * config.layers
    cache_type = "tensor<2x2x128x32xf32>"
    touching = {op for line in text.splitlines() if cache_type in line for op in operations(line)}
    assert "stablehlo.reshape" in touching and touching <= {"stablehlo.reshape", "stablehlo.scatter"}, touching


def test_decode_step_with_one_kv_head_per_device_is_one_fused_attention_kernel_per_layer():
    """Lowered for Neuron (dry run), a decode step whose layers hold one kv head (MQA, or a tensor-parallel shard of
    GQA) is per layer one attention_block_tkg (RMSNorm, QKV, RoPE, cache update, attention and output projection,
    the caches aliased in place) and one mlp, then the final rmsnorm_tkg; the caches are only reshaped."""
    config = llama.LlamaConfig(vocab=256, hidden=256, layers=2, heads=4, kv_heads=1, intermediate=512, max_len=128)
    params = llama.init_params(config, jax.random.key(0))
    step = lambda p, t, c: llama.decode_step(p, config, t, jnp.array([5, 9]), c)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(step, params, jnp.zeros(2, jnp.int32), llama.init_cache(config, 2))
    configs = kernel_configs(text)
    assert [cfg["func_name"] for cfg in configs] == ["attention_block_tkg", "mlp"] * 2 + ["rmsnorm_tkg"]
    for cfg in configs[:-1:2]:  # K_cache and V_cache (inputs 2, 3) are outputs 1, 2
        assert sorted(map(tuple, cfg["aliases"])) == [(2, 1), (3, 2)], cfg["aliases"]
    cache_type = f"tensor<2x1x128x{config.head_dim}xf32>"
    touching = {op for line in text.splitlines() if cache_type in line for op in operations(line)}
    assert touching == {"stablehlo.reshape"}, touching


def test_a_tensor_parallel_decode_step_is_one_fused_attention_kernel_per_layer_per_device():
    """GQA with 4 kv heads on a 2 x 4 (data x model) mesh, parameters placed by param_specs: each device holds one
    kv head, so each layer's attention is one attention_block_tkg (its grouped w_qkv slice reshaped, never
    concatenated) and each layer's attention and MLP end with one all-reduce."""
    config = llama.LlamaConfig(vocab=256, hidden=256, layers=2, heads=8, kv_heads=4, intermediate=512, max_len=128)
    params = llama.init_params(config, jax.random.key(0))
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    with use_mesh(mesh), jax_nkilib.neuron.dry_run():
        placed = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), llama.param_specs(params)))
        cache = jax.device_put(llama.init_cache(config, 2), NamedSharding(mesh, P("data", "model")))
        tokens, position = (
            jax.device_put(a, NamedSharding(mesh, P("data"))) for a in (jnp.zeros(2, jnp.int32), jnp.array([5, 9]))
        )
        text = jax_nkilib.neuron_hlo(
            lambda p, t, n, c: llama.decode_step(p, config, t, n, c), placed, tokens, position, cache
        )
    kernels = [cfg["func_name"] for cfg in kernel_configs(text)]
    assert kernels == ["attention_block_tkg", "mlp"] * 2 + ["rmsnorm_tkg"], kernels
    ops = operations(text)
    assert ops.count("stablehlo.all_reduce") == 2 * config.layers and "stablehlo.concatenate" not in ops


def test_load_hf_checkpoint_names_what_is_missing_or_misshapen(tmp_path):
    tensors, path = write_checkpoint(tmp_path, HF_CONFIG)
    config = llama.LlamaConfig.from_hf_config(HF_CONFIG)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        llama.load_hf_checkpoint(path, config)
    wrong = llama.LlamaConfig.from_hf_config({**HF_CONFIG, "intermediate_size": 80})
    write_checkpoint(tmp_path, HF_CONFIG)
    with pytest.raises(ValueError, match=r"gate_proj.weight has shape \(96, 64\); the config needs \(80, 64\)"):
        llama.load_hf_checkpoint(path, wrong)
    with pytest.raises(ValueError, match="tokens must be \\[batch, seq\\]"):
        llama.prefill(llama.load_hf_checkpoint(path, config), config, jnp.zeros((3,), jnp.int32), None)


def test_generate_and_decode_refuse_what_the_cache_cannot_hold():
    config = llama.LlamaConfig(vocab=64, hidden=64, layers=1, heads=4, kv_heads=2, intermediate=64, max_len=8)
    params = llama.init_params(config, jax.random.key(0))
    with pytest.raises(ValueError, match="seq \\+ steps <= max_len; got seq=5, steps=4, max_len=8"):
        llama.generate(params, config, jnp.zeros((1, 5), jnp.int32), 4)
    with pytest.raises(ValueError, match="8 tokens exceed the cache's max_len - 1 = 7 tokens"):
        llama.prefill(params, config, jnp.zeros((1, 8), jnp.int32), llama.init_cache(config, 1))
    with pytest.raises(TypeError, match="tokens must be integers"):
        llama.forward(params, config, jnp.zeros((1, 3), jnp.float32))
    with pytest.raises(ValueError, match="token must be \\[batch\\]"):
        llama.decode_step(params, config, jnp.zeros((1, 1), jnp.int32), 0, llama.init_cache(config, 1))
    with pytest.raises(ValueError, match="top_p must be in \\(0, 1\\]"):
        sample(jnp.zeros((1, 8)), jax.random.key(0), top_p=1.5)
