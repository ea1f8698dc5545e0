"""jax_nkilib.nki.swa_fused_cte: the fused SWA layer against a float64 oracle, cache writes (incl. FP8 bytes),
transformations, Neuron lowering and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import swa_fused_cte
from tests.support.data import angles, random
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

BLOCK = 4
FP8_MAX = {np.dtype(jnp.float8_e4m3fn): 448.0, np.dtype(jnp.float8_e5m2): 240.0}


# ----------------------------------------------------------------------------------------------- float64 oracle
def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + np.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def swa_oracle(
    hidden,
    qkv_w,
    op_w,
    k_cache,
    v_cache,
    tables,
    cos,
    sin,
    sink,
    prior,
    qkv_b,
    op_b,
    k_scale=None,
    v_scale=None,
    *,
    scale=1.0,
    sliding_window=128,
    block_size=BLOCK,
    num_q_heads,
    num_kv_heads,
    d_head,
):
    """``(out float64, k_cache, v_cache)`` with the caches in their own dtype, token by token."""
    f64 = lambda x: np.asarray(x).astype(np.float64)  # noqa: E731
    hidden_dtype = np.dtype(hidden.dtype)
    n_q, n_kv, d, w = num_q_heads, num_kv_heads, d_head, sliding_window
    batch, seq, _ = hidden.shape
    prior = int(np.asarray(prior).reshape(-1)[0])
    tables = np.asarray(tables)
    qkv = np.einsum("bsh,hi->bsi", f64(hidden), f64(qkv_w)) + f64(qkv_b)[0]
    cos, sin = f64(cos)[:, :, None, :], f64(sin)[:, :, None, :]
    q = _rotate(qkv[..., : n_q * d].reshape(batch, seq, n_q, d), cos, sin) * scale
    k = _rotate(qkv[..., n_q * d : (n_q + n_kv) * d].reshape(batch, seq, n_kv, d), cos, sin)
    v = qkv[..., (n_q + n_kv) * d :].reshape(batch, seq, n_kv, d)

    k_new, v_new = np.array(k_cache), np.array(v_cache)
    packed = k_new.ndim == 5
    k_s = None if k_scale is None else float(np.asarray(k_scale)[0, 0])
    v_s = None if v_scale is None else float(np.asarray(v_scale)[0, 0])

    def stored(x, cache, s):
        if s is None:
            return x.astype(cache.dtype)
        rounded = x.astype(hidden_dtype).astype(np.float64)
        limit = FP8_MAX[np.dtype(cache.dtype)]
        return np.clip(rounded / s, -limit, limit).astype(cache.dtype)

    first = -(-prior // block_size)
    for b in range(batch):
        for s in range(seq):
            blk, slot = tables[b, first + s // block_size], s % block_size
            for g in range(n_kv):
                if packed:
                    k_new[blk, g, slot // 2, :, slot % 2] = stored(k[b, s, g], k_new, k_s)
                else:
                    k_new[blk, g, slot, :] = stored(k[b, s, g], k_new, k_s)
                v_new[blk, g, slot, :] = stored(v[b, s, g], v_new, v_s)

    def read(cache, blk, slot, s, is_packed):
        token = cache[blk, :, slot // 2, :, slot % 2] if is_packed else cache[blk, :, slot, :]
        return f64(token) * (1.0 if s is None else s)

    group = n_q // n_kv
    out = np.zeros((batch, seq, n_q * d))
    for b in range(batch):
        # keys by absolute position: prior tokens from the (updated) cache, active ones fresh (unquantized)
        keys = [read(k_new, tables[b, p // block_size], p % block_size, k_s, packed) for p in range(prior)]
        values = [read(v_new, tables[b, p // block_size], p % block_size, v_s, False) for p in range(prior)]
        keys, values = np.array(keys + list(k[b])), np.array(values + list(v[b]))  # [T, n_kv, d]
        positions = np.arange(prior + seq)
        for s in range(seq):
            pos = prior + s
            visible = (positions <= pos) & (positions >= pos - (w - 1))
            for h in range(n_q):
                scores = keys[visible, h // group] @ q[b, s, h]
                logits = np.append(scores, f64(sink)[b, h])
                weights = np.exp(logits - logits.max())
                weights = weights[:-1] / weights.sum()
                out[b, s, h * d : (h + 1) * d] = weights @ values[visible, h // group]
    return out @ f64(op_w) + f64(op_b)[0], k_new, v_new


# ------------------------------------------------------------------------------------------------------ inputs
def problem(dtype=jnp.float32, batch=2, seq=8, hidden=16, n_q=4, n_kv=2, d=8, n_blocks=16, max_blocks=6, seed=0):
    width = (n_q + 2 * n_kv) * d
    tables = np.random.default_rng(seed).permutation(n_blocks)[: batch * max_blocks].reshape(batch, max_blocks)
    cos, sin = angles((batch, seq, d), jnp.float32, seed + 9)
    return dict(
        hidden=random((batch, seq, hidden), dtype, seed, 0.5),
        qkv_w=random((hidden, width), dtype, seed + 1, 0.3),
        op_w=random((n_q * d, hidden), dtype, seed + 2, 0.3),
        tables=jnp.asarray(tables, jnp.int32),
        k_cache=random((n_blocks, n_kv, BLOCK, d), dtype, seed + 3),
        v_cache=random((n_blocks, n_kv, BLOCK, d), dtype, seed + 4),
        cos=cos,
        sin=sin,
        sink=random((batch, n_q), jnp.float32, seed + 5),
        qkv_b=random((1, width), dtype, seed + 6, 0.2),
        op_b=random((1, hidden), dtype, seed + 7, 0.2),
    )


ORDER = ("hidden", "qkv_w", "op_w", "k_cache", "v_cache", "tables", "cos", "sin", "sink")


def args_of(pr, prior):
    return tuple(pr[n] for n in ORDER) + (jnp.array([[prior]], jnp.int32), pr["qkv_b"], pr["op_b"])


def flags_of(pr, **extra):
    n_kv, d = pr["k_cache"].shape[1], pr["v_cache"].shape[-1]
    return dict(block_size=BLOCK, num_q_heads=pr["sink"].shape[1], num_kv_heads=n_kv, d_head=d, **extra)


# ---------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(prior=0, n_kv=1),
        dict(prior=3, sliding_window=5),
        dict(prior=16, sliding_window=6, scale=0.35, n_kv=4),
    ],
)
def test_matches_oracle(dtype, config):
    pr = problem(dtype, n_kv=config.get("n_kv", 2))
    args = args_of(pr, config.get("prior", 9))
    flags = flags_of(pr, **{k: config[k] for k in ("sliding_window", "scale") if k in config})
    out, k_new, v_new = swa_fused_cte(*args, **flags)
    want, k_want, v_want = swa_oracle(*args, **flags)
    assert out.dtype == dtype and k_new.dtype == dtype and k_new.shape == pr["k_cache"].shape
    assert_close(out, want, dtype, reduction=16, ops=2)
    assert_close(k_new, k_want, dtype, reduction=16)
    assert_close(v_new, v_want, dtype, reduction=16)
    for new, old in ((k_new, pr["k_cache"]), (v_new, pr["v_cache"])):  # exactly the B * S active slots change
        changed = (np.asarray(new) != np.asarray(old)).any(axis=(1, 3))
        assert changed.sum() == 2 * 8


def _exact_problem(dtype):
    """Small integers and cos/sin in {0, +-1}: every value before quantization is exact in every precision, so
    FP8 bytes can be compared exactly."""
    pr = problem(dtype)
    rng = np.random.default_rng(3)
    for name in ("hidden", "qkv_w", "qkv_b"):
        pr[name] = jnp.asarray(rng.integers(-2, 3, pr[name].shape), dtype)
    theta = rng.integers(0, 4, pr["cos"].shape) * (np.pi / 2)
    pr["cos"], pr["sin"] = (
        jnp.asarray(np.round(np.cos(theta)), jnp.float32),
        jnp.asarray(np.round(np.sin(theta)), jnp.float32),
    )
    return pr


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
@pytest.mark.parametrize("exact", [True, False])
def test_fp8_caches(fp8, exact):
    dtype = jnp.bfloat16
    pr = _exact_problem(dtype) if exact else problem(dtype)
    n_blocks, n_kv, _, d = pr["k_cache"].shape
    k_tokens = random((n_blocks, n_kv, BLOCK, d), jnp.float32, 11, 4.0).astype(fp8)
    pr["k_cache"] = jnp.stack([k_tokens[:, :, 0::2], k_tokens[:, :, 1::2]], axis=-1)  # [.., block/2, d, 2]
    pr["v_cache"] = random((n_blocks, n_kv, BLOCK, d), jnp.float32, 12, 4.0).astype(fp8)
    scales = jnp.full((128, 1), 2.0**-6 if exact else 0.25, jnp.float32), jnp.full((128, 1), 0.5, jnp.float32)
    args = args_of(pr, 9) + scales
    out, k_new, v_new = swa_fused_cte(*args, **flags_of(pr, scale=0.5))
    want, k_want, v_want = swa_oracle(*args, **flags_of(pr, scale=0.5))
    assert k_new.dtype == fp8 and k_new.shape == (n_blocks, n_kv, BLOCK // 2, d, 2) and v_new.dtype == fp8
    assert_close(out, want, dtype, reduction=16, ops=2)
    if exact:
        clamped = float(np.float32(FP8_MAX[np.dtype(fp8)]).astype(fp8))  # e5m2 rounds its 240 clamp to 256
        assert (np.abs(np.asarray(k_want, np.float32)) == clamped).any()  # the clamp is exercised
        np.testing.assert_array_equal(np.asarray(k_new).view(np.uint8), np.asarray(k_want).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(v_new).view(np.uint8), np.asarray(v_want).view(np.uint8))
    else:  # float32 vs float64 values before the bf16 rounding: at most a rare one-step difference
        for got, expected in ((k_new, k_want), (v_new, v_want)):
            steps = np.abs(np.asarray(got).view(np.uint8).astype(int) - np.asarray(expected).view(np.uint8))
            assert steps.max() <= 1 and steps.mean() < 0.02


# -------------------------------------------------------------------------------------------- transformations
def test_runtime_prior_under_jit_and_vmap():
    pr = problem()
    fn = jax.jit(lambda *a: swa_fused_cte(*a, **flags_of(pr, sliding_window=7)))
    for prior in (0, 4, 13):
        got, want = fn(*args_of(pr, prior)), swa_oracle(*args_of(pr, prior), **flags_of(pr, sliding_window=7))
        for g, w in zip(got, want):
            assert_close(g, w, jnp.float32, reduction=16, ops=2)
    assert fn._cache_size() == 1  # prior_tokens is a runtime value: one compilation
    # vmap: batched hidden states and tables over one shared cache; each element updates its own copy
    other = problem(seed=5)
    in_axes = (0, None, None, None, None, 0) + (None,) * 6
    stacked = [jnp.stack([pr[n], other[n]]) if n in ("hidden", "tables") else pr[n] for n in ORDER]
    args = tuple(stacked) + args_of(pr, 9)[len(ORDER) :]
    outs = jax.vmap(lambda *a: swa_fused_cte(*a, **flags_of(pr)), in_axes=in_axes)(*args)
    mixed = dict(pr, hidden=other["hidden"], tables=other["tables"])
    for got, want in zip(outs, swa_oracle(*args_of(mixed, 9), **flags_of(pr))):
        assert got.shape[0] == 2
        assert_close(got[1], want, jnp.float32, reduction=16, ops=2)


def test_gradients_of_out():
    pr = {k: v.astype(jnp.float64) if v.dtype == jnp.float32 else v for k, v in problem(seq=4).items()}
    prior = jnp.array([[6]], jnp.int32)
    flags = flags_of(pr, sliding_window=5, scale=0.7)

    def out(hidden, qkv_w, op_w, k_cache, sink, qkv_b, op_b):
        return swa_fused_cte(
            hidden,
            qkv_w,
            op_w,
            k_cache,
            pr["v_cache"],
            pr["tables"],
            pr["cos"],
            pr["sin"],
            sink,
            prior,
            qkv_b,
            op_b,
            **flags,
        )[0]

    check_grads(
        jax.jit(out),
        tuple(pr[n] for n in ("hidden", "qkv_w", "op_w", "k_cache", "sink", "qkv_b", "op_b")),
        order=1,
        modes=["rev"],
    )
    # the updated caches are not differentiable outputs: zero cotangent by definition
    grad = jax.grad(lambda h: jnp.sum(swa_fused_cte(*args_of(dict(pr, hidden=h), 6), **flags)[1]))(pr["hidden"])
    assert not np.asarray(grad).any()


def test_shard_map_over_batch_with_per_device_cache_pools():
    """Data parallel: each device holds one sequence and its own pool of cache blocks (local block ids)."""
    mesh = mesh_1d()
    pr = problem(batch=8, n_blocks=32, max_blocks=4)
    pr["tables"] = jnp.asarray(np.stack([np.random.default_rng(b).permutation(8)[:4] for b in range(8)]), jnp.int32)
    pools = {n: random((64,) + pr[n].shape[1:], jnp.float32, i) for i, n in enumerate(("k_cache", "v_cache"))}
    args = args_of(dict(pr, **pools), 5)
    specs = (P("data"),) + (P(),) * 2 + (P("data"),) * 6 + (P(),) * 3
    fn = jax.shard_map(
        lambda *a: swa_fused_cte(*a, **flags_of(pr)), mesh=mesh, in_specs=specs, out_specs=(P("data"),) * 3
    )
    out, k_new, v_new = (np.asarray(x) for x in jax.jit(fn)(*shard(mesh, specs, *args)))
    for dev in range(8):
        local = [a[dev : dev + 1] if s == P("data") else a for a, s in zip(args, specs)]
        local[3], local[4] = args[3][8 * dev : 8 * dev + 8], args[4][8 * dev : 8 * dev + 8]
        want, k_want, v_want = swa_oracle(*local, **flags_of(pr))
        assert_close(out[dev : dev + 1], want, jnp.float32, reduction=16, ops=2)
        assert_close(k_new[8 * dev : 8 * dev + 8], k_want, jnp.float32)
        assert_close(v_new[8 * dev : 8 * dev + 8], v_want, jnp.float32)


# ----------------------------------------------------------------------------------------------------- Neuron
def _kernel_sized(dtype=jnp.bfloat16, fp8=None, n_q=4):
    """Shapes that meet the kernel's limits: S = 128, d_head = 64, block_size = 32, H = 128."""
    n_kv, d, block = 2, 64, 32
    args = [
        jnp.zeros((1, 128, 128), dtype),
        jnp.zeros((128, (n_q + 2 * n_kv) * d), dtype),
        jnp.zeros((n_q * d, 128), dtype),
        jnp.zeros((16, n_kv, block, d), dtype),
        jnp.zeros((16, n_kv, block, d), dtype),
        jnp.zeros((1, 8), jnp.int32),
        jnp.zeros((1, 128, d), jnp.float32),
        jnp.zeros((1, 128, d), jnp.float32),
        jnp.zeros((1, n_q), jnp.float32),
        jnp.zeros((1, 1), jnp.int32),
        jnp.zeros((1, (n_q + 2 * n_kv) * d), dtype),
        jnp.zeros((1, 128), dtype),
    ]
    if fp8 is not None:
        args[3], args[4] = jnp.zeros((16, n_kv, block // 2, d, 2), fp8), jnp.zeros((16, n_kv, block, d), fp8)
        args += [jnp.ones((128, 1), jnp.float32), jnp.ones((128, 1), jnp.float32)]
    return args, dict(block_size=block, num_q_heads=n_q, num_kv_heads=n_kv, d_head=d, scale=0.125)


@pytest.mark.parametrize("lnc, fp8", [(1, None), (2, None), (1, jnp.float8_e4m3fn)])
def test_neuron_lowering_is_one_aliased_kernel_call(lnc, fp8):
    args, flags = _kernel_sized(fp8=fp8)
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = neuron_text(lambda *a: swa_fused_cte(*a, **flags), *args)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "swa_fused_cte" and cfg["grid"] == lnc and cfg["aliases"] == [[3, 1], [4, 2]]
    assert cfg["entry_point"] == "nkilib.experimental.attention.swa_fused_cte:swa_fused_cte"
    assert cfg["params"] == dict(flags, sliding_window=128) and cfg["output_names"] == ["out", "k_cache", "v_cache"]
    assert cfg["input_names"][-2:] == (["k_scale", "v_scale"] if fp8 else ["qkv_bias", "op_bias"])
    assert "output_operand_aliases" in text and text.count("AwsNeuronCustomNativeKernel") == 1


@pytest.mark.parametrize(
    "change, limit",
    [
        (dict(sliding_window=64), "sliding_window=64 must be 128"),
        (dict(lnc=2, n_q=2), "num_q_heads=2 / LNC=2 must be even"),
        (dict(small=True), "S=8 must be a multiple of 128"),
    ],
)
def test_neuron_limits_fall_back_to_the_reference(change, limit):
    args, flags = _kernel_sized(n_q=change.get("n_q", 4))
    if change.get("small"):
        pr = problem(jnp.bfloat16)
        args, flags = args_of(pr, 4), flags_of(pr)
    flags.update({k: v for k, v in change.items() if k == "sliding_window"})
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=change.get("lnc", 1)):
        with pytest.warns(NeuronFallbackWarning, match=limit):
            text = neuron_text(lambda *a: swa_fused_cte(*a, **flags), *args)
    assert "AwsNeuronCustomNativeKernel" not in text


# ------------------------------------------------------------------------------------------------- bad inputs
def _fp8_caches(pr):
    n_blocks, n_kv, _, d = pr["k_cache"].shape
    return (
        jnp.zeros((n_blocks, n_kv, BLOCK // 2, d, 2), jnp.float8_e4m3fn),
        jnp.zeros((n_blocks, n_kv, BLOCK, d), jnp.float8_e4m3fn),
    )


@pytest.mark.parametrize(
    "case, error, fragment",
    [
        ("defaults", ValueError, "d_head=64 does not match the caches' last axis (8)"),
        ("num_q_heads", ValueError, "num_q_heads=2 does not match sink's second axis (4)"),
        ("gqa", ValueError, "num_q_heads=3 must be a multiple of num_kv_heads=2"),
        ("odd_d", ValueError, "d_head=5 must be even"),
        (
            "columns",
            ValueError,
            "qkv_weight has 72 columns; it must have (num_q_heads + 2 * num_kv_heads) * d_head = 64",
        ),
        ("tables", ValueError, "active tokens need 2 of block_size=4"),
        ("window", ValueError, "`sliding_window` must be positive"),
        ("weights_dtype", TypeError, "`op_weight` must have the dtype of hidden_states"),
        ("fp8_no_scale", ValueError, "`k_scale` is required for an FP8 k_cache"),
        ("scale_no_fp8", ValueError, "`v_scale` is only accepted with an FP8 v_cache"),
        ("unpacked_fp8", TypeError, "`k_cache` must be FP8 exactly when packed"),
        ("prior_dtype", TypeError, "`prior_tokens` must have dtype in (int32)"),
    ],
)
def test_bad_inputs(case, error, fragment):
    pr = problem(n_q=3 if case == "gqa" else 4, d=5 if case == "odd_d" else 8, max_blocks=1 if case == "tables" else 6)
    flags = {} if case == "defaults" else flags_of(pr)
    args, extra = list(args_of(pr, 4)), []
    if case == "num_q_heads":
        flags[case] = 2
    if case == "columns":
        args[1], args[10] = jnp.zeros((16, 72), jnp.float32), jnp.zeros((1, 72), jnp.float32)
    if case == "window":
        flags["sliding_window"] = 0
    if case == "weights_dtype":
        args[2] = args[2].astype(jnp.bfloat16)
    if case == "fp8_no_scale":
        args[3], args[4] = _fp8_caches(pr)
    if case == "scale_no_fp8":
        extra = [None, jnp.ones((128, 1), jnp.float32)]
    if case == "unpacked_fp8":
        args[3], args[4] = pr["k_cache"].astype(jnp.float8_e4m3fn), _fp8_caches(pr)[1]
        extra = [jnp.ones((128, 1), jnp.float32)] * 2
    if case == "prior_dtype":
        args[9] = jnp.zeros((1, 1), jnp.float32)
    with pytest.raises(error) as info:
        swa_fused_cte(*args, *extra, **flags)
    assert fragment in str(info.value)
