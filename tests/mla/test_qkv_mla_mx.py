"""``jax_nkilib.nki.qkv_mla_mx`` and ``qkv_mla_mx_deepseek_v4`` against the float64 NumPy oracle written from their
torch references (``tests/mla/mx_oracle.py``, whose independent packer builds every MX operand), float32 and bfloat16
inputs with odd head sizes and partial scale blocks; the swizzle and weight decoding; vmap; the Neuron limits and the
per-batch-row split; bad inputs; no VJP (jit, shard_map and the lowering also run in the conformance suite)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.quant.mx_weights import decode_weight, swizzle_512, unswizzle_512
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.mla import mx_oracle
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close, f64


@dataclasses.dataclass(frozen=True)
class Dims:
    b: int
    s: int
    h: int
    q_rank: int
    kv_rank: int
    rope: int
    heads: int
    nope: int = 0  # v32
    v_dim: int = 0  # v32
    head_dim: int = 0  # v4


def _weight(rng, k, n):
    codes = mx_oracle.random_fp8_codes(rng, k, n)
    return codes, mx_oracle.random_compact_scales(rng, k, n)


def _device(weight):
    codes, compact = weight
    return jnp.asarray(mx_oracle.pack_words(codes)), jnp.asarray(compact)


def _floats(rng, d: Dims, dtype, gamma_widths):
    x = jnp.asarray(rng.standard_normal((d.b, d.s, d.h)), dtype)
    gammas = [jnp.asarray(1 + 0.2 * rng.standard_normal((1, n)), dtype) for n in gamma_widths]
    theta = rng.uniform(-np.pi, np.pi, (d.b, d.s, d.rope))
    return x, gammas, jnp.asarray(np.cos(theta), dtype), jnp.asarray(np.sin(theta), dtype)


def v32_case(d: Dims, dtype, seed=0):
    """``(args, kwargs, oracle weights)`` of a qkv_mla_mx call."""
    rng = np.random.default_rng(seed)
    w_a = _weight(rng, d.h, d.q_rank + d.kv_rank + d.rope)
    w_qb = _weight(rng, d.q_rank, d.heads * (d.nope + d.rope))
    w_kvb = _weight(rng, d.kv_rank, d.heads * (d.nope + d.v_dim))
    x, (gq, gkv), cos, sin = _floats(rng, d, dtype, (d.q_rank, d.kv_rank))
    args = (x, *_device(w_a), *_device(w_qb), gq, *_device(w_kvb), gkv, cos, sin)
    kwargs = dict(
        n_heads=d.heads,
        qk_nope_head_dim=d.nope,
        qk_rope_head_dim=d.rope,
        v_head_dim=d.v_dim,
        kv_lora_rank=d.kv_rank,
        qk_lora_rank=d.q_rank,
    )
    return args, kwargs, (w_a, w_qb, w_kvb)


def v4_case(d: Dims, dtype, seed=0):
    rng = np.random.default_rng(seed)
    w = _weight(rng, d.h, d.q_rank + d.kv_rank + d.rope)
    w_qb = _weight(rng, d.q_rank, d.heads * d.head_dim)
    x, (gq, gkv), cos, sin = _floats(rng, d, dtype, (d.q_rank, d.kv_rank + d.rope))
    args = (x, *_device(w), *_device(w_qb), gq, gkv, cos, sin)
    kwargs = dict(
        n_heads=d.heads, head_dim=d.head_dim, qk_rope_head_dim=d.rope, kv_lora_rank=d.kv_rank, qk_lora_rank=d.q_rank
    )
    return args, kwargs, (w, w_qb)


V32_F32 = Dims(b=1, s=5, h=1024, q_rank=512, kv_rank=512, rope=6, heads=3, nope=5, v_dim=7)
V32_BF16 = Dims(b=2, s=3, h=512, q_rank=1024, kv_rank=512, rope=4, heads=2, nope=3, v_dim=5)
V4_F32 = Dims(b=1, s=7, h=512, q_rank=512, kv_rank=37, rope=6, heads=3, head_dim=10)
V4_BF16 = Dims(b=2, s=4, h=1024, q_rank=1024, kv_rank=64, rope=8, heads=2, head_dim=16)


def oracle_v32(args, kwargs, weights, eps=1e-6):
    x, gq, gkv, cos, sin = (f64(args[i]) for i in (0, 5, 8, 9, 10))
    k = kwargs
    return mx_oracle.qkv_mla_mx(
        x, weights[0], weights[1], gq, weights[2], gkv, cos, sin,
        k["n_heads"], k["qk_nope_head_dim"], k["qk_rope_head_dim"], k["v_head_dim"], k["kv_lora_rank"],
        k["qk_lora_rank"], eps,
    )  # fmt: skip


def oracle_v4(args, kwargs, weights, eps=1e-6):
    x, gq, gkv, cos, sin = (f64(args[i]) for i in (0, 5, 6, 7, 8))
    k = kwargs
    return mx_oracle.qkv_mla_mx_deepseek_v4(
        x, weights[0], weights[1], gq, gkv, cos, sin,
        k["n_heads"], k["head_dim"], k["qk_rope_head_dim"], k["qk_lora_rank"], eps,
    )  # fmt: skip


def _assert_outputs(outs, wants, shapes):
    for out, want, shape in zip(outs, wants, shapes, strict=True):
        assert out.shape == shape and out.dtype == jnp.bfloat16
        assert_close(out, want, jnp.bfloat16, ops=2)


@pytest.mark.parametrize(
    "dims, dtype", [(V32_F32, jnp.float32), pytest.param(V32_BF16, jnp.bfloat16, marks=pytest.mark.slow)]
)
def test_qkv_mla_mx_matches_the_oracle(dims, dtype):
    args, kwargs, weights = v32_case(dims, dtype)
    outs = jax.jit(lambda *a: nki.qkv_mla_mx(*a, **kwargs))(*args)
    qk = (dims.b, dims.s, dims.heads, dims.nope + dims.rope)
    _assert_outputs(outs, oracle_v32(args, kwargs, weights), (qk, qk, (dims.b, dims.s, dims.heads, dims.v_dim)))


@pytest.mark.parametrize(
    "dims, dtype", [pytest.param(V4_F32, jnp.float32, marks=pytest.mark.slow), (V4_BF16, jnp.bfloat16)]
)
def test_qkv_mla_mx_deepseek_v4_matches_the_oracle(dims, dtype):
    args, kwargs, weights = v4_case(dims, dtype)
    outs = jax.jit(lambda *a: nki.qkv_mla_mx_deepseek_v4(*a, **kwargs))(*args)
    shapes = ((dims.b, dims.s, dims.heads, dims.head_dim), (dims.b, dims.s, dims.kv_rank + dims.rope))
    _assert_outputs(outs, oracle_v4(args, kwargs, weights), shapes)


@pytest.mark.slow
def test_norm_eps_reaches_every_norm():
    args, kwargs, weights = v4_case(V4_F32, jnp.float32, seed=3)
    args = (args[0] * 1e-3, *args[1:])  # small activations: eps = 0.5 dominates the RMS statistics
    outs = nki.qkv_mla_mx_deepseek_v4(*args, **kwargs, norm_eps=0.5)
    _assert_outputs(outs, oracle_v4(args, kwargs, weights, eps=0.5), [o.shape for o in outs])


def test_the_512_swizzle_is_the_documented_permutation():
    natural = jnp.arange(1024)
    stored = swizzle_512(natural)
    # stored position q * 256 + t * 128 + p holds natural t * 512 + 4 p + q
    assert stored[0 * 256 + 0 * 128 + 1] == 4 and stored[3 * 256 + 1 * 128 + 2] == 512 + 8 + 3
    assert jnp.array_equal(unswizzle_512(stored), natural)
    assert np.array_equal(np.asarray(stored), mx_oracle.swizzle_columns(np.arange(1024)))


def test_block128_weights_decode_exactly():
    rng = np.random.default_rng(1)
    codes, compact = _weight(rng, 256, 200)
    words, scales = _device((codes, compact))
    np.testing.assert_array_equal(np.asarray(decode_weight(words, scales)), mx_oracle.decode(codes, compact))


@pytest.mark.slow  # the conformance suite runs vmap (full and partial) fast
def test_vmap_over_the_hidden_states_matches_a_loop():
    args, kwargs, _ = v4_case(V4_F32, jnp.float32)
    xs = jnp.stack([args[0], -2 * args[0]])
    fn = lambda x: nki.qkv_mla_mx_deepseek_v4(x, *args[1:], **kwargs)  # noqa: E731
    batched = jax.vmap(fn)(xs)
    for i in range(2):
        for got, want in zip(batched, fn(xs[i]), strict=True):
            assert_close(got[i], f64(want), jnp.bfloat16, ops=1)


def _lower(fn, args):
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",))


def test_neuron_limits_name_what_the_kernel_needs():
    dims = dataclasses.replace(V32_F32, heads=4)
    args, kwargs, _ = v32_case(dims, jnp.float32)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning) as record:
        _lower(lambda *a: nki.qkv_mla_mx(*a, **kwargs), args)
    message = str(record[0].message)
    for fragment in ("x_hbm must be bfloat16", "cos_cache_hbm must be bfloat16", "n_heads=4 must be one of"):
        assert fragment in message


def test_neuron_lowering_runs_one_kernel_call_per_batch_row():
    args, kwargs, _ = v4_case(V4_BF16, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        lowered = _lower(lambda *a: nki.qkv_mla_mx_deepseek_v4(*a, **kwargs), args)
    names = [config["func_name"] for config in kernel_configs(lowered.as_text())]
    assert names == ["qkv_mla_mx_deepseek_v4"] * V4_BF16.b


@pytest.mark.slow
def test_v4_limits_name_the_validated_ranges():
    dims = Dims(b=1, s=2, h=512, q_rank=2560, kv_rank=1030, rope=2, heads=9, head_dim=520)
    args, kwargs, _ = v4_case(dims, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning) as record:
        _lower(lambda *a: nki.qkv_mla_mx_deepseek_v4(*a, **kwargs), args)
    message = str(record[0].message)
    for fragment in ("n_heads=9", "head_dim=520", "qk_lora_rank=2560", "kv_lora_rank=1030"):
        assert fragment in message


def _bad_v32(change):
    args, kwargs, _ = v32_case(V32_BF16, jnp.bfloat16)
    args, kwargs = change(list(args), dict(kwargs))
    return lambda: nki.qkv_mla_mx(*args, **kwargs)


def _replace(index, fn):
    def change(args, kwargs):
        args[index] = fn(args[index])
        return args, kwargs

    return change


def _set(**values):
    return lambda args, kwargs: (args, {**kwargs, **values})


@pytest.mark.parametrize(
    "change, fragments",
    [
        (_replace(1, lambda w: w.astype(jnp.int32)), ["wqkv_a_hbm", "uint32"]),
        (_replace(2, lambda s: s[:, :-1]), ["wqkv_a_scale_hbm", "ceil(A/128)"]),
        (_replace(3, lambda w: w[:, :-1]), ["wq_b_hbm", "n_heads * (qk_nope_head_dim + R)"]),
        (_replace(6, lambda w: w[:-1]), ["wkv_b_hbm", "KVR/4"]),
        (_replace(0, lambda x: x[0]), ["x_hbm", "B, S, H"]),
        (_set(qk_rope_head_dim=3), ["qk_rope_head_dim"]),
        (_set(qk_lora_rank=512), ["q_norm_gamma_hbm", "qk_lora_rank"]),
        (_set(norm_eps=0.0), ["norm_eps", "positive"]),
        (_set(n_heads=2.0), ["n_heads", "int"]),
    ],
)
def test_bad_inputs_name_the_argument(change, fragments):
    with pytest.raises((TypeError, ValueError)) as info:
        _bad_v32(change)()
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_hidden_size_must_be_a_multiple_of_512():
    args, kwargs, _ = v4_case(dataclasses.replace(V4_F32, h=384), jnp.float32)
    with pytest.raises(ValueError, match="x_hbm.*H % 512|x_hbm.*multiple of 512"):
        nki.qkv_mla_mx_deepseek_v4(*args, **kwargs)


def test_dimension_params_are_required():
    args, kwargs, _ = v4_case(V4_F32, jnp.float32)
    del kwargs["head_dim"]
    with pytest.raises(TypeError, match="head_dim"):
        nki.qkv_mla_mx_deepseek_v4(*args, **kwargs)


def test_v4_checks_head_dim_and_the_kv_gain():
    args, kwargs, _ = v4_case(V4_F32, jnp.float32)
    with pytest.raises(ValueError, match="head_dim"):
        nki.qkv_mla_mx_deepseek_v4(*args, **{**kwargs, "head_dim": V4_F32.rope})
    bad = list(args)
    bad[6] = bad[6][:, :-1]
    with pytest.raises(ValueError, match="kv_norm_gamma_hbm"):
        nki.qkv_mla_mx_deepseek_v4(*bad, **kwargs)


def test_there_is_no_vjp():
    args, kwargs, _ = v4_case(V4_F32, jnp.float32)
    loss = lambda x: nki.qkv_mla_mx_deepseek_v4(x, *args[1:], **kwargs)[0].astype(jnp.float32).sum()  # noqa: E731
    with pytest.raises(Exception, match="(?i)differentiat|jvp|transpose"):
        jax.grad(loss)(args[0])


@pytest.mark.parametrize("variant", ["v32", "v4"])
def test_explain_notes_the_ocp_scale_flag(variant):
    """The reference quantizes activations with quantize_mx's default scale (as the library compiles the kernel);
    under neuronx-cc's --enable-ocp-compliant-scale-computation (the torch reference's OCP rule) the device differs."""
    if variant == "v32":
        args, kwargs, _ = v32_case(V32_BF16, jnp.bfloat16)
        fn = nki.qkv_mla_mx
    else:
        args, kwargs, _ = v4_case(V4_BF16, jnp.bfloat16)
        fn = nki.qkv_mla_mx_deepseek_v4
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    report = str(jax_nkilib.explain(functools.partial(fn, **kwargs), *shapes))
    assert "enable-ocp-compliant-scale-computation" in report and "quantize_mx's default scale" in report
