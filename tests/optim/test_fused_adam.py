"""jax_nkilib.nki.adam_kernel / adamw_kernel against a float64 NumPy oracle of torch.optim.Adam / AdamW (lr, weight
decay and the step count in, the kernel's host-side scalars computed from them as torch does); amsgrad; float32 and
bfloat16; odd sizes; shard_map; Neuron lowering; errors."""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64
from tests.support.sharding import mesh_1d, run_sharded

LR, WD, B1, B2, EPS = 1e-2, 0.1, 0.9, 0.999, 1e-8


def torch_adam_step(p, g, m, v, v_max, t, *, decoupled, amsgrad, lr=LR, wd=WD):
    """One torch.optim.Adam(W) step in float64 (torch's _single_tensor_adam, capturable=False)."""
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g * g
    bias_correction1, bias_correction2 = 1 - B1**t, 1 - B2**t
    if amsgrad:
        v_max = np.maximum(v_max, v)
    denom = np.sqrt(v_max if amsgrad else v) / np.sqrt(bias_correction2) + EPS
    return p - lr / bias_correction1 * m / denom, m, v, v_max


def host_scalars(t, decoupled, lr=LR, wd=WD):
    """The kernel's [128, 1] scalars for step t (the docs' host-side bias correction)."""
    values = (lr / (1 - B1**t), 1 / np.sqrt(1 - B2**t), 1 - lr * wd if decoupled else wd)
    return tuple(jnp.full((128, 1), value, jnp.float32) for value in values)


def initial_state(n, dtype):
    p, g = random((n,), dtype, seed=1), random((n,), dtype, seed=2)
    return p, g, jnp.zeros((n,), dtype), jnp.zeros((n,), dtype), jnp.zeros((n,), dtype)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
@pytest.mark.parametrize("amsgrad", [False, True], ids=["", "amsgrad"])
def test_five_steps_match_torch_optim(decoupled, amsgrad):
    n, dtype = 3 * 128 + 5, jnp.float32
    kernel = nki.adamw_kernel if decoupled else nki.adam_kernel
    p, _, m, v, v_max = initial_state(n, dtype)
    ref = [f64(a) for a in (p, m, v, v_max)]
    for t in range(1, 6):
        g = random((n,), dtype, seed=10 + t)
        if t == 4:
            g = g * 0.01  # v falls below its running max: amsgrad's max matters
        outs = kernel(
            p, g, m, v, v_max if amsgrad else jnp.zeros((1,), dtype), *host_scalars(t, decoupled),
            numel=n, beta1=B1, beta2=B2, eps=EPS, amsgrad=amsgrad,
        )  # fmt: skip
        assert len(outs) == (4 if amsgrad else 3) and all(o.shape == (n,) and o.dtype == dtype for o in outs)
        p, m, v = outs[:3]
        v_max = outs[3] if amsgrad else v_max
        ref = list(torch_adam_step(ref[0], f64(g), ref[1], ref[2], ref[3], t, decoupled=decoupled, amsgrad=amsgrad))
    for actual, expected in zip((p, m, v) + ((v_max,) if amsgrad else ()), ref):
        assert_close(actual, expected, dtype, ops=16)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_bfloat16_step(decoupled):
    n, dtype = 1001, jnp.bfloat16
    kernel = nki.adamw_kernel if decoupled else nki.adam_kernel
    p, g, _, _, _ = initial_state(n, dtype)
    m, v = random((n,), dtype, seed=3) * 0.1, (jnp.abs(random((n,), jnp.float32, seed=4)) * 0.01).astype(dtype)
    outs = kernel(p, g, m, v, jnp.zeros((1,), dtype), *host_scalars(7, decoupled), numel=n, beta1=B1, beta2=B2, eps=EPS)
    expected = torch_adam_step(f64(p), f64(g), f64(m), f64(v), None, 7, decoupled=decoupled, amsgrad=False)
    for actual, oracle in zip(outs, expected):
        assert actual.dtype == dtype
        assert_close(actual, oracle, dtype)


def test_runs_per_shard_inside_shard_map():
    mesh, n = mesh_1d(), 8 * 64
    p, g, m, v, _ = initial_state(n, jnp.float32)
    scalars = host_scalars(1, True)

    def step(p, g, m, v, *scalars):
        return nki.adamw_kernel(p, g, m, v, jnp.zeros((1,)), *scalars, numel=n // 8, beta1=B1, beta2=B2, eps=EPS)

    flat, rep = P("data"), P()
    outs = run_sharded(step, mesh, (flat,) * 4 + (rep,) * 3, (flat,) * 3, p, g, m, v, *scalars)
    expected = torch_adam_step(f64(p), f64(g), f64(m), f64(v), None, 1, decoupled=True, amsgrad=False)
    for actual, oracle in zip(outs, expected):
        assert_close(actual, oracle, jnp.float32, ops=8)


@pytest.mark.parametrize("amsgrad", [False, True])
def test_neuron_lowering_is_one_kernel_call(amsgrad):
    n = 300
    p, g, m, v, v_max = initial_state(n, jnp.float32)
    v_max = v_max if amsgrad else jnp.zeros((1,), jnp.float32)
    fn = lambda *args: nki.adamw_kernel(*args, numel=n, beta1=B1, beta2=B2, eps=EPS, amsgrad=amsgrad)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(fn, p, g, m, v, v_max, *host_scalars(1, True))
    (config,) = kernel_configs(text)
    assert config["func_name"] == "adamw_kernel" and not compute_operations(text)
    assert config["aliases"] == []  # the kernel writes fresh HBM outputs (donate the state to reuse buffers)
    assert text.count("tensor<300xf32>") >= 4 + 3 + amsgrad


def test_bad_inputs_name_the_argument():
    p, g, m, v, _ = initial_state(10, jnp.float32)
    scalars = host_scalars(1, True)
    kw = dict(numel=10, beta1=B1, beta2=B2, eps=EPS)
    with pytest.raises(ValueError, match="exp_avg_sq_ptr"):
        nki.adamw_kernel(p, g, m, v[:-1], v, *scalars, **kw)
    with pytest.raises(ValueError, match="max_exp_avg_sq_ptr"):
        nki.adamw_kernel(p, g, m, v, jnp.zeros((1,)), *scalars, **kw, amsgrad=True)
    with pytest.raises(ValueError, match=r"step_size_ptr.*\[128, 1\]"):
        nki.adam_kernel(p, g, m, v, v, jnp.ones((1, 1)), *scalars[1:], **kw)
    with pytest.raises(ValueError, match="beta2"):
        nki.adam_kernel(p, g, m, v, v, *scalars, **{**kw, "beta2": 1.0})
    with pytest.raises(TypeError, match="eps"):
        nki.adam_kernel(p, g, m, v, v, *scalars, numel=10, beta1=B1, beta2=B2)
    with pytest.raises(TypeError, match="one dtype"):
        nki.adam_kernel(p, g.astype(jnp.bfloat16), m, v, v, *scalars, **kw)
