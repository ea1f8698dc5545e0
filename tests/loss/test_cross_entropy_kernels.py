"""jax_nkilib.nki.cross_entropy_forward / cross_entropy_backward against float64 oracles: chunked online LSE with a
partial last chunk, the output dtype policy, the backward's implied cotangent and in-place aliasing, the forward's
VJP on the backward kernel, Neuron lowering and limits, bad inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.nki import cross_entropy_backward, cross_entropy_forward
from tests.loss.oracle import losses, softmax_minus_onehot
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text
from tests.support.numerics import assert_close

N, V, CHUNK = 13, 100, 32  # V = 3 chunks of 32 + a partial chunk of 4; N odd


def inputs(dtype, n=N, vocab=V, seed=0):
    logits = random((n, vocab), dtype, seed, scale=3.0)
    targets = jnp.asarray(np.random.default_rng(seed + 1).integers(0, vocab, n), jnp.int32)
    return logits, targets


@pytest.mark.parametrize("logits_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk", [CHUNK, V])
def test_forward_matches_oracle(logits_dtype, dtype, chunk):
    logits, targets = inputs(logits_dtype)
    loss, lse = cross_entropy_forward(logits, targets, chunk_size=chunk, dtype=dtype)
    assert loss.shape == lse.shape == (N,) and loss.dtype == lse.dtype == dtype  # outputs in `dtype`
    want_loss, want_lse = losses(logits, targets)
    assert_close(lse, want_lse, dtype, reduction=V)
    # loss = lse - x_t: rounding of lse (about 3-digit magnitudes) relative to the loss' own scale
    assert_close(loss, want_loss, dtype, reduction=V, ops=8)


def test_forward_float64_logits_compute_and_return_float64():
    logits, targets = inputs(jnp.float64)
    loss, lse = cross_entropy_forward(logits, targets, chunk_size=CHUNK)  # dtype=bfloat16 is a Neuron setting
    assert loss.dtype == lse.dtype == jnp.float64
    want_loss, want_lse = losses(logits, targets)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-12)


def test_forward_is_stable_for_huge_logits():
    logits, targets = inputs(jnp.float32)
    logits = logits.at[:, 7].add(1e4).at[:, 70].add(1e4)  # exp overflows without the running max
    loss, lse = cross_entropy_forward(logits, targets, chunk_size=CHUNK, dtype=jnp.float32)
    want_loss, want_lse = losses(logits, targets)
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(lse))
    assert_close(lse, want_lse, jnp.float32, reduction=V)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("logits_dtype", [jnp.float32, jnp.bfloat16])
def test_backward_matches_oracle(reduction, inplace, logits_dtype):
    logits, targets = inputs(logits_dtype)
    _, lse = losses(logits, targets)
    lse = jnp.asarray(lse, jnp.float32)
    grad = cross_entropy_backward(
        logits, targets, lse, reduction=reduction, chunk_size=CHUNK, dtype=jnp.float32, inplace=inplace
    )
    # inplace: the gradient lives in the logits buffer (its dtype); otherwise a new array in `dtype`
    assert grad.shape == (N, V) and grad.dtype == (logits_dtype if inplace else jnp.float32)
    scale = 1.0 / N if reduction == "mean" else 1.0  # the implied cotangent of mean(loss) / sum(loss)
    assert_close(grad, scale * softmax_minus_onehot(logits, targets, lse), grad.dtype, reduction=V)


def test_backward_is_the_gradient_of_the_mean_or_sum_loss():
    """The kernel takes no upstream gradient: its output equals jax.grad of mean(loss) / sum(loss)."""
    logits, targets = inputs(jnp.float64)
    lse = cross_entropy_forward(logits, targets)[1]
    for reduction, reduce in (("mean", jnp.mean), ("sum", jnp.sum)):
        grad = cross_entropy_backward(logits, targets, lse, reduction=reduction, chunk_size=CHUNK)
        want = jax.grad(lambda x: reduce(cross_entropy_forward(x, targets, chunk_size=CHUNK)[0]))(logits)
        np.testing.assert_allclose(grad, want, atol=1e-14)


def test_forward_vjp_runs_the_backward_kernel_for_any_cotangents():
    """``dlogits = (dloss + dlse) (softmax - onehot) + dlse onehot`` for arbitrary row cotangents."""
    logits, targets = inputs(jnp.float32)
    w_loss, w_lse = random((N,), seed=5), random((N,), seed=6)

    def weighted(x):
        loss, lse = cross_entropy_forward(x, targets, chunk_size=CHUNK, dtype=jnp.float32)
        return jnp.sum(w_loss * loss) + jnp.sum(w_lse * lse)

    grad = jax.jit(jax.grad(weighted))(logits)
    g = softmax_minus_onehot(logits, targets)
    onehot = np.arange(V) == np.asarray(targets)[:, None]
    want = (np.asarray(w_loss, np.float64) + np.asarray(w_lse, np.float64))[:, None] * g + np.asarray(
        w_lse, np.float64
    )[:, None] * onehot
    assert_close(grad, want, jnp.float32, reduction=V)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(jax.grad(weighted), logits)
    forward, backward = kernel_configs(text)
    assert forward["func_name"] == "cross_entropy_forward" and backward["func_name"] == "cross_entropy_backward"
    assert backward["params"]["reduction"] == "sum" and backward["params"]["chunk_size"] == CHUNK


def test_vmap_of_the_mean_backward_keeps_each_calls_1_over_n():
    logits, targets = inputs(jnp.float32)
    lse = cross_entropy_forward(logits, targets, dtype=jnp.float32, chunk_size=CHUNK)[1]
    stacked = jnp.stack([logits, 2 * logits])
    got = jax.vmap(lambda x: cross_entropy_backward(x, targets, lse, chunk_size=CHUNK, dtype=jnp.float32))(stacked)
    for i in range(2):
        want = cross_entropy_backward(stacked[i], targets, lse, chunk_size=CHUNK, dtype=jnp.float32)
        np.testing.assert_array_equal(got[i], want)


@pytest.mark.parametrize("inplace", [True, False])
def test_neuron_lowering_aliases_the_logits_only_in_place(inplace):
    shapes = (
        jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16),
        jax.ShapeDtypeStruct((256,), jnp.int32),
        jax.ShapeDtypeStruct((256,), jnp.bfloat16),
    )
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=2):
        text = neuron_text(lambda *a: cross_entropy_backward(*a, chunk_size=2048, inplace=inplace), *shapes)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "cross_entropy_backward" and cfg["grid"] == 2
    assert cfg["input_names"] == ["logits_hbm", "targets_hbm", "lse_state_hbm"]
    assert compute_operations(text) == []
    if inplace:
        assert cfg["output_names"] == ["logits_hbm"] and cfg["aliases"] == [[0, 0]]
        assert "output_operand_aliases" in text
    else:
        assert cfg["output_names"] == ["grad_logits_hbm"] and cfg["aliases"] == []
        assert "output_operand_aliases" not in text


@pytest.mark.parametrize(
    "shape, dtype, flags, reason",
    [
        ((64, 1000), jnp.bfloat16, {}, "chunk_size=32768 must be <= V=1000"),  # the kernel's default chunk
        ((64, 70000), jnp.bfloat16, {"chunk_size": 65536}, "<= 65535"),
        ((64, 1000), jnp.bfloat16, {"chunk_size": 1000, "positions_per_batch": 256}, "positions_per_batch=256"),
        ((64, 65535), jnp.float32, {"chunk_size": 65535, "positions_per_batch": 128}, "exceeds 24 MiB"),
        ((64, 1000), jnp.float64, {"chunk_size": 1000}, "bfloat16 or float32 on Neuron"),
    ],
)
def test_neuron_limits_fall_back_or_raise(monkeypatch, shape, dtype, flags, reason):
    monkeypatch.setattr(neuron_lowering, "_warned", set())  # the warning is once per call site and reasons
    shapes = (jax.ShapeDtypeStruct(shape, dtype), jax.ShapeDtypeStruct(shape[:1], jnp.int32))
    call = lambda x, t: cross_entropy_forward(x, t, **flags)
    with jax_nkilib.neuron.dry_run(), pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match=reason):
        assert kernel_configs(neuron_text(call, *shapes)) == []
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error"):
        with pytest.raises(Exception, match=reason):
            neuron_text(call, *shapes)


def test_backward_sbuf_limit_and_the_forward_vjp_chunk_cap(monkeypatch):
    """float32 chunks of 32768 exceed the backward's 2*chunk*4 <= 229376 bytes: the kernel-native backward falls
    back; the forward's VJP caps its chunk (28672) so that the backward kernel runs."""
    monkeypatch.setattr(neuron_lowering, "_warned", set())
    x, t = jax.ShapeDtypeStruct((64, 65536), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32)
    lse = jax.ShapeDtypeStruct((64,), jnp.float32)
    with jax_nkilib.neuron.dry_run(), pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match="229376"):
        assert kernel_configs(neuron_text(lambda *a: cross_entropy_backward(*a, dtype=jnp.float32), x, t, lse)) == []
    loss = lambda x, t: jnp.sum(cross_entropy_forward(x, t, dtype=jnp.float32)[0])
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error"):
        forward, backward = kernel_configs(neuron_text(jax.grad(loss), x, t))
    assert forward["params"]["chunk_size"] == 32768 and backward["params"]["chunk_size"] == 28672


@pytest.mark.parametrize(
    "args, flags, error, match",
    [
        (lambda x, t: (x[None], t), {}, ValueError, "logits_hbm.*N, V"),
        (lambda x, t: (x, t.astype(jnp.float32)), {}, TypeError, "targets_hbm"),
        (lambda x, t: (x, t[:-1]), {}, ValueError, "targets_hbm"),
        (lambda x, t: (x.astype(jnp.float16), t), {}, TypeError, "logits_hbm"),
        (lambda x, t: (x, t), {"dtype": jnp.float16}, ValueError, "dtype.*bfloat16 or jnp.float32"),
        (lambda x, t: (x, t), {"chunk_size": 0}, ValueError, "chunk_size"),
        (lambda x, t: (x, t), {"positions_per_batch": 2.0}, TypeError, "positions_per_batch"),
    ],
)
def test_forward_bad_inputs_name_the_argument(args, flags, error, match):
    logits, targets = inputs(jnp.float32)
    with pytest.raises(error, match=match):
        jax.jit(lambda x, t: cross_entropy_forward(*args(x, t), **flags)).trace(logits, targets)


@pytest.mark.parametrize(
    "flags, lse_len, error, match",
    [
        ({"reduction": "none"}, N, ValueError, "reduction"),
        ({"inplace": 1}, N, TypeError, "inplace"),
        ({}, N + 1, ValueError, "lse_state_hbm"),
    ],
)
def test_backward_bad_inputs_name_the_argument(flags, lse_len, error, match):
    logits, targets = inputs(jnp.float32)
    with pytest.raises(error, match=match):
        cross_entropy_backward(logits, targets, jnp.zeros((lse_len,), jnp.float32), **flags)
