"""jax_nkilib.nki.selective_scan against a float64 NumPy sequential loop (Mamba's discretized recurrence): float32
and bfloat16, odd sizes, with and without D / initial_state, float64 gradients, vmap, Neuron lowering and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.nki import selective_scan
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def loop_oracle(x, dt, A, B, C, D=None, initial_state=None):
    """The recurrence of the kernel's docstring, one time step at a time in float64: ``(y, final_state)``."""
    x, dt, A, B, C = (f64(v) for v in (x, dt, A, B, C))
    batch, channels, length = x.shape
    state = np.zeros((batch, channels, A.shape[1])) if initial_state is None else f64(initial_state).copy()
    y = np.zeros_like(x)
    for t in range(length):
        decay = np.exp(dt[:, :, t, None] * A[None])  # [b, c, N]
        state = decay * state + (dt[:, :, t] * x[:, :, t])[:, :, None] * B[:, None, :, t]
        y[:, :, t] = np.einsum("bcn,bn->bc", state, C[:, :, t])
    if D is not None:
        y = y + f64(D)[None, :, None] * x
    return y, state


def inputs(batch, channels, length, states, dtype=jnp.float32, seed=0):
    """Mamba-like values: positive small dt, negative A; ``(x, dt, A, B, C, D, initial_state)``."""
    rng = np.random.default_rng(seed)
    values = (
        rng.standard_normal((batch, channels, length)),
        rng.uniform(0.01, 0.3, (batch, channels, length)),
        -rng.uniform(0.1, 1.0, (channels, states)),
        rng.standard_normal((batch, states, length)),
        rng.standard_normal((batch, states, length)),
        rng.standard_normal(channels),
        0.1 * rng.standard_normal((batch, channels, states)),
    )
    return tuple(jnp.asarray(v, dtype) for v in values)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "sizes, with_D, with_initial",
    [
        ((2, 5, 33, 3), True, True),
        pytest.param((1, 7, 70, 4), False, False, marks=pytest.mark.slow),
        ((3, 1, 1, 1), False, False),
    ],
)
def test_forward_matches_float64_loop(sizes, with_D, with_initial, dtype):
    x, dt, A, B, C, D, h0 = inputs(*sizes, dtype, seed=sum(sizes))
    D, h0 = (D if with_D else None), (h0 if with_initial else None)
    y, final = selective_scan(x, dt, A, B, C, D, h0)
    batch, channels, length, states = sizes
    assert y.shape == (batch, channels, length) and y.dtype == dtype
    assert final.shape == (batch, channels, states) and final.dtype == jnp.float32
    want_y, want_final = loop_oracle(x, dt, A, B, C, D, h0)
    assert_close(y, want_y, dtype, reduction=states * 8)
    assert_close(final, want_final, jnp.float32, reduction=length)  # float32 throughout


@pytest.mark.slow  # the kernel's 512-column tiles carry a float32 state: no numerical effect to test fast
def test_long_sequence_beyond_the_kernel_tile():
    args = inputs(1, 3, 1100, 2, seed=9)  # more than two of the kernel's 512-column tiles
    y, final = selective_scan(*args)
    want_y, want_final = loop_oracle(*args)
    assert_close(y, want_y, jnp.float32, reduction=64)
    assert_close(final, want_final, jnp.float32, reduction=64)


@pytest.mark.slow  # CI: the conformance suite's check_grads
def test_gradients_float64():
    args = inputs(2, 3, 7, 2, jnp.float64, seed=1)
    check_grads(jax.jit(selective_scan), args, order=1, modes=["rev"])


def test_vmap_folds_into_batch():
    x, dt, A, B, C, D, h0 = inputs(4, 3, 17, 2, seed=2)
    batched = jax.vmap(selective_scan, in_axes=(0, 0, None, 0, 0, None, 0))(
        x[:, None], dt[:, None], A, B[:, None], C[:, None], D, h0[:, None]
    )
    want = selective_scan(x, dt, A, B, C, D, h0)
    np.testing.assert_allclose(batched[0][:, 0], want[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(batched[1][:, 0], want[1], rtol=1e-6, atol=1e-6)
    with jax_nkilib.neuron.dry_run():
        lowered = neuron_text(
            jax.vmap(selective_scan, in_axes=(0, 0, None, 0, 0)), x[:, None], dt[:, None], A, B[:, None], C[:, None]
        )
        (cfg,) = kernel_configs(lowered)
    assert cfg["input_specs"][0][0] == [4, 3, 17]


def test_neuron_lowering_is_one_kernel_call():
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in inputs(2, 256, 1024, 16)]
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(selective_scan, *shapes))
    assert cfg["entry_point"] == "nkilib.experimental.scan.selective_scan:selective_scan"
    assert [spec[0] for spec in cfg["input_specs"]] == [
        [2, 256, 1024],
        [2, 256, 1024],
        [256, 16],
        [2, 16, 1024],
        [2, 16, 1024],
        [256],
        [2, 256, 16],
    ]


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x, dt, A, B, C, D, h: selective_scan(x, dt, A, B[:, :, :-1], C), ValueError, "`B` must have layout"),
        (lambda x, dt, A, B, C, D, h: selective_scan(x, dt, A.T, B, C), ValueError, "`A` must have layout"),
        (lambda x, dt, A, B, C, D, h: selective_scan(x, dt, A, B, C, D[:-1]), ValueError, "`D` must have layout"),
        (lambda x, dt, A, B, C, D, h: selective_scan(x.astype(jnp.int32), dt, A, B, C), TypeError, "`x` must"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(*inputs(2, 3, 8, 4))
    assert fragment in str(info.value)
