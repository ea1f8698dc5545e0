"""jax_nkilib.nki.mlp with quantization_type=STATIC_MX (CTE: FP8 tensor-scaled weights in the kernel's swizzles)
against a float64 NumPy oracle that un-swizzles the weights with explicit index formulas; ROW_MX stays rejected."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.nki import mlp
from tests.mlp.test_mlp_kernel import ACTS, _f64, _quantize, _round
from tests.support.data import random
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

H = INTER = 512
BF16 = np.dtype(jnp.bfloat16)


def gate_up_position(h, i, hidden, inter):
    """Flat position in the swizzled [H, I] array of W[h, i]: W.reshape(2, H/512, 128, 2, I/512, 128, 4)
    .transpose(2, 1, 4, 6, 5, 0, 3), i.e. index (p, t, k, j, r, a, b) with h = a H/2 + 256 t + 2 p + b,
    i = 512 k + 4 r + j."""
    a, rem = divmod(h, hidden // 2)
    t, rem = divmod(rem, 256)
    p, b = divmod(rem, 2)
    k, rem = divmod(i, 512)
    r, j = divmod(rem, 4)
    return (((((p * (hidden // 512) + t) * (inter // 512) + k) * 4 + j) * 128 + r) * 2 + a) * 2 + b


def down_position(i, h, inter, hidden):
    """Flat position of W[i, h] in W.reshape(I/512, 128, 4, H).transpose(1, 0, 3, 2): index (q, k, h, j) with
    i = 512 k + 4 q + j."""
    k, rem = divmod(i, 512)
    q, j = divmod(rem, 4)
    return ((q * (inter // 512) + k) * hidden + h) * 4 + j


def swizzle(w, position):
    rows, cols = w.shape
    r, c = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    out = np.empty(rows * cols, w.dtype)
    out[position(r, c, rows, cols).reshape(-1)] = w.reshape(-1)
    return out.reshape(rows, cols)


def problem(b=2, s=3, fmt=ml_dtypes.float8_e4m3, seed=0):
    """bfloat16 hidden states, dense FP8 weights and their swizzles, tensor dequantization and input scales."""
    x = random((b, s, H), jnp.bfloat16, seed)
    dense, scales = {}, {}
    for name, shape in (("gate", (H, INTER)), ("up", (H, INTER)), ("down", (INTER, H))):
        w = np.asarray(random(shape, jnp.float64, seed + len(dense) + 1, 0.05))
        d = np.abs(w).max() / 200
        dense[name] = (w / d).astype(fmt)
        scales[f"{name}_w_scale"] = jnp.full((128, 1), d, jnp.float32)
    scales["gate_up_in_scale"] = jnp.full((128, 1), 0.02, jnp.float32)  # |hidden| <= 4.8
    scales["down_in_scale"] = jnp.full((128, 1), 0.04, jnp.float32)  # |intermediate| <= 9.6
    swizzled = (
        jnp.asarray(swizzle(dense["gate"], gate_up_position)),
        jnp.asarray(swizzle(dense["up"], gate_up_position)),
        jnp.asarray(swizzle(dense["down"], down_position)),
    )
    return x, dense, swizzled, scales


def oracle(
    x,
    dense,
    scales,
    *,
    gamma=None,
    gate_b=None,
    up_b=None,
    down_b=None,
    fused_add=None,
    act="SiLU",
    skip_gate=False,
    eps=1e-6,
):
    """STATIC on the dense weights, CTE rounding points, raw projections rounded to bfloat16 (the PSUM dtype)."""
    io = np.dtype(x.dtype)
    compute = BF16 if io == np.float32 else io
    v = _f64(x) if fused_add is None else _f64(x) + _f64(fused_add)
    v = _round(v, compute)
    add_out = v.astype(io)
    if gamma is not None:
        v = _round(v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * _f64(gamma).reshape(-1), compute)

    def proj(a, a_scale, w, w_scale, bias):
        y = _round(a @ w.astype(np.float64), BF16) * float(np.asarray(w_scale)[0, 0]) * a_scale
        return y if bias is None else y + _round(_f64(bias).reshape(-1), compute)

    a, a_scale = _quantize(v, "static", dense["up"].dtype, scales["gate_up_in_scale"], 0.0, compute)
    up = proj(a, a_scale, dense["up"], scales["up_w_scale"], up_b)
    h = ACTS[act](up) if skip_gate else ACTS[act](proj(a, a_scale, dense["gate"], scales["gate_w_scale"], gate_b)) * up
    h, h_scale = _quantize(_round(h, compute), "static", dense["down"].dtype, scales["down_in_scale"], 0.0, compute)
    return _round(proj(h, h_scale, dense["down"], scales["down_w_scale"], down_b), compute).astype(io), add_out


CONFIGS = [
    dict(),
    dict(norm=True, bias=True),
    dict(skip_gate=True, fused_add=True, act="GELU"),
    dict(tokens=(1, 100)),
    dict(fmt="e4m3fn", norm=True),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("config", range(len(CONFIGS)))
def test_matches_oracle(dtype, config):
    cfg = CONFIGS[config]
    b, s = cfg.get("tokens", (2, 3))
    fmt = ml_dtypes.float8_e4m3fn if cfg.get("fmt") == "e4m3fn" else ml_dtypes.float8_e4m3
    x, dense, (wg, wu, wd), scales = problem(b, s, fmt)
    x = x.astype(dtype)
    gamma = random((1, H), dtype, 7, 0.3) + 1 if cfg.get("norm") else None
    biases = (
        (random((1, INTER), dtype, 4, 0.3), random((1, INTER), dtype, 5, 0.3), random((1, H), dtype, 6, 0.3))
        if cfg.get("bias")
        else (None, None, None)
    )
    fa = random((b, s, H), dtype, 9) if cfg.get("fused_add") else None
    outs = mlp(
        x,
        wg,
        wu,
        wd,
        gamma,
        *biases,
        None,
        fa,
        quantization_type="STATIC_MX",
        force_cte_mode=b * s <= 96,
        normalization_type="RMS_NORM" if gamma is not None else "NO_NORM",
        store_fused_add_result=fa is not None,
        activation_fn=cfg.get("act", "SiLU"),
        skip_gate_proj=cfg.get("skip_gate", False),
        **scales,
    )
    want, want_add = oracle(
        x,
        dense,
        scales,
        gamma=gamma,
        gate_b=biases[0],
        up_b=biases[1],
        down_b=biases[2],
        fused_add=fa,
        act=cfg.get("act", "SiLU"),
        skip_gate=cfg.get("skip_gate", False),
    )
    out = outs[0] if fa is not None else outs
    assert out.dtype == dtype and out.shape == (b, s, H)
    assert_close(out, want, jnp.bfloat16, ops=3)
    if fa is not None:
        assert_close(outs[1], want_add, jnp.bfloat16, ops=1)


def test_swizzle_is_read_and_matches_static_on_dense_weights():
    x, dense, (wg, wu, wd), scales = problem()
    static_mx = mlp(x, wg, wu, wd, quantization_type="STATIC_MX", force_cte_mode=True, **scales)
    dense_w = [jnp.asarray(dense[n]) for n in ("gate", "up", "down")]
    static = mlp(x, *dense_w, quantization_type="STATIC", force_cte_mode=True, **scales)
    assert_close(static_mx, static, jnp.bfloat16, ops=3)
    unswizzled = mlp(x, *dense_w, quantization_type="STATIC_MX", force_cte_mode=True, **scales)
    with pytest.raises(AssertionError):
        assert_close(unswizzled, static, jnp.bfloat16, ops=3)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_jit_vmap_and_straight_through_gradients():
    x, dense, (wg, wu, wd), scales = problem()
    fn = jax.jit(lambda a: mlp(a, wg, wu, wd, quantization_type="STATIC_MX", force_cte_mode=True, **scales))
    assert_close(fn(x), oracle(x, dense, scales)[0], jnp.bfloat16, ops=3)
    xs = jnp.stack([x, -x])
    batched = jax.vmap(fn)(xs)
    assert_close(batched[1], oracle(-x, dense, scales)[0], jnp.bfloat16, ops=3)
    in_scales = jnp.stack([scales["down_in_scale"], 2 * scales["down_in_scale"]])
    partial = jax.vmap(
        lambda s_: mlp(
            x, wg, wu, wd, quantization_type="STATIC_MX", force_cte_mode=True, **dict(scales, down_in_scale=s_)
        )
    )(in_scales)
    assert_close(partial[1], oracle(x, dense, dict(scales, down_in_scale=in_scales[1]))[0], jnp.bfloat16, ops=3)
    nested = jax.vmap(jax.vmap(fn))(jnp.stack([xs, 2 * xs]))
    assert_close(nested[1, 1], oracle(-2 * x, dense, scales)[0], jnp.bfloat16, ops=3)

    # Straight through: the gradient is that of the unquantized MLP on the dequantized dense weights
    x64 = x.astype(jnp.float64)
    deq = [
        jnp.asarray(dense[n].astype(np.float64)) * float(scales[f"{n}_w_scale"][0, 0]) for n in ("gate", "up", "down")
    ]
    ct = random(x.shape, jnp.float64, 11)
    loss = lambda a, sc: jnp.sum(
        mlp(
            a,
            wg,
            wu,
            wd,
            quantization_type="STATIC_MX",
            force_cte_mode=True,  # noqa
            **dict(scales, up_w_scale=sc),
        )
        * ct
    )
    plain = jax.grad(lambda a: jnp.sum(mlp(a, *deq, force_cte_mode=True) * ct))
    dx, dscale = jax.grad(loss, argnums=(0, 1))(x64, scales["up_w_scale"])
    assert_close(dx, plain(x64), jnp.float64, reduction=H)
    assert bool(jnp.any(dscale[0] != 0)) and not bool(jnp.any(dscale[1:] != 0))
    grads = jax.vmap(jax.grad(lambda a: loss(a, scales["up_w_scale"])))(jnp.stack([x64, 2 * x64]))
    assert_close(grads[1], plain(2 * x64), jnp.float64, reduction=H)


def test_shard_map_over_tokens():
    mesh = mesh_1d("d")
    x, dense, weights, scales = problem(b=8, s=2)
    names = tuple(scales)
    specs = (P("d"), P(), P(), P()) + (P(),) * len(names)

    def body(x_, wg_, wu_, wd_, *sc):
        return mlp(x_, wg_, wu_, wd_, quantization_type="STATIC_MX", force_cte_mode=True, **dict(zip(names, sc)))

    sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P("d")))
    out = sharded(*shard(mesh, specs, x, *weights, *(scales[n] for n in names)))
    assert_close(out, oracle(x, dense, scales)[0], jnp.bfloat16, ops=3)


def test_neuron_lowering_is_one_custom_call():
    from tests.support.hlo import compute_operations, kernel_configs, neuron_text

    x, _, weights, scales = problem(b=1, s=128)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda *a: mlp(*a, quantization_type="STATIC_MX", **scales), x, *weights)
    (cfg,) = kernel_configs(text)
    assert compute_operations(text) == []
    assert cfg["func_name"] == "mlp" and cfg["params"]["quantization_type"] == "STATIC_MX"
    assert cfg["output_names"] == ["out"]


def _bad(**overrides):
    x, _, (wg, wu, wd), scales = problem()
    args = dict(
        dict(
            hidden_tensor=x,
            gate_proj_weights_tensor=wg,
            up_proj_weights_tensor=wu,
            down_proj_weights_tensor=wd,
            quantization_type="STATIC_MX",
            force_cte_mode=True,
            **scales,
        ),
        **overrides,
    )
    return lambda: mlp(**{k: v for k, v in args.items() if v is not None})


@pytest.mark.parametrize(
    "make, error, fragments",
    [
        (lambda: _bad(force_cte_mode=False), ValueError, ["STATIC_MX", "only on the CTE path", "B*S=6"]),
        (lambda: _bad(gate_up_in_scale=None), ValueError, ["needs gate_up_in_scale", "[128, 1]"]),
        (lambda: _bad(up_w_scale=jnp.ones((128, INTER), jnp.float32)), ValueError, ["`up_w_scale`", "[128, 1]"]),
        (
            lambda: _bad(down_proj_weights_tensor=jnp.zeros((INTER, H), jnp.bfloat16)),
            TypeError,
            ["STATIC_MX", "float8_e4m3", "down_proj_weights_tensor"],
        ),
        (
            lambda: _bad(
                hidden_tensor=jnp.zeros((2, 3, 256), jnp.bfloat16),
                gate_proj_weights_tensor=jnp.zeros((256, 512), jnp.float8_e4m3),
                up_proj_weights_tensor=jnp.zeros((256, 512), jnp.float8_e4m3),
                down_proj_weights_tensor=jnp.zeros((512, 256), jnp.float8_e4m3),
            ),
            ValueError,
            ["STATIC_MX", "H % 512 == 0", "[128, H/512, I/512, 4, 128, 2, 2]", "H=256"],
        ),
        (lambda: _bad(quantization_type="ROW_MX"), ValueError, ["ROW_MX", "not bound", "2.29"]),
    ],
)
def test_bad_inputs(make, error, fragments):
    with pytest.raises(error) as info:
        make()()
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
