"""jax_nkilib.cross_entropy against a float64 oracle and optax: mean/sum/none, ignore_index, z_loss, bfloat16 and
float32 logits, a vocabulary that is not a multiple of the kernels' chunk; gradients for any upstream cotangent; the
Neuron lowering of value_and_grad (the two kernels and the stated glue); the reference's memory; bad inputs."""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.ops.loss import KERNEL_CHUNK
from tests.loss.oracle import losses, softmax_minus_onehot
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close, f64
from tests.support.sharding import use_mesh

B, S = 3, 5
V = KERNEL_CHUNK + 3619  # two chunks, the second partial


def batch(dtype, vocab=V, seed=0, ignored=None):
    logits = random((B, S, vocab), dtype, seed, scale=2.0)
    labels = np.random.default_rng(seed + 1).integers(0, vocab, (B, S)).astype(np.int32)
    if ignored is not None:
        labels[0, 1] = labels[2, 4] = labels[1, 0] = ignored
    return logits, jnp.asarray(labels)


def oracle(logits, labels, reduction="mean", ignore_index=None, z_loss=0.0, cotangent=None):
    """``(loss, dlogits)`` in float64 for the upstream ``cotangent`` (default 1)."""
    labels = np.asarray(labels)
    counted = np.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    safe = np.where(counted, labels, 0)
    loss, lse = losses(logits, safe)
    rows = np.where(counted, loss + z_loss * lse**2, 0.0)
    count = max(counted.sum(), 1)
    value = {"mean": rows.sum() / count, "sum": rows.sum(), "none": rows}[reduction]
    c = np.ones(labels.shape) if cotangent is None else f64(cotangent) * np.ones(labels.shape)
    if reduction == "mean":
        c = c / count
    c = np.where(counted, c, 0.0)[..., None]
    x = f64(logits)
    softmax = np.exp(x - lse[..., None])
    dlogits = c * softmax_minus_onehot(x, safe) + c * 2 * z_loss * lse[..., None] * softmax
    return value, dlogits


def value_and_grad(logits, labels, cotangent=None, **flags):
    def loss(x):
        out = jax_nkilib.cross_entropy(x, labels, **flags)
        return jnp.sum(out * cotangent) if cotangent is not None else out

    value = jax_nkilib.cross_entropy(logits, labels, **flags)
    return value, jax.jit(jax.grad(loss))(logits)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "flags",
    [
        {},
        {"reduction": "sum"},
        {"reduction": "none"},
        {"ignore_index": -100},
        {"reduction": "none", "ignore_index": 7, "z_loss": 1e-2},
        {"z_loss": 1e-3},
    ],
    ids=["mean", "sum", "none", "mean-ignore", "none-ignore-zloss", "mean-zloss"],
)
def test_value_and_gradient_match_float64_oracle(dtype, flags):
    ignored = flags.get("ignore_index")
    logits, labels = batch(dtype, ignored=ignored)
    cotangent = random((B, S), seed=9) if flags.get("reduction") == "none" else None  # any upstream cotangent
    value, grad = value_and_grad(logits, labels, cotangent, **flags)
    want_value, want_grad = oracle(logits, labels, cotangent=cotangent, **flags)
    wide = jnp.float32  # the loss is float32 for bfloat16 and float32 logits
    assert value.dtype == wide and value.shape == np.shape(want_value)
    assert grad.dtype == dtype and grad.shape == logits.shape
    assert_close(value, want_value, wide, reduction=V)
    # bfloat16: the kernel's gradient is rounded to the logits' dtype, then scaled and rounded again
    assert_close(grad, want_grad, dtype, reduction=V if dtype == jnp.float32 else 1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_optax(dtype, reduction):
    optax = pytest.importorskip("optax")
    logits, labels = batch(dtype, vocab=1000, seed=3)
    reduce = {"mean": jnp.mean, "sum": jnp.sum, "none": lambda rows: rows}[reduction]
    # optax on float32 copies (its bfloat16 path computes the log-softmax in bfloat16)
    plain = lambda x: reduce(optax.softmax_cross_entropy_with_integer_labels(x.astype(jnp.float32), labels))
    ours = lambda x: jax_nkilib.cross_entropy(x, labels, reduction=reduction)
    weights = random((B, S), seed=4)
    scalar = lambda f: lambda x: jnp.sum(f(x) * weights) if reduction == "none" else f(x)
    np.testing.assert_allclose(ours(logits), plain(logits), rtol=2e-6, atol=2e-6)
    grad, want = jax.grad(scalar(ours))(logits), jax.grad(scalar(plain))(logits)
    tol = 1e-6 if dtype == jnp.float32 else 2e-2 * float(jnp.max(jnp.abs(want)))
    np.testing.assert_allclose(np.asarray(grad, np.float32), np.asarray(want, np.float32), atol=tol)


def test_every_row_ignored_gives_zero_loss_and_gradient():
    logits, labels = batch(jnp.float32, vocab=50)
    labels = jnp.full_like(labels, -1)
    value, grad = value_and_grad(logits, labels, ignore_index=-1)
    assert float(value) == 0.0 and not np.any(np.asarray(grad))


def test_float64_logits_give_float64_loss():
    logits, labels = batch(jnp.float64, vocab=300)
    value, grad = value_and_grad(logits, labels, ignore_index=3, z_loss=0.5)
    want_value, want_grad = oracle(logits, labels, ignore_index=3, z_loss=0.5)
    assert value.dtype == grad.dtype == jnp.float64
    np.testing.assert_allclose(value, want_value, rtol=1e-12)
    np.testing.assert_allclose(grad, want_grad, atol=1e-14)


def test_neuron_value_and_grad_is_the_two_kernels_and_row_scaling():
    """On Neuron, forward + VJP are the two kernels; the only [N, V] glue is the row-scaling multiply (and its
    converts) and the reshapes; the softmax math (exp, log, max) stays inside the kernels."""
    n, vocab = 4 * 512, 50000
    x = jax.ShapeDtypeStruct((4, 512, vocab), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((4, 512), jnp.int32)
    loss = lambda x, y: jax_nkilib.cross_entropy(x, y, ignore_index=-100)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error", lnc=2):
        text = neuron_text(jax.value_and_grad(loss), x, y)
    forward, backward = kernel_configs(text)
    assert forward["func_name"] == "cross_entropy_forward" and backward["func_name"] == "cross_entropy_backward"
    assert backward["params"]["reduction"] == "sum" and backward["params"]["inplace"] is True
    assert backward["aliases"] == [[0, 0]] and forward["params"]["chunk_size"] == KERNEL_CHUNK
    ops = set(re.findall(r"=\s*(stablehlo\.[a-z_]+)", text))
    assert not ops & {"stablehlo.exponential", "stablehlo.log", "stablehlo.exponential_minus_one"}
    big = set()  # operations whose result is [N, V] or [4, 512, V] (the last type on the line is the result's)
    for line in text.splitlines():
        op, result = re.search(r"=\s*(stablehlo\.[a-z_]+)", line), re.findall(r"tensor<([0-9x]+)x[a-z0-9]+>", line)
        if op and result and result[-1] in (f"{n}x{vocab}", f"4x512x{vocab}"):
            big.add(op.group(1))
    # the kernels, the row scale broadcast and multiply of the row scaling with its converts, the reshapes
    glue = {"stablehlo.multiply", "stablehlo.broadcast_in_dim", "stablehlo.convert", "stablehlo.reshape"}
    assert big == {"stablehlo.custom_call"} | glue, big


def test_reference_never_materialises_a_float32_softmax():
    """Off Neuron the compiled value_and_grad of bfloat16 logits holds less temporary memory than one float32 copy
    of the logits (the chunks are [N, 16384]; the gradient itself is bfloat16)."""
    n, vocab = 64, 8 * KERNEL_CHUNK
    x = jax.ShapeDtypeStruct((n, vocab), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((n,), jnp.int32)
    compiled = jax.jit(jax.value_and_grad(jax_nkilib.cross_entropy)).lower(x, y).compile()
    stats = compiled.memory_analysis()
    assert stats.temp_size_in_bytes < n * vocab * 4, stats.temp_size_in_bytes


@pytest.mark.parametrize(
    "labels, flags, error, match",
    [
        (lambda y: y.astype(jnp.float32), {}, TypeError, "labels.*integer"),
        (lambda y: y[:, :2], {}, ValueError, "labels"),
        (lambda y: y, {"reduction": "avg"}, ValueError, "reduction"),
        (lambda y: y, {"z_loss": -1.0}, ValueError, "z_loss"),
        (lambda y: y, {"ignore_index": 1.5}, TypeError, "ignore_index"),
    ],
)
def test_bad_inputs_name_the_argument(labels, flags, error, match):
    logits, y = batch(jnp.float32, vocab=20)
    with pytest.raises(error, match=match):
        jax_nkilib.cross_entropy(logits, labels(y), **flags)


def test_traced_static_arguments_are_refused():
    logits, labels = batch(jnp.float32, vocab=20)
    with pytest.raises(TypeError, match="z_loss.*static"):
        jax.jit(lambda x, y, z: jax_nkilib.cross_entropy(x, y, z_loss=z))(logits, labels, 0.1)
    with pytest.raises(TypeError, match="logits"):
        jax_nkilib.cross_entropy([[1.0, 2.0]], jnp.zeros((1,), jnp.int32))


def test_a_sharded_vocabulary_is_refused_by_name():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    logits, labels = batch(jnp.float32, vocab=64)
    with use_mesh(mesh):
        placed = jax.device_put(logits, NamedSharding(mesh, P(None, None, "data")))
        with pytest.raises(ValueError, match="logits.*vocabulary.*'data'"):
            jax_nkilib.cross_entropy(placed, labels)


def test_llama_training_loss_runs_the_two_loss_kernels_on_neuron():
    from jax_nkilib.models import llama

    config = llama.LlamaConfig(
        vocab=128, hidden=64, layers=1, heads=4, kv_heads=1, intermediate=128, max_len=16, rope_theta=10000.0
    )
    params = jax.eval_shape(lambda: llama.init_params(config, jax.random.key(0)))
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    with jax_nkilib.neuron.dry_run(), warnings.catch_warnings():
        warnings.simplefilter("ignore", jax_nkilib.neuron.NeuronFallbackWarning)  # the tiny model's other kernels
        text = neuron_text(jax.grad(lambda p, x, y: llama.loss(p, config, x, y)), params, tokens, tokens)
    names = [cfg["func_name"] for cfg in kernel_configs(text)]
    assert names.count("cross_entropy_forward") == names.count("cross_entropy_backward") == 1, names
