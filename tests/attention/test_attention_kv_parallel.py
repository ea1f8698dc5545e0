"""jax_nkilib.nki.attention_kv_parallel_segmented_cte on 8 CPU devices: the KV-parallel group is a mesh axis (vmap,
gradients and seg_size naming the argument: the conformance spec attention_kv_parallel_segmented_cte)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.nki import attention_kv_parallel_segmented_cte as kv_parallel
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, mesh_1d, shard

G, QH, S, D, BLOCK, N_BLOCKS, MAX_BLOCKS = 8, 2, 8, 16, 4, 5, 3
LOCAL = MAX_BLOCKS * BLOCK
Q_START = 40  # global position of query 0
SPECS = (P("kvp"), P("kvp"), P("kvp"), P("kvp"), P("kvp"), P("kvp"), P(), P())


def problem(dtype=jnp.float32, round_robin=False, cache_dtype=None):
    """Per-rank inputs stacked along axis 0 (sharded over `kvp`)."""
    q = random((G * QH, S, D), dtype, 0)
    cache_dtype = cache_dtype or dtype
    k_cache = random((G * N_BLOCKS, 1, BLOCK, D), jnp.float32, 1).astype(cache_dtype)
    v_cache = random((G * N_BLOCKS, 1, BLOCK, D), jnp.float32, 2).astype(cache_dtype)
    rng = np.random.default_rng(3)
    tables = jnp.asarray(np.stack([rng.permutation(N_BLOCKS)[:MAX_BLOCKS] for _ in range(G)]), jnp.int32)
    ranks = jnp.arange(G, dtype=jnp.int32)[:, None]
    offsets = jnp.full((G, 1), Q_START, jnp.int32) if round_robin else Q_START - ranks * LOCAL
    return q, k_cache, v_cache, tables, offsets, ranks


def oracle(
    q, k_cache, v_cache, tables, offsets, ranks, *, round_robin=False, scale=1.0, window=0, k_scale=None, v_scale=None
):
    """float64: every rank's heads attend the union of all ranks' local tokens, each masked by its owner's
    positions (contiguous: local token t at t, query i at offset + i; round-robin: global block b * G + rank)."""
    q, offsets, ranks = (np.asarray(x, np.float64) for x in (q, offsets, ranks))
    k_cache, v_cache = (np.asarray(jnp.asarray(c, jnp.float32), np.float64) for c in (k_cache, v_cache))
    keys, values, allowed = [], [], []
    i = np.arange(S)[:, None]
    for g in range(G):
        pages = tables[g]
        k = k_cache[g * N_BLOCKS + np.asarray(pages), 0].reshape(LOCAL, D)
        v = v_cache[g * N_BLOCKS + np.asarray(pages), 0].reshape(LOCAL, D)
        keys.append(k * (1.0 if k_scale is None else np.asarray(k_scale)[:D, 0]))
        values.append(v * (1.0 if v_scale is None else float(v_scale[0, 0])))
        t = np.arange(LOCAL)[None, :]
        pos = ((t // BLOCK) * G + ranks[g, 0]) * BLOCK + t % BLOCK if round_robin else t
        q_pos = offsets[g, 0] + i
        ok = pos <= q_pos
        if window:
            ok &= pos > q_pos - window
        allowed.append(ok)
    keys, values, allowed = np.concatenate(keys), np.concatenate(values), np.concatenate(allowed, axis=1)
    scores = np.where(allowed, scale * np.einsum("hsd,td->hst", q, keys), -np.inf)
    top = scores.max(-1, keepdims=True)
    weights = np.where(allowed, np.exp(scores - np.where(np.isfinite(top), top, 0.0)), 0.0)
    total = weights.sum(-1, keepdims=True)
    return np.einsum("hst,td->hsd", weights / np.where(total > 0, total, 1.0), values)


def run(fn, *args, specs=SPECS, out_spec=P("kvp")):
    mesh = mesh_1d("kvp")
    body = jax.shard_map(fn, mesh=mesh, in_specs=specs[: len(args)], out_specs=out_spec)
    return jax.jit(body)(*shard(mesh, specs, *args))


def call(q, k, v, t, o, r=None, ks=None, vs=None, **flags):
    flags = dict(
        dict(replica_groups="kvp", group_size=G, block_size=BLOCK, seg_size=S, global_q_offset=Q_START), **flags
    )
    return kv_parallel(q, k, v, t, o, r, None, ks, vs, **flags)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("round_robin", [False, True])
def test_matches_oracle(dtype, round_robin):
    args = problem(dtype, round_robin)
    flags = dict(kvp_group_size=G) if round_robin else {}
    out = run(functools.partial(call, **flags), *args)
    assert out.dtype == dtype
    assert_close(out, oracle(*args, round_robin=round_robin), dtype, reduction=G * LOCAL)


def test_sliding_window_scale_and_transposed_output():
    args = problem()
    out = run(functools.partial(call, sliding_window=20, scale=0.4, tp_out=True), *args)
    assert out.shape == (G * QH, D, S)
    assert_close(jnp.swapaxes(out, 1, 2), oracle(*args, window=20, scale=0.4), jnp.float32, reduction=G * LOCAL)


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_packed_cache_with_scales(fp8):
    q, k_cache, v_cache, tables, offsets, ranks = problem(jnp.bfloat16, cache_dtype=fp8)
    # packed K: tokens 2i and 2i + 1 of a block share a row, in the trailing pair
    k_packed = jnp.swapaxes(k_cache.reshape(G * N_BLOCKS, 1, BLOCK // 2, 2, D), 3, 4)
    k_scale = jnp.asarray(np.linspace(0.5, 1.5, 128)[:, None], jnp.float32)
    v_scale = jnp.full((128, 1), 0.75, jnp.float32)
    out = run(functools.partial(call, fp8_packed=True), q, k_packed, v_cache, tables, offsets, ranks, k_scale, v_scale)
    want = oracle(q, k_cache, v_cache, tables, offsets, ranks, k_scale=k_scale, v_scale=v_scale)
    assert_close(out, want, jnp.bfloat16, reduction=G * LOCAL)


def test_rows_seeing_no_key_are_zero():
    q, k, v, t, _, r = problem()
    early = jnp.full((G, 1), -LOCAL * G, jnp.int32)  # every key lies after every query
    out = run(call, q, k, v, t, early, r)
    assert np.all(np.asarray(out) == 0)


def test_neuron_lowering_is_one_collective_kernel_call_with_rank_lists():
    mesh = make_mesh((4, 2), ("kvp", "tp"))
    q, k, v, t, o, r = problem()
    specs = (P(("kvp", "tp")), P("kvp"), P("kvp"), P("kvp"), P("kvp"))
    body = jax.shard_map(functools.partial(call, group_size=4), mesh=mesh, in_specs=specs, out_specs=P(("kvp", "tp")))
    args = (q, k[: 4 * N_BLOCKS], v[: 4 * N_BLOCKS], t[:4], o[:4])
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(body, *shard(mesh, specs, *args))
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "attention_kv_parallel_segmented_cte" and cfg["has_collectives"] is True
    assert cfg["params"]["replica_groups"] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert 'has_collectives = "1"' in text
    assert operations(text).count("stablehlo.custom_call") == 1
    assert not {"stablehlo.all_gather", "stablehlo.all_to_all"} & set(operations(text))


@pytest.mark.parametrize(
    "flags, error, fragment",
    [
        (dict(group_size=4), ValueError, "has 8 ranks"),
        (dict(replica_groups="nope"), ValueError, "not bound here"),
        (dict(replica_groups=3), TypeError, "mesh axis name"),
        (dict(block_size=8), ValueError, "block axis"),
        (dict(kvp_group_size=G, rank=False), ValueError, "kvp_rank_id"),
        (dict(apc_mode=True), ValueError, "valid_num_prior_tokens"),
    ],
)
def test_bad_inputs(flags, error, fragment):
    q, k, v, t, o, r = problem()
    if not flags.pop("rank", True):
        r = None
    with pytest.raises(error) as info:
        run(lambda *a: call(*a[:5], r if r is None else a[5], **flags), q, k, v, t, o, r if r is not None else o)
    assert fragment in str(info.value)


def test_outside_shard_map_names_the_missing_axis():
    q, k, v, t, o, r = problem()
    with pytest.raises(ValueError, match="inside jax.shard_map"):
        call(q[:QH], k[:N_BLOCKS], v[:N_BLOCKS], t[:1], o[:1])


def test_more_than_one_kv_head_is_rejected():
    q, k, v, t, o, r = problem()
    two = lambda c: jnp.concatenate([c, c], axis=1)  # noqa: E731
    with pytest.raises(ValueError, match="KV head 0 only"):
        run(call, q, two(k), two(v), t, o)
