"""jax_nkilib.nki.topk_reduce against a float64 NumPy oracle that reads the packed int32 token ids from the raw bytes
of the last two 16-bit columns (as the kernel's DMA does); reverse mode; Neuron lowering; errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib.nki import topk_reduce
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close


def packed(values, ids):
    """``values [N, H]`` with the int32 ``ids`` appended as 2 columns of the same 16-bit type (bytes, not values)."""
    values = np.asarray(values)
    id_columns = np.ascontiguousarray(np.asarray(ids, "<i4")).view(values.dtype).reshape(len(ids), 2)
    return jnp.asarray(np.concatenate([values, id_columns], axis=1))


def oracle(input, T, K, base=0):
    """``out[t]`` = sum of the first ``K`` rows (in row order) whose packed id minus ``base`` is ``t``."""
    raw = np.asarray(input)
    ids = np.ascontiguousarray(raw[:, -2:]).view("<i4").reshape(-1) - base
    values = raw[:, :-2].astype(np.float64)
    out = np.zeros((T, values.shape[1]))
    for t in range(T):
        out[t] = values[np.flatnonzero(ids == t)[:K]].sum(axis=0)
    return out, ids


def scattered(t, k, h, dtype, seed=0, base=0, padding=4, extra=()):
    """Each token's ``k`` rows shuffled among ``padding`` rows with id -1 (plus ``extra`` rows for listed tokens)."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.repeat(np.arange(t), k), np.full(padding, -1 - base), np.asarray(extra, int)])
    ids = ids[rng.permutation(ids.size)] + base
    values = np.asarray(jnp.asarray(rng.standard_normal((ids.size, h)), dtype))
    return packed(values, ids)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("t, k, h", [(5, 3, 12), (1, 8, 7), (33, 2, 130)])
def test_matches_oracle(dtype, t, k, h):
    x = scattered(t, k, h, dtype)
    out = topk_reduce(x, T=t, K=k)
    assert out.shape == (t, h) and out.dtype == dtype
    assert_close(out, oracle(x, t, k)[0], dtype, reduction=k)


def test_only_the_first_k_rows_of_a_token_count():
    x = scattered(4, 2, 9, jnp.bfloat16, seed=3, extra=(1, 1, 3))  # tokens 1 and 3 have surplus rows
    assert_close(topk_reduce(x, T=4, K=2), oracle(x, 4, 2)[0], jnp.bfloat16, reduction=2)
    full, _ = oracle(x, 4, 4)
    assert not np.allclose(np.asarray(topk_reduce(x, T=4, K=2), np.float64)[1], full[1])


def test_token_base_index_one_is_the_2_32_packing():
    x = scattered(6, 2, 10, jnp.bfloat16, seed=4, base=1)  # ids 1..6, padding rows -1
    assert_close(topk_reduce(x, T=6, K=2, token_base_index=1), oracle(x, 6, 2, base=1)[0], jnp.bfloat16, reduction=2)


def test_reverse_mode_sends_each_summed_row_its_tokens_cotangent():
    x = scattered(4, 3, 8, jnp.bfloat16, seed=5, extra=(2,))
    cotangent = jnp.asarray(np.random.default_rng(6).standard_normal((4, 8)), jnp.bfloat16)
    _, pullback = jax.vjp(lambda x: topk_reduce(x, T=4, K=3), x)
    (grad,) = pullback(cotangent)
    _, ids = oracle(x, 4, 3)
    want = np.zeros(x.shape)
    for t in range(4):
        want[np.flatnonzero(ids == t)[:3], :8] = np.asarray(cotangent, np.float64)[t]
    np.testing.assert_array_equal(np.asarray(grad, np.float64), want)


def test_vmap_and_jit_match_single_calls():
    xs = jnp.stack([scattered(3, 2, 6, jnp.bfloat16, seed=s) for s in range(3)])
    fn = lambda x: topk_reduce(x, T=3, K=2)
    batched = jax.jit(jax.vmap(fn))(xs)
    for i in range(3):
        np.testing.assert_array_equal(batched[i], fn(xs[i]))


def test_neuron_lowering_and_fallback():
    x = jax.ShapeDtypeStruct((70, 258), jnp.bfloat16)
    with jax_nkilib.neuron.dry_run():
        (config,) = kernel_configs(neuron_text(lambda x: topk_reduce(x, T=16, K=4), x))
        assert config["entry_point"] == "jax_nkilib_kernels.moe_tkg:topk_reduce"
        assert (config["params"]["T"], config["params"]["K"], config["params"]["token_base_index"]) == (16, 4, 0)
        with pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match="K <= 8"):
            assert kernel_configs(neuron_text(lambda x: topk_reduce(x, T=7, K=10), x)) == []


@pytest.mark.parametrize(
    "make, flags, error, fragment",
    [
        (lambda: jnp.zeros((4, 2), jnp.bfloat16), dict(T=1, K=1), ValueError, "H >= 1"),
        (lambda: jnp.zeros((4, 6), jnp.float32), dict(T=1, K=1), TypeError, "input"),
        (lambda: jnp.zeros((4, 6), jnp.bfloat16), dict(T=0, K=1), ValueError, "`T`"),
        (lambda: jnp.zeros((4, 6), jnp.bfloat16), dict(T=2), TypeError, "`K`"),
    ],
)
def test_bad_inputs_are_named(make, flags, error, fragment):
    with pytest.raises(error, match=fragment):
        topk_reduce(make(), **flags)
