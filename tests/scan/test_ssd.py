"""jax_nkilib.nki.ssd against a float64 NumPy sequential loop (Mamba-2's recurrence, one group): float32 and
bfloat16, odd sizes (a length that is not a multiple of the chunk), D / initial_state, the causal mask's role, float64
gradients, vmap, Neuron lowering with its limits and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import ssd
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def loop_oracle(x, dt, A, B, C, D=None, initial_state=None):
    """``state[t] = exp(dt A) state[t-1] + dt outer(B[t], x[t])``, ``y[t] = C[t] @ state[t] + D x[t]`` one step at
    a time in float64: ``(y, final_state)``."""
    x, dt, A, B, C = (f64(v) for v in (x, dt, A, B, C))
    batch, heads, length, headdim = x.shape
    state = np.zeros((batch, heads, B.shape[-1], headdim)) if initial_state is None else f64(initial_state).copy()
    y = np.zeros_like(x)
    for t in range(length):
        decay = np.exp(dt[:, :, t] * A[None])[..., None, None]
        state = decay * state + dt[:, :, t, None, None] * np.einsum("bn,bhp->bhnp", B[:, t], x[:, :, t])
        y[:, :, t] = np.einsum("bn,bhnp->bhp", C[:, t], state)
    if D is not None:
        y = y + f64(D)[None, :, None, None] * x
    return y, state


def inputs(batch, heads, length, headdim, dstate, dtype=jnp.float32, seed=0):
    """Mamba-2-like values; ``(x, dt, A, B, C, D, initial_state)``."""
    rng = np.random.default_rng(seed)
    values = (
        rng.standard_normal((batch, heads, length, headdim)),
        rng.uniform(0.01, 0.3, (batch, heads, length)),
        -rng.uniform(0.1, 1.0, heads),
        rng.standard_normal((batch, length, dstate)),
        rng.standard_normal((batch, length, dstate)),
        rng.standard_normal(heads),
        0.1 * rng.standard_normal((batch, heads, dstate, headdim)),
    )
    return tuple(jnp.asarray(v, dtype) for v in values)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "sizes, chunk, with_D, with_initial",
    [
        ((2, 3, 37, 5, 4), 8, True, True),
        pytest.param((1, 2, 64, 3, 2), 16, False, False, marks=pytest.mark.slow),
        ((2, 1, 5, 7, 3), 8, False, False),
    ],
)
def test_forward_matches_float64_loop(sizes, chunk, with_D, with_initial, dtype):
    x, dt, A, B, C, D, h0 = inputs(*sizes, dtype, seed=sum(sizes))
    D, h0 = (D if with_D else None), (h0 if with_initial else None)
    y, final = ssd(x, dt, A, B, C, chunk_size=chunk, D=D, initial_state=h0)
    batch, heads, length, headdim, dstate = sizes
    assert y.shape == x.shape and y.dtype == dtype
    assert final.shape == (batch, heads, dstate, headdim) and final.dtype == jnp.float32
    want_y, want_final = loop_oracle(x, dt, A, B, C, D, h0)
    assert_close(y, want_y, dtype, reduction=dstate * chunk)
    assert_close(final, want_final, jnp.float32, reduction=length)  # float32 inside, whatever x's dtype


@pytest.mark.slow  # CI: the forward test's ragged (L=37, Q=8) and short (L=5 < Q=8) cases
def test_the_result_does_not_depend_on_the_chunk_size():
    args = inputs(1, 2, 48, 4, 3, seed=3)
    want_y, want_final = loop_oracle(*args)
    for chunk in (5, 128):  # ragged chunks; one chunk longer than the sequence
        y, final = ssd(*args[:5], chunk_size=chunk, D=args[5], initial_state=args[6])
        assert_close(y, want_y, jnp.float32, reduction=48)
        assert_close(final, want_final, jnp.float32, reduction=48)


def test_causal_mask_multiplies_the_intra_chunk_scores():
    """An all-zero mask drops the intra-chunk term: each output sees only the state entering its chunk."""
    x, dt, A, B, C, _, h0 = inputs(1, 1, 8, 2, 2, seed=4)
    y, _ = ssd(x, dt, A, B, C, chunk_size=4, initial_state=h0, causal_mask=jnp.zeros((4, 4)))
    full, _ = loop_oracle(x, dt, A, B, C, None, h0)
    cs = np.cumsum(f64(dt)[0, 0, :4] * f64(A)[0])
    first_chunk = np.exp(cs)[:, None] * np.einsum("tn,np->tp", f64(C)[0, :4], f64(h0)[0, 0])
    assert_close(y[0, 0, :4], first_chunk, jnp.float32, reduction=4)
    assert not np.allclose(y[0, 0, :4], full[0, 0, :4])


@pytest.mark.slow  # CI: the conformance suite's check_grads
def test_gradients_float64():
    args = inputs(2, 2, 11, 3, 2, jnp.float64, seed=1)
    check_grads(jax.jit(lambda *a: ssd(*a[:5], chunk_size=4, D=a[5], initial_state=a[6])), args, 1, modes=["rev"])


def test_vmap_folds_into_batch():
    x, dt, A, B, C, D, h0 = inputs(3, 2, 16, 3, 2, seed=2)
    fn = lambda x, dt, B, C: ssd(x, dt, A, B, C, chunk_size=8, D=D)  # noqa: E731
    batched = jax.vmap(fn)(x[:, None], dt[:, None], B[:, None], C[:, None])
    want = fn(x, dt, B, C)
    np.testing.assert_allclose(batched[0][:, 0], want[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(batched[1][:, 0], want[1], rtol=1e-5, atol=1e-6)
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(jax.vmap(fn), x[:, None], dt[:, None], B[:, None], C[:, None]))
    assert cfg["input_specs"][0][0] == [3, 2, 16, 3]


def test_neuron_lowering_passes_the_mask_and_falls_back_outside_the_limits():
    def shapes(*sizes):
        return [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in inputs(*sizes)[:5]]

    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(lambda *a: ssd(*a, chunk_size=64), *shapes(2, 4, 256, 64, 16)))
        assert cfg["entry_point"] == "nkilib.experimental.scan.ssd:ssd" and cfg["params"] == {"chunk_size": 64}
        assert cfg["input_specs"][-1][0] == [64, 64]  # causal_mask [Q, Q], passed by jax_nkilib
        for sizes, chunk, reason in [
            ((1, 2, 256, 8, 4), 256, "chunk_size=256 exceeds"),
            ((1, 2, 100, 8, 4), 64, "L=100 is not a multiple of chunk_size=64"),
            ((1, 2, 64, 8, 129), 64, "dstate n=129 exceeds"),
            ((1, 1, 64, 513, 4), 64, "headdim p=513 exceeds"),
        ]:
            with pytest.warns(NeuronFallbackWarning, match=reason):
                text = neuron_text(lambda *a, q=chunk: ssd(*a, chunk_size=q), *shapes(*sizes))
            assert kernel_configs(text) == []


@pytest.mark.parametrize(
    "call, error, fragment",
    [
        (lambda x, dt, A, B, C: ssd(x, dt, A, B, C, chunk_size=0), ValueError, "`chunk_size` must be positive"),
        (lambda x, dt, A, B, C: ssd(x, dt, A, B, C, chunk_size=4, causal_mask=jnp.ones((3, 3))), ValueError, "[Q, Q]"),
        (lambda x, dt, A, B, C: ssd(x, dt, A, B[:, :-1], C, chunk_size=4), ValueError, "`B` must have layout"),
        (lambda x, dt, A, B, C: ssd(x, dt, A[:1], B, C, chunk_size=4), ValueError, "`A` must have layout"),
        (lambda x, dt, A, B, C: ssd(x, dt, A, B, C, chunk_size=2.0), TypeError, "`chunk_size`"),
    ],
)
def test_bad_inputs(call, error, fragment):
    with pytest.raises(error) as info:
        call(*inputs(2, 3, 8, 4, 2)[:5])
    assert fragment in str(info.value)
