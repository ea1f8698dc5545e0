"""permute_routed_tokens (catalog row 78) against a NumPy oracle that simulates the kernel's argsort pass by pass
(``max8`` then ``nc_match_replace8``, as its torch reference describes the hardware) and packs the rows with NumPy
byte views. Outputs are compared bit for bit."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import kernel_configs


def oracle_argsort_ascending(values):
    """Pass ``p`` takes the 8 largest remaining values; the values are matched from the 8th down to the 1st, each
    to its first remaining occurrence; the ascending result writes pass ``p`` reversed into the ``p``-th block from
    the end."""
    data = np.asarray(values, np.float64).copy()
    n = data.size
    out = np.zeros(n, np.int64)
    passes = n // 8
    for p in range(passes):
        top = np.sort(data)[::-1][:8]
        picked = np.zeros(8, np.int64)
        for j in range(7, -1, -1):
            position = int(np.flatnonzero(data == top[j])[0])
            picked[j] = position
            data[position] = -np.inf
        start = 8 * (passes - p) - 1
        for j in range(8):
            out[start - j] = picked[j]
    return out


def oracle(hidden, expert_index, affinities):
    """``[T*K, C + n]`` packed rows as bytes of ``hidden``'s dtype."""
    hidden, expert_index = np.asarray(hidden), np.asarray(expert_index)
    affinities = np.asarray(affinities).astype(ml_dtypes.bfloat16)
    tokens, k = expert_index.shape
    order = oracle_argsort_ascending(expert_index.ravel())
    token = order // k
    expert = expert_index.ravel()[order]
    affinity = affinities[token, expert]  # [T*K] bfloat16
    dtype = hidden.dtype
    tail = [
        affinity.view(np.uint8).view(dtype).reshape(tokens * k, -1),
        token.astype(np.int32).view(np.uint8).view(dtype).reshape(tokens * k, -1),
    ]
    return np.concatenate([hidden[token]] + tail, axis=1)


def routing(tokens, k, experts, seed, dtype=jnp.bfloat16, cols=5):
    rng = np.random.default_rng(seed)
    index = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    affinities = np.zeros((tokens, experts))
    np.put_along_axis(affinities, index, rng.uniform(0.05, 1.0, (tokens, k)), axis=1)
    hidden = rng.standard_normal((tokens, cols)) * 3
    return jnp.asarray(hidden, dtype), jnp.asarray(index), jnp.asarray(affinities, jnp.bfloat16)


def as_bytes(x):
    return np.asarray(x).view(np.uint8)


@pytest.mark.parametrize(
    "tokens, k, experts",
    [(8, 1, 4), (6, 4, 8), (16, 8, 8), (12, 2, 64), (32, 4, 5)],
)
def test_bfloat16_matches_oracle(tokens, k, experts):
    hidden, index, affinities = routing(tokens, k, experts, seed=tokens * k)
    out = jax.jit(nki.permute_routed_tokens)(hidden, index, affinities)
    assert out.dtype == jnp.bfloat16 and out.shape == (tokens * k, 5 + 3)
    np.testing.assert_array_equal(as_bytes(out), as_bytes(oracle(hidden, index, affinities)))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float8_e4m3])
def test_fp8_matches_oracle(dtype):
    hidden, index, affinities = routing(12, 2, 6, seed=5, dtype=dtype, cols=7)
    out = nki.permute_routed_tokens(hidden, index, affinities)
    assert out.dtype == dtype and out.shape == (24, 7 + 6)
    np.testing.assert_array_equal(as_bytes(out), as_bytes(oracle(hidden, index, affinities)))


def test_rows_are_grouped_by_expert_with_the_packed_columns():
    """Decoding the packed columns gives back the routing: expert order, token ids and affinities."""
    hidden, index, affinities = routing(10, 4, 8, seed=7)
    out = np.asarray(nki.permute_routed_tokens(hidden, index, affinities))
    token = out[:, -2:].view(np.int32).ravel()
    affinity = out[:, -3]
    expert = np.sort(np.asarray(index).ravel())  # rows are sorted by expert
    assert all(e in np.asarray(index)[t] for t, e in zip(token, expert)), "each row is a (token, expert) pair"
    np.testing.assert_array_equal(out[:, :5], np.asarray(hidden)[token])
    np.testing.assert_array_equal(affinity, np.asarray(affinities)[token, expert])
    assert sorted(np.bincount(token, minlength=10)) == [4] * 10


def test_tie_order_is_the_kernels():
    """16 tokens all routed to one expert: the kernel's passes give tokens 8-15, then 0-7 (not a stable sort)."""
    hidden = jnp.asarray(np.arange(16 * 2).reshape(16, 2), jnp.bfloat16)
    index = jnp.zeros((16, 1), jnp.int32)
    affinities = jnp.ones((16, 3), jnp.bfloat16)
    out = np.asarray(nki.permute_routed_tokens(hidden, index, affinities))
    np.testing.assert_array_equal(out[:, -2:].view(np.int32).ravel(), [*range(8, 16), *range(8)])


def test_not_differentiable():
    hidden, index, affinities = routing(4, 2, 4, seed=1)
    grad = jax.grad(lambda h: jnp.sum(nki.permute_routed_tokens(h, index, affinities).astype(jnp.float32)))(hidden)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), 0.0)


# ---------------------------------------------------------------------------------------------------- bad inputs
def test_bad_inputs_name_the_argument():
    hidden, index, affinities = routing(6, 4, 8, seed=2)
    with pytest.raises(ValueError, match=r"T\*K=18 \(expert_index \[T, K\]\) must be a multiple of 8"):
        nki.permute_routed_tokens(hidden, index[:, :3], affinities)
    with pytest.raises(TypeError, match="expert_affinities_masked"):
        nki.permute_routed_tokens(hidden, index, affinities.astype(jnp.float32))
    with pytest.raises(TypeError, match="hidden_input"):
        nki.permute_routed_tokens(hidden.astype(jnp.float32), index, affinities)
    with pytest.raises(ValueError, match="expert_affinities_masked"):
        nki.permute_routed_tokens(hidden, index, affinities[:5])


# ------------------------------------------------------------------------------------------------ Neuron limits
@pytest.mark.parametrize("tokens, k, reason", [(17, 8, r"T\*K=136 must be <= 128"), (8, 3, r"K=3 must be one of")])
def test_neuron_limits_fall_back_with_the_reason(tokens, k, reason):
    args = (
        jax.ShapeDtypeStruct((tokens, 16), jnp.bfloat16),
        jax.ShapeDtypeStruct((tokens, k), jnp.int32),
        jax.ShapeDtypeStruct((tokens, 8), jnp.bfloat16),
    )
    with jax_nkilib.neuron.dry_run(), pytest.warns(NeuronFallbackWarning, match=reason):
        text = jax.jit(nki.permute_routed_tokens).trace(*args).lower(lowering_platforms=("neuron",)).as_text()
    assert kernel_configs(text) == []


def test_runtime_check_reports_an_expert_outside_the_affinities():
    hidden, index, affinities = routing(4, 2, 8, seed=3)
    bad = index.at[2, 1].set(8)
    with jax_nkilib.config(runtime_checks=True):
        checked = jax.jit(checkify.checkify(nki.permute_routed_tokens, errors=checkify.user_checks))
        err, _ = checked(hidden, bad, affinities)
        assert checked(hidden, index, affinities)[0].get() is None
    assert "expert_index[2 1] = 8 is outside [0, E=8)" in err.get()
