"""jax_nkilib.nki.qkv: both device paths against a float64 oracle (residual add, norms, bias, RoPE, layouts, FP8
STATIC/ROW), the fused KV-cache write (flat and block caches, FP8 bytes), transformations, Neuron lowering (one
call; caches aliased) and bad inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import NormType, QKVOutputLayout, qkv
from tests.support.data import angles, random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

NQ, NKV, D = 2, 1, 4
WIDTH = (NQ + 2 * NKV) * D
HEADS = dict(num_q_heads=NQ, num_kv_heads=NKV, d_head=D)


# ----------------------------------------------------------------------------------------------- float64 oracle


def qkv_oracle(
    x,
    w,
    *,
    nq=NQ,
    nkv=NKV,
    d=D,
    bias=None,
    mlp_prev=None,
    attention_prev=None,
    norm=None,
    gamma=None,
    beta=None,
    eps=1e-6,
    hidden_actual=None,
    cos=None,
    sin=None,
    quant=None,
    w_scale=None,
    in_scale=None,
    store=None,
):
    """``(t [B, S, I], fused_hidden or None)`` in float64, written from the kernel's documented math; quantized
    projections round to ``store`` after the matmul, the dequantization and the bias (the kernel's buffers)."""
    keep = (lambda v: v.astype(store).astype(np.float64)) if quant and store else (lambda v: v)  # noqa: E731
    h, fused = f64(x), None
    if mlp_prev is not None:
        h = h + f64(mlp_prev) + f64(attention_prev)
        fused = h
    if norm in ("rms", "rms_skip"):
        count = h.shape[-1] if hidden_actual is None else hidden_actual
        h = h / np.sqrt(np.sum(h * h, axis=-1, keepdims=True) / count + eps)
        if norm == "rms":
            h = h * f64(gamma)[0]
    elif norm == "layer":
        mean = h.mean(-1, keepdims=True)
        h = (h - mean) / np.sqrt(((h - mean) ** 2).mean(-1, keepdims=True) + eps) * f64(gamma)[0]
        if beta is not None:
            h = h + f64(beta)[0]
    weight = f64(w)
    if quant == "static":
        bound = float(ml_dtypes.finfo(np.dtype(w.dtype)).max)
        q = np.clip(h / in_scale, -bound, bound).astype(np.dtype(w.dtype)).astype(np.float64)
        scale = np.concatenate([np.full(n * d, s) for n, s in zip((nq, nkv, nkv), w_scale)])
        t = keep(keep(q @ weight) * (scale * in_scale))
    elif quant == "row":
        t = keep(keep(h @ weight) * f64(w_scale))
    else:
        t = h @ weight
    if bias is not None:
        t = keep(t + f64(bias)[0])
    if cos is not None:
        b, s, _ = t.shape
        heads, half = nq + nkv, d // 2
        x_h = t[..., : heads * d].reshape(b, s, heads, d)
        c, sn = f64(cos)[:, :, None, :], f64(sin)[:, :, None, :half]
        x1, x2 = x_h[..., :half], x_h[..., half:]
        rotated = np.concatenate([x1 * c[..., :half] - x2 * sn, x2 * c[..., half:] + x1 * sn], axis=-1)
        t = np.concatenate([rotated.reshape(b, s, heads * d), t[..., heads * d :]], axis=-1)
    return t, fused


def heads_layout(t, layout):
    b, s, width = t.shape
    heads = t.reshape(b, s, width // D, D)
    return np.transpose(heads, (2, 0, 1, 3) if layout == "NBSd" else (2, 0, 3, 1))


def problem(b=2, s=3, h=8, dtype=jnp.float32, seed=0):
    return dict(
        x=random((b, s, h), dtype, seed),
        w=random((h, WIDTH), dtype, seed + 1, 0.4),
        bias=random((1, WIDTH), dtype, seed + 2, 0.3),
        mlp=random((b, s, h), dtype, seed + 3, 0.5),
        attn=random((b, s, h), dtype, seed + 4, 0.5),
        gamma=random((1, h), dtype, seed + 5, 0.3) + 1,
        beta=random((1, h), dtype, seed + 6, 0.2),
    )


def rope_tables(b, s, dtype=jnp.float32, seed=7):
    cos, sin = angles((b, s, D // 2), dtype, seed)
    return jnp.concatenate([cos, cos], -1), jnp.concatenate([sin, sin], -1)


# ----------------------------------------------------------------------------------------------------- paths
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", [None, "rms", "rms_skip", "layer"])
def test_tkg_path_with_fused_add_norm_and_bias(dtype, norm):
    pr = problem(dtype=dtype)
    norm_type = {None: "NO_NORM", "rms": "RMS_NORM", "rms_skip": "RMS_NORM_SKIP_GAMMA", "layer": "LAYER_NORM"}[norm]
    gamma = pr["gamma"] if norm in ("rms", "layer") else None
    beta = pr["beta"] if norm == "layer" else None
    out, fused = qkv(
        pr["x"],
        pr["w"],
        pr["bias"],
        None,
        None,
        pr["mlp"],
        pr["attn"],
        gamma,
        beta,
        fused_residual_add=True,
        fused_norm_type=norm_type,
        norm_eps=1e-5,
    )
    want, want_fused = qkv_oracle(
        pr["x"],
        pr["w"],
        bias=pr["bias"],
        mlp_prev=pr["mlp"],
        attention_prev=pr["attn"],
        norm=norm,
        gamma=gamma,
        beta=beta,
        eps=1e-5,
    )
    assert out.shape == (2, 3, WIDTH) and out.dtype == dtype and fused.shape == (2, 3, 8) and fused.dtype == dtype
    assert_close(out, want, dtype, reduction=8, ops=8)
    assert_close(fused, want_fused, dtype, ops=3)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("layout", ["BSD", "NBSd", "NBdS"])
def test_cte_path_by_sequence_length_computes_in_bfloat16(dtype, layout):
    pr = problem(b=1, s=97, dtype=dtype)
    out = qkv(
        pr["x"],
        pr["w"],
        pr["bias"],
        None,
        None,
        pr["mlp"],
        pr["attn"],
        pr["gamma"],
        fused_residual_add=True,
        fused_norm_type=NormType.RMS_NORM,
        hidden_actual=6,
        output_layout=layout,
        d_head=D,
    )
    assert not isinstance(out, tuple) and out.dtype == dtype  # the CTE path returns no fused_hidden
    want, _ = qkv_oracle(
        pr["x"],
        pr["w"],
        bias=pr["bias"],
        mlp_prev=pr["mlp"],
        attention_prev=pr["attn"],
        norm="rms",
        gamma=pr["gamma"],
        hidden_actual=6,
    )
    want = want if layout == "BSD" else heads_layout(want, layout)
    assert_close(out, want, jnp.bfloat16, reduction=8, ops=8)  # float32 input computes in bfloat16 here
    if dtype == jnp.float32:
        assert np.array_equal(np.asarray(out), np.asarray(out).astype(ml_dtypes.bfloat16).astype(np.float32))


def test_tkg_path_keeps_float32_precision_and_hidden_actual():
    pr = problem()
    (out, _) = qkv(
        pr["x"],
        pr["w"],
        None,
        None,
        None,
        pr["mlp"],
        pr["attn"],
        pr["gamma"],
        fused_residual_add=True,
        fused_norm_type="RMS_NORM",
        hidden_actual=5,
    )
    want, _ = qkv_oracle(
        pr["x"], pr["w"], mlp_prev=pr["mlp"], attention_prev=pr["attn"], norm="rms", gamma=pr["gamma"], hidden_actual=5
    )
    assert_close(out, want, jnp.float32, reduction=8, ops=8)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_rope_reads_cos_in_full_and_the_first_half_of_sin(dtype):
    pr = problem(dtype=dtype)
    cos, sin = rope_tables(2, 3, dtype)
    out = qkv(pr["x"], pr["w"], pr["bias"], cos_cache=cos, sin_cache=sin, fused_rope=True, **HEADS)
    want, _ = qkv_oracle(pr["x"], pr["w"], bias=pr["bias"], cos=cos, sin=sin)
    assert_close(out, want, jnp.bfloat16, reduction=8, ops=10)
    garbage = sin.at[..., D // 2 :].set(7.0)  # the second half of sin is never read
    np.testing.assert_array_equal(
        qkv(pr["x"], pr["w"], pr["bias"], cos_cache=cos, sin_cache=garbage, fused_rope=True, **HEADS), out
    )
    v = out[..., (NQ + NKV) * D :]  # V heads are not rotated
    np.testing.assert_array_equal(
        v,
        qkv(pr["x"], pr["w"], pr["bias"], cos_cache=cos * 0 + 1, sin_cache=sin * 0, fused_rope=True, **HEADS)[
            ..., (NQ + NKV) * D :
        ],
    )


def _integers(shape, low, high, dtype, seed):
    return jnp.asarray(np.random.default_rng(seed).integers(low, high, shape), jnp.float32).astype(dtype)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3, jnp.float8_e4m3fn])
@pytest.mark.parametrize("seq", [3, 97])
def test_static_fp8_is_exact_on_both_paths(fp8, seq):
    """Integer inputs, power-of-two scales: quantization, products and dequantization are exact; the clamp (the
    weights' largest finite value) is exercised."""
    x = _integers((1, seq, 8), -4, 5, jnp.bfloat16, 1).at[0, 0, 0].set(120.0)  # 120 / 2^-2 = 480: clamped
    w = _integers((8, WIDTH), -3, 4, jnp.float32, 2).astype(fp8)
    w_scale = jnp.broadcast_to(jnp.array([[0.5, 0.25, 2.0]], jnp.float32), (128, 3))
    in_scale = jnp.full((1, 1), 0.25, jnp.float32)
    out = qkv(x, w, None, w_scale, in_scale, quantization_type="STATIC", num_q_heads=NQ, num_kv_heads=NKV)
    want, _ = qkv_oracle(x, w, quant="static", w_scale=(0.5, 0.25, 2.0), in_scale=0.25, store=ml_dtypes.bfloat16)
    assert out.dtype == jnp.bfloat16  # STATIC: bfloat16 on the CTE path, the input's dtype on the TKG path
    np.testing.assert_array_equal(np.asarray(out, np.float64), want)


def test_row_fp8_on_the_tkg_path():
    x = _integers((2, 3, 8), -4, 5, jnp.bfloat16, 3)
    w = _integers((8, WIDTH), -3, 4, jnp.float32, 4).astype(jnp.float8_e4m3fn)
    row = jnp.asarray(2.0 ** (np.arange(WIDTH) % 5 - 2), jnp.float32)[None]  # powers of two: exact
    out = qkv(x, w, None, row, quantization_type="ROW")
    want, _ = qkv_oracle(x, w, quant="row", w_scale=row[0], store=ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float64), want)


# ----------------------------------------------------------------------------------------------------- KV cache
def _exact_cache_problem(b, s, dtype=jnp.bfloat16):
    x = _integers((b, s, 8), -2, 3, dtype, 5)
    w = _integers((8, WIDTH), -2, 3, dtype, 6)
    theta = np.random.default_rng(7).integers(0, 4, (b, s, D // 2)) * (np.pi / 2)
    cos, sin = (jnp.asarray(np.round(f(np.concatenate([theta, theta], -1))), dtype) for f in (np.cos, np.sin))
    return x, w, cos, sin


def _cache_oracle(t, caches, scales, kv_dtype, slots=None, bounds=None):
    """The caches after writing ``t``'s K and V, token by token."""
    q_dim, kv_dim = NQ * D, NKV * D
    top = float(ml_dtypes.finfo(np.dtype(kv_dtype)).max)
    low, high = bounds or (-top, top)
    new = [np.array(c) for c in caches]
    b, s, _ = t.shape
    for which, (cache, scale) in enumerate(zip(new, scales)):
        part = t[..., q_dim + which * kv_dim : q_dim + (which + 1) * kv_dim]
        values = np.clip(part / scale, low, high).astype(np.dtype(kv_dtype))
        flat = cache.reshape(-1, kv_dim)
        for bi in range(b):
            for si in range(s):
                if slots is None:
                    cache[bi, si] = values[bi, si]
                elif 0 <= slots[bi, si] < flat.shape[0]:
                    flat[slots[bi, si]] = values[bi, si]
    return new


@pytest.mark.parametrize("kv_dtype", [jnp.float8_e4m3, jnp.float8_e4m3fn, jnp.bfloat16])
@pytest.mark.parametrize("block", [False, True])
def test_fused_kv_cache_write_is_exact(kv_dtype, block):
    b, s = 2, 4  # B * S <= 128 and S <= 96: fused RoPE selects the CTE path
    x, w, cos, sin = _exact_cache_problem(b, s)
    scales = (0.5, 0.125) if kv_dtype != jnp.bfloat16 else (1.0, 1.0)
    if block:
        caches = [random((6, 4, NKV * D), jnp.float32, 10 + i).astype(kv_dtype) for i in range(2)]
        slots = np.array([[5, 6, 7, 8], [23, -1, 0, 24]], np.int32)  # -1 and 24 are outside: skipped
        extra = dict(use_block_kv=True, block_size=4)
    else:
        caches = [random((b, 9, NKV * D), jnp.float32, 10 + i).astype(kv_dtype) for i in range(2)]
        slots, extra = None, {}
    k_scale, v_scale = (jnp.full((128, 1), sc, jnp.float32) for sc in scales)
    q, k_new, v_new = qkv(
        x,
        w,
        cos_cache=cos,
        sin_cache=sin,
        k_cache=caches[0],
        v_cache=caches[1],
        k_scale=k_scale,
        v_scale=v_scale,
        slot_mapping=None if slots is None else jnp.asarray(slots),
        fused_rope=True,
        kv_dtype=kv_dtype,
        **HEADS,
        **extra,
    )
    t, _ = qkv_oracle(x, w, cos=cos, sin=sin)
    assert q.shape == (b, s, NQ * D) and q.dtype == jnp.bfloat16 and k_new.dtype == kv_dtype
    np.testing.assert_array_equal(np.asarray(q, np.float64), t[..., : NQ * D])
    for got, want in zip((k_new, v_new), _cache_oracle(t, caches, scales, kv_dtype, slots)):
        np.testing.assert_array_equal(
            np.asarray(got).view(np.uint8 if kv_dtype != jnp.bfloat16 else np.uint16),
            want.view(np.uint8 if kv_dtype != jnp.bfloat16 else np.uint16),
        )


def test_kv_quantization_clamps_to_fp8_min_max():
    x, w, cos, sin = _exact_cache_problem(1, 2)
    caches = [jnp.zeros((1, 2, NKV * D), jnp.float8_e4m3fn)] * 2
    scale = jnp.full((128, 1), 2.0**-6, jnp.float32)  # values up to ~ 2^7 scaled to 2^13: far beyond the clamp
    q, k_new, v_new = qkv(
        x,
        w,
        cos_cache=cos,
        sin_cache=sin,
        k_cache=caches[0],
        v_cache=caches[1],
        k_scale=scale,
        v_scale=scale,
        fused_rope=True,
        kv_dtype=jnp.float8_e4m3fn,
        fp8_max=64.0,
        fp8_min=-32.0,
        **HEADS,
    )
    values = np.asarray(k_new.astype(jnp.float32))
    assert values.max() == 64.0 and values.min() == -32.0
    t, _ = qkv_oracle(x, w, cos=cos, sin=sin)
    want = _cache_oracle(
        t, [np.zeros((1, 2, 4), ml_dtypes.float8_e4m3fn)] * 2, (2.0**-6,) * 2, jnp.float8_e4m3fn, bounds=(-32.0, 64.0)
    )
    np.testing.assert_array_equal(np.asarray(v_new).view(np.uint8), want[1].view(np.uint8))


def test_cache_write_on_the_long_sequence_path_without_rope():
    pr = problem(b=1, s=100, dtype=jnp.bfloat16)
    caches = [jnp.zeros((1, 128, NKV * D), jnp.bfloat16)] * 2
    one = jnp.ones((128, 1), jnp.float32)
    q, k_new, _ = qkv(
        pr["x"], pr["w"], pr["bias"], k_cache=caches[0], v_cache=caches[1], k_scale=one, v_scale=one, **HEADS
    )
    out = qkv(pr["x"], pr["w"], pr["bias"], **HEADS)
    np.testing.assert_array_equal(q, out[..., : NQ * D])
    np.testing.assert_array_equal(k_new[:, :100], out[..., NQ * D : (NQ + NKV) * D])
    assert not np.asarray(k_new[:, 100:].astype(jnp.float32)).any()


# -------------------------------------------------------------------------------------------------- gradients
# (jit, vmap, nested vmap and shard_map of each path are the conformance suite's: arg specs qkv,
# qkv.tkg_fused_residual, qkv.kv_cache)
def test_gradients_float64():
    pr = {k: v.astype(jnp.float64) for k, v in problem(s=3).items()}
    cos, sin = (t.astype(jnp.float64) for t in rope_tables(2, 3))

    def cte(x, w, bias, gamma, cos):
        return qkv(
            x,
            w,
            bias,
            None,
            None,
            None,
            None,
            gamma,
            None,
            cos,
            sin,
            fused_norm_type="RMS_NORM",
            fused_rope=True,
            **HEADS,
        )

    check_grads(cte, (pr["x"], pr["w"], pr["bias"], pr["gamma"], cos), order=1, modes=["rev"])

    def tkg(x, w, mlp, gamma, beta):
        out, fused = qkv(
            x, w, None, None, None, mlp, pr["attn"], gamma, beta, fused_residual_add=True, fused_norm_type="LAYER_NORM"
        )
        return out, fused

    check_grads(tkg, (pr["x"], pr["w"], pr["mlp"], pr["gamma"], pr["beta"]), order=1, modes=["rev"])
    grad = jax.grad(lambda x: jnp.sum(qkv(x, pr["w"]) ** 2))
    np.testing.assert_allclose(jax.vmap(grad)(jnp.stack([pr["x"], -pr["x"]]))[1], grad(-pr["x"]), rtol=1e-12)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_updated_caches_carry_no_gradient():
    x, w, cos, sin = (t.astype(jnp.float32) for t in _exact_cache_problem(1, 2))
    cache = jnp.zeros((1, 4, NKV * D), jnp.float32)
    one = jnp.ones((128, 1), jnp.float32)

    def loss(x, cache):
        q, k_new, v_new = qkv(
            x,
            w,
            cos_cache=cos,
            sin_cache=sin,
            k_cache=cache,
            v_cache=cache,
            k_scale=one,
            v_scale=one,
            fused_rope=True,
            **HEADS,
        )
        return jnp.sum(k_new) + jnp.sum(v_new), jnp.sum(q)

    assert not np.asarray(jax.grad(lambda x: loss(x, cache)[0])(x)).any()
    assert np.asarray(jax.grad(lambda x: loss(x, cache)[1])(x)).any()


# ----------------------------------------------------------------------------------------------------- Neuron
def _kernel_sized(s, dtype=jnp.bfloat16):
    """H = 256, d_head = 64, I = 256: shapes the kernel takes (also at LNC 2)."""
    return random((1, s, 256), dtype, 0), random((256, 256), dtype, 1), dict(num_q_heads=2, num_kv_heads=1, d_head=64)


@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_lowering_is_one_call_per_path(lnc):
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        x, w, heads = _kernel_sized(128)
        text = neuron_text(lambda x, w: qkv(x, w, **heads), x, w)
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "qkv" and cfg["entry_point"] == "nkilib.core.qkv.qkv:qkv" and cfg["grid"] == lnc
        assert cfg["output_names"] == ["out"] and compute_operations(text) == []
        x, w, heads = _kernel_sized(4)
        text = neuron_text(lambda x, w, m: qkv(x, w, None, None, None, m, m, fused_residual_add=True, **heads), x, w, x)
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "qkv" and cfg["output_names"] == ["out", "fused_hidden"]  # the TKG path
        assert cfg["entry_point"] == "nkilib.core.qkv.qkv:qkv" and compute_operations(text) == []


@pytest.mark.parametrize("block", [False, True])
def test_neuron_cache_write_aliases_the_caches(block):
    x, w, heads = _kernel_sized(128)
    one = jnp.ones((128, 1), jnp.float32)
    caches = jnp.zeros((4, 64, 64) if block else (1, 256, 64), jnp.float8_e4m3)
    extra = dict(use_block_kv=True, block_size=64) if block else {}
    slots = jnp.arange(128, dtype=jnp.int32)[None] if block else None
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(
            lambda x, w, k, v: qkv(
                x,
                w,
                k_cache=k,
                v_cache=v,
                k_scale=one,
                v_scale=one,
                slot_mapping=slots,
                kv_dtype=jnp.float8_e4m3,
                **heads,
                **extra,
            ),
            x,
            w,
            caches,
            caches,
        )
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "qkv" and cfg["aliases"] == [[2, 1], [3, 2]]
    assert cfg["input_names"][:4] == ["input", "fused_qkv_weights", "k_cache", "v_cache"]
    assert cfg["output_names"] == ["q", "k_cache", "v_cache"] and "output_operand_aliases" in text


@pytest.mark.parametrize(
    "flags, limit",
    [
        (dict(output_layout="NBdS"), "output_layout=NBdS is not implemented"),
        (dict(output_layout="NBSd"), "output_layout=NBSd needs d_head=128"),
    ],
)
def test_neuron_limits_fall_back(flags, limit):
    x, w, heads = _kernel_sized(128)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match=limit):
        text = neuron_text(lambda x, w: qkv(x, w, **heads, **flags), x, w)
    assert "AwsNeuronCustomNativeKernel" not in text


def test_row_on_the_cte_path_falls_back():
    x, w, heads = _kernel_sized(128)
    scale = jnp.ones((1, 256), jnp.float32)
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match="no ROW weight scales"):
        neuron_text(lambda x, w: qkv(x, w, None, scale, quantization_type="ROW", **heads), x, w.astype(jnp.float8_e4m3))


# ------------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize(
    "case, error, fragment",
    [
        ("cache_on_tkg", ValueError, "runs only on qkv's CTE path"),
        ("cache_without_scales", ValueError, "missing k_scale, v_scale"),
        ("kv_dtype", TypeError, "pass kv_dtype=float8_e4m3fn"),
        ("block_without_slots", ValueError, "use_block_kv=True needs `slot_mapping`"),
        ("cache_params_alone", ValueError, "kv_dtype configure the fused KV-cache write"),
        ("small_cache", ValueError, "hold max_S=2 positions, fewer than the S=4 tokens"),
        (
            "mx",
            ValueError,
            "MX (quantization_type=MX, MX weight layouts, is_h_dim_4h_transposed) runs only on qkv's CTE",
        ),
        ("static_mx", ValueError, "quantization_type=STATIC_MX: STATIC_MX (FP8 x4-packed weights"),
        ("mx_layout", ValueError, "weight_layout=MX_CONTIGUOUS and is_h_dim_4h_transposed=False are MX options"),
        ("sbuf", ValueError, "store_output_in_sbuf=True"),
        ("residual", ValueError, "fused_residual_add=True needs both `mlp_prev` and `attention_prev`"),
        ("gamma", ValueError, "`gamma_norm_weights` [1, H] is required by"),
        ("heads", ValueError, "(num_q_heads + 2 * num_kv_heads) * d_head = (2 + 2 * 2) * 4 must equal"),
        ("layout", ValueError, "output_layout=NBSd needs d_head"),
        ("rope_tables", ValueError, "fused_rope=True needs `cos_cache` and `sin_cache`"),
        ("rope_heads", ValueError, "fused_rope=True needs num_q_heads and num_kv_heads"),
        ("tables_without_rope", ValueError, "they are only used with it; got fused_rope=False"),
        ("static_scales", ValueError, "quantization_type=STATIC requires `qkv_in_scale`"),
        ("static_weights", TypeError, "needs FP8 `fused_qkv_weights`"),
        ("weights_dtype", TypeError, "must have the input's dtype"),
        ("enum", TypeError, "parameter `fused_norm_type` must be a NormType member"),
        ("too_many", TypeError, "takes 16 tensor arguments"),
    ],
)
def test_bad_inputs(case, error, fragment):
    x, w, cos, sin = _exact_cache_problem(1, 4)
    f8 = jnp.zeros((1, 8, NKV * D), jnp.float8_e4m3fn)
    one = jnp.ones((128, 1), jnp.float32)
    cache = dict(k_cache=f8, v_cache=f8, k_scale=one, v_scale=one, kv_dtype=jnp.float8_e4m3fn)
    rope = dict(cos_cache=cos, sin_cache=sin, fused_rope=True)
    calls = {
        "cache_on_tkg": lambda: qkv(x, w, **cache, **HEADS),
        "cache_without_scales": lambda: qkv(x, w, k_cache=f8, v_cache=f8, **rope, **HEADS),
        "kv_dtype": lambda: qkv(x, w, **dict(cache, kv_dtype=None), **rope, **HEADS),
        "block_without_slots": lambda: qkv(x, w, **cache, **rope, **HEADS, use_block_kv=True, block_size=8),
        "cache_params_alone": lambda: qkv(x, w, kv_dtype=jnp.float8_e4m3fn),
        "small_cache": lambda: qkv(x, w, **dict(cache, k_cache=f8[:, :2], v_cache=f8[:, :2]), **rope, **HEADS),
        "mx": lambda: qkv(x, w, quantization_type="MX"),
        "static_mx": lambda: qkv(x, w, **rope, **HEADS, quantization_type="STATIC_MX"),
        "mx_layout": lambda: qkv(x, w, **rope, **HEADS, weight_layout="MX_CONTIGUOUS"),
        "sbuf": lambda: qkv(x, w, store_output_in_sbuf=True),
        "residual": lambda: qkv(x, w, None, None, None, x, fused_residual_add=True),
        "gamma": lambda: qkv(x, w, fused_norm_type="RMS_NORM"),
        "heads": lambda: qkv(x, w, num_q_heads=2, num_kv_heads=2, d_head=4),
        "layout": lambda: qkv(x, w, output_layout=QKVOutputLayout.NBSd),
        "rope_tables": lambda: qkv(x, w, cos_cache=cos, fused_rope=True, **HEADS),
        "rope_heads": lambda: qkv(x, w, **rope),
        "tables_without_rope": lambda: qkv(x, w, cos_cache=cos, sin_cache=sin),
        "static_scales": lambda: qkv(
            x, w.astype(jnp.float8_e4m3), None, jnp.ones((1, 3), jnp.float32), quantization_type="STATIC", **HEADS
        ),
        "static_weights": lambda: qkv(
            x,
            w,
            None,
            jnp.ones((1, 3), jnp.float32),
            jnp.ones((1, 1), jnp.float32),
            quantization_type="STATIC",
            **HEADS,
        ),
        "weights_dtype": lambda: qkv(x, w.astype(jnp.float32)),
        "enum": lambda: qkv(x, w, fused_norm_type="RMS"),
        "too_many": lambda: qkv(*([x] * 17)),
    }
    with pytest.raises(error) as info:
        calls[case]()
    assert fragment in str(info.value)
