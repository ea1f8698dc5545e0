"""jax_nkilib.nki.linear_scan against a float64 NumPy sequential loop: any leading dimensions, the kernel's tiled
bfloat16 numerics (the carry between 2048-column tiles rounded), the kernel-run adjoint recurrence, vmap, Neuron
lowering and errors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.nki import linear_scan
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64

TILE = 2048  # the kernel's column tile (experimental/scan/linear_scan.py F_TILE_SIZE)


def loop_oracle(decay, data, initial=None):
    """``result[t] = decay[t] * result[t - 1] + data[t]`` by a float64 loop; ``(result, final_state)``."""
    decay, data = f64(decay), f64(data)
    state = np.zeros(decay.shape[:-1]) if initial is None else f64(initial)[..., 0]
    result = np.empty_like(decay)
    for t in range(decay.shape[-1]):
        state = decay[..., t] * state + data[..., t]
        result[..., t] = state
    return result, state[..., None]


def inputs(shape, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    decay = jnp.asarray(rng.uniform(0.5, 1.0, shape), dtype)
    data = jnp.asarray(rng.standard_normal(shape), dtype)
    initial = jnp.asarray(rng.standard_normal(shape[:-1] + (1,)), dtype)
    return decay, data, initial


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "shape, with_initial",
    [((5, 37), True), pytest.param((2, 3, 129), False, marks=pytest.mark.slow), ((2, 2, 3, 7), False)],
)
def test_forward_matches_float64_loop(shape, with_initial, dtype):
    decay, data, initial = inputs(shape, dtype, seed=sum(shape))
    result, final = linear_scan(decay, data, initial if with_initial else None)
    assert result.shape == shape and result.dtype == dtype
    assert final.shape == shape[:-1] + (1,) and final.dtype == jnp.float32
    want, want_final = loop_oracle(decay, data, initial if with_initial else None)
    assert_close(result, want, dtype, reduction=shape[-1])
    assert_close(final, want_final, dtype, reduction=shape[-1])
    np.testing.assert_array_equal(final[..., 0], result[..., -1].astype(jnp.float32))  # the last output, widened


@pytest.mark.slow  # CI: the bfloat16 test below spans tiles
def test_long_sequence_spans_tiles():
    decay, data, initial = inputs((3, 2 * TILE + 77), seed=4)
    result, final = linear_scan(decay, data, initial)
    want, want_final = loop_oracle(decay, data, initial)
    assert_close(result, want, jnp.float32, reduction=64)
    assert_close(final, want_final, jnp.float32, reduction=64)


def test_bfloat16_carry_between_tiles_is_rounded():
    """With decay 1 and quarter-integer data the float32 state is exact: only bfloat16 roundings differ. The output
    equals the kernel's model (a float32 loop per tile, the carry the tile's last rounded output) bit for bit."""
    rng = np.random.default_rng(0)
    length = 2 * TILE + 50
    data = (rng.integers(0, 8, (2, length)) / 4).astype(ml_dtypes.bfloat16)
    decay = np.ones((2, length), ml_dtypes.bfloat16)
    result, final = linear_scan(jnp.asarray(decay), jnp.asarray(data))
    model = np.empty((2, length), ml_dtypes.bfloat16)
    carry = np.zeros(2, np.float32)
    for start in range(0, length, TILE):
        sums = carry[:, None] + np.cumsum(data[:, start : start + TILE].astype(np.float32), axis=1)
        model[:, start : start + TILE] = sums.astype(ml_dtypes.bfloat16)
        carry = model[:, min(start + TILE, length) - 1].astype(np.float32)
    np.testing.assert_array_equal(np.asarray(result).view(np.uint16), model.view(np.uint16))
    np.testing.assert_array_equal(np.asarray(final)[:, 0], carry)


@pytest.mark.slow  # CI: the conformance suite's first-order check_grads and the adjoint test below
def test_gradients_float64_with_and_without_initial():
    decay, data, initial = inputs((2, 3, 11), jnp.float64, seed=2)
    check_grads(linear_scan, (decay, data, initial), order=2, modes=["rev"])  # the adjoint's adjoint too
    check_grads(lambda a, b: linear_scan(a, b)[1], (decay, data), order=1, modes=["rev"])


def test_gradient_matches_the_adjoint_loop():
    """d data = lam with lam[t] = g[t] + decay[t + 1] lam[t + 1] (+ g_final at the end); d decay[t] =
    lam[t] result[t - 1]; d initial = decay[0] lam[0], all from a float64 loop."""
    decay, data, initial = inputs((4, 30), seed=3)
    g, g_final = np.random.default_rng(5).standard_normal((4, 30)), np.random.default_rng(6).standard_normal((4, 1))
    _, pullback = jax.vjp(linear_scan, decay, data, initial)
    d_decay, d_data, d_initial = pullback((jnp.asarray(g, jnp.float32), jnp.asarray(g_final, jnp.float32)))
    result, _ = loop_oracle(decay, data, initial)
    lam = np.empty_like(g)
    carry = g_final[:, 0]
    a = f64(decay)
    for t in reversed(range(30)):
        carry = g[:, t] + carry
        lam[:, t] = carry
        carry = a[:, t] * carry
    previous = np.concatenate([f64(initial), result[:, :-1]], axis=1)
    assert_close(d_data, lam, jnp.float32, reduction=30)
    assert_close(d_decay, lam * previous, jnp.float32, reduction=30)
    assert_close(d_initial, a[:, :1] * lam[:, :1], jnp.float32, reduction=30)


def test_vmap_folds_into_partitions():
    decay, data, initial = inputs((4, 3, 25), seed=7)
    batched = jax.vmap(linear_scan, in_axes=(0, 0, None))(decay, data, initial[0])
    for i in range(4):
        one = linear_scan(decay[i], data[i], initial[0])
        np.testing.assert_allclose(batched[0][i], one[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(batched[1][i], one[1], rtol=1e-6, atol=1e-6)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(jax.vmap(linear_scan), decay, data))
    assert cfg["input_specs"][0][0] == [12, 25]


def test_neuron_lowering_forward_and_backward_are_the_kernel():
    decay, data, initial = (jax.ShapeDtypeStruct(s.shape, jnp.bfloat16) for s in inputs((2, 128, 4096)))
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(linear_scan, decay, data, initial))
        assert cfg["entry_point"] == "nkilib.experimental.scan.linear_scan:linear_scan"
        assert [spec[0] for spec in cfg["input_specs"]] == [[2, 128, 4096], [2, 128, 4096], [2, 128, 1]]
        loss = lambda a, b, i: jnp.sum(linear_scan(a, b, i)[0].astype(jnp.float32))  # noqa: E731
        configs = kernel_configs(neuron_text(jax.grad(loss, argnums=(0, 1, 2)), decay, data, initial))
    assert [c["func_name"] for c in configs] == ["linear_scan", "linear_scan"]  # forward, then the adjoint


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda a, b, i: linear_scan(a, b[..., :-1]), ValueError, "`data` must have layout [B, P, L]"),
        (lambda a, b, i: linear_scan(a[:1], b[:1, None]), ValueError, "`data` must have decay's shape"),
        (lambda a, b, i: linear_scan(a, b, i[..., 0]), ValueError, "`initial` must have layout"),
        (lambda a, b, i: linear_scan(a[0, 0], b[0, 0]), ValueError, "`decay` must have layout"),
        (lambda a, b, i: linear_scan(a.astype(jnp.int32), b), TypeError, "`decay` must have dtype"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(*inputs((2, 3, 8)))
    assert fragment in str(info.value)
