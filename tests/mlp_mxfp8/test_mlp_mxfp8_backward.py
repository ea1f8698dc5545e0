"""jax_nkilib.nki.mlp_backward_mxfp8_nki against a float64 oracle of the kernel's phases (recompute, clamps,
pre-quantized copies); the reverse mode of mlp_forward_mxfp8_nki; transformations; Neuron lowering; errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import mlp_backward_mxfp8_nki, mlp_forward_mxfp8_nki
from tests.mlp_mxfp8.test_mlp_mxfp8_forward import assert_matches, oracle_forward, problem, silu
from tests.mlp_mxfp8.test_mx_operands import oracle_quantize_operand, oracle_round_trip, oracle_swizzle
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import f64

BF16 = ml_dtypes.bfloat16
NAMES = ("gate_pre", "gate_act", "up", "intermediate")
NO_CLAMPS = dict.fromkeys(
    (
        "linear_clamp_upper_limit",
        "linear_clamp_lower_limit",
        "non_linear_clamp_upper_limit",
        "non_linear_clamp_lower_limit",
    )
)


def bf(x):
    return np.asarray(x, np.float64).astype(BF16).astype(np.float64)


def clip(x, upper, lower):
    x = x if upper is None else np.minimum(x, upper)
    return x if lower is None else np.maximum(x, lower)


def window(x, upper, lower):
    mask = np.ones(x.shape, bool)
    if upper is not None:
        mask &= x < upper
    if lower is not None:
        mask &= x > lower
    return mask


def oracle_backward(dy, x, gate_up, down, checkpoints=None, clamps=NO_CLAMPS):
    """float64 ``(dX, dWgu, dWd)``: the kernel's phases 0-4 with bf16 roundings and MXFP8 operands."""
    dy, x, gate_up, down = (f64(a) for a in (dy, x, gate_up, down))
    i = gate_up.shape[0] // 2
    given = {name: None if c is None else bf(f64(c)) for name, c in zip(NAMES, checkpoints or (None,) * 4)}
    if given["gate_pre"] is None or given["up"] is None:
        projections = oracle_round_trip(x) @ oracle_round_trip(gate_up).T
        gate = bf(
            clip(projections[:, :i], clamps["non_linear_clamp_upper_limit"], clamps["non_linear_clamp_lower_limit"])
        )
        up = bf(clip(projections[:, i:], clamps["linear_clamp_upper_limit"], clamps["linear_clamp_lower_limit"]))
        given["gate_pre"] = gate if given["gate_pre"] is None else given["gate_pre"]
        given["up"] = up if given["up"] is None else given["up"]
    gate, up = given["gate_pre"], given["up"]
    act = bf(silu(gate)) if given["gate_act"] is None else given["gate_act"]
    intermediate = bf(act * up) if given["intermediate"] is None else given["intermediate"]
    d = oracle_round_trip(dy) @ oracle_round_trip(bf(down).T).T  # contraction H
    s = 1 / (1 + np.exp(-gate))
    d_gate = bf(d * bf(bf(s * (1 + gate * (1 - s))) * up))
    d_gate = d_gate * window(gate, clamps["non_linear_clamp_upper_limit"], clamps["non_linear_clamp_lower_limit"])
    d_up = bf(d * act) * window(up, clamps["linear_clamp_upper_limit"], clamps["linear_clamp_lower_limit"])
    d_gate_up = np.concatenate([d_gate, d_up], axis=1)
    dx = bf(oracle_round_trip(d_gate_up) @ oracle_round_trip(bf(gate_up).T).T)
    dw_gate_up = bf(oracle_round_trip(d_gate_up.T) @ oracle_round_trip(bf(x).T).T)
    dw_down = bf(oracle_round_trip(bf(dy).T) @ oracle_round_trip(intermediate.T).T)
    return dx, dw_gate_up, dw_down


def backward_problem(s=64, h=256, i=96, seed=0):
    x, gate_up, down = problem(s=s, h=h, i=i, seed=seed)
    dy = jnp.asarray(np.random.default_rng(seed + 100).standard_normal((s, h)), jnp.bfloat16)
    checkpoints = tuple(jnp.asarray(c, jnp.bfloat16) for c in oracle_forward(x, gate_up, down)[1:])
    return dy, x, gate_up, down, checkpoints


def assert_grads_match(grads, want, exact=0.97):
    assert [g.dtype for g in grads] == [jnp.bfloat16] * 3
    for got, expected in zip(grads, want):
        assert_matches(got, expected, jnp.bfloat16, exact)


@pytest.mark.parametrize("saved", [NAMES, (), ("gate_pre", "intermediate"), ("up", "gate_act")])
def test_matches_oracle_with_checkpoints_or_recompute(saved):
    dy, x, gate_up, down, checkpoints = backward_problem()
    given = {name: c for name, c in zip(NAMES, checkpoints) if name in saved}
    grads = mlp_backward_mxfp8_nki(dy, x, down, gate_up, **given)
    assert [g.shape for g in grads] == [(64, 256), (192, 256), (256, 96)]
    want = oracle_backward(dy, x, gate_up, down, tuple(given.get(name) for name in NAMES))
    assert_grads_match(grads, want)


@pytest.mark.parametrize("recompute", [False, True])
def test_clamp_limits(recompute):
    dy, x, gate_up, down, checkpoints = backward_problem(seed=1)
    clamps = dict(
        linear_clamp_upper_limit=0.5,
        linear_clamp_lower_limit=-0.75,
        non_linear_clamp_upper_limit=1.0,
        non_linear_clamp_lower_limit=None,
    )
    given = {} if recompute else dict(zip(NAMES, checkpoints))
    grads = mlp_backward_mxfp8_nki(dy, x, down, gate_up, **given, **clamps)
    want = oracle_backward(dy, x, gate_up, down, tuple(given.get(name) for name in NAMES), clamps)
    assert_grads_match(grads, want)
    unclamped = mlp_backward_mxfp8_nki(dy, x, down, gate_up, **given)
    assert not np.array_equal(np.asarray(grads[0], np.float32), np.asarray(unclamped[0], np.float32))


def test_float32_inputs_and_odd_sizes():
    dy, x, gate_up, down, checkpoints = backward_problem(s=32, h=96, i=48, seed=2)
    args = [a.astype(jnp.float32) for a in (dy, x, gate_up, down)]
    grads = mlp_backward_mxfp8_nki(*args[:2], args[3], args[2])  # recomputes everything from float32 inputs
    assert_grads_match(grads, oracle_backward(*args))


def test_pre_quantized_copies_give_the_raw_results():
    dy, x, gate_up, down, checkpoints = backward_problem(s=64, h=256, i=96, seed=3)
    raw = mlp_backward_mxfp8_nki(dy, x, down, gate_up, *([None] * 9), *checkpoints)
    for packed in (False, True):
        copies = {}
        for name, value in (
            ("gate_up_weight_T", gate_up.T),
            ("down_weight_T", down.T),
            ("output_grad_T", dy.T),
            ("hidden_states_T", x.T),
            ("gate_up_weights", gate_up),
        ):
            words, scales = oracle_quantize_operand(np.asarray(value, np.float32), packed)
            copies[name], copies[f"{name}_scales"] = jnp.asarray(words), jnp.asarray(scales)
        got = mlp_backward_mxfp8_nki(dy, x, **copies, **dict(zip(NAMES, checkpoints)))
        for g, w in zip(got, raw):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_forward_vjp_is_the_backward_kernel_and_approximates_the_gradient():
    dy, x, gate_up, down, checkpoints = backward_problem(s=64, h=256, i=96, seed=4)
    out, pullback = jax.vjp(mlp_forward_mxfp8_nki, x, gate_up, down)
    grads = pullback(dy)
    assert_grads_match(grads, oracle_backward(dy, x, gate_up, down, checkpoints))

    def exact(a, b, c):  # the unquantized SwiGLU MLP in float64
        i = b.shape[0] // 2
        return (jax.nn.silu(a @ b[:i].T) * (a @ b[i:].T)) @ c.T

    wide = [jnp.asarray(a, jnp.float64) for a in (x, gate_up, down, dy)]
    true = jax.vjp(exact, *wide[:3])[1](wide[3])
    for got, want in zip(grads, true):
        error = np.linalg.norm(f64(got) - np.asarray(want)) / np.linalg.norm(np.asarray(want))
        assert error < 0.1, f"MXFP8 gradient is {error:.3f} away from the exact one"
    # a pre-swizzled operand gets its gradient swizzled; a pre-quantized one gets none (the others still do)
    swizzled = jnp.asarray(oracle_swizzle(np.asarray(x, np.float32).T), jnp.bfloat16)
    swizzled_grads = jax.vjp(
        lambda a, b, c: mlp_forward_mxfp8_nki(a, b, c, hidden_is_swizzled=True), swizzled, gate_up, down
    )[1](dy)
    np.testing.assert_array_equal(
        np.asarray(swizzled_grads[0], np.float32), oracle_swizzle(np.asarray(grads[0], np.float32).T)
    )
    for got, want in zip(swizzled_grads[1:], grads[1:]):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    words, scales = (jnp.asarray(a) for a in oracle_quantize_operand(np.asarray(down, np.float32)))
    fn = lambda a, b: mlp_forward_mxfp8_nki(a, b, words, down_scales=scales)  # noqa: E731
    dx, dw = jax.vjp(fn, x, gate_up)[1](dy)
    assert dx.shape == x.shape and dw.shape == gate_up.shape and np.all(np.isfinite(np.asarray(dx, np.float32)))
    with_checkpoint = jax.grad(
        lambda a: jnp.sum(mlp_forward_mxfp8_nki(a, gate_up, down, save_up=True)[1].astype(jnp.float32))
    )(x)
    assert not np.any(np.asarray(with_checkpoint, np.float32))


def test_neuron_lowering():
    dy, x, gate_up, down, checkpoints = backward_problem(s=256, h=256, i=128, seed=6)
    call = lambda *a, **k: mlp_backward_mxfp8_nki(*a, run_with_lnc2=False, **k)  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda *a: call(*a[:4], gate_pre=a[4], up=a[5]), dy, x, down, gate_up, *checkpoints[::2])
        (cfg,) = kernel_configs(text)
        assert compute_operations(text) == []
        assert cfg["entry_point"] == "jax_nkilib_kernels.mxfp8:mlp_backward_mxfp8_nki"
        assert cfg["output_names"] == ["hidden_states_grad", "gate_up_weight_grad", "down_proj_weight_grad"]
        assert cfg["params"]["non_linear_clamp_upper_limit"] is None
        with pytest.warns(NeuronFallbackWarning, match="run_with_lnc2=True needs LNC=2"):
            neuron_text(mlp_backward_mxfp8_nki, dy, x, down, gate_up)
        small = backward_problem(s=96, h=256, i=128, seed=7)
        with pytest.warns(NeuronFallbackWarning, match="S=96 must be a multiple of 128"):
            neuron_text(call, small[0], small[1], small[3], small[2])
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        assert len(kernel_configs(neuron_text(mlp_backward_mxfp8_nki, dy, x, down, gate_up))) == 1


def _bad(**changes):
    def build():
        x, gate_up, down = problem(s=32, h=64, i=32)
        args = dict(output_grad=x, hidden_states=x, down_proj_weight=down, gate_up_weights=gate_up)
        return dict(args, **{k: v() for k, v in changes.items()})

    return build


BAD = [
    (_bad(gate_up_weights=lambda: None), TypeError, "missing required tensor argument `gate_up_weights`"),
    (_bad(down_proj_weight=lambda: None), ValueError, "give `down_proj_weight`"),
    (
        _bad(down_weight_T=lambda: jnp.zeros((16, 32), jnp.uint32)),
        ValueError,
        "`down_weight_T` .* and `down_weight_T_scales` go together",
    ),
    (
        _bad(
            gate_up_weights=lambda: jnp.zeros((16, 64), jnp.uint32),
            gate_up_weights_scales=lambda: jnp.zeros((16, 64), jnp.uint8),
        ),
        ValueError,
        "pre-quantized `gate_up_weights` cannot be transposed",
    ),
    (
        _bad(gate_pre=lambda: jnp.zeros((32, 16), jnp.bfloat16)),
        ValueError,
        r"argument `gate_pre` must have layout \[S, I\] with I=32",
    ),
    (_bad(output_grad=lambda: jnp.zeros((16, 64), jnp.bfloat16)), ValueError, r"`hidden_states` must have layout"),
    (
        _bad(
            output_grad_T=lambda: jnp.zeros((16, 64), jnp.uint32),
            output_grad_T_scales=lambda: jnp.zeros((16, 64), jnp.uint8),
        ),
        ValueError,
        r"`output_grad_T` must have layout \[S/4, H\] uint32 .* with S=32",
    ),
    (_bad(output_grad=lambda: jnp.zeros((32, 64), jnp.int32)), TypeError, "argument `output_grad`"),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    build, error, fragment = case
    with pytest.raises(error, match=fragment):
        mlp_backward_mxfp8_nki(**build())
