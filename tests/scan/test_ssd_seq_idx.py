"""jax_nkilib.ssd with ``seq_idx`` (Mamba-2's packed sequences) against the float64 sequential loop with state resets
(tests/scan/test_ssm_ops.py's ``mamba2_loop``): forward and final states in float32 (bfloat16 -m slow) with resets
inside chunks, on chunk boundaries and sequences spanning chunks; packing equals separate runs; float64 gradients;
jit and vmap; the Neuron lowering (no ``ssd`` kernel call, a NeuronFallbackWarning naming seq_idx, an error under
on_unsupported="error") and bad seq_idx."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronUnsupportedError
from tests.scan.test_ssm_ops import mamba2_inputs, mamba2_loop
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close


def packed(*lengths, batch=1):
    """``seq_idx [batch, sum(lengths)]``: sequence ``k`` of every row spans ``lengths[k]`` tokens."""
    row = np.repeat(np.arange(len(lengths), dtype=np.int32), lengths)
    return jnp.asarray(np.tile(row, (batch, 1)))


def kernel_names(fn, *args):
    with jax_nkilib.neuron.dry_run():
        return [config["func_name"] for config in kernel_configs(neuron_text(fn, *args))]


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=pytest.mark.slow)])
def test_ssd_with_seq_idx_matches_the_float64_loop_with_resets(dtype):
    # 2 groups, D per channel, z, dt_bias, initial states; L = 29 with chunk 8: a reset inside chunk 0 (t = 3), on a
    # chunk boundary (t = 16), a one-token sequence, a sequence across chunks, and rows starting at other indices
    args = mamba2_inputs(2, 29, 4, 3, 2, 5, dtype=dtype, seed=11)
    seq_idx = jnp.asarray(
        np.stack([np.repeat([0, 1, 2, 3], [3, 13, 1, 12]), np.repeat([4, 5, 9], [8, 8, 13])]).astype(np.int32)
    )
    out, final = jax.jit(
        lambda a, s: jax_nkilib.ssd(**a, chunk_size=8, dt_softplus=True, return_final_states=True, seq_idx=s)
    )(args, seq_idx)
    assert out.shape == args["x"].shape and out.dtype == dtype and final.dtype == jnp.float32
    want, want_final = mamba2_loop(**args, dt_softplus=True, seq_idx=seq_idx)
    assert_close(out, want, dtype, reduction=32, ops=8)
    assert_close(final, want_final, dtype, reduction=32)
    # the resets matter: without seq_idx the loop differs after the first reset
    unpacked = mamba2_loop(**args, dt_softplus=True)[0]
    assert np.abs(unpacked[:, 3:] - want[:, 3:]).max() > 0.1


def test_packing_two_sequences_equals_running_them_separately():
    args = mamba2_inputs(2, 19, 2, 3, 1, 4, dtype=jnp.float64, seed=12)
    first, second = 7, 12
    split = {name: (v[:, :first], v[:, first:]) for name, v in args.items() if name in ("x", "dt", "B", "C", "z")}
    shared = {name: args[name] for name in ("A", "D", "dt_bias")}
    ssd = jax.jit(jax_nkilib.ssd, static_argnames=("chunk_size", "dt_softplus", "return_final_states"))
    flags = dict(chunk_size=4, dt_softplus=True, return_final_states=True)
    out, final = ssd(**args, **flags, seq_idx=packed(first, second, batch=2))
    # the initial states belong to the first sequence; the final states are the last sequence's
    out_1, _ = ssd(**{k: v[0] for k, v in split.items()}, **shared, initial_states=args["initial_states"], **flags)
    out_2, final_2 = ssd(**{k: v[1] for k, v in split.items()}, **shared, **flags)
    np.testing.assert_allclose(out, jnp.concatenate([out_1, out_2], axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(final, final_2, rtol=1e-12, atol=1e-12)


def test_ssd_with_seq_idx_gradients_float64():
    args = mamba2_inputs(1, 6, 2, 2, 1, 2, jnp.float64, seed=13)
    seq_idx = packed(2, 4)

    def fn(*a):
        return jax_nkilib.ssd(*a[:5], 3, *a[5:], dt_softplus=True, return_final_states=True, seq_idx=seq_idx)

    check_grads(jax.jit(fn), tuple(args.values()), order=1, modes=["rev"])


def test_ssd_with_seq_idx_under_jit_and_vmap():
    args = mamba2_inputs(2, 11, 2, 3, 1, 2, jnp.float32, seed=14)
    del args["z"], args["dt_bias"]
    # row 1 is not non-decreasing: every change of the index starts a sequence (3, 1, 3 are three sequences)
    seq_idx = jnp.asarray(np.stack([np.repeat([0, 1], [4, 7]), np.repeat([3, 1, 3], [6, 1, 4])]).astype(np.int32))

    def run(x, dt, A, B, C, D, h0, seq_idx):
        return jax_nkilib.ssd(x, dt, A, B, C, 4, D, None, None, h0, return_final_states=True, seq_idx=seq_idx)

    want = mamba2_loop(**args, seq_idx=seq_idx)
    jitted = jax.jit(run)(*args.values(), seq_idx)
    # vmap over a leading axis: each row of the batch as its own call of batch 1 (A and D unbatched)
    rows = {k: (v[:, None] if k not in ("A", "D") else v) for k, v in args.items()}
    in_axes = tuple(None if k in ("A", "D") else 0 for k in args) + (0,)
    mapped = jax.jit(jax.vmap(run, in_axes=in_axes))(*rows.values(), seq_idx[:, None])
    for got, mapped_got, expected in zip(jitted, mapped, want):
        assert_close(got, expected, jnp.float32, reduction=32, ops=8)
        assert_close(mapped_got[:, 0], expected, jnp.float32, reduction=32, ops=8)


def test_seq_idx_lowers_without_the_kernel_and_warns_on_neuron():
    args = mamba2_inputs(2, 256, 4, 64, 1, 16, jnp.bfloat16)
    seq_idx = packed(100, 156, batch=2)
    with pytest.warns(NeuronFallbackWarning, match="`seq_idx`.*no sequence index"):
        names = kernel_names(lambda a, s: jax_nkilib.ssd(**a, chunk_size=128, seq_idx=s), args, seq_idx)
    assert names == []
    assert kernel_names(lambda a: jax_nkilib.ssd(**a, chunk_size=128), args) == ["ssd"]
    with jax_nkilib.config(on_unsupported="error"), pytest.raises(NeuronUnsupportedError, match="seq_idx"):
        kernel_names(lambda a, s: jax_nkilib.ssd(**a, chunk_size=128, seq_idx=s), args, seq_idx)


@pytest.mark.parametrize(
    "seq_idx, error, fragment",
    [
        (np.zeros((2, 9), np.float32), TypeError, "`seq_idx` [batch, L]"),
        (np.zeros((2, 8), np.int32), ValueError, "`seq_idx` must have layout [batch, L]"),
        (np.zeros(9, np.int32), ValueError, "`seq_idx` must have layout [batch, L]"),
        ([0, 1], TypeError, "`seq_idx` must be an array"),
    ],
)
def test_ssd_bad_seq_idx(seq_idx, error, fragment):
    args = mamba2_inputs(2, 9, 4, 3, 2, 2)
    with pytest.raises(error) as info:
        jax_nkilib.ssd(**args, chunk_size=4, seq_idx=seq_idx)
    assert fragment in str(info.value)
