"""jax_nkilib.nki.attention_mxfp8_tkg against a float64 oracle of the kernel's MXFP8 datapath; transformations;
Neuron lowering; errors."""

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import attention_mxfp8_tkg
from tests.quant.test_mx import oracle_decode_cache, oracle_encode_cache, oracle_round_trip
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.sharding import mesh_1d, shard

D = 128
CHUNK = 2048


def bf16(x):
    """float64 values rounded to bfloat16 (nearest even)."""
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def mxfp8_oracle(q, k_active, v_active, k_prior, v_prior, mask, table=None):
    """float64 loops over rows and 2048-token chunks, rounding where the kernel's datapath rounds: q * 1/sqrt(d)
    to bf16 then MXFP8 along d; scores masked to -65504 and rounded to bf16; online softmax from -1e38 with
    p = bf16(exp(s - m)) summed as is and MXFP8-quantized along the tokens for p . v; the active tokens as a last
    chunk of 2048 (masked zero padding) with k quantized along d and v along the tokens; out = bf16(acc / l)."""
    q, k_active, v_active = (bf16(np.asarray(x, np.float32)) for x in (q, k_active, v_active))
    batch, heads, s_active, d = q.shape
    rows = heads * s_active
    q_rt = oracle_round_trip(bf16(q.reshape(batch, rows, d) / math.sqrt(d)), -1)
    keys_all, values_all = oracle_decode_cache(k_prior, "d_head"), oracle_decode_cache(v_prior, "block_len")
    mask = np.asarray(mask).reshape(batch, rows, -1) != 0
    s_prior = mask.shape[-1] - s_active
    table = np.arange(len(keys_all))[None].repeat(batch, 0) if table is None else np.asarray(table)
    out = np.zeros((batch, rows, d))
    for b in range(batch):
        keys, values = keys_all[table[b]].reshape(-1, d), values_all[table[b]].reshape(-1, d)
        visible = np.zeros((rows, len(keys)), bool)
        visible[:, :s_prior] = mask[b, :, :s_prior]
        chunks = [
            (keys[t : t + CHUNK], values[t : t + CHUNK], visible[:, t : t + CHUNK]) for t in range(0, len(keys), CHUNK)
        ]
        active = np.zeros((CHUNK, d)), np.zeros((CHUNK, d)), np.zeros((rows, CHUNK), bool)
        active[0][:s_active] = oracle_round_trip(k_active[b], -1)
        active[1][:s_active] = oracle_round_trip(v_active[b], 0)
        active[2][:, :s_active] = mask[b, :, s_prior:]
        m, total, acc = np.full((rows, 1), -1e38), np.zeros((rows, 1)), np.zeros((rows, d))
        for keys_c, values_c, visible_c in chunks + [active]:
            scores = bf16(np.where(visible_c, q_rt[b] @ keys_c.T, -65504.0))
            m_new = np.maximum(m, scores.max(axis=1, keepdims=True))
            correction = np.exp(m - m_new)
            p = bf16(np.exp(scores - m_new))
            total = total * correction + p.sum(axis=1, keepdims=True)
            acc = acc * correction + oracle_round_trip(p, -1) @ values_c
            m = m_new
        out[b] = bf16(acc / total)
    return out.reshape(batch, heads, s_active, d)


def assert_matches(out, want, exact=0.99, bound=2.0**-7):
    """bf16 ``out`` equals the oracle bit for bit on most entries (the rest: float32-vs-float64 ties flipping a
    bf16 or e4m3 rounding) and is within ``bound`` (normwise, relative) everywhere."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert out.shape == want.shape
    assert np.mean(out == want) >= exact, f"only {np.mean(out == want):.3f} of the outputs are bit-identical"
    error = np.max(np.abs(out - want)) / np.max(np.abs(want))
    assert error <= bound, f"relative error {error:.3e} exceeds {bound:.3e}"


def problem(batch=2, heads=4, s_active=2, n_blocks=20, s_prior=2300, dtype=jnp.bfloat16, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((batch, heads, s_active, D)) * 2, dtype)
    k_active, v_active = (jnp.asarray(rng.standard_normal((batch, s_active, D)), dtype) for _ in range(2))
    k_prior = jnp.asarray(oracle_encode_cache(rng.standard_normal((n_blocks, 128, D)), "d_head"))
    v_prior = jnp.asarray(oracle_encode_cache(rng.standard_normal((n_blocks, 128, D)), "block_len"))
    mask = jnp.asarray(rng.uniform(size=(batch, heads, s_active, s_prior + s_active)) < 0.7, jnp.uint8)
    return q, k_active, v_active, k_prior, v_prior, mask


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("with_table", [False, True])
def test_matches_oracle(dtype, with_table):
    args = problem(dtype=dtype, n_blocks=24 if with_table else 20)
    # a pool of 24 blocks, each row reading 20 of them (repeats allowed): one full 2048-token chunk and a partial one
    table = jnp.asarray(np.random.default_rng(1).integers(0, 24, (2, 20)), jnp.int32) if with_table else None
    out = attention_mxfp8_tkg(*args, active_blocks_table=table)
    assert out.shape == (2, 4, 2, D) and out.dtype == jnp.bfloat16
    assert_matches(out, mxfp8_oracle(*args, table))
    if dtype == jnp.float32:  # inputs are read as bfloat16, the kernel's input dtype
        rounded = [a.astype(jnp.bfloat16) for a in args[:3]]
        np.testing.assert_array_equal(
            np.asarray(out, np.float32), np.asarray(attention_mxfp8_tkg(*rounded, *args[3:], None, table), np.float32)
        )


def test_masks_empty_rows_and_no_prior():
    q, k_active, v_active, k_prior, v_prior, mask = problem(batch=1, heads=4, n_blocks=3, s_prior=300)
    mask = np.array(mask)
    mask[0, 0, 0] = 0  # sees nothing: the mean of every V row, padding included (the kernel computes whole chunks)
    mask[0, 1, 1, :300] = 0  # sees only the active tokens
    mask[0, 2, 0, 300:] = 0  # sees only the cache
    args = (q, k_active, v_active, k_prior, v_prior, jnp.asarray(mask))
    out = attention_mxfp8_tkg(*args)
    want = mxfp8_oracle(*args)
    assert_matches(out, want)
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    values = np.concatenate(
        [
            oracle_decode_cache(v_prior, "block_len").reshape(-1, D),
            np.zeros((CHUNK - 2, D)),
            oracle_round_trip(bf16(np.asarray(v_active[0], np.float32)), 0),
        ]
    )
    np.testing.assert_allclose(np.asarray(out[0, 0, 0], np.float32), values.mean(axis=0), atol=2e-3)
    no_prior = (q, k_active, v_active, k_prior, v_prior, jnp.asarray(mask[..., 300:]))  # s_prior = 0
    assert_matches(attention_mxfp8_tkg(*no_prior), mxfp8_oracle(*no_prior))


def test_vmap_folds_and_zero_gradients():
    # jit == eager and vmap == a loop: the conformance spec attention_mxfp8_tkg
    q, k_active, v_active, k_prior, v_prior, mask = problem(batch=2, heads=2, n_blocks=2, s_prior=200)
    fn = lambda q_, ka: attention_mxfp8_tkg(q_, ka, v_active, k_prior, v_prior, mask)  # noqa: E731
    assert "scan" not in str(jax.make_jaxpr(jax.vmap(fn))(jnp.stack([q, -q]), jnp.stack([k_active, k_active])))
    grads = jax.grad(lambda a, b: jnp.sum(fn(a, b).astype(jnp.float32)), argnums=(0, 1))(q, k_active)
    assert all(g.dtype == jnp.bfloat16 and not np.any(np.asarray(g, np.float32)) for g in grads)


def test_inside_shard_map():
    mesh = mesh_1d()
    q, k_active, v_active, k_prior, v_prior, mask = problem(batch=8, heads=2, s_active=1, n_blocks=2, s_prior=250)
    table = jnp.asarray(np.random.default_rng(2).integers(0, 2, (8, 2)), jnp.int32)
    specs = (P("data"), P("data"), P("data"), P(), P(), P("data"), P("data"))
    fn = jax.shard_map(
        lambda q_, ka, va, kp, vp, m, t: attention_mxfp8_tkg(q_, ka, va, kp, vp, m, active_blocks_table=t),
        mesh=mesh,
        in_specs=specs,
        out_specs=P("data"),
    )
    out = jax.jit(fn)(*shard(mesh, specs, q, k_active, v_active, k_prior, v_prior, mask, table))
    assert_matches(out, mxfp8_oracle(q, k_active, v_active, k_prior, v_prior, mask, table))


def test_neuron_lowering():
    q, k_active, v_active, k_prior, v_prior, mask = problem(batch=1, heads=32, s_active=1, n_blocks=16, s_prior=2000)
    table = jnp.arange(16, dtype=jnp.int32)[None]
    identity = jnp.eye(128, dtype=jnp.bfloat16)
    call = lambda *a: attention_mxfp8_tkg(*a)  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        (cfg,) = kernel_configs(neuron_text(call, q, k_active, v_active, k_prior, v_prior, mask, identity, table))
        assert cfg["func_name"] == "attention_mxfp8_tkg" and cfg["output_names"] == ["out_hbm"]
        assert cfg["entry_point"] == "nkilib.experimental.attention_mxfp8.attention_mxfp8_tkg:attention_mxfp8_tkg"
        assert cfg["input_names"] == [
            "q",
            "k_active",
            "v_active",
            "k_prior",
            "v_prior",
            "mask",
            "identity_hbm",
            "active_blocks_table",
        ]
        with pytest.warns(NeuronFallbackWarning, match="the kernel needs active_blocks_table"):
            text = neuron_text(call, q, k_active, v_active, k_prior, v_prior, mask, identity)
        assert "AwsNeuronCustomNativeKernel" not in text
        with pytest.warns(NeuronFallbackWarning, match="got float32; H=4 query heads must be 32 or 64"):
            small = problem(batch=1, n_blocks=16, s_prior=2000, dtype=jnp.float32)
            neuron_text(call, *small, identity, table)


def _bad(**changes):
    """Keyword arguments of a small valid call with ``changes`` (callables, so nothing is built at collection)."""

    def build():
        q, k_active, v_active, k_prior, v_prior, mask = problem(batch=1, heads=2, n_blocks=2, s_prior=100)
        args = dict(q=q, k_active=k_active, v_active=v_active, k_prior=k_prior, v_prior=v_prior, mask=mask)
        return dict(args, **{name: make() for name, make in changes.items()})

    return build


BAD = [
    (
        _bad(
            q=lambda: jnp.zeros((1, 2, 2, 64)),
            k_active=lambda: jnp.zeros((1, 2, 64)),
            v_active=lambda: jnp.zeros((1, 2, 64)),
        ),
        ValueError,
        "must have d = 128, fixed by the MXFP8 cache block",
    ),
    (_bad(k_prior=lambda: jnp.zeros((2, 32, 128), jnp.float32)), ValueError, "argument `k_prior`"),
    (
        _bad(mask=lambda: jnp.ones((1, 2, 2, 1), jnp.uint8)),
        ValueError,
        r"mask must be \[B, H, s_active, s_prior \+ s_active\]",
    ),
    (_bad(mask=lambda: jnp.ones((1, 2, 2, 259), jnp.uint8)), ValueError, "0 <= s_prior <= 256"),
    (_bad(mask=lambda: jnp.ones((1, 3, 2, 102), jnp.uint8)), ValueError, "argument `mask`"),
    (_bad(mask=lambda: jnp.ones((1, 2, 2, 102), jnp.int32)), TypeError, "argument `mask` must have dtype"),
    (_bad(k_active=lambda: jnp.zeros((1, 2, 128), jnp.float32)), TypeError, "must share one dtype"),
    (_bad(active_blocks_table=lambda: jnp.zeros((1, 2), jnp.float32)), TypeError, "argument `active_blocks_table`"),
    (_bad(active_blocks_table=lambda: jnp.zeros((2, 2), jnp.int32)), ValueError, "argument `active_blocks_table`"),
    (
        _bad(identity_hbm=lambda: jnp.eye(64, dtype=jnp.bfloat16)),
        ValueError,
        r"identity_hbm must be a \[>=128, >=128\]",
    ),
]


@pytest.mark.parametrize("case", BAD, ids=lambda c: c[2])
def test_bad_inputs(case):
    build, error, fragment = case
    with pytest.raises(error, match=fragment):
        attention_mxfp8_tkg(**build())
