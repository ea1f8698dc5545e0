"""A tiny Mamba-2 block trained for a few Adam steps (jax_nkilib.optim) on CPU; the NKI kernels of its lowering.

Run: python examples/mamba2.py

The block follows Mamba-2: ``in_proj`` makes ``z`` (the gate), ``xBC`` and ``dt`` from each token; a causal
depthwise ``conv1d`` (plain ``jnp``, width 4) and SiLU mix ``xBC`` along time; ``jax_nkilib.ssd`` runs the chunked
state-space scan (``A = -exp(A_log)``, ``dt = softplus(dt + dt_bias)``, skip ``D``, one group of B/C); a gated
RMS norm ``rms_norm(y * silu(z))`` and ``out_proj`` give the output, added to the input. The task is to predict a
fixed exponentially smoothed mix of the input sequence, which a linear recurrence can learn. Off Neuron ``ssd`` runs
its JAX reference (an associative scan over chunks, so memory grows linearly with the length); lowered for Neuron
the scan is the NKI Library's ``ssd`` kernel (its gradient is the reference's, in plain JAX) and the norm is
``rmsnorm_tkg``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np

import jax_nkilib

BATCH, SEQ, MODEL = 4, 64, 32
HEADS, HEAD_DIM, DSTATE, CHUNK, CONV = 4, 64, 16, 16, 4  # INNER = 256: rmsnorm_tkg at LNC 2 wants H % 256 == 0
INNER = HEADS * HEAD_DIM
STEPS = 12


def init_params(seed=0):
    """Random projections (NumPy: nothing to compile) and Mamba-2's usual A, dt bias and D initialisations."""
    rng = np.random.default_rng(seed)
    normal = lambda shape, fan_in: jnp.asarray(rng.standard_normal(shape) * fan_in**-0.5, jnp.float32)  # noqa: E731
    width = INNER + 2 * DSTATE  # the convolved channels: x, B, C
    return {
        "in_proj": normal((MODEL, INNER + width + HEADS), MODEL),  # z, xBC, dt
        "conv": normal((CONV, width), CONV),
        "A_log": jnp.asarray(np.log(np.linspace(1.0, 4.0, HEADS)), jnp.float32),
        "dt_bias": jnp.full((HEADS,), -2.0, jnp.float32),
        "D": jnp.ones((HEADS,), jnp.float32),
        "norm": jnp.ones((INNER,), jnp.float32),
        "out_proj": normal((INNER, MODEL), INNER),
    }


def causal_conv1d(x, weight):
    """Depthwise causal convolution along time: ``x [b, L, c]``, ``weight [width, c]``."""
    width = weight.shape[0]
    padded = jnp.pad(x, ((0, 0), (width - 1, 0), (0, 0)))
    return sum(padded[:, k : k + x.shape[1]] * weight[k] for k in range(width))


def mamba2_block(params, x):
    """``x [b, L, MODEL]`` -> ``[b, L, MODEL]``: the block of the module docstring, with a residual."""
    batch, length, _ = x.shape
    projected = x @ params["in_proj"]
    z, xbc, dt = jnp.split(projected, [INNER, projected.shape[-1] - HEADS], axis=-1)
    xbc = jax.nn.silu(causal_conv1d(xbc, params["conv"]))
    xs, B, C = jnp.split(xbc, [INNER, INNER + DSTATE], axis=-1)
    y = jax_nkilib.ssd(
        xs.reshape(batch, length, HEADS, HEAD_DIM),
        dt,
        -jnp.exp(params["A_log"]),
        B[:, :, None],
        C[:, :, None],
        chunk_size=CHUNK,
        D=params["D"],
        dt_bias=params["dt_bias"],
        dt_softplus=True,
    ).reshape(batch, length, INNER)
    y = jax_nkilib.rms_norm(y * jax.nn.silu(z), params["norm"])  # Mamba-2's gated RMS norm
    return x + y @ params["out_proj"]


def synthetic_batch(seed=2):
    """Inputs and the target: an exponentially smoothed (decay 0.9) mix of the inputs' channels (NumPy)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, SEQ, MODEL))
    mix = rng.standard_normal((MODEL, MODEL)) * MODEL**-0.5
    smoothed, state = np.zeros_like(x), np.zeros((BATCH, MODEL))
    for t in range(SEQ):
        state = 0.9 * state + 0.1 * x[:, t]
        smoothed[:, t] = state
    return jnp.asarray(x, jnp.float32), jnp.asarray(smoothed @ mix, jnp.float32)


def loss_fn(params, x, target):
    return jnp.mean((mamba2_block(params, x) - target) ** 2)


def kernel_names(neuron_text: str) -> list[str]:
    """The NKI kernels a Neuron StableHLO module calls, in program order."""
    pattern = r'@AwsNeuronCustomNativeKernel\(.*?backend_config = "([A-Za-z0-9+/=]*)"'
    return [jax_nkilib.neuron.decode_backend_config(e)["func_name"] for e in re.findall(pattern, neuron_text)]


def main(steps=STEPS):
    params = init_params()
    x, target = synthetic_batch()
    optimizer = jax_nkilib.optim.adam(1e-2)  # optax's adam updates, by the fused adam_kernel on Neuron
    state = optimizer.init(params)

    @jax.jit
    def train_step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, target)
        updates, state = optimizer.update(grads, state, params)
        return jax.tree.map(jnp.add, params, updates), state, loss

    losses = []
    for _ in range(steps):
        params, state, loss = train_step(params, state)
        losses.append(float(loss))
    print(f"loss over {steps} adam steps: {losses[0]:.4f} -> {losses[-1]:.4f}")

    with jax_nkilib.neuron.dry_run():
        forward = kernel_names(jax_nkilib.neuron_hlo(mamba2_block, params, x))
        training = kernel_names(jax_nkilib.neuron_hlo(jax.grad(loss_fn), params, x, target))
    print(f"Neuron kernels of the block: {forward}; of its gradient: {training}")
    return {"losses": losses, "forward_kernels": forward, "gradient_kernels": training}


if __name__ == "__main__":
    main()
