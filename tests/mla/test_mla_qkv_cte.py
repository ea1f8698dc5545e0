"""``jax_nkilib.nki.mla_qkv_cte_kernel`` against the float64 NumPy oracle written from its torch reference (packed MX
rows built by an independent NumPy packer, fp8 x4 weights with compact block-128 scales, the MLA column swizzle),
float32 and bfloat16 with odd sizes; rows produced by ``rmsnorm_mx_prefill``; gradients; jit, vmap, shard_map; the
Neuron limits; bad inputs (the trn3 lowering runs in the conformance suite)."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.quant.mx_weights import unswizzle_512
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.mla import mla_qkv_oracle as oracle
from tests.support.numerics import assert_close

OUTPUTS = ("q_lift", "q_pe", "c_kv", "k_pe")


def problem(b, s, hidden, heads, nope, rope, latent, q_rank, dtype, seed=0):
    """``(operands, static kwargs, dequantized weights)`` of one call."""
    rng = np.random.default_rng(seed)
    x_rows = oracle.pack_x(rng.standard_normal((b, s, hidden)))
    a_words, a_scales, w_a = oracle.random_mx_weight(rng, hidden, q_rank + latent + rope)
    b_words, b_scales, w_b = oracle.random_mx_weight(rng, q_rank, heads * (nope + rope))
    gain = lambda n: 1 + 0.1 * rng.standard_normal((1, n))  # noqa: E731
    theta = rng.uniform(-np.pi, np.pi, (b, s, rope))
    floats = (gain(q_rank), gain(latent), rng.standard_normal((nope, heads * latent)) * nope**-0.5)
    floats += (np.cos(theta), np.sin(theta))
    floats = tuple(jnp.asarray(a, dtype) for a in floats)
    operands = (jnp.asarray(x_rows), jnp.asarray(a_words), jnp.asarray(a_scales))
    operands += (jnp.asarray(b_words), jnp.asarray(b_scales)) + floats
    kwargs = dict(n_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope, kv_lora_rank=latent)
    return operands, dict(kwargs, qk_lora_rank=q_rank), (w_a, w_b)


def expected(operands, kwargs, weights, eps=1e-6):
    f64 = lambda a: np.asarray(jnp.asarray(a, jnp.float32), np.float64)  # noqa: E731
    round_to = ml_dtypes.bfloat16 if operands[7].dtype == jnp.bfloat16 else np.float32
    q_gamma, kv_gamma, wuk, cos, sin = map(f64, operands[5:])
    k = kwargs
    return oracle.mla_qkv(
        np.asarray(operands[0]), *weights, q_gamma, kv_gamma, wuk, cos, sin, k["n_heads"], k["qk_nope_head_dim"],
        k["qk_rope_head_dim"], k["kv_lora_rank"], k["qk_lora_rank"], eps, round_to,
    )  # fmt: skip


def check(outs, want, dtype, kwargs, hidden):
    """The oracle replays every rounding of the reference, so what is left is float32 accumulation over the last
    contraction that makes each output (q_lift: nope, q_pe: q_lora_rank, c_kv and k_pe: H) and, for bfloat16 outputs,
    their final rounding (one bfloat16 operation, which dominates)."""
    reductions = (kwargs["qk_nope_head_dim"], kwargs["qk_lora_rank"], hidden, hidden)
    for name, out, ref, reduction in zip(OUTPUTS, outs, want, reductions):
        assert out.shape == ref.shape and out.dtype == dtype, name
        if dtype == jnp.bfloat16:
            assert_close(out, ref, dtype, reduction=1, ops=2)
        else:
            assert_close(out, ref, dtype, reduction=reduction, ops=4)


def test_float32_matches_the_oracle_with_odd_sizes():
    """Odd heads and sequence, two swizzle tiles of qr, a norm_eps of its own (both norms)."""
    operands, kwargs, weights = problem(2, 5, 512, 3, 8, 6, 512, 1024, jnp.float32)
    outs = jax.jit(functools.partial(nki.mla_qkv_cte_kernel, **kwargs, norm_eps=0.25))(*operands)
    check(outs, expected(operands, kwargs, weights, eps=0.25), jnp.float32, kwargs, 512)


def test_bfloat16_rows_from_rmsnorm_mx_prefill_match_the_oracle():
    """The packed activation that rmsnorm_mx_prefill emits is this kernel's input layout, here over 5 H512 tiles (two
    packed scale groups); the oracle decodes the row bytes itself (rmsnorm_mx_prefill only produces the input)."""
    operands, kwargs, weights = problem(1, 3, 2560, 2, 16, 4, 1024, 512, jnp.bfloat16, seed=5)
    hidden = jnp.asarray(np.random.default_rng(6).standard_normal((1, 3, 2560)), jnp.bfloat16)
    rows = nki.rmsnorm_mx_prefill(hidden, jnp.ones((1, 2560), jnp.bfloat16)).reshape(1, 3, -1)  # [T, row] alone
    operands = (rows,) + operands[1:]
    outs = jax.jit(functools.partial(nki.mla_qkv_cte_kernel, **kwargs))(*operands)
    check(outs, expected(operands, kwargs, weights), jnp.bfloat16, kwargs, 2560)


@pytest.mark.slow
def test_bfloat16_numpy_packed_rows_match_the_oracle():
    operands, kwargs, weights = problem(2, 3, 1024, 4, 8, 6, 512, 512, jnp.bfloat16, seed=2)
    outs = nki.mla_qkv_cte_kernel(*operands, **kwargs)
    check(outs, expected(operands, kwargs, weights), jnp.bfloat16, kwargs, 1024)


def test_vmap_and_shard_map_match_the_unbatched_calls():
    """vmap over the activation and RoPE tables (weights unbatched) and shard_map over 8 devices (batch split), in
    one jitted program, against jitted unbatched calls."""
    operands, kwargs, _ = problem(1, 3, 512, 2, 4, 2, 512, 512, jnp.float32, seed=7)
    call = functools.partial(nki.mla_qkv_cte_kernel, **kwargs)
    weights = operands[1:8]
    items = [(operands[0], operands[8], operands[9]), tuple(a[:, ::-1] for a in (operands[0], *operands[8:]))]
    stacked = [jnp.stack(column) for column in zip(*items)]  # [2, 1, S, ...]
    wide = [jnp.concatenate(column * 4) for column in zip(*items)]  # [8, S, ...]: device d holds item d % 2
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    specs = (P("data"),) + (P(),) * 7 + (P("data"),) * 2

    @jax.jit
    def batched(stacked, wide):
        mapped = jax.vmap(call, in_axes=(0,) + (None,) * 7 + (0, 0))(stacked[0], *weights, *stacked[1:])
        sharded = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=P("data"))(wide[0], *weights, *wide[1:])
        return mapped, sharded

    mapped, sharded = batched(stacked, wide)
    single = [jax.jit(call)(x, *weights, cos, sin) for x, cos, sin in items]
    for index, name in enumerate(OUTPUTS):
        want = jnp.stack([one[index] for one in single])
        np.testing.assert_allclose(mapped[index], want, rtol=1e-6, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(sharded[index], jnp.concatenate(list(want) * 4), rtol=1e-6, atol=1e-6)


def test_unswizzle_is_the_documented_permutation():
    width = 1024
    stored = jnp.asarray([oracle.swizzled_column(width, c) for c in range(width)], jnp.float32)
    # natural column c reads the stored column the swizzle put it in
    assert np.array_equal(np.asarray(unswizzle_512(jnp.arange(width, dtype=jnp.float32))), stored)
    assert np.asarray(stored)[:6].tolist() == [0, 256, 512, 768, 1, 257]


def test_neuron_limits_name_what_the_kernel_needs():
    operands, kwargs, _ = problem(2, 2, 512, 3, 8, 4, 512, 512, jnp.float32)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands]
    fn = functools.partial(nki.mla_qkv_cte_kernel, **kwargs)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning) as record:
        jax.jit(fn).trace(*shapes).lower(lowering_platforms=("neuron",))
    message = str(record[0].message)
    for fragment in ("trn3", "bfloat16", "B=2 must be 1", "qk_nope_head_dim=8", "n_heads=3"):
        assert fragment in message


def test_explain_notes_the_ocp_scale_flag():
    operands, kwargs, _ = problem(1, 2, 512, 2, 128, 4, 512, 512, jnp.bfloat16)
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in operands]
    with jax_nkilib.config(target="trn3"):
        report = str(jax_nkilib.explain(functools.partial(nki.mla_qkv_cte_kernel, **kwargs), *shapes))
    assert "mla_qkv_cte_kernel" in report and "enable-ocp-compliant-scale-computation" in report


@pytest.mark.parametrize(
    "change, fragments",
    [
        (lambda a, k: ((a[0][..., :-1],) + a[1:], k), ["x_hbm_mx", "H + ceil(H/2048)*128"]),
        (lambda a, k: ((a[0].astype(jnp.float32),) + a[1:], k), ["x_hbm_mx", "float8_e4m3fn"]),
        (lambda a, k: (a[:2] + (a[2][:, :-1],) + a[3:], k), ["wqkv_a_scale_hbm", "[H/128, ceil(Na/128)]"]),
        (lambda a, k: (a[:1] + (a[1].astype(jnp.int32),) + a[2:], k), ["wqkv_a_hbm", "uint32"]),
        (lambda a, k: (a, dict(k, kv_lora_rank=256)), ["kv_lora_rank", "multiple of 512"]),
        (lambda a, k: (a, dict(k, n_heads=3)), ["wq_b_hbm", "n_heads*(nope + rope)"]),
        (lambda a, k: (a[:7] + (a[7].astype(jnp.bfloat16),) + a[8:], k), ["wuk_hbm", "one dtype"]),
        (lambda a, k: (a, dict(k, qk_rope_head_dim=3)), ["qk_rope_head_dim", "even"]),
    ],
)
def test_bad_inputs_name_the_argument(change, fragments):
    operands, kwargs, _ = problem(1, 2, 512, 2, 4, 2, 512, 512, jnp.float32)
    operands, kwargs = change(operands, kwargs)
    with pytest.raises((TypeError, ValueError)) as info:
        nki.mla_qkv_cte_kernel(*operands, **kwargs)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_dimension_params_are_required():
    operands, kwargs, _ = problem(1, 2, 512, 2, 4, 2, 512, 512, jnp.float32)
    with pytest.raises(TypeError, match="n_heads"):
        nki.mla_qkv_cte_kernel(*operands, **{k: v for k, v in kwargs.items() if k != "n_heads"})


def test_gradients_of_the_float_operands_against_the_oracle():
    """W_uk's gradient is the oracle's q_nope contracted with q_lift's cotangent, kv_norm_gamma's the normalized kv
    times c_kv's; q_norm_gamma (behind the MX-quantized qr) gets zero. (check_grads in float64 over kv_norm_gamma,
    W_uk, cos and sin: the conformance spec mla_qkv_cte_kernel.float_operands, with -m slow.)"""
    operands, kwargs, (w_a, w_b) = problem(1, 3, 512, 2, 4, 2, 512, 512, jnp.float32, seed=9)
    cotangent = jnp.asarray(np.random.default_rng(10).standard_normal((1, 3, 2, 512)), jnp.float32)

    kv_cotangent = jnp.asarray(np.random.default_rng(11).standard_normal((1, 3, 512)), jnp.float32)

    def loss(q_gamma, kv_gamma, wuk):
        args = operands[:5] + (q_gamma, kv_gamma, wuk) + operands[8:]
        q_lift, _, c_kv, _ = nki.mla_qkv_cte_kernel(*args, **kwargs)
        return jnp.sum(q_lift * cotangent) + jnp.sum(c_kv * kv_cotangent)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*operands[5:8])
    q_gamma = np.asarray(operands[5], np.float64)
    q, kv, _ = oracle.projections(np.asarray(operands[0]), w_a, w_b, q_gamma, 2, 512, 512, 1e-6)
    want_wuk = np.einsum("bshd,bshl->dhl", q[..., :4], np.asarray(cotangent, np.float64)).reshape(4, 2 * 512)
    assert_close(grads[2], want_wuk, jnp.float32, reduction=3 * 512, ops=8)
    normalized = kv / np.sqrt(np.mean(kv * kv, axis=-1, keepdims=True) + 1e-6)
    want_kv_gamma = np.sum(normalized * np.asarray(kv_cotangent, np.float64).reshape(3, 512), axis=0)[None]
    assert_close(grads[1], want_kv_gamma, jnp.float32, reduction=3, ops=8)
    assert not np.any(np.asarray(grads[0]))
