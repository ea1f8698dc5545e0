"""jax_nkilib.selective_scan (Mamba's selective_scan_fn) and jax_nkilib.ssd (Mamba-2's mamba_chunk_scan_combined)
against float64 NumPy sequential loops written from Mamba's semantics: forward in float32 and bfloat16 on odd sizes
(groups, gates, biases, softplus, D per channel, lengths that are not a multiple of the chunk), gradients
(check_grads in float64, and one against central differences of the loop), the Neuron lowering (one kernel call per
group) and errors. CI runs float32; bfloat16 (the kernels' own tests run it in CI) and check_grads here are -m slow
(the conformance suite runs the ops' check_grads in CI)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64


def softplus(v):
    return np.logaddexp(0.0, v)


def silu(v):
    return v / (1.0 + np.exp(-v))


def mamba_loop(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):
    """selective_scan_fn, one time step at a time in float64: ``(out, last_state)``. B/C [b, n, L] or grouped
    [b, g, n, L] (channel c uses group c // (dim / g))."""
    u, delta, A, B, C = (f64(v) for v in (u, delta, A, B, C))
    batch, dim, length = u.shape
    if delta_bias is not None:
        delta = delta + f64(delta_bias)[None, :, None]
    if delta_softplus:
        delta = softplus(delta)
    if B.ndim == 3:
        B, C = B[:, None], C[:, None]
    B, C = np.repeat(B, dim // B.shape[1], axis=1), np.repeat(C, dim // C.shape[1], axis=1)  # [b, dim, n, L]
    state = np.zeros((batch, dim, A.shape[1]))
    y = np.zeros_like(u)
    for t in range(length):
        state = np.exp(delta[:, :, t, None] * A) * state + (delta[:, :, t] * u[:, :, t])[:, :, None] * B[..., t]
        y[:, :, t] = np.sum(state * C[..., t], axis=-1)
    if D is not None:
        y = y + f64(D)[None, :, None] * u
    if z is not None:
        y = y * silu(f64(z))
    return y, state


def mamba2_loop(
    x, dt, A, B, C, D=None, z=None, dt_bias=None, initial_states=None, dt_softplus=False, limit=None, seq_idx=None
):
    """mamba_chunk_scan_combined, one time step at a time in float64: ``(out, final_states)``; states
    [b, h, headdim, dstate]; head h uses group h // (nheads / ngroups). With ``seq_idx [b, L]`` (packed sequences)
    the state of a row is set to zero before every token whose sequence index differs from its predecessor's."""
    x, dt, A, B, C = (f64(v) for v in (x, dt, A, B, C))
    batch, length, heads, headdim = x.shape
    if dt_bias is not None:
        dt = dt + f64(dt_bias)
    if dt_softplus:
        dt = softplus(dt)
    if limit is not None:
        dt = np.clip(dt, *limit)
    B, C = np.repeat(B, heads // B.shape[2], axis=2), np.repeat(C, heads // C.shape[2], axis=2)  # [b, L, h, n]
    state = np.zeros((batch, heads, headdim, B.shape[-1])) if initial_states is None else f64(initial_states)
    y = np.zeros_like(x)
    for t in range(length):
        decay = np.exp(dt[:, t] * A)[..., None, None]
        if seq_idx is not None and t > 0:
            decay = decay * (np.asarray(seq_idx)[:, t] == np.asarray(seq_idx)[:, t - 1])[:, None, None, None]
        state = decay * state + dt[:, t, :, None, None] * x[:, t, :, :, None] * B[:, t, :, None, :]
        y[:, t] = np.sum(state * C[:, t, :, None, :], axis=-1)
    if D is not None:
        y = y + (f64(D)[:, None] if np.ndim(D) == 1 else f64(D)) * x
    if z is not None:
        y = y * silu(f64(z))
    return y, state


def mamba_inputs(batch, dim, length, dstate, groups, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    b_shape = (batch, dstate, length) if groups == 0 else (batch, groups, dstate, length)
    values = dict(
        u=rng.standard_normal((batch, dim, length)),
        delta=0.5 * rng.standard_normal((batch, dim, length)),
        A=-rng.uniform(0.1, 1.0, (dim, dstate)),
        B=rng.standard_normal(b_shape),
        C=rng.standard_normal(b_shape),
        D=rng.standard_normal(dim),
        z=rng.standard_normal((batch, dim, length)),
        delta_bias=0.1 * rng.standard_normal(dim),
    )
    return {name: jnp.asarray(v, dtype) for name, v in values.items()}


def mamba2_inputs(batch, length, heads, headdim, groups, dstate, dtype=jnp.float32, seed=0, d_per_channel=True):
    rng = np.random.default_rng(seed)
    values = dict(
        x=rng.standard_normal((batch, length, heads, headdim)),
        dt=0.5 * rng.standard_normal((batch, length, heads)),
        A=-rng.uniform(0.1, 1.0, heads),
        B=rng.standard_normal((batch, length, groups, dstate)),
        C=rng.standard_normal((batch, length, groups, dstate)),
        D=rng.standard_normal((heads, headdim) if d_per_channel else heads),
        z=rng.standard_normal((batch, length, heads, headdim)),
        dt_bias=0.1 * rng.standard_normal(heads),
        initial_states=0.1 * rng.standard_normal((batch, heads, headdim, dstate)),
    )
    return {name: jnp.asarray(v, dtype) for name, v in values.items()}


# ------------------------------------------------------------------------------------------------ selective_scan
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "sizes, extras",
    [
        ((2, 6, 29, 3, 2), dict(delta_softplus=True)),  # grouped B/C, D, z, bias, softplus
        pytest.param((1, 5, 17, 4, 0), dict(drop=("z", "D", "delta_bias")), marks=pytest.mark.slow),  # bare
    ],
)
def test_selective_scan_matches_the_float64_loop(sizes, extras, dtype):
    args = mamba_inputs(*sizes, dtype=dtype, seed=sum(sizes))
    if "drop" in extras:
        args = {k: v for k, v in args.items() if k not in extras["drop"]}
    else:
        args["delta"] = args["delta"] * 0.5
    softplus_flag = extras.get("delta_softplus", False)
    if not softplus_flag:
        args["delta"] = jnp.abs(args["delta"])  # positive time steps without softplus
    out, last = jax_nkilib.selective_scan(**args, delta_softplus=softplus_flag, return_last_state=True)
    assert out.shape == args["u"].shape and out.dtype == dtype and last.dtype == jnp.float32
    want, want_last = mamba_loop(**args, delta_softplus=softplus_flag)
    assert_close(out, want, dtype, reduction=32, ops=8)  # the kernel's rounding of y, then the gate's
    assert_close(last, want_last, dtype, reduction=32)  # float32 state from inputs rounded to dtype


@pytest.mark.slow  # CI: the conformance suite's check_grads of jax_nkilib.selective_scan
def test_selective_scan_gradients_float64():
    args = mamba_inputs(2, 4, 7, 2, 2, jnp.float64, seed=3)
    fn = jax.jit(lambda *a: jax_nkilib.selective_scan(*a, delta_softplus=True, return_last_state=True))
    check_grads(fn, tuple(args.values()), order=1, modes=["rev"])


def test_selective_scan_gradient_matches_central_differences_of_the_loop():
    args = mamba_inputs(1, 2, 9, 2, 0, jnp.float64, seed=4)
    g = np.random.default_rng(5).standard_normal(args["u"].shape)

    def loss(A):
        return jnp.sum(jax_nkilib.selective_scan(**{**args, "A": A}, delta_softplus=True) * g)

    grad_A = np.asarray(jax.jit(jax.grad(loss))(args["A"]))
    numeric = np.zeros_like(grad_A)
    for index in np.ndindex(grad_A.shape):
        step = np.zeros(grad_A.shape)
        step[index] = 1e-6
        plus = mamba_loop(**{**args, "A": f64(args["A"]) + step}, delta_softplus=True)[0]
        minus = mamba_loop(**{**args, "A": f64(args["A"]) - step}, delta_softplus=True)[0]
        numeric[index] = np.sum((plus - minus) * g) / 2e-6
    np.testing.assert_allclose(grad_A, numeric, rtol=1e-6, atol=1e-8)


def test_selective_scan_lowers_to_one_kernel_call_per_group():
    args = mamba_inputs(2, 256, 64, 16, 4, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        configs = kernel_configs(neuron_text(lambda a: jax_nkilib.selective_scan(**a, delta_softplus=True), args))
    assert [c["func_name"] for c in configs] == ["selective_scan"] * 4
    assert configs[0]["input_specs"][0][0] == [2, 64, 64]  # the group's 64 channels


@pytest.mark.parametrize(
    "change, error, fragment",
    [
        (dict(B=np.zeros((2, 4, 7)), C=np.zeros((2, 4, 7))), ValueError, "`B` must have layout [batch, dstate, L]"),
        (dict(B=np.zeros((2, 4, 3, 7)), C=np.zeros((2, 4, 3, 7))), ValueError, "groups dividing dim=6"),
        (dict(A=np.zeros((5, 3))), ValueError, "`A` must have layout [dim, dstate]"),
        (dict(z=np.zeros((2, 6, 8))), ValueError, "`z` must have layout [batch, dim, L]"),
        (dict(u=np.zeros((2, 6, 7), np.int32)), TypeError, "`u`"),
        (dict(delta_softplus="yes"), TypeError, "`delta_softplus` must be a Python bool"),
    ],
)
def test_selective_scan_bad_inputs(change, error, fragment):
    args = {**mamba_inputs(2, 6, 7, 3, 2), **change}
    with pytest.raises(error) as info:
        jax_nkilib.selective_scan(**args)
    assert fragment in str(info.value)


# ----------------------------------------------------------------------------------------------------------- ssd
@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
@pytest.mark.parametrize(
    "sizes, chunk, d_per_channel, limit",
    [
        ((2, 21, 4, 3, 2, 2), 8, True, (0.0, float("inf"))),
        pytest.param((1, 16, 3, 5, 1, 4), 16, False, (0.05, 0.5), marks=pytest.mark.slow),
    ],
)
def test_ssd_matches_the_float64_loop(sizes, chunk, d_per_channel, limit, dtype):
    args = mamba2_inputs(*sizes, dtype=dtype, seed=sum(sizes), d_per_channel=d_per_channel)
    out, final = jax_nkilib.ssd(**args, chunk_size=chunk, dt_softplus=True, dt_limit=limit, return_final_states=True)
    assert out.shape == args["x"].shape and out.dtype == dtype
    assert final.shape == args["initial_states"].shape and final.dtype == jnp.float32
    want, want_final = mamba2_loop(**args, dt_softplus=True, limit=limit)
    assert_close(out, want, dtype, reduction=32, ops=8)
    assert_close(final, want_final, dtype, reduction=32)


@pytest.mark.slow  # CI: the conformance suite's check_grads of jax_nkilib.ssd
def test_ssd_gradients_float64():
    args = mamba2_inputs(2, 7, 2, 2, 1, 2, jnp.float64, seed=6)
    fn = jax.jit(lambda *a: jax_nkilib.ssd(*a[:5], 4, *a[5:], dt_softplus=True, return_final_states=True))
    check_grads(fn, tuple(args.values()), order=1, modes=["rev"])


def test_ssd_lowers_to_one_kernel_call_per_group_on_whole_chunks():
    args = mamba2_inputs(2, 250, 8, 64, 2, 16, jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        configs = kernel_configs(neuron_text(lambda a: jax_nkilib.ssd(**a, chunk_size=128, dt_softplus=True), args))
    assert [c["func_name"] for c in configs] == ["ssd", "ssd"]
    assert configs[0]["input_specs"][0][0] == [2, 4, 256, 64]  # [b, heads of the group, L padded to chunks, p]
    assert configs[0]["params"] == {"chunk_size": 128}


@pytest.mark.parametrize(
    "change, error, fragment",
    [
        (dict(B=np.zeros((2, 9, 3, 2))), ValueError, "`B` must have layout [batch, L, ngroups, dstate]"),
        (dict(initial_states=np.zeros((2, 4, 2, 3))), ValueError, "[batch, nheads, headdim, dstate]"),
        (dict(D=np.zeros(3)), ValueError, "`D` must have layout [nheads] or [nheads, headdim]"),
        (dict(dt=np.zeros((2, 4, 9))), ValueError, "`dt` must have layout [batch, L, nheads]"),
        (dict(chunk_size=0), ValueError, "`chunk_size`"),
        (dict(chunk_size=4.0), TypeError, "`chunk_size`"),
    ],
)
def test_ssd_bad_inputs(change, error, fragment):
    args = {**mamba2_inputs(2, 9, 4, 3, 2, 2), "chunk_size": 4, **change}
    with pytest.raises(error) as info:
        jax_nkilib.ssd(**args)
    assert fragment in str(info.value)
