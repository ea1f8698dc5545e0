"""``jax_nkilib.nki.mla_vupmx_oproj_cte_kernel`` against a float64 NumPy oracle written from its torch reference
(``mla_vupmx_oproj_cte_torch_ref``: 4-pack de-permutation, bf16 latent, MXFP8 activation blocks of 32 with the
kernel's quantize_mx scale, compact block-128 weight scales, bf16 between the stages and at the end), with weights
packed by an independent NumPy packer; the chain from ``mla_sparse_attention_cte_kernel``; vmap and shard_map; the
Neuron lowering on trn3 and its fallbacks; bad inputs (jit, the generic vmap/shard_map variants and the lowering
also run in the conformance suite)."""

import warnings

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.mla import oracle
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64, relative_error
from tests.support.sharding import mesh_1d, run_sharded

FP8 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
EMAX = 7  # nisa.quantize_mx's default scale (the alternative emax), the kernel's rule as compiled by the library


# ----------------------------------------------------------------------------------------- independent NumPy packer
def pack_weight(w, rng):
    """``(words [K/4, N] uint32, scales [K/128, ceil(N/128)] uint8, exact float64 value [K, N])`` of a float64 weight:
    one e8m0 byte per 128 x 128 block (the block's largest magnitude maps into [64, 256)), elements
    float8_e4m3fn, element ``4r + q`` of column ``n`` in byte ``q`` of word ``[r, n]``."""
    k, n = w.shape
    scales = np.zeros((k // 128, -(-n // 128)), np.uint8)
    elements = np.zeros((k, n), FP8)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = w[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)]
            exponent = int(np.floor(np.log2(np.abs(block).max()))) - 7 + int(rng.integers(0, 2))
            scales[i, j] = exponent + 127
            elements[128 * i : 128 * (i + 1), 128 * j : 128 * (j + 1)] = (block / 2.0**exponent).astype(FP8)
    codes = elements.view(np.uint8).astype(np.uint32).reshape(k // 4, 4, n)
    words = codes[:, 0] | (codes[:, 1] << 8) | (codes[:, 2] << 16) | (codes[:, 3] << 24)
    value = elements.astype(np.float64) * 2.0 ** (np.repeat(np.repeat(scales, 128, 0), 128, 1)[:, :n] - 127.0)
    return words, scales, value


# --------------------------------------------------------------------------------------------- float64 oracle
def mx_blocks(x):
    """MXFP8 (e4m3) round trip of float64 ``x [..., K]`` (float32 values) in blocks of 32 along K with
    ``nisa.quantize_mx``'s default scale (the alternative emax 7; the torch reference's OCP rule has 8): scale byte
    ``clip(E - 7, 0, 255)`` for the block's largest float32 biased exponent E, elements
    ``fp8(clip(x 2**(134 - E), +-448))``, value ``element 2**(byte - 127)``."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    _, exponent = np.frexp(np.abs(blocks).astype(np.float32))  # |x| = m 2**e, m in [0.5, 1): biased E = e + 126
    biased = np.where(blocks == 0, 0, exponent.astype(np.int64) + 126).max(axis=-1, keepdims=True)
    scaled = np.clip(blocks * 2.0 ** (127 + EMAX - biased), -448, 448)
    value = scaled.astype(np.float32).astype(FP8).astype(np.float64) * 2.0 ** (np.clip(biased - EMAX, 0, 255) - 127)
    return value.reshape(x.shape)


def to_bf16(x):
    return np.asarray(x, np.float32).astype(BF16).astype(np.float64)


def vup_oproj_oracle(out_attn, w_uv, w_o, heads):
    """``[B, S, HID]`` (bf16 values in float64) from ``out_attn [B, S, H L]`` (4-pack columns) and the exact
    natural weights ``w_uv [H L, d_v]``, ``w_o [H d_v, HID]``."""
    attn = to_bf16(out_attn)
    batch, seq, width = attn.shape
    latent = width // heads
    natural = np.empty((batch, seq, heads, latent))
    for h in range(heads):
        for index in range(latent):
            group, sub = divmod(index, 4)
            natural[:, :, h, index] = attn[:, :, h * latent + sub * (latent // 4) + group]
    d_v = w_uv.shape[1]
    v = np.stack([mx_blocks(natural[:, :, h]) @ w_uv[h * latent : (h + 1) * latent] for h in range(heads)], axis=2)
    v = to_bf16(v).reshape(batch, seq, heads * d_v)
    return to_bf16(mx_blocks(v) @ w_o)


def problem(b, s, h, latent, d_v, hid, dtype=jnp.bfloat16, seed=0):
    """``(operands, natural weights)``: a 4-pack latent in ``dtype`` and packed W_uv, W_o."""
    rng = np.random.default_rng(seed)
    out_attn = jnp.asarray(rng.standard_normal((b, s, h * latent)) * 0.3, dtype)
    wuv, wuv_scale, w_uv = pack_weight(rng.standard_normal((h * latent, d_v)) * latent**-0.5, rng)
    wo, wo_scale, w_o = pack_weight(rng.standard_normal((h * d_v, hid)) * (h * d_v) ** -0.5, rng)
    operands = (out_attn, jnp.asarray(wuv), jnp.asarray(wuv_scale), jnp.asarray(wo), jnp.asarray(wo_scale))
    return operands, (w_uv, w_o)


def assert_matches_oracle(out, want):
    """The bf16 results agree with the oracle's to a bf16 ulp of the largest magnitude, and almost all bitwise (the
    oracle sums in float64, the reference in float32: a rare bf16 rounding of v flips)."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert_close(out, want, jnp.bfloat16, ops=1)
    assert np.mean(out == want) > 0.97, f"only {np.mean(out == want):.3f} of the outputs equal the oracle's"


@pytest.mark.parametrize(
    "dtype, dims",
    [(jnp.bfloat16, (1, 9, 2, 64, 64, 40)), (jnp.float32, (2, 5, 4, 32, 32, 200))],
    ids=["bf16", "f32-odd"],
)
def test_matches_the_oracle(dtype, dims):
    operands, (w_uv, w_o) = problem(*dims, dtype=dtype)
    out = jax.jit(nki.mla_vupmx_oproj_cte_kernel)(*operands)
    b, s, h, _, _, hid = dims
    assert out.shape == (b, s, hid) and out.dtype == jnp.bfloat16
    want = vup_oproj_oracle(f64(operands[0]), w_uv, w_o, h)
    assert_matches_oracle(out, want)
    latent = to_bf16(oracle_natural(f64(operands[0]), h))
    v = np.einsum("bshl,hlj->bshj", latent, w_uv.reshape(h, -1, w_uv.shape[1]))
    plain = v.reshape(b, s, -1) @ w_o  # the same projections without the MX activation quantization
    assert relative_error(out, plain) > 4 * relative_error(out, want) + 1e-3  # the MX emulation is what matches


def oracle_natural(out_attn, heads):
    """4-pack columns back to ``[B, S, H, L]`` natural latent order (the inverse of the sparse oracle's write)."""
    b, s, width = out_attn.shape
    latent = width // heads
    return out_attn.reshape(b, s, heads, 4, latent // 4).swapaxes(-1, -2).reshape(b, s, heads, latent)


@pytest.mark.slow
def test_matches_the_oracle_at_the_kernels_dims():
    operands, (w_uv, w_o) = problem(1, 16, 4, 512, 128, 512, seed=3)
    assert_matches_oracle(nki.mla_vupmx_oproj_cte_kernel(*operands), vup_oproj_oracle(f64(operands[0]), w_uv, w_o, 4))


def test_chains_after_mla_sparse_attention_cte_kernel():
    """The sparse kernel's [B, S, H L] output (4-pack columns) is this kernel's input as it is."""
    rng = np.random.default_rng(5)
    b, s, h, latent, r, k, d_v, hid = 1, 6, 2, 64, 8, 4, 64, 48
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) * shape[-1] ** -0.25, jnp.bfloat16)  # noqa: E731
    q_lift, q_pe, c_kv, k_pe = normal(b, s, h, latent), normal(b, s, h, r), normal(b, s, latent), normal(b, s, r)
    idx = rng.integers(0, s, (b, s, k))
    idx[:, :, 0] = np.arange(s)  # each query sees itself
    idx = jnp.asarray(idx, jnp.int32)
    wuv, wuv_scale, w_uv = pack_weight(rng.standard_normal((h * latent, d_v)) * latent**-0.5, rng)
    wo, wo_scale, w_o = pack_weight(rng.standard_normal((h * d_v, hid)) * (h * d_v) ** -0.5, rng)

    @jax.jit
    def prefill_tail(q_lift, q_pe, c_kv, k_pe, idx):
        attn = nki.mla_sparse_attention_cte_kernel(q_lift, q_pe, c_kv, k_pe, idx, softmax_scale=0.3)
        return nki.mla_vupmx_oproj_cte_kernel(attn, wuv, wuv_scale, wo, wo_scale)

    out = prefill_tail(q_lift, q_pe, c_kv, k_pe, idx)
    attn = oracle.sparse_latent_attention(*map(f64, (q_lift, q_pe, c_kv, k_pe)), np.asarray(idx), 0.3)
    want = vup_oproj_oracle(attn, w_uv, w_o, h)
    assert_close(out, want, jnp.bfloat16, reduction=h * d_v, ops=2)
    natural_order = vup_oproj_oracle(oracle_natural(attn, h).reshape(attn.shape), w_uv, w_o, h)
    assert relative_error(out, natural_order) > 10 * relative_error(out, want)  # the column order matters


def test_vmap_of_the_latent_folds_into_the_batch():
    operands, _ = problem(1, 16, 2, 64, 64, 24, seed=2)
    stacked = jnp.stack([operands[0], -operands[0][:, ::-1]])
    batched = jax.vmap(nki.mla_vupmx_oproj_cte_kernel, in_axes=(0, None, None, None, None))
    jaxpr = str(jax.make_jaxpr(batched)(stacked, *operands[1:]))
    assert "bf16[2,16,128]" in jaxpr and "scan" not in jaxpr and "while" not in jaxpr  # one call over B = 2, no loop


@pytest.mark.slow
def test_vmap_and_shard_map_over_the_queries_match_single_calls():
    operands, _ = problem(1, 16, 2, 64, 64, 24, seed=2)
    stacked = jnp.stack([operands[0], -operands[0][:, ::-1]])
    one = jax.vmap(nki.mla_vupmx_oproj_cte_kernel, in_axes=(0, None, None, None, None))(stacked, *operands[1:])
    for i in range(2):
        assert jnp.array_equal(one[i], nki.mla_vupmx_oproj_cte_kernel(stacked[i], *operands[1:]))
    sharded = run_sharded(
        nki.mla_vupmx_oproj_cte_kernel,
        mesh_1d("seq", 8),
        (P(None, "seq"), P(), P(), P(), P()),
        P(None, "seq"),
        *operands,
    )
    assert jnp.array_equal(sharded, nki.mla_vupmx_oproj_cte_kernel(*operands))


def test_out_attn_gets_a_zero_cotangent():
    operands, _ = problem(1, 3, 2, 64, 64, 16, dtype=jnp.float32)
    loss = lambda x: nki.mla_vupmx_oproj_cte_kernel(x, *operands[1:]).astype(jnp.float32).sum()  # noqa: E731
    assert not jnp.any(jax.grad(loss)(operands[0]))


def _shapes(*dims, dtype=jnp.bfloat16):
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in problem(*dims, dtype=dtype)[0]]


@pytest.mark.parametrize("lnc, s", [(1, 128), (2, 256)])
def test_neuron_lowering_is_one_kernel_call_on_trn3(lnc, s):
    shapes = _shapes(1, s, 8, 512, 128, 1024)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target="trn3", lnc=lnc, on_unsupported="error"):
        (config,) = kernel_configs(neuron_text(nki.mla_vupmx_oproj_cte_kernel, *shapes))
    assert config["func_name"] == "mla_vupmx_oproj_cte_kernel" and config["grid"] == lnc
    assert config["entry_point"].endswith("mla_vup_oproj_cte:mla_vupmx_oproj_cte_kernel")
    assert [dtype for _, dtype in config["input_specs"][1:]] == ["float8_e4m3fn_x4", "uint8"] * 2


@pytest.mark.parametrize(
    "target, dims, lnc, fragments",
    [
        ("trn2", (1, 128, 4, 512, 128, 512), 1, ["trn3"]),
        ("trn3", (2, 8, 12, 64, 64, 200), 1, ["B=2", "L=64", "d_v=64", "H=12", "HID=200"]),
        ("trn3", (1, 256, 8, 512, 128, 512), 1, ["S / LNC = 256", "H == 4"]),
        ("trn3", (1, 5, 4, 512, 128, 512), 2, ["S=5", "LNC degree 2"]),
    ],
    ids=["trn2", "dims", "s-batches", "lnc"],
)
def test_neuron_falls_back_outside_the_kernels_limits(target, dims, lnc, fragments):
    shapes = _shapes(*dims)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target=target, lnc=lnc), warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.warns(NeuronFallbackWarning) as record:
            assert kernel_configs(neuron_text(nki.mla_vupmx_oproj_cte_kernel, *shapes)) == []
    message = str(record[0].message)
    for fragment in fragments:
        assert fragment in message


def test_float32_latent_falls_back_naming_bfloat16():
    shapes = _shapes(1, 16, 4, 512, 128, 512, dtype=jnp.float32)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(target="trn3"), pytest.warns(NeuronFallbackWarning) as record:
        neuron_text(nki.mla_vupmx_oproj_cte_kernel, *shapes)
    assert "out_attn_hbm must be bfloat16" in str(record[0].message)


def _replace(index, fn):
    return lambda ops: tuple(fn(a) if i == index else a for i, a in enumerate(ops))


@pytest.mark.parametrize(
    "change, error, fragments",
    [
        (_replace(1, lambda w: w.astype(jnp.int32)), TypeError, ["wuv_qtz_hbm", "uint32"]),
        (_replace(2, lambda s: s.astype(jnp.float32)), TypeError, ["wuv_scale_hbm", "uint8"]),
        (_replace(1, lambda w: w[:-4]), ValueError, ["wuv_qtz_hbm", "HL/4"]),
        (_replace(3, lambda w: w[:-1]), ValueError, ["wo_qtz_hbm", "d_v=64"]),
        (_replace(4, lambda s: jnp.concatenate([s, s], axis=1)), ValueError, ["wo_scale_hbm", "1 columns"]),
        (_replace(4, lambda s: jnp.concatenate([s, s])), ValueError, ["wo_scale_hbm", "[H * d_v / 128"]),
        (_replace(0, lambda x: x[..., :-16]), ValueError, ["wuv_qtz_hbm", "HL=112"]),
    ],
    ids=["word-dtype", "scale-dtype", "wuv-rows", "wo-rows", "wo-scale-cols", "wo-scale-rows", "latent-width"],
)
def test_bad_inputs_name_the_argument(change, error, fragments):
    operands, _ = problem(1, 4, 2, 64, 64, 40)
    with pytest.raises(error) as info:
        nki.mla_vupmx_oproj_cte_kernel(*change(operands))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_explain_notes_the_ocp_scale_flag_and_the_bf16_k_slab_sums():
    def shapes(h, hid):
        return [
            jax.ShapeDtypeStruct(shape, dtype)
            for shape, dtype in (
                ((1, 128, h * 512), jnp.bfloat16),
                ((h * 128, 128), jnp.uint32),
                ((h * 4, 1), jnp.uint8),
                ((h * 32, hid), jnp.uint32),
                ((h, hid // 128), jnp.uint8),
            )
        ]

    with jax_nkilib.config(target="trn3"):
        one_slab = str(jax_nkilib.explain(nki.mla_vupmx_oproj_cte_kernel, *shapes(4, 7168)))
        two_slabs = str(jax_nkilib.explain(nki.mla_vupmx_oproj_cte_kernel, *shapes(16, 7168)))
    assert "enable-ocp-compliant-scale-computation" in one_slab and "K-slabs" not in one_slab
    assert "its 2 W_o K-slabs in a bfloat16 accumulator" in two_slabs
