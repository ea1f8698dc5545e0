"""jax_nkilib.nki.matmul_mxfp8 and matmul_mxfp8_backward against float64 NumPy oracles of the kernels' MXFP8
datapaths; straight-through reverse mode; transformations; Neuron lowering; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import matmul_mxfp8, matmul_mxfp8_backward, quantize_block_mxfp8_kernel
from tests.quant.test_quantize_mxfp8 import (
    oracle_contract,
    oracle_dense_scales,
    oracle_dequantize_tiles,
    oracle_mx_matmul,
    oracle_operand,
    oracle_swizzle,
    spread,
)
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

RAW = dict(lhs_is_swizzled=False, rhs_is_swizzled=False)


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def same(out, want, k):
    """Equal up to float32 summation order (XLA may block a folded batch's dot differently)."""
    assert_close(f64(out), f64(want), jnp.float32, reduction=k)


def check(out, want, dtype, k):
    """float32 accumulation of exact products: within the float32 (or output dtype) bound over K terms."""
    assert out.shape == want.shape
    assert_close(f64(out), want, dtype, reduction=k)


def oracle_backward(dy, w, x, fmt="float8_e5m2"):
    """``(dX, dW)``: ``q_N(dY) q_N(W)`` and ``q_M(dY)^T q_M(X)``, float64."""
    dy, w, x = (np.asarray(jnp.asarray(a, jnp.float32)) for a in (dy, w, x))
    return oracle_mx_matmul(dy, w.T, fmt), oracle_mx_matmul(dy.T, x.T, fmt)


def operands(m=24, n=40, k=640, dtype=jnp.bfloat16, seed=0):
    return spread((m, k), seed, dtype) * 2.0**-10, spread((n, k), seed + 1, dtype) * 2.0**-10


# ---------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize(
    "fmt, scheme, dtype",
    [
        ("float8_e4m3fn", "wrapX", jnp.bfloat16),
        ("float8_e5m2", "wrapX", jnp.float32),
        ("float8_e4m3fn", "1x32", jnp.float32),
        ("float8_e5m2", "1x32", jnp.bfloat16),
    ],
)
def test_raw_operands_match_oracle(fmt, scheme, dtype):
    lhs, rhs = operands(dtype=dtype)
    out = matmul_mxfp8(lhs, rhs, float8_dtype=fmt, quant_scheme=scheme, output_dtype=jnp.float32, **RAW)
    assert out.dtype == jnp.float32
    check(out, oracle_mx_matmul(f64(lhs), f64(rhs), fmt, scheme), jnp.float32, 640)


@pytest.mark.parametrize("shape", [(5, 7, 96), (1, 3, 100), (9, 33, 2944)])
def test_odd_sizes_and_default_output_dtype(shape):
    m, n, k = shape  # K = 100: raw contractions are zero-padded to a multiple of 32 (CPU extension)
    lhs, rhs = operands(m, n, k, jnp.float32, seed=k)
    out = matmul_mxfp8(lhs, rhs, **RAW)
    assert out.dtype == jnp.bfloat16 and out.shape == (m, n)
    check(out, oracle_mx_matmul(f64(lhs), f64(rhs), "float8_e5m2"), jnp.bfloat16, 1)


@pytest.mark.parametrize("scheme", ["wrapX", "1x32"])
def test_swizzled_operands(scheme):
    lhs, rhs = operands(m=16, n=8, k=896)
    lhs_sw, rhs_sw = (jnp.asarray(oracle_swizzle(f64(a), scheme), jnp.bfloat16) for a in (lhs, rhs))
    want = oracle_mx_matmul(f64(lhs), f64(rhs), "float8_e4m3fn", scheme)
    both = matmul_mxfp8(lhs_sw, rhs_sw, float8_dtype="float8_e4m3fn", quant_scheme=scheme, output_dtype=jnp.float32)
    check(both, want, jnp.float32, 896)
    mixed = matmul_mxfp8(
        lhs_sw, rhs, rhs_is_swizzled=False, float8_dtype="float8_e4m3fn", quant_scheme=scheme, output_dtype=jnp.float32
    )
    np.testing.assert_array_equal(np.asarray(mixed), np.asarray(both))
    # the blocks of a swizzled operand are its own 8 x 4 tiles, whatever the scheme (only the sum order changes)
    other = matmul_mxfp8(
        lhs_sw,
        rhs_sw,
        float8_dtype="float8_e4m3fn",
        quant_scheme="1x32" if scheme == "wrapX" else "wrapX",
        output_dtype=jnp.float32,
    )
    check(other, want, jnp.float32, 896)


@pytest.mark.parametrize("packed, scale_dtype", [(True, jnp.float8_e8m0fnu), (False, jnp.uint8)])
def test_prequantized_operands(packed, scale_dtype):
    lhs, rhs = operands(m=16, n=24, k=2944)
    quantize = lambda a: quantize_block_mxfp8_kernel(
        a,
        return_fp8_dtype="float8_e4m3fn",  # noqa: E731
        enable_scale_packing=packed,
    )
    (lhs_scales, lhs_data), (rhs_scales, rhs_data) = quantize(lhs), quantize(rhs)
    lhs_scales, rhs_scales = (jax.lax.bitcast_convert_type(s, scale_dtype) for s in (lhs_scales, rhs_scales))
    out = matmul_mxfp8(
        lhs_data,
        rhs_data,
        lhs_scales,
        rhs_scales,
        float8_dtype="float8_e4m3fn",
        use_scale_packing=packed,
        output_dtype=jnp.float32,
    )
    # the oracle decodes the given bytes (dense scales from the layout) independently of the quantizer
    dequantized = [
        oracle_dequantize_tiles(np.asarray(d), oracle_dense_scales(np.asarray(s).view(np.uint8), 2944))
        for d, s in ((lhs_data, lhs_scales), (rhs_data, rhs_scales))
    ]
    want = oracle_contract(*dequantized)
    check(out, want, jnp.float32, 2944)
    check(out, oracle_mx_matmul(f64(lhs), f64(rhs), "float8_e4m3fn"), jnp.float32, 2944)
    raw_rhs = matmul_mxfp8(
        lhs_data,
        rhs,
        lhs_scales,
        float8_dtype="float8_e4m3fn",
        use_scale_packing=packed,
        rhs_is_swizzled=False,
        output_dtype=jnp.float32,
    )
    np.testing.assert_array_equal(np.asarray(raw_rhs), np.asarray(out))


def test_tiling_knobs_do_not_change_the_result():
    lhs, rhs = operands()
    base = matmul_mxfp8(lhs, rhs, **RAW)
    tuned = matmul_mxfp8(
        lhs,
        rhs,
        TILES_IN_BLOCK_M=2,
        TILES_IN_BLOCK_N=4,
        TILES_IN_BLOCK_K=1,
        TILES_IN_LOAD_M=1,
        TILES_IN_LOAD_N=2,
        lhs_matmul_tile_shape_logical=(512, 128),
        rhs_matmul_tile_shape_logical=[512, 256],
        tile_loop_order="nmk",
        spill_reload=True,
        run_with_lnc2=False,
        lnc_2_shard_rhs=False,
        **RAW,
    )
    np.testing.assert_array_equal(np.asarray(tuned, np.float32), np.asarray(base, np.float32))


def test_vmap_folds():
    """vmap of one operand folds into M (raw) or into the 4N columns (swizzled); jit, vmap of both and nested vmap
    against a loop are the conformance suite's (arg spec matmul_mxfp8)."""
    lhs, rhs = operands(m=8, n=16, k=256)
    call = lambda a, b: matmul_mxfp8(a, b, output_dtype=jnp.float32, **RAW)  # noqa: E731
    lhs3 = jnp.stack([lhs, -2 * lhs, lhs[::-1]])
    batched = jax.vmap(call, in_axes=(0, None))(lhs3, rhs)
    assert "while" not in str(jax.make_jaxpr(jax.vmap(call, in_axes=(0, None)))(lhs3, rhs))  # folded into M
    same(batched[1], call(lhs3[1], rhs), 256)
    # swizzled operands fold into their 4M / 4N columns
    lhs_sw, rhs_sw = (jnp.asarray(oracle_swizzle(f64(a)), jnp.bfloat16) for a in (lhs, rhs))
    swizzled = lambda a, b: matmul_mxfp8(a, b, output_dtype=jnp.float32)  # noqa: E731
    stacked = jnp.stack([rhs_sw, 2 * rhs_sw])
    out = jax.vmap(swizzled, in_axes=(None, 0))(lhs_sw, stacked)
    same(out[1], swizzled(lhs_sw, stacked[1]), 256)


# ------------------------------------------------------------------------------------------------ reverse mode
def test_reverse_mode_is_the_backward_kernel():
    lhs, rhs = operands(m=24, n=40, k=256)
    g = spread((24, 40), 7, jnp.float32)
    out, vjp = jax.vjp(lambda a, b: matmul_mxfp8(a, b, output_dtype=jnp.float32, **RAW), lhs, rhs)
    dlhs, drhs = vjp(g)
    assert dlhs.dtype == drhs.dtype == jnp.bfloat16
    want_dx, want_dw = oracle_backward(g, rhs, lhs)
    check(dlhs, want_dx, jnp.bfloat16, 1)
    check(drhs, want_dw, jnp.bfloat16, 1)
    # pre-swizzled operands get swizzled gradients; pre-quantized ones none (their dequantized values are W)
    lhs_sw = jnp.asarray(oracle_swizzle(f64(lhs)), jnp.bfloat16)
    scales, data = quantize_block_mxfp8_kernel(rhs, return_fp8_dtype="float8_e5m2")
    _, vjp = jax.vjp(
        lambda a, d: matmul_mxfp8(a, d, rhs_scales=scales, use_scale_packing=True, output_dtype=jnp.float32),
        lhs_sw,
        data,
    )
    dlhs_sw, ddata = vjp(g)
    assert not np.any(np.asarray(ddata, np.float32))
    dequantized = oracle_unswizzle(oracle_operand(f64(rhs), "float8_e5m2"), 256)
    check(dlhs_sw, oracle_swizzle(oracle_backward(g, dequantized, lhs)[0]), jnp.bfloat16, 1)


def oracle_unswizzle(swizzled, k, scheme="wrapX"):
    """Inverse of ``oracle_swizzle``: ``[K/4, 4F]`` -> ``[F, K]`` through the swizzle of the K indices."""
    index = oracle_swizzle(np.arange(k, dtype=np.float64)[None], scheme).astype(int)  # [K/4, 4]: K at (r, j)
    out = np.zeros((swizzled.shape[1] // 4, k))
    for r in range(k // 4):
        for j in range(4):
            out[:, index[r, j]] = swizzled[r, j::4]
    return out


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_grad_of_vmap():
    """The rhs gradient of a vmapped loss is the sum of the per-example ones (vmap of grad is the conformance
    suite's: arg spec matmul_mxfp8)."""
    lhs, rhs = operands(m=8, n=16, k=128)
    loss = lambda a, b: jnp.sum(matmul_mxfp8(a, b, output_dtype=jnp.float32, **RAW) ** 2)  # noqa: E731
    lhs3 = jnp.stack([lhs, 3 * lhs])
    per_example = [jax.grad(loss, argnums=1)(lhs3[i], rhs) for i in range(2)]
    summed = jax.grad(lambda a, b: jnp.sum(jax.vmap(loss, in_axes=(0, None))(a, b)), argnums=1)(lhs3, rhs)
    assert_close(f64(summed), f64(per_example[0]) + f64(per_example[1]), jnp.bfloat16, reduction=2)


def test_rhs_gradient_inside_shard_map_is_the_oracle_sum():
    """The replicated rhs's gradient against the oracle (values and gradients against the unsharded call are the
    conformance suite's: arg spec matmul_mxfp8)."""
    mesh = mesh_1d()
    lhs, rhs = operands(m=32, n=16, k=256)
    call = lambda a, b: matmul_mxfp8(a, b, output_dtype=jnp.float32, **RAW)  # noqa: E731
    fn = jax.shard_map(call, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))
    grad = jax.jit(jax.grad(lambda a, b: jnp.sum(fn(a, b)), argnums=1))(*shard(mesh, (P("data"), P()), lhs, rhs))
    check(grad, oracle_backward(np.ones((32, 16)), rhs, lhs)[1], jnp.bfloat16, 8)


# ------------------------------------------------------------------------------------------------- the backward
@pytest.mark.parametrize("shape, fmt", [((128, 64, 512), "float8_e4m3fn"), ((10, 7, 96), "float8_e5m2")])
def test_backward_matches_oracle(shape, fmt):
    m, n, k = shape  # (10, 7, 96): contractions zero-padded to 32 (CPU extension)
    dy, w, x = spread((m, n), 1, jnp.bfloat16), spread((n, k), 2, jnp.bfloat16), spread((m, k), 3, jnp.bfloat16)
    dx, dw = matmul_mxfp8_backward(dy, w, x, float8_dtype=fmt, output_dtype=jnp.float32)
    want_dx, want_dw = oracle_backward(dy, w, x, fmt)
    check(dx, want_dx, jnp.float32, n)
    check(dw, want_dw, jnp.float32, m)
    dx16, _ = matmul_mxfp8_backward(
        dy,
        w,
        x,
        float8_dtype=fmt,
        input_grad_config={"tile_k": 512},
        weight_grad_config={"TILES_IN_BLOCK_M": 2, "TILES_IN_LOAD_M": 1},
    )
    assert dx16.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx16, np.float32), np.asarray(dx.astype(jnp.bfloat16), np.float32))


def test_backward_vmap_of_the_weights_folds():
    """vmap of the weights alone folds into K; jit, vmap of all operands and shard_map are the conformance suite's
    (arg spec matmul_mxfp8_backward)."""
    dy, w, x = spread((16, 8), 1, jnp.bfloat16), spread((8, 64), 2, jnp.bfloat16), spread((16, 64), 3, jnp.bfloat16)
    call = lambda a, b, c: matmul_mxfp8_backward(a, b, c, output_dtype=jnp.float32)  # noqa: E731
    ws = jnp.stack([w, -w, 2 * w])
    batched = jax.vmap(call, in_axes=(None, 0, None))(dy, ws, x)  # K is free: folded
    assert "while" not in str(jax.make_jaxpr(jax.vmap(call, in_axes=(None, 0, None)))(dy, ws, x))
    for got, want in zip(batched, call(dy, ws[2], x)):
        same(got[2], want, 16)


# --------------------------------------------------------------------------------------------- Neuron lowering
def test_neuron_lowering():
    lhs, rhs = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((384, 512), jnp.bfloat16)
    call = lambda a, b, **kw: matmul_mxfp8(a, b, **RAW, **kw)  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(call, lhs, rhs))
        assert cfg["entry_point"] == "jax_nkilib_kernels.quant:matmul_mxfp8" and cfg["output_names"] == ["out"]
        assert cfg["params"]["output_dtype"] == "bfloat16" and cfg["params"]["run_with_lnc2"] is False
        assert cfg["mac_count"] == 256 * 384 * 512
        scales, data = quantize_block_mxfp8_kernel(lhs, return_fp8_dtype="float8_e5m2")
        prequantized = lambda d, s, b: matmul_mxfp8(
            d,
            b,
            lhs_scales=s,
            rhs_is_swizzled=False,  # noqa: E731
            use_scale_packing=True,
        )
        (cfg,) = kernel_configs(neuron_text(prequantized, data, jax.lax.bitcast_convert_type(scales, jnp.uint8), rhs))
        assert cfg["input_names"] == ["lhs", "rhs", "lhs_scales"]
        with pytest.warns(NeuronFallbackWarning, match="`lhs_scales` has dtype float8_e8m0fnu"):
            neuron_text(prequantized, data, scales, rhs)  # the planner takes no e8m0 operand: pass uint8 bytes
        with pytest.warns(NeuronFallbackWarning, match="lhs must be bfloat16; got float32"):
            assert not kernel_configs(neuron_text(call, lhs.astype(jnp.float32), rhs))
        with pytest.warns(NeuronFallbackWarning, match="a raw lhs needs K % 128 == 0; got K=96"):
            neuron_text(call, lhs[:, :96], rhs[:, :96])
        with pytest.warns(NeuronFallbackWarning, match="loaded in K tiles of 512; got tile_k=256"):
            neuron_text(lambda a, b: call(a, b, lhs_matmul_tile_shape_logical=(256, 128)), lhs, rhs)
        with pytest.warns(NeuronFallbackWarning, match="run_with_lnc2=True needs LNC=2"):
            neuron_text(lambda a, b: call(a, b, run_with_lnc2=True), lhs, rhs)
        dy, x = jnp.zeros((256, 512), jnp.bfloat16), jnp.zeros((256, 1024), jnp.bfloat16)
        w = jnp.zeros((512, 1024), jnp.bfloat16)
        (cfg,) = kernel_configs(neuron_text(matmul_mxfp8_backward, dy, w, x))
        assert cfg["entry_point"] == "jax_nkilib_kernels.quant:matmul_mxfp8_backward"
        assert cfg["output_names"] == ["input_grad", "weight_grad"]
        with pytest.warns(NeuronFallbackWarning, match="N=384 must be a multiple of 512"):
            neuron_text(matmul_mxfp8_backward, dy[:, :384], w[:384], x)


# -------------------------------------------------------------------------------------------------- bad inputs
def _args(**changes):
    def build():
        lhs, rhs = jnp.zeros((8, 128), jnp.bfloat16), jnp.zeros((16, 128), jnp.bfloat16)
        return dict(dict(lhs=lhs, rhs=rhs, **RAW), **{k: v() if callable(v) else v for k, v in changes.items()})

    return build


_SW = dict(
    lhs=lambda: jnp.zeros((32, 32), jnp.bfloat16),
    rhs=lambda: jnp.zeros((32, 64), jnp.bfloat16),
    lhs_is_swizzled=True,
    rhs_is_swizzled=True,
)
_PRE = dict(_SW, lhs=lambda: jnp.zeros((32, 32), jnp.float8_e5m2), lhs_scales=lambda: jnp.zeros((32, 8), jnp.uint8))
BAD = [
    (_args(rhs=lambda: jnp.zeros((16, 64), jnp.bfloat16)), ValueError, r"argument `rhs` must have layout \[N, K\]"),
    (_args(lhs=lambda: jnp.zeros((8, 128), jnp.int32)), TypeError, "argument `lhs` must have dtype"),
    (_args(lhs=lambda: jnp.zeros((8, 128), jnp.float8_e5m2)), TypeError, "fp8 data needs its `lhs_scales`"),
    (
        _args(lhs_scales=lambda: jnp.zeros((32, 8), jnp.uint8)),
        ValueError,
        "always in the swizzled layout .* lhs_is_swizzled must be True",
    ),
    (
        _args(**dict(_PRE, lhs=lambda: jnp.zeros((32, 32), jnp.float8_e4m3fn))),
        TypeError,
        "must hold float8_e5m2 elements",
    ),
    (
        _args(**dict(_PRE, lhs_scales=lambda: jnp.zeros((16, 8), jnp.uint8))),
        ValueError,
        r"`lhs_scales` must have layout \[K/4, M\] = \(32, 8\)",
    ),
    (
        _args(**dict(_PRE, use_scale_packing=True, lhs_scales=lambda: jnp.zeros((32, 8), jnp.uint8))),
        ValueError,
        r"packed \[ceil\(K/2048\)\*128, M\] = \(128, 8\)",
    ),
    (
        _args(**dict(_PRE, lhs_scales=lambda: jnp.zeros((32, 8), jnp.int8))),
        TypeError,
        "argument `lhs_scales` must have dtype",
    ),
    (
        _args(**dict(_SW, lhs=lambda: jnp.zeros((12, 32), jnp.bfloat16), rhs=lambda: jnp.zeros((12, 64)))),
        ValueError,
        r"swizzled `lhs` must have layout \[K/4, 4\*M\] with K a multiple of 32",
    ),
    (_args(**dict(_SW, lhs=lambda: jnp.zeros((32, 30), jnp.bfloat16))), ValueError, r"\[K/4, 4\*M\]"),
    (_args(lhs_matmul_tile_shape_logical=(500, 128)), ValueError, "tile_k=500 must be a multiple of 128"),
    (_args(rhs_matmul_tile_shape_logical=(512, 8200)), ValueError, "tile_n=8200 must be a multiple of 32 and at most"),
    (
        _args(lhs_matmul_tile_shape_logical=(512, 128), rhs_matmul_tile_shape_logical=(256, 128)),
        ValueError,
        "the same tile_k",
    ),
    (_args(lhs_matmul_tile_shape_logical=512), TypeError, r"a \(tile_k, tile\) pair of positive ints"),
    (
        _args(TILES_IN_BLOCK_M=3, TILES_IN_LOAD_M=2),
        ValueError,
        "TILES_IN_BLOCK_M=3 must be a multiple of TILES_IN_LOAD_M=2",
    ),
    (_args(TILES_IN_BLOCK_N=0), ValueError, "TILES_IN_BLOCK_N must be positive"),
    (_args(block_loop_order="nmk"), ValueError, r"`block_loop_order` must be one of \('mnk',\)"),
    (_args(quant_scheme="1x16"), ValueError, "`quant_scheme` must be one of"),
    (_args(float8_dtype="float4_e2m1fn"), ValueError, "`float8_dtype` must be one of"),
    (_args(output_dtype="not-a-dtype"), TypeError, "`output_dtype` must be a dtype"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    build, error, fragment = case
    with pytest.raises(error, match=fragment):
        matmul_mxfp8(**build())


BAD_BACKWARD = [
    (dict(weights_is_swizzled=True), ValueError, "weights_is_swizzled=True is not supported by the kernel"),
    (dict(input_grad_config={"tile_q": 4}), TypeError, "`input_grad_config` must be None or a mapping"),
    (dict(weight_grad_config={"tile_m": 48}), ValueError, "weight_grad_config: tile_m=48 must be a multiple of 32"),
    (dict(input_activation=jnp.zeros((9, 64))), ValueError, r"argument `input_activation` must have layout \[M, K\]"),
]


@pytest.mark.parametrize("case", BAD_BACKWARD, ids=lambda c: c[2])
def test_backward_bad_inputs(case):
    changes, error, fragment = case
    args = dict(output_grad=jnp.zeros((8, 16)), weights=jnp.zeros((16, 64)), input_activation=jnp.zeros((8, 64)))
    with pytest.raises(error, match=fragment):
        matmul_mxfp8_backward(**dict(args, **changes))
