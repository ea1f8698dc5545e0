"""jax_nkilib.nki.mlp_forward_mxfp8_nki against a float64 oracle of the kernel's MXFP8 datapath; operand forms;
transformations; Neuron lowering (forward + VJP = the two kernels); errors.

The ``oracle_*`` and ``problem`` helpers are shared with the backward kernel's tests.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import mlp_forward_mxfp8_nki
from tests.mlp_mxfp8.test_mx_operands import oracle_quantize_operand, oracle_round_trip, oracle_swizzle
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close

CHECKPOINTS = dict(save_gate_pre=True, save_gate_act=True, save_up=True, save_hidden=True)


def rounder(dtype):
    return lambda v: np.asarray(v, np.float64).astype(dtype).astype(np.float64)


def silu(x):
    return x / (1 + np.exp(-x))


def oracle_forward(x, gate_up, down, dtype=ml_dtypes.bfloat16):
    """float64 ``(out, gate_pre, gate_act, up, intermediate)``: MXFP8 operands (wrapX, emax 7) along each matmul's
    contraction, exact products and sums, ``dtype`` roundings of the intermediate, output and checkpoints."""
    r = rounder(dtype)
    i = np.shape(gate_up)[0] // 2
    projections = oracle_round_trip(x) @ oracle_round_trip(gate_up).T
    gate, up = projections[:, :i], projections[:, i:]
    intermediate = r(silu(gate) * up)
    out = r(oracle_round_trip(intermediate) @ oracle_round_trip(down).T)
    return out, r(gate), r(silu(gate)), r(up), intermediate


def problem(s=24, h=640, i=160, dtype=jnp.bfloat16, seed=0):
    """``(hidden [S, H], gate_up_weights [2I, H], down_weights [H, I])`` with unit-scale activations."""
    rng = np.random.default_rng(seed)
    return (
        jnp.asarray(rng.standard_normal((s, h)), dtype),
        jnp.asarray(rng.standard_normal((2 * i, h)) / np.sqrt(h), dtype),
        jnp.asarray(rng.standard_normal((h, i)) / np.sqrt(i), dtype),
    )


def assert_matches(actual, expected, dtype, exact=0.98):
    """Close everywhere and, in a 16-bit dtype, bit-identical on most entries (the rest: float32-vs-float64 sums
    flipping a rounding)."""
    actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
    assert actual.shape == expected.shape
    if np.dtype(dtype).itemsize == 2:
        assert np.mean(actual == expected) >= exact, f"only {np.mean(actual == expected):.3f} are bit-identical"
    assert_close(actual, expected, dtype, ops=2)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_matches_oracle_with_checkpoints(dtype):
    args = problem(dtype=dtype)
    outs = mlp_forward_mxfp8_nki(*args, **CHECKPOINTS, dtype=dtype)
    assert [o.shape for o in outs] == [(24, 640)] + [(24, 160)] * 4 and all(o.dtype == dtype for o in outs)
    for out, want in zip(outs, oracle_forward(*args, dtype=np.dtype(dtype))):
        assert_matches(out, want, dtype)
    # the default call returns only the output; a subset of flags returns those checkpoints in the kernel's order
    np.testing.assert_array_equal(
        np.asarray(mlp_forward_mxfp8_nki(*args, dtype=dtype), np.float32), np.asarray(outs[0], np.float32)
    )
    some = mlp_forward_mxfp8_nki(*args, save_up=True, save_gate_pre=True, dtype=dtype)
    for got, want in zip(some, (outs[0], outs[1], outs[3])):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_odd_sizes_and_float16_output():
    args = problem(s=3, h=96, i=32, dtype=jnp.float32, seed=1)  # one 96-wide swizzle tile; S odd
    out = mlp_forward_mxfp8_nki(*args, dtype=jnp.float16)
    assert out.dtype == jnp.float16
    assert_matches(out, oracle_forward(*args, dtype=np.float16)[0], jnp.float16)


def test_pre_swizzled_and_pre_quantized_operands_give_the_raw_results():
    x, gate_up, down = problem(s=8, h=256, i=160, seed=2)
    raw = mlp_forward_mxfp8_nki(x, gate_up, down, save_hidden=True)
    swizzled = [jnp.asarray(oracle_swizzle(np.asarray(a, np.float32).T), jnp.bfloat16) for a in (x, gate_up, down)]
    flags = dict(hidden_is_swizzled=True, gate_up_is_swizzled=True, down_is_swizzled=True)
    for got, want in zip(mlp_forward_mxfp8_nki(*swizzled, save_hidden=True, **flags), raw):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    for packed in (False, True):
        (xw, xs), (gw, gs), (dw, ds) = (
            oracle_quantize_operand(np.asarray(a, np.float32), packed) for a in (x, gate_up, down)
        )
        got = mlp_forward_mxfp8_nki(xw, gw, dw, hidden_scales=xs, gate_up_scales=gs, down_scales=ds, save_hidden=True)
        for g, w in zip(got, raw):
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    mixed = mlp_forward_mxfp8_nki(
        x, swizzled[1], jnp.asarray(dw), down_scales=jnp.asarray(ds), gate_up_is_swizzled=True
    )
    np.testing.assert_array_equal(np.asarray(mixed, np.float32), np.asarray(raw[0], np.float32))


def test_vmap_of_the_activations_folds_into_s():
    x, gate_up, down = problem(s=8, h=128, i=64, seed=3)
    fn = lambda a, b, c: mlp_forward_mxfp8_nki(a, b, c, save_gate_act=True)  # noqa: E731
    xs = jnp.stack([x, -x, 2 * x])
    batched = jax.vmap(fn, in_axes=(0, None, None))(xs, gate_up, down)  # folds into S
    assert "while" not in str(jax.make_jaxpr(jax.vmap(fn, in_axes=(0, None, None)))(xs, gate_up, down))
    for k in range(3):
        for got, want in zip(batched, fn(xs[k], gate_up, down)):
            np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(want, np.float32))


def test_neuron_lowering_forward_and_vjp_are_the_two_kernels():
    x, gate_up, down = problem(s=256, h=256, i=128, seed=5)

    def forward_and_vjp(a, b, c):
        out, pullback = jax.vjp(mlp_forward_mxfp8_nki, a, b, c)
        return out, pullback(out)

    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(forward_and_vjp, x, gate_up, down)
        forward, backward = kernel_configs(text)
        assert compute_operations(text) == []
        assert forward["func_name"] == "mlp_forward_mxfp8_nki" and forward["grid"] == 2
        assert forward["entry_point"] == "jax_nkilib_kernels.mxfp8:mlp_forward_mxfp8_nki"
        assert forward["output_names"] == ["output", "gate_pre", "gate_act", "up", "intermediate"]
        assert backward["func_name"] == "mlp_backward_mxfp8_nki"
        assert backward["input_names"] == [
            "output_grad",
            "hidden_states",
            "down_proj_weight",
            "gate_up_weights",
            "gate_pre",
            "gate_act",
            "up",
            "intermediate",
        ]
        (plain,) = kernel_configs(neuron_text(mlp_forward_mxfp8_nki, x, gate_up, down))
        assert plain["output_names"] == ["output"] and plain["params"]["dtype"] == "bfloat16"
    with jax_nkilib.neuron.dry_run():  # LNC=1
        with pytest.warns(NeuronFallbackWarning, match="run_with_lnc2=True needs LNC=2; got LNC=1"):
            assert kernel_configs(neuron_text(mlp_forward_mxfp8_nki, x, gate_up, down)) == []
        single = lambda a, b, c: mlp_forward_mxfp8_nki(a, b, c, run_with_lnc2=False)  # noqa: E731
        assert len(kernel_configs(neuron_text(single, x, gate_up, down))) == 1
        with pytest.warns(NeuronFallbackWarning, match=r"bfloat16 operands; got hidden \(float32\)"):
            neuron_text(single, x.astype(jnp.float32), gate_up, down)
        small = problem(s=8, h=96, i=128, seed=6)
        with pytest.warns(NeuronFallbackWarning, match="H=96 must be a multiple of 128"):
            neuron_text(single, *small)
        swizzled = jnp.asarray(oracle_swizzle(np.asarray(small[0], np.float32).T), jnp.bfloat16)
        pre = lambda a, b, c: mlp_forward_mxfp8_nki(a, b, c, run_with_lnc2=False, hidden_is_swizzled=True)  # noqa
        with pytest.warns(NeuronFallbackWarning, match="unswizzled `gate_up_weights`"):
            neuron_text(pre, swizzled, *small[1:])


def _bad(**changes):
    def build():
        x, gate_up, down = problem(s=4, h=64, i=32)
        return dict(dict(hidden=x, gate_up_weights=gate_up, down_weights=down), **{k: v() for k, v in changes.items()})

    return build


BAD = [
    (_bad(hidden=lambda: jnp.zeros((1, 4, 64))), ValueError, "argument `hidden` must have layout"),
    (_bad(gate_up_weights=lambda: jnp.zeros((63, 64))), ValueError, r"`gate_up_weights` must have layout \[2\*I, H\]"),
    (_bad(hidden=lambda: jnp.zeros((4, 96))), ValueError, r"`gate_up_weights` must have layout \[2\*I, H\] with H=96"),
    (
        _bad(
            hidden=lambda: jnp.zeros((12, 16), jnp.bfloat16),
            gate_up_weights=lambda: jnp.zeros((64, 48)),
            down_weights=lambda: jnp.zeros((48, 32)),
            hidden_is_swizzled=lambda: True,
        ),
        ValueError,
        "contraction H=48 of the swizzled `hidden`.* multiple of 32",
    ),
    (_bad(hidden=lambda: jnp.zeros((4, 64), jnp.int32)), TypeError, "argument `hidden`"),
    (
        _bad(hidden=lambda: jnp.zeros((16, 4), jnp.uint32), hidden_scales=lambda: jnp.zeros((16, 4), jnp.float32)),
        TypeError,
        "argument `hidden_scales` must have dtype",
    ),
    (
        _bad(hidden=lambda: jnp.zeros((16, 4), jnp.float32), hidden_scales=lambda: jnp.zeros((16, 4), jnp.uint8)),
        TypeError,
        r"argument `hidden` \(pre-quantized, layout \[H/4, S\] uint32",
    ),
    (
        _bad(hidden=lambda: jnp.zeros((16, 4), jnp.uint32), hidden_scales=lambda: jnp.zeros((8, 4), jnp.uint8)),
        ValueError,
        r"`hidden_scales` must be \[H/4, S\] or packed",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    build, error, fragment = case
    with pytest.raises(error, match=fragment):
        mlp_forward_mxfp8_nki(**build())


def test_bad_flags():
    x, gate_up, down = problem(s=4, h=64, i=32)
    with pytest.raises(TypeError, match="dtype must be one of"):
        mlp_forward_mxfp8_nki(x, gate_up, down, dtype=jnp.int8)
    with pytest.raises(TypeError, match="fp8_x4_dtype must be float8_e4m3fn or float8_e5m2"):
        mlp_forward_mxfp8_nki(x, gate_up, down, fp8_x4_dtype=jnp.float16)
    with pytest.raises(ValueError, match="gate_up_tiles_m must be >= 1"):
        mlp_forward_mxfp8_nki(x, gate_up, down, gate_up_tiles_m=0)
    words, scales = oracle_quantize_operand(np.asarray(x, np.float32))
    with pytest.raises(ValueError, match="give either `hidden_scales`.*not both"):
        mlp_forward_mxfp8_nki(
            jnp.asarray(words), gate_up, down, hidden_scales=jnp.asarray(scales), hidden_is_swizzled=True
        )
    with pytest.raises(ValueError, match=r"`hidden` must have layout \[H/4, 4\*S\] \(wrapX swizzled\)"):
        mlp_forward_mxfp8_nki(jnp.zeros((16, 6), jnp.bfloat16), gate_up, down, hidden_is_swizzled=True)
