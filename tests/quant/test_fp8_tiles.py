"""static_quantization, row_quantization and pre_combine_dequant_scales (catalog row 86) against float64 NumPy
oracles written from the library's pseudocode; transformations; Neuron lowering; errors.

The oracle rounds like the hardware pipeline: float32 products (exact in float64, then rounded), stored in the
input's dtype, then FP8 by an independent round-to-nearest-even on the format's grid.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.quant.fp8_quantize import pre_combine_dequant_scales, row_quantization, static_quantization
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import kernel_configs, neuron_text

E4M3, E4M3FN, E5M2 = jnp.float8_e4m3, jnp.float8_e4m3fn, jnp.float8_e5m2
LARGEST = {np.dtype(E4M3): 240.0, np.dtype(E4M3FN): 448.0, np.dtype(E5M2): 57344.0}  # the library's table
MINVAL = 1e-6


# ------------------------------------------------------------------------------------------------------- the oracle
def oracle_round(x, dtype):
    """``x`` (float64) rounded to ``dtype``; for FP8 by RNE on the format's grid (values within range)."""
    x = np.asarray(x, np.float64)
    dtype = np.dtype(dtype)
    if dtype not in LARGEST:
        return x.astype(np.float32).astype(dtype).astype(np.float64) if dtype != np.float64 else x
    info = ml_dtypes.finfo(dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        exponent = np.maximum(np.floor(np.log2(np.abs(x))), info.minexp)
        ulp = np.where(np.isfinite(exponent), 2.0 ** (exponent - info.nmant), 1.0)
        return np.where(np.isfinite(x), np.round(x / ulp) * ulp, x)


def oracle_stored(product, dtype):
    """A float32 product (float64 for float64 inputs) stored in ``dtype``."""
    product = np.asarray(product, np.float64)
    if np.dtype(dtype) == np.float64:
        return product
    return oracle_round(product.astype(np.float32), dtype)


def oracle_fp8(x, dtype):
    """``fp8(clip(x, +-M))`` as float64 values."""
    largest = LARGEST[np.dtype(dtype)]
    return oracle_round(np.clip(x, -largest, largest), dtype)


def oracle_reciprocal(x):
    return np.float32(1.0) / np.asarray(x, np.float32)


def oracle_static(hidden, dequant, quant_scale=None, dtype=E4M3FN):
    h = np.asarray(hidden, np.float64)
    s = oracle_reciprocal(dequant) if quant_scale is None else np.asarray(quant_scale, np.float32)
    return oracle_fp8(oracle_stored(h * s.astype(np.float64), np.asarray(hidden).dtype), dtype)


def oracle_scale(absmax, dtype):
    product = np.float32(absmax.astype(np.float64) * np.float64(np.float32(1.0 / LARGEST[np.dtype(dtype)])))
    return np.maximum(product, np.float32(MINVAL))


def oracle_row(hidden, dtype=E4M3FN):
    """Rank 2: per partition row; quantized in hidden's dtype, unclipped."""
    h = np.asarray(hidden, np.float64)
    absmax = np.asarray(np.abs(h).max(axis=1, keepdims=True), np.float32)
    scale = oracle_scale(absmax, dtype)
    with np.errstate(invalid="ignore"):  # inf * 0
        return oracle_stored(h * oracle_reciprocal(scale).astype(np.float64), np.asarray(hidden).dtype), scale


def oracle_row_3d(hidden, dtype=E4M3FN, output_dtype=None):
    """Rank 3: per token ``[:, t, :]``; FP8 with ``output_dtype``."""
    h = np.asarray(hidden, np.float64)
    p0, tokens, _ = h.shape
    quantized, scales = np.zeros_like(h), np.zeros((p0, tokens, 1), np.float32)
    for t in range(tokens):
        scale = oracle_scale(np.float32(np.abs(h[:, t, :]).max()), dtype)
        scales[:, t, 0] = scale
        stored = oracle_stored(h[:, t, :] * np.float64(oracle_reciprocal(scale)), np.asarray(hidden).dtype)
        quantized[:, t, :] = stored if output_dtype is None else oracle_fp8(stored, output_dtype)
    return quantized, scales


# ------------------------------------------------------------------------------------------------------- helpers
def spread(shape, dtype, seed=0):
    """Normal values times powers of two from 2**-6 to 2**10, rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.integers(-6, 10, shape), dtype)


def scales(p, seed=1):
    return jnp.asarray(np.random.default_rng(seed).uniform(0.05, 4.0, (p, 1)), jnp.float32)


def values(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float64))


def assert_equal(actual, expected, dtype):
    """Same dtype and the same values (NaN where NaN)."""
    assert np.dtype(actual.dtype) == np.dtype(dtype), (actual.dtype, dtype)
    np.testing.assert_array_equal(values(actual), expected)


# ------------------------------------------------------------------------------------------------------ oracles
@pytest.mark.parametrize("fmt", [E4M3, E4M3FN, E5M2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float16, jnp.float64])
def test_static_quantization_matches_oracle(fmt, dtype):
    hidden, dequant = spread((5, 37), dtype).at[0, 0].set(1e6), scales(5)  # odd sizes; per-partition scales
    quantized, passed = static_quantization(hidden, dequant, dtype=fmt)
    assert_equal(quantized, oracle_static(hidden, dequant, dtype=fmt), fmt)
    np.testing.assert_array_equal(passed, dequant)
    assert np.any(np.abs(values(quantized)) == LARGEST[np.dtype(fmt)])  # saturation reached


def test_static_quantization_uses_a_given_quant_scale():
    hidden, dequant, quant = spread((7, 9), jnp.bfloat16, 2), scales(7), scales(7, seed=3)
    quantized, passed = static_quantization(hidden, dequant, quant)  # used as given, not checked against 1/dequant
    assert_equal(quantized, oracle_static(hidden, dequant, quant), E4M3FN)
    np.testing.assert_array_equal(passed, dequant)


def test_static_quantization_rounds_the_product_to_the_input_dtype_first():
    # 2.25 * 1.00195 = 2.2544 is 2.25 in bfloat16, a tie of e5m2's 2.0 and 2.5 (RNE: 2.0); unrounded it gives 2.5
    dequant = jnp.full((1, 1), 1.0 / 1.001953125, jnp.float32)
    for dtype, want in ((jnp.bfloat16, 2.0), (jnp.float32, 2.5)):
        hidden = jnp.full((1, 1), 2.25, dtype)
        quantized, _ = static_quantization(hidden, dequant, dtype=E5M2)
        assert values(quantized)[0, 0] == want == oracle_static(hidden, dequant, dtype=E5M2)[0, 0]


@pytest.mark.parametrize("fmt", [E4M3, E4M3FN, E5M2])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.float64])
def test_row_quantization_rank2_matches_oracle(fmt, dtype):
    hidden = spread((6, 33), dtype, 4)
    quantized, scale = row_quantization(hidden, dtype=fmt)
    want_q, want_scale = oracle_row(hidden, fmt)
    assert_equal(quantized, want_q, dtype)  # hidden's dtype: scaled, not clipped, not FP8
    assert_equal(scale, want_scale, jnp.float32)
    assert scale.shape == (6, 1)
    largest = LARGEST[np.dtype(fmt)]
    np.testing.assert_allclose(np.abs(values(quantized)).max(axis=1), largest, rtol=2.0**-7)  # row max -> ~M


def test_row_quantization_rank2_ignores_output_dtype():
    hidden = spread((4, 16), jnp.bfloat16, 5)
    for got, want in zip(row_quantization(hidden, output_dtype=E4M3), row_quantization(hidden)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(values(got), values(want))


@pytest.mark.parametrize("fmt, out", [(E4M3FN, None), (E4M3, E4M3), (E4M3FN, E4M3FN), (E4M3FN, E4M3), (E5M2, E5M2)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_row_quantization_rank3_matches_oracle(fmt, out, dtype):
    hidden = spread((5, 3, 11), dtype, 6)  # P0=5 partitions, 3 tokens of 5 x 11 values
    quantized, scale = row_quantization(hidden, dtype=fmt, output_dtype=out)
    want_q, want_scale = oracle_row_3d(hidden, fmt, out)
    assert_equal(quantized, want_q, dtype if out is None else out)
    assert_equal(scale, want_scale, jnp.float32)
    assert scale.shape == (5, 3, 1)
    if out is not None and LARGEST[np.dtype(out)] < LARGEST[np.dtype(fmt)]:  # scaled to 448, clipped at 240
        assert np.abs(values(quantized)).max() == 240.0


def test_pre_combine_dequant_scales_matches_oracle():
    dequant = scales(9)
    weight = jnp.asarray(np.random.default_rng(8).uniform(0.001, 3.0, (9, 13)), jnp.float32)
    combined = pre_combine_dequant_scales(dequant, weight)
    assert combined.dtype == jnp.float32 and combined.shape == (9, 13)
    want = np.float32(np.asarray(weight, np.float64) * np.asarray(dequant, np.float64))
    np.testing.assert_array_equal(combined, want)


# ------------------------------------------------------------------------------------ saturation, NaN, inf, zeros
def test_static_quantization_saturates_and_keeps_nan():
    hidden = jnp.asarray([[np.inf, -np.inf, np.nan, 1.0e4, -1.0e4, 3.0e38, 0.0, -0.0]], jnp.float32)
    quantized, _ = static_quantization(hidden, jnp.ones((1, 1), jnp.float32), dtype=E4M3)
    got = values(quantized)[0]
    np.testing.assert_array_equal(got[[0, 1, 3, 4, 5]], [240, -240, 240, -240, 240])
    assert np.isnan(got[2]) and got[6] == 0 and got[7] == 0


def test_row_quantization_zero_nan_and_inf_rows():
    hidden = np.ones((4, 6), np.float32)
    hidden[0] = 0.0  # zero row: scale MINVAL, quantized 0
    hidden[1, 2] = np.nan  # NaN row: scale NaN, every element NaN
    hidden[2, 3] = np.inf  # inf row: scale inf, NaN at the inf, 0 elsewhere
    quantized, scale = row_quantization(jnp.asarray(hidden))
    q, s = values(quantized), np.asarray(scale)[:, 0]
    assert s[0] == np.float32(MINVAL) and not np.any(q[0])
    assert np.isnan(s[1]) and np.all(np.isnan(q[1]))
    assert s[2] == np.inf and np.isnan(q[2, 3]) and not np.any(np.delete(q[2], 3))
    assert s[3] == np.float32(np.float32(1.0) * np.float32(1 / 448)) and np.all(q[3] == values(quantized)[3, 0])
    want_q, want_s = oracle_row(hidden)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(s, want_s[:, 0])


def test_row_quantization_rank3_zero_and_nan_tokens():
    hidden = np.ones((3, 3, 4), np.float32)
    hidden[:, 0] = 0.0
    hidden[2, 1, 1] = np.nan  # one NaN on one partition spoils the whole token on every partition
    quantized, scale = row_quantization(jnp.asarray(hidden), output_dtype=E4M3FN)
    q, s = values(quantized), np.asarray(scale)[..., 0]
    assert np.all(s[:, 0] == np.float32(MINVAL)) and not np.any(q[:, 0])
    assert np.all(np.isnan(s[:, 1])) and np.all(np.isnan(q[:, 1]))
    assert np.all(q[:, 2] == 448.0)


# ----------------------------------------------------------------------------------------------- transformations
def test_vmap_folds():
    """vmap folds into the kernel's axes (no loop); jit, vmap and nested vmap against a loop are the conformance
    suite's (arg specs static_quantization, row_quantization, row_quantization.3d, pre_combine_dequant_scales)."""
    hidden, dequant = spread((4, 10), jnp.bfloat16, 9), scales(4)
    stacked = jnp.stack([hidden, -hidden, 2 * hidden])
    static = lambda h, s: static_quantization(h, s, dtype=E4M3)  # noqa: E731
    batched = jax.vmap(static, in_axes=(0, None))(stacked, dequant)  # the scale is shared
    assert "while" not in str(jax.make_jaxpr(jax.vmap(static, in_axes=(0, None)))(stacked, dequant))
    for i in range(3):
        np.testing.assert_array_equal(values(batched[0][i]), values(static(stacked[i], dequant)[0]))
        np.testing.assert_array_equal(batched[1][i], dequant)

    tokens = spread((4, 2, 6), jnp.float32, 10)
    row3 = lambda h: row_quantization(h, output_dtype=E4M3FN)  # noqa: E731
    many = jnp.stack([tokens, 3 * tokens])
    assert "while" not in str(jax.make_jaxpr(jax.vmap(row3))(many))  # folded into BxS
    for got, want in zip(jax.vmap(row3)(many), row3(3 * tokens)):
        np.testing.assert_array_equal(values(got[1]), values(want))
    rows = jax.vmap(row_quantization, in_axes=1, out_axes=1)(many)  # a middle axis
    np.testing.assert_array_equal(values(rows[0][:, 1]), values(row_quantization(many[:, 1])[0]))


def test_gradients():
    hidden, dequant = spread((3, 8), jnp.float32, 12), scales(3)

    def loss(h, s):
        quantized, passed = static_quantization(h, s)
        return jnp.sum(quantized.astype(jnp.float32)) + jnp.sum(3.0 * passed)

    grad_h, grad_s = jax.grad(loss, argnums=(0, 1))(hidden, dequant)
    assert not np.any(grad_h)  # quantized: zero cotangent
    np.testing.assert_array_equal(grad_s, 3.0)  # the passed-through scale: identity
    row_loss = lambda h: sum(jnp.sum(out.astype(jnp.float32)) for out in row_quantization(h))  # noqa: E731
    assert not np.any(jax.grad(row_loss)(hidden))
    assert not np.any(jax.grad(row_loss)(hidden.reshape(3, 2, 4)))

    dequant64 = jnp.asarray(dequant, jnp.float64)
    weight64 = jnp.asarray(np.random.default_rng(13).uniform(0.1, 2.0, (3, 5)))
    per_example = jax.vmap(jax.grad(lambda s, w: jnp.sum(pre_combine_dequant_scales(s, w) ** 2)), in_axes=(None, 0))
    got = per_example(dequant64, jnp.stack([weight64, 2 * weight64]))
    np.testing.assert_allclose(got[1], np.sum(2 * (4 * weight64**2) * dequant64, axis=1, keepdims=True))


# ----------------------------------------------------------------------------------------------- Neuron lowering
def test_neuron_lowering_one_call_each():
    hidden, dequant = jnp.zeros((128, 512), jnp.bfloat16), jnp.ones((128, 1), jnp.float32)
    weight = jnp.ones((128, 4), jnp.float32)
    cases = [
        (
            lambda h, s: static_quantization(h, s, dtype=E4M3),
            (hidden, dequant),
            "static_quantization",
            {"dtype": "float8_e4m3"},
            ["quantized", "input_dequant_scale_out"],
            "tensor<128x512xf8E4M3>",
        ),
        (
            lambda h, s, q: static_quantization(h, s, q),
            (hidden, dequant, dequant),
            "static_quantization",
            {"dtype": "float8_e4m3fn"},
            ["quantized", "input_dequant_scale_out"],
            "tensor<128x512xf8E4M3FN>",
        ),
        (
            lambda h: row_quantization(h),
            (hidden,),
            "row_quantization",
            {"dtype": "float8_e4m3fn", "output_dtype": None},
            ["quantized", "dequant_scale"],
            "tensor<128x1xf32>",
        ),
        (
            lambda h: row_quantization(h, output_dtype=E5M2),
            (hidden.reshape(128, 4, 128),),
            "row_quantization",
            {"dtype": "float8_e4m3fn", "output_dtype": "float8_e5m2"},
            ["quantized", "dequant_scale"],
            "tensor<128x4x128xf8E5M2>",
        ),
        (
            pre_combine_dequant_scales,
            (dequant, weight),
            "pre_combine_dequant_scales",
            {},
            ["combined"],
            "tensor<128x4xf32>",
        ),
    ]
    with jax_nkilib.neuron.dry_run():
        for call, args, entry, params, names, result in cases:
            text = neuron_text(call, *args)
            (cfg,) = kernel_configs(text)
            assert cfg["entry_point"] == f"jax_nkilib_kernels.quant:{entry}" and cfg["params"] == params
            assert cfg["output_names"] == names and not cfg["has_collectives"] and cfg["grid"] == 1
            assert result in text


def test_neuron_lowering_splits_past_128_partitions_and_falls_back():
    with jax_nkilib.neuron.dry_run():
        big = jnp.zeros((256, 64), jnp.bfloat16)
        assert (
            len(
                kernel_configs(
                    neuron_text(lambda h, s: static_quantization(h, s), big, jnp.ones((256, 1), jnp.float32))
                )
            )
            == 2
        )
        assert len(kernel_configs(neuron_text(row_quantization, big))) == 2
        tokens = jax.ShapeDtypeStruct((128, 1024, 128), jnp.bfloat16)  # SBUF capacity: split along BxS, not P0
        configs = kernel_configs(neuron_text(row_quantization, tokens))
        assert len(configs) > 1 and all(c["input_specs"][0][0][0] == 128 for c in configs)
        wide = jax.ShapeDtypeStruct((8, 40000), jnp.float32)  # rows are reduced whole: no split helps
        with pytest.warns(NeuronFallbackWarning, match="SBUF capacity: about 480008 bytes per partition"):
            assert not kernel_configs(neuron_text(lambda h: row_quantization(h), wide))
        with pytest.warns(NeuronFallbackWarning, match="P0=129 exceeds the 128 SBUF partitions"):
            assert not kernel_configs(neuron_text(lambda h: row_quantization(h), jnp.zeros((129, 2, 8), jnp.bfloat16)))
        with pytest.warns(NeuronFallbackWarning, match="`hidden_state` has dtype float64"):
            assert not kernel_configs(neuron_text(lambda h: row_quantization(h), jnp.zeros((8, 8), jnp.float64)))


# ---------------------------------------------------------------------------------------------------- bad inputs
H, S = jnp.zeros((4, 8), jnp.bfloat16), jnp.ones((4, 1), jnp.float32)
BAD = [
    (lambda: static_quantization(H, S, dtype=jnp.bfloat16), ValueError, r"`dtype` must be an FP8 dtype"),
    (lambda: static_quantization(H, S, dtype="float9"), TypeError, r"`dtype` must be a dtype"),
    (lambda: static_quantization(H, S, dtype=None), ValueError, r"`dtype` must be an FP8 dtype .*; got None"),
    (
        lambda: static_quantization(H, jnp.ones((5, 1), jnp.float32)),
        ValueError,
        r"`input_dequant_scale` must have "
        r"layout \[P, 1\]",
    ),
    (lambda: static_quantization(H, S.astype(jnp.bfloat16)), TypeError, r"`input_dequant_scale` must have dtype"),
    (lambda: static_quantization(H, S, S[:2]), ValueError, r"`quant_scale` must have layout \[P, 1\]"),
    (lambda: static_quantization(H.astype(jnp.int32), S), TypeError, r"`hidden_state` must have dtype"),
    (lambda: static_quantization(H[None], S), ValueError, r"`hidden_state` must have layout \[P, F\]"),
    (lambda: static_quantization(H), TypeError, r"missing required tensor argument `input_dequant_scale`"),
    (lambda: row_quantization(H, output_dtype=jnp.float32), ValueError, r"`output_dtype` must be an FP8 dtype"),
    (lambda: row_quantization(H[0]), ValueError, r"\[P, F\] or \[P0, BxS, F0\] \(rank 2 or 3\); got shape \(8,\)"),
    (lambda: row_quantization(H[None, None]), ValueError, r"rank 2 or 3"),
    (lambda: row_quantization(H, jnp.float8_e4m3), TypeError, r"takes 1 tensor arguments"),
    (lambda: row_quantization(H, sbm=None), TypeError, r"unexpected keyword argument `sbm`"),
    (
        lambda: pre_combine_dequant_scales(S, jnp.ones((5, 3), jnp.float32)),
        ValueError,
        r"`weight_dequant_scale` must have layout \[P, F_w\]",
    ),
    (lambda: pre_combine_dequant_scales(S, jnp.ones((4, 3))), TypeError, r"must have the same dtype"),
    (
        lambda: pre_combine_dequant_scales(S, jnp.ones((4, 3), jnp.bfloat16)),
        TypeError,
        r"`weight_dequant_scale` must have dtype",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    call, error, fragment = case
    with pytest.raises(error, match=fragment):
        call()
    with pytest.raises(error, match=fragment):
        jax.jit(call)()  # at trace time too
