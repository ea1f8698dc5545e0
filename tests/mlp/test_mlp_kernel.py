"""jax_nkilib.nki.mlp against a float64 NumPy oracle (FP8 emulated with ml_dtypes); dispatch; transformations."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.nki import ActFnType, QuantizationType, mlp
from tests.support.data import random
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

E4M3 = np.dtype(ml_dtypes.float8_e4m3)
_erf = np.vectorize(math.erf)
ACTS = {
    "SiLU": lambda v: v / (1 + np.exp(-v)),
    "GELU": lambda v: 0.5 * v * (1 + _erf(v / np.sqrt(2))),
    "GELU_Tanh_Approx": lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v**3))),
    "Swish": lambda v: v / (1 + np.exp(-1.702 * v)),
    "ReLU": lambda v: np.maximum(v, 0),
}


def _f64(value):
    return None if value is None else np.asarray(value).astype(np.float64)


def _round(value, dtype):
    return np.asarray(value, np.float64).astype(np.dtype(dtype)).astype(np.float64)


def _quantize(v, kind, fmt, in_scale, clip, compute):
    """FP8 activation quantization as the CTE path does it: (values, dequant scale)."""
    if kind == "row":
        if clip > 0:
            v = np.clip(v, -clip, clip)
        d = np.maximum(np.abs(v).max(-1, keepdims=True) / 240.0, 1e-6)
        return _round(np.clip(v / d, -240, 240), fmt), d
    d = float(np.asarray(in_scale)[0, 0])
    return _round(np.clip(_round(v / d, compute), -240, 240), fmt), d


def mlp_oracle(
    hidden,
    gate_w,
    up_w,
    down_w,
    *,
    norm="none",
    gamma=None,
    beta=None,
    gate_b=None,
    up_b=None,
    down_b=None,
    fused_add=None,
    store=False,
    act="SiLU",
    gate_clamp=(None, None),
    up_clamp=(None, None),
    skip_gate=False,
    quant=None,
    scales=None,
    clip=0.0,
    eps=1e-6,
    force_cte=False,
    output_dtype=None,
):
    """The kernel's semantics in float64 with its rounding points: ``(out, add_out)`` (clamps are (upper, lower))."""
    io = np.dtype(hidden.dtype)
    out_dtype = np.dtype(output_dtype or io)
    b, s, _ = hidden.shape
    tkg = b * s <= 96 and not force_cte
    compute = np.dtype(jnp.bfloat16) if (not tkg and io == np.float32) else io
    scales = scales or {}
    x, add_out = _f64(hidden), None
    if fused_add is not None:
        x = _round(x + _f64(fused_add), out_dtype if (tkg and store) else compute)
        add_out = x.astype(out_dtype) if store else None
    else:
        x = _round(x, compute)
    if norm == "layer":
        mu = x.mean(-1, keepdims=True)
        n = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * _f64(gamma).reshape(-1)
        n = n + (0 if beta is None else _f64(beta).reshape(-1))
    elif norm in ("rms", "rms_skip"):
        n = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
        n = n * (_f64(gamma).reshape(-1) if norm == "rms" else 1)
    else:
        n = x
    n = n if norm == "none" else _round(n, compute)

    def load(w):  # CTE tiles hold float weights and biases in the compute dtype
        return _f64(w) if (tkg or quant) else _round(_f64(w), compute)

    def proj(a, a_scale, w, w_scale, bias):
        y = a @ _f64(w) if quant else a @ load(w)
        if quant:
            y = y * _f64(w_scale)[0] * a_scale
        return y if bias is None else y + load(bias).reshape(-1)

    def clamp(v, bounds):
        upper, lower = bounds
        v = v if upper is None else np.minimum(v, upper)
        return v if lower is None else np.maximum(v, lower)

    a, a_scale = n, 1.0
    if quant and not tkg:
        a, a_scale = _quantize(n, quant, up_w.dtype, scales.get("gate_up_in_scale"), clip, compute)
    up = clamp(proj(a, a_scale, up_w, scales.get("up_w_scale"), up_b), up_clamp)
    if skip_gate:
        h = ACTS[act](up)
    else:
        gate = clamp(proj(a, a_scale, gate_w, scales.get("gate_w_scale"), gate_b), gate_clamp)
        h = ACTS[act](gate) * up
    h, h_scale = _round(h, compute), 1.0
    if quant and not tkg:
        h, h_scale = _quantize(h, quant, down_w.dtype, scales.get("down_in_scale"), clip, compute)
    out = _round(proj(h, h_scale, down_w, scales.get("down_w_scale"), down_b), compute).astype(out_dtype)
    return out, add_out


def problem(b=2, s=3, h=48, i=40, dtype=jnp.float32, seed=0):
    return (
        random((b, s, h), dtype, seed),
        random((h, i), dtype, seed + 1, 0.2),
        random((h, i), dtype, seed + 2, 0.2),
        random((i, h), dtype, seed + 3, 0.2),
    )


def norm_args(norm, h, dtype):
    gamma = random((1, h), dtype, 7, 0.5) + 1 if norm in ("rms", "layer") else None
    beta = random((1, h), dtype, 8, 0.1) if norm == "layer" else None
    kind = {"none": "NO_NORM", "rms": "RMS_NORM", "rms_skip": "RMS_NORM_SKIP_GAMMA", "layer": "LAYER_NORM"}[norm]
    return gamma, beta, kind


CONFIGS = [
    dict(),
    dict(norm="rms"),
    dict(norm="rms_skip"),
    dict(norm="layer"),
    dict(bias=True),
    dict(fused_add=True, store=True, norm="rms"),
    dict(fused_add=True),
    dict(skip_gate=True, bias=True),
    dict(clamps=True),
    dict(force_cte=True, norm="layer", bias=True, fused_add=True, store=True),
    dict(tokens=(2, 50), norm="rms"),
    dict(odd=True, norm="rms", bias=True),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_matches_oracle(dtype, config):
    cfg = CONFIGS[config]
    b, s = cfg.get("tokens", (2, 3))
    h, i = (40, 24) if cfg.get("odd") else (48, 40)
    x, wg, wu, wd = problem(b, s, h, i, dtype)
    gamma, beta, kind = norm_args(cfg.get("norm", "none"), h, dtype)
    biases = (
        (random((1, i), dtype, 4, 0.3), random((1, i), dtype, 5, 0.3), random((1, h), dtype, 6, 0.3))
        if cfg.get("bias")
        else (None, None, None)
    )
    fa = random((b, s, h), dtype, 9) if cfg.get("fused_add") else None
    clamps = (
        dict(
            gate_clamp_upper_limit=0.5,
            gate_clamp_lower_limit=-0.75,
            up_clamp_upper_limit=0.4,
            up_clamp_lower_limit=-0.3,
        )
        if cfg.get("clamps")
        else {}
    )
    store = cfg.get("store", False)
    outs = mlp(
        x,
        wg,
        wu,
        wd,
        gamma,
        *biases,
        beta,
        fa,
        normalization_type=kind,
        store_fused_add_result=store,
        skip_gate_proj=cfg.get("skip_gate", False),
        force_cte_mode=cfg.get("force_cte", False),
        **clamps,
    )
    want, want_add = mlp_oracle(
        x,
        wg,
        wu,
        wd,
        norm=cfg.get("norm", "none"),
        gamma=gamma,
        beta=beta,
        gate_b=biases[0],
        up_b=biases[1],
        down_b=biases[2],
        fused_add=fa,
        store=store,
        skip_gate=cfg.get("skip_gate", False),
        force_cte=cfg.get("force_cte", False),
        gate_clamp=(clamps.get("gate_clamp_upper_limit"), clamps.get("gate_clamp_lower_limit")),
        up_clamp=(clamps.get("up_clamp_upper_limit"), clamps.get("up_clamp_lower_limit")),
    )
    out = outs[0] if store else outs
    tkg = b * s <= 96 and not cfg.get("force_cte", False)
    assert out.dtype == dtype and out.shape == (b, s, h)
    if tkg and dtype == jnp.float32:
        assert_close(out, want, dtype, reduction=max(h, i))
    else:  # the oracle rounds to bfloat16 where the kernel does (CTE computes float32 inputs in bfloat16)
        assert_close(out, want, jnp.bfloat16, ops=2)
    if store:
        assert outs[1].dtype == dtype
        assert_close(outs[1], want_add, dtype if tkg else jnp.bfloat16, ops=1)


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("skip_gate", [False, True])
def test_activations(act, skip_gate):
    x, wg, wu, wd = problem(dtype=jnp.float32)
    out = mlp(x, wg, wu, wd, activation_fn=act, skip_gate_proj=skip_gate)
    want, _ = mlp_oracle(x, wg, wu, wd, act=act, skip_gate=skip_gate)
    assert_close(out, want, jnp.float32, reduction=48)


def test_swish_is_the_sigmoid_gelu_not_silu():
    x, wg, wu, wd = problem(dtype=jnp.float64)
    swish, silu = (mlp(x, wg, wu, wd, activation_fn=fn) for fn in (ActFnType.Swish, ActFnType.SiLU))
    assert float(jnp.max(jnp.abs(swish - silu))) > 1e-3


def test_float32_cte_computes_in_bfloat16_and_output_dtype():
    x, wg, wu, wd = problem(dtype=jnp.float32)
    tkg, cte = mlp(x, wg, wu, wd), mlp(x, wg, wu, wd, force_cte_mode=True)
    assert np.array_equal(np.asarray(cte), np.asarray(cte.astype(jnp.bfloat16).astype(jnp.float32)))
    assert not np.array_equal(np.asarray(tkg), np.asarray(cte))
    wide = mlp(x.astype(jnp.bfloat16), wg, wu, wd, output_dtype=jnp.float32)
    assert wide.dtype == jnp.float32


def _fp8_problem(quant, i=40, h=48):
    """bfloat16 activations, E4M3 weights with their dequantization scales (ROW: one per output column)."""
    x, wg, wu, wd = problem(h=h, i=i, dtype=jnp.float64)
    scales, weights = {}, []
    for name, w, cols in (("gate_w_scale", wg, i), ("up_w_scale", wu, i), ("down_w_scale", wd, h)):
        w = np.asarray(w)
        per_col = np.abs(w).max(0) / 200 if quant == "row" else np.full(cols, np.abs(w).max() / 200)
        shape = (128, cols) if quant == "row" else (128, 1)
        scales[name] = jnp.asarray(np.broadcast_to(per_col[: shape[1]], shape), jnp.float32)
        weights.append(jnp.asarray((w / per_col).astype(E4M3)))
    if quant == "static":
        scales["gate_up_in_scale"] = jnp.full((128, 1), 0.025, jnp.float32)  # |normalized input| <= 4.6
        scales["down_in_scale"] = jnp.full((128, 1), 0.04, jnp.float32)  # |intermediate| <= 7.3
    return x.astype(jnp.bfloat16), weights, scales


@pytest.mark.parametrize("quant", ["row", "static"])
@pytest.mark.parametrize("force_cte", [False, True])
def test_fp8_weights_match_emulating_oracle(quant, force_cte):
    x, (wg, wu, wd), scales = _fp8_problem(quant)
    kind = QuantizationType.ROW if quant == "row" else QuantizationType.STATIC
    gamma, beta, _ = norm_args("rms", 48, jnp.bfloat16)
    clip = 6.0 if quant == "row" else 0.0
    out = mlp(
        x,
        wg,
        wu,
        wd,
        gamma,
        quantization_type=kind,
        normalization_type="RMS_NORM",
        force_cte_mode=force_cte,
        quant_clipping_bound=clip,
        **scales,
    )
    want, _ = mlp_oracle(
        x, wg, wu, wd, norm="rms", gamma=gamma, quant=quant, scales=scales, force_cte=force_cte, clip=clip
    )
    assert out.dtype == jnp.bfloat16
    assert_close(out, want, jnp.bfloat16, ops=2)


def test_fp8_cte_quantizes_activations_tkg_does_not():
    x, (wg, wu, wd), scales = _fp8_problem("row")
    tkg = mlp(x, wg, wu, wd, quantization_type="ROW", **scales)
    cte = mlp(x, wg, wu, wd, quantization_type="ROW", force_cte_mode=True, **scales)
    plain, _ = mlp_oracle(x, wg, wu, wd, quant="row", scales=scales)
    assert_close(tkg, plain, jnp.bfloat16, ops=2)
    with pytest.raises(AssertionError):  # FP8 activations cost ~2.5% (normwise) here
        assert_close(cte, plain, jnp.bfloat16, ops=2)


def test_optimized_down_layout_follows_lnc():
    x, wg, wu, wd = problem(b=1, s=2, h=512, i=32, dtype=jnp.float32)
    plain = mlp(x, wg, wu, wd)
    for lnc in (1, 2):
        swizzled = wd.reshape(32, lnc, 128, 512 // 128 // lnc).transpose(0, 1, 3, 2).reshape(32, 512)
        with jax_nkilib.config(lnc=lnc):
            out = mlp(
                x, wg, wu, swizzled, use_tkg_down_proj_optimized_layout=True, use_tkg_down_proj_column_tiling=False
            )
        assert_close(out, plain, jnp.float32, reduction=512)


def test_jit_of_the_tkg_norm_and_vmap_of_the_cte_fused_add():
    """The variants no arg spec covers (jit, vmap and nested vmap of the plain TKG and the RMS-norm CTE paths are the
    conformance suite's: arg specs mlp, mlp.rms_norm_cte)."""
    x, wg, wu, wd = problem(dtype=jnp.float32)
    fn = jax.jit(lambda a, g: mlp(a, wg, wu, wd, g, normalization_type="RMS_NORM"))
    gamma = random((1, 48), jnp.float32, 3) + 1
    assert_close(fn(x, gamma), mlp_oracle(x, wg, wu, wd, norm="rms", gamma=gamma)[0], jnp.float32, reduction=48)
    xs = jnp.stack([x, -x, 2 * x])
    cte = jax.vmap(
        lambda a, f: mlp(a, wg, wu, wd, fused_add_tensor=f, force_cte_mode=True, store_fused_add_result=True)
    )(xs, -xs)  # CTE: folded into B
    assert_close(cte[1], np.zeros(xs.shape), jnp.float32)
    assert_close(
        cte[0][2], mlp_oracle(xs[2], wg, wu, wd, fused_add=-xs[2], force_cte=True)[0], jnp.bfloat16, reduction=48
    )


# the plain TKG configuration is the conformance suite's (arg spec mlp)
CHECK_GRADS = [
    dict(norm="layer", bias=True),
    dict(norm="rms", fused_add=True, store=True),
    dict(act="GELU", clamps=True),
    dict(act="GELU_Tanh_Approx", skip_gate=True, bias=True),
    dict(act="Swish", force_cte=True, norm="rms_skip"),
]


@pytest.mark.parametrize("config", range(len(CHECK_GRADS)))
def test_gradients_float64(config):
    cfg = CHECK_GRADS[config]
    x, wg, wu, wd = problem(b=1, s=2, h=8, i=6, dtype=jnp.float64)
    gamma, beta, kind = norm_args(cfg.get("norm", "none"), 8, jnp.float64)
    bias = cfg.get("bias", False)
    extra = (
        [random((1, 6), jnp.float64, 4), random((1, 6), jnp.float64, 5), random((1, 8), jnp.float64, 6)] if bias else []
    )
    clamps = (
        dict(
            gate_clamp_upper_limit=1.3, gate_clamp_lower_limit=-1.1, up_clamp_upper_limit=0.9, up_clamp_lower_limit=-1.2
        )
        if cfg.get("clamps")
        else {}
    )
    fa = random((1, 2, 8), jnp.float64, 9) if cfg.get("fused_add") else None
    store = cfg.get("store", False)
    norm_params = [p for p in (gamma, beta) if p is not None]

    def fn(x_, wg_, wu_, wd_, *rest):
        rest = list(rest)
        g = rest.pop(0) if gamma is not None else None
        bt = rest.pop(0) if beta is not None else None
        bs = [rest.pop(0) for _ in range(3)] if bias else [None] * 3
        f = rest.pop(0) if fa is not None else None
        outs = mlp(
            x_,
            wg_,
            wu_,
            wd_,
            g,
            *bs,
            bt,
            f,
            normalization_type=kind,
            store_fused_add_result=store,
            activation_fn=cfg.get("act", "SiLU"),
            skip_gate_proj=cfg.get("skip_gate", False),
            force_cte_mode=cfg.get("force_cte", False),
            **clamps,
        )
        return (outs[0] * outs[1]) if store else outs

    args = (x, wg, wu, wd, *norm_params, *extra) + ((fa,) if fa is not None else ())
    check_grads(fn, args, order=1, modes=["rev"])


def test_fp8_scale_gradient():
    xq, (wgq, wuq, wdq), scales = _fp8_problem("row")
    loss = lambda a, s: jnp.sum(
        mlp(a, wgq, wuq, wdq, quantization_type="ROW", **dict(scales, up_w_scale=s)).astype(jnp.float32)  # noqa
    )
    dx, ds = jax.grad(loss, argnums=(0, 1))(xq, scales["up_w_scale"])
    assert dx.dtype == jnp.bfloat16 and bool(jnp.any(ds[0] != 0)) and not bool(jnp.any(ds[1:] != 0))


def test_shard_map_tensor_parallel():
    """I sharded over the devices (sharding the batch is the conformance suite's: arg spec mlp)."""
    mesh = mesh_1d("d")
    x, wg, wu, wd = problem(b=8, s=2, h=48, i=64, dtype=jnp.float32)

    def tensor_parallel(x_, wg_, wu_, wd_, gamma_):  # I sharded: each device's partial down projection, then psum
        return jax.lax.psum(mlp(x_, wg_, wu_, wd_, gamma_, normalization_type="RMS_NORM"), "d")

    gamma = random((1, 48), jnp.float32, 3) + 1
    specs = (P(), P(None, "d"), P(None, "d"), P("d", None), P())
    tp = jax.jit(jax.shard_map(tensor_parallel, mesh=mesh, in_specs=specs, out_specs=P()))
    assert_close(
        tp(*shard(mesh, specs, x, wg, wu, wd, gamma)),
        mlp_oracle(x, wg, wu, wd, norm="rms", gamma=gamma)[0],
        jnp.float32,
        reduction=64,
    )


def test_neuron_lowering_is_one_custom_call():
    from tests.support.hlo import compute_operations, kernel_configs, neuron_text

    x, wg, wu, wd = problem(b=2, s=4, h=256, i=128, dtype=jnp.bfloat16)
    fa = random((2, 4, 256), jnp.bfloat16, 5)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(
            lambda *a: mlp(*a, fused_add_tensor=fa, store_fused_add_result=True, activation_fn="GELU"), x, wg, wu, wd
        )
    (cfg,) = kernel_configs(text)
    assert compute_operations(text) == []
    assert cfg["func_name"] == "mlp" and cfg["entry_point"] == "nkilib.core.mlp.mlp:mlp"
    assert cfg["output_names"] == ["out", "add_out"] and cfg["params"]["activation_fn"] == "GELU"
    assert cfg["params"]["output_dtype"] == "bfloat16" and cfg["mac_count"] == 3 * 8 * 256 * 128
    assert cfg["input_names"][:4] == [
        "hidden_tensor",
        "gate_proj_weights_tensor",
        "up_proj_weights_tensor",
        "down_proj_weights_tensor",
    ]


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (dict(force_cte_mode=True, gate_clamp_upper_limit=1.0), "clamps run only on the TKG path"),
        (dict(activation_fn="ReLU"), "ReLU needs NKI Library 2.32"),
    ],
)
def test_neuron_limits_fall_back(flags, fragment):
    from tests.support.hlo import neuron_text

    x, wg, wu, wd = problem(b=1, s=2, h=128, i=128, dtype=jnp.bfloat16)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error"):
        with pytest.raises(Exception, match=fragment):
            neuron_text(lambda *a: mlp(*a, **flags), x, wg, wu, wd)
