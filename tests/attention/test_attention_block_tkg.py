"""jax_nkilib.nki.attention_block_tkg against a float64 NumPy oracle written from the kernel's semantics (catalog
1.20): flat, transposed and block caches, the cache update (skips, aliasing), FP8 KV, the output projection
layouts, KVDP inside shard_map, vmap, the Neuron lowering and bad inputs."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.nki import attention_block_tkg
from tests.support.hlo import kernel_configs, neuron_text
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, run_sharded

SKIP = np.iinfo(np.uint32).max


# ----------------------------------------------------------------------------------------------- float64 oracle
def _f64(x):
    return None if x is None else np.asarray(jnp.asarray(x, jnp.float32) if x.dtype != np.float64 else x, np.float64)


def _rms(x, axis, eps, gamma=None):
    y = x / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + eps)
    return y if gamma is None else y * gamma


def _rope(x, cos, sin, contiguous):
    """``x [B, S, n, d]``, tables ``[d/2, B, S]``: rotate pairs (i, i + d/2) or (2i, 2i + 1)."""
    c, s = cos.transpose(1, 2, 0)[:, :, None], sin.transpose(1, 2, 0)[:, :, None]
    half = x.shape[-1] // 2
    a, b = (x[..., :half], x[..., half:]) if contiguous else (x[..., 0::2], x[..., 1::2])
    ra, rb = a * c - b * s, b * c + a * s
    return np.concatenate([ra, rb], -1) if contiguous else np.stack([ra, rb], -1).reshape(x.shape)


def _fp8(x):
    return np.clip(x, -240, 240).astype(ml_dtypes.float8_e4m3).astype(np.float64)


def _fp8_weights(x, dtype):
    """``x`` clipped to the FP8 ``dtype``'s range and rounded to it (the activation of a STATIC projection)."""
    fmt = np.dtype(dtype)
    top = float(ml_dtypes.finfo(fmt).max)
    return np.clip(x, -top, top).astype(fmt).astype(np.float64)


def oracle(args, flags, rank=None, kvdp=1, all_q=None):
    """``(out, K_out, V_out)`` in float64. ``all_q``: with KVDP, every rank's scaled queries ``[KVDP, B, q, S, d]``."""
    a = {k: _f64(v) for k, v in args.items()}
    x = a["X"]
    batch, seq, hidden = x.shape
    d = a["V_cache"].shape[-1]
    q = a["W_qkv"].shape[1] // d - 2
    if flags.get("rmsnorm_X_enabled"):
        eps = flags.get("rmsnorm_X_eps") or 1e-3
        x = x * a["rmsnorm_X_gamma"][0] / np.sqrt(np.sum(x * x, -1, keepdims=True) / hidden + eps)
    if flags.get("quantization_type_qkv") == "STATIC":
        in_s, w_s = a["input_dequant_scale_qkv"][0, 0], a["weight_dequant_scale_qkv"][0]
        seg = np.repeat(w_s, [q * d, d, d]) * in_s
        t = _fp8_weights(x / in_s, args["W_qkv"].dtype) @ a["W_qkv"] * seg
    else:
        t = x @ a["W_qkv"]
    t = t + (0 if a.get("bias_qkv") is None else a["bias_qkv"][0])
    heads = t.reshape(batch, seq, q + 2, d)
    qs, k, v = heads[:, :, :q], heads[:, :, q], heads[:, :, q + 1]
    for stage in ("pre", "post"):
        if stage == "post" and a.get("cos") is not None:
            contiguous = flags.get("rope_contiguous_layout", True)
            qs, k = (
                _rope(qs, a["cos"], a["sin"], contiguous),
                _rope(k[:, :, None], a["cos"], a["sin"], contiguous)[:, :, 0],
            )
        if flags.get(f"rmsnorm_QK_{stage}_rope_enabled"):
            eps = flags.get(f"rmsnorm_QK_{stage}_rope_eps", 1e-6)
            gq, gk = (a.get(f"rmsnorm_QK_{stage}_rope_W_{h}") for h in "QK")
            qs = _rms(qs, -1, eps, None if gq is None else gq[0])
            k = _rms(k, -1, eps, None if gk is None else gk[0])
    if a.get("k_scale") is not None:
        k, v = _fp8(k * a["k_scale"][0, 0]), _fp8(v * a["v_scale"][0, 0])
    scale = flags.get("softmax_scale") or d**-0.5
    qs = qs.transpose(0, 2, 1, 3) * scale  # [B, q, S, d]
    b_attn = batch // kvdp
    rows = slice(0, batch) if rank is None else slice(rank * b_attn, (rank + 1) * b_attn)
    if all_q is not None:
        qs = np.concatenate(list(all_q), axis=1)  # [B, KVDP q, S, d], rank-major heads
    qs, k, v = qs[rows], k[rows], v[rows]
    mask = np.asarray(args["attention_mask"]) != 0  # [S_ctx, B_attn, Hq, S]
    s_ctx = mask.shape[0]
    if a.get("active_blocks_table") is not None:
        table = np.asarray(args["active_blocks_table"]).astype(np.int64)
        keys = a["K_cache"][table].reshape(len(table), -1, d)
        values = a["V_cache"][table].reshape(len(table), -1, d)
    else:
        keys = a["K_cache"].swapaxes(1, 2) if flags.get("K_cache_transposed") else a["K_cache"]
        values = a["V_cache"]
    keys, values = keys[:, :s_ctx].copy(), values[:, :s_ctx].copy()
    keys[:, s_ctx - seq :], values[:, s_ctx - seq :] = k, v
    scores = np.einsum("bhid,bsd->bhis", qs, keys)
    scores = np.where(mask.transpose(1, 2, 3, 0), scores, -np.inf)
    top = scores.max(-1, keepdims=True)
    sink = a.get("sink")
    if sink is not None:
        top = np.maximum(top, sink[None, :, :, None])
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True) + (0 if sink is None else np.exp(sink[None, :, :, None] - top))
    attn = np.einsum("bhis,bsd->bhdi", weights / total, values)  # [B_attn, Hq, d, S]
    if kvdp > 1:
        attn = attn  # gathered by the caller
    if flags.get("update_cache"):
        K_out, V_out = _update(a, args, k, v, flags)
    else:
        K_out, V_out = k.transpose(2, 0, 1), v[:, None]
    if a.get("W_out") is None:
        return attn, K_out, V_out
    flat = attn.transpose(0, 3, 1, 2).reshape(batch * seq, q * d)
    if flags.get("quantization_type_out") == "STATIC":
        in_s, w_s = a["input_dequant_scale_out"][0, 0], a["weight_dequant_scale_out"][0, 0]
        out = _fp8_weights(flat / in_s, args["W_out"].dtype) @ a["W_out"] * (w_s * in_s)
    else:
        out = flat @ a["W_out"]
    out = out + (0 if a.get("bias_out") is None else a["bias_out"][0])
    if flags.get("transposed_out"):
        lnc = flags.get("lnc", 1)
        out = out.reshape(batch * seq, lnc, 128, hidden // lnc // 128).transpose(2, 1, 3, 0)
    return out, K_out, V_out


def _update(a, args, k, v, flags):
    index = np.asarray(args["kv_cache_update_idx"]).astype(np.uint32).reshape(-1).astype(np.int64)
    K, V = a["K_cache"].copy(), a["V_cache"].copy()
    seq = k.shape[1]
    block = a.get("active_blocks_table") is not None
    if block:
        d = K.shape[-1]
        K, V = K.reshape(-1, d), V.reshape(-1, d)
    for b, start in enumerate(index):
        for s in range(seq):
            pos = start + s
            if block:
                if pos < len(K):
                    K[pos], V[pos] = k[b, s], v[b, s]
            elif pos < V.shape[1]:
                if flags.get("K_cache_transposed"):
                    K[b, :, pos] = k[b, s]
                else:
                    K[b, pos] = k[b, s]
                V[b, pos] = v[b, s]
    return K.reshape(a["K_cache"].shape), V.reshape(a["V_cache"].shape)


# ------------------------------------------------------------------------------------------------------ inputs
def _mask(rng, s_ctx, batch, heads, seq, dense=False):
    """Random visibility of the prior slots, causal over the last ``seq`` (each query sees itself)."""
    m = (rng.uniform(size=(s_ctx, batch, heads, seq)) < 0.6) | dense
    tail = np.arange(seq)[:, None] <= np.arange(seq)[None, :]  # slot j visible to query i when j <= i
    m[s_ctx - seq :] = np.broadcast_to(tail[:, None, None, :], (seq, batch, heads, seq))
    return jnp.asarray(m, jnp.uint8)


def make_args(
    dtype=jnp.float32,
    *,
    B=3,
    S=2,
    H=128,
    d=16,
    q=3,
    s_max=24,
    s_ctx=20,
    seed=0,
    norm=True,
    rope=True,
    bias=True,
    w_out=True,
    transposed=False,
    update=False,
    qk_norm=False,
    sink=False,
    fp8=False,
):
    rng = np.random.default_rng(seed)

    def r(shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    width = d * (q + 2)
    cache_dtype = jnp.float8_e4m3 if fp8 else dtype
    k_cache = jnp.asarray(rng.standard_normal((B, s_max, d)), cache_dtype)
    args = dict(
        X=r((B, S, H)),
        rmsnorm_X_gamma=r((1, H)) if norm else None,
        W_qkv=r((H, width), H**-0.5),
        bias_qkv=r((1, width), 0.3) if bias else None,
        K_cache=jnp.swapaxes(k_cache, 1, 2) if transposed else k_cache,
        V_cache=jnp.asarray(rng.standard_normal((B, s_max, d)), cache_dtype),
        attention_mask=_mask(rng, s_ctx, B, q, S),
    )
    if rope:
        theta = rng.uniform(-np.pi, np.pi, (d // 2, B, S))
        args.update(cos=jnp.asarray(np.cos(theta), dtype), sin=jnp.asarray(np.sin(theta), dtype))
    if qk_norm:
        for stage in ("pre", "post"):
            args[f"rmsnorm_QK_{stage}_rope_W_Q"] = r((1, d))
            args[f"rmsnorm_QK_{stage}_rope_W_K"] = r((1, d))
    if sink:
        args["sink"] = r((q, 1))
    if update:
        starts = rng.permutation(s_max - S)[:B].astype(np.uint32)
        args["kv_cache_update_idx"] = jnp.asarray(starts[:, None])
    if w_out:
        args.update(W_out=r((q * d, H), (q * d) ** -0.5), bias_out=r((1, H), 0.3) if bias else None)
    if fp8:
        args.update(k_scale=jnp.full((1, 1), 0.5, jnp.float32), v_scale=jnp.full((128, 1), 2.0, jnp.float32))
    flags = dict(
        rmsnorm_X_enabled=norm,
        K_cache_transposed=transposed,
        update_cache=update,
        rmsnorm_QK_pre_rope_enabled=qk_norm,
        rmsnorm_QK_post_rope_enabled=qk_norm,
    )
    return {k: v for k, v in args.items() if v is not None}, flags


def _check(outs, expected, dtype, hidden):
    for got, want in zip(outs, expected):
        assert got.shape == want.shape
        assert_close(got, want, dtype, reduction=hidden, ops=16)


# ------------------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_flat_cache_with_projection_matches_oracle(dtype):
    args, flags = make_args(dtype)
    outs = attention_block_tkg(**args, **flags)
    assert outs[0].shape == (3 * 2, 128) and outs[1].shape == (16, 3, 2) and outs[2].shape == (3, 1, 2, 16)
    _check(outs, oracle(args, flags), dtype, 128)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_transposed_cache_interleaved_rope_qk_norms_sink(dtype):
    args, flags = make_args(dtype, B=2, S=3, q=2, d=8, transposed=True, qk_norm=True, sink=True, w_out=False)
    flags.update(rope_contiguous_layout=False, softmax_scale=0.3, rmsnorm_QK_pre_rope_eps=1e-5)
    outs = attention_block_tkg(**args, **flags)
    assert outs[0].shape == (2, 2, 8, 3)
    _check(outs, oracle(args, flags), dtype, 128)


@pytest.mark.parametrize("transposed", [False, True])
def test_update_cache_writes_rows_and_skips_uint32_max(transposed):
    args, flags = make_args(update=True, transposed=transposed, s_max=20, s_ctx=20)
    idx = np.asarray(args["kv_cache_update_idx"]).copy()
    idx[1, 0] = SKIP
    idx[2, 0] = 19  # the second token falls past the cache: dropped
    args["kv_cache_update_idx"] = jnp.asarray(idx)
    out, K, V = attention_block_tkg(**args, **flags)
    assert K.shape == args["K_cache"].shape and V.shape == args["V_cache"].shape
    expected = oracle(args, flags)
    _check((out, K, V), expected, jnp.float32, 128)
    np.testing.assert_array_equal(np.asarray(V[1]), np.asarray(args["V_cache"][1]))  # skipped row untouched


def test_block_cache_with_table_and_update():
    rng = np.random.default_rng(3)
    args, flags = make_args(B=2, S=1, q=2, d=16, s_ctx=256, w_out=False, update=True)
    pool_k = jnp.asarray(rng.standard_normal((40, 16, 16)), jnp.float32)
    pool_v = jnp.asarray(rng.standard_normal((40, 16, 16)), jnp.float32)
    table = rng.permutation(40)[:32].reshape(2, 16).astype(np.int32)
    # every slot visible: a block-cache mask's slot order is the kernel's (LNC-dependent), this one has none
    mask = jnp.ones((256, 2, 2, 1), jnp.uint8)
    slots = np.array([[table[0, 3] * 16 + 5], [SKIP]], np.uint32)
    args.update(
        K_cache=pool_k,
        V_cache=pool_v,
        active_blocks_table=jnp.asarray(table),
        attention_mask=mask,
        kv_cache_update_idx=jnp.asarray(slots),
    )
    outs = attention_block_tkg(**args, **flags)
    _check(outs, oracle(args, flags), jnp.float32, 128)


def test_fp8_kv_cache_quantizes_new_tokens():
    args, flags = make_args(fp8=True, update=True, w_out=False, B=2, S=1, q=2)
    outs = attention_block_tkg(**args, **flags)
    assert outs[1].dtype == jnp.float8_e4m3 and outs[2].dtype == jnp.float8_e4m3
    expected = oracle(args, flags)
    assert_close(outs[0], expected[0], jnp.float32, reduction=128, ops=64)
    for got, want in zip(outs[1:], expected[1:]):  # cache bytes: each new token within one FP8 step of the oracle
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2**-3, atol=2**-9)
    args_no_update, flags_no_update = dict(args), dict(flags, update_cache=False)
    del args_no_update["kv_cache_update_idx"]
    k_new = attention_block_tkg(**args_no_update, **flags_no_update)[1]
    assert k_new.dtype == jnp.float8_e4m3 and k_new.shape == (16, 2, 1)


def test_transposed_out_follows_lnc():
    args, flags = make_args(H=256, B=2, S=1, q=2)
    flags["transposed_out"] = True
    with jax_nkilib.config(lnc=2):
        out = attention_block_tkg(**args, **flags)[0]
    assert out.shape == (128, 2, 1, 2)
    _check((out,), oracle(args, dict(flags, lnc=2))[:1], jnp.float32, 256)


@pytest.mark.slow  # CI: the conformance checklist's full and partial vmaps of this kernel
def test_vmap_matches_per_example_calls():
    batches = [make_args(seed=s, B=2, S=1, q=2, update=True) for s in range(3)]
    flags = batches[0][1]
    stacked = {k: jnp.stack([b[0][k] for b in batches]) for k in batches[0][0]}
    outs = jax.vmap(lambda a: attention_block_tkg(**a, **flags))(stacked)
    for i, (args, _) in enumerate(batches):
        for got, want in zip(outs, attention_block_tkg(**args, **flags)):
            np.testing.assert_allclose(np.asarray(got[i]), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_kvdp_in_shard_map_gathers_heads_and_rows():
    kvdp, B, q, d, S, H = 8, 8, 1, 16, 1, 128
    rng = np.random.default_rng(5)
    base, _ = make_args(B=B, S=S, q=q, d=d, H=H, w_out=True, norm=False, rope=True)
    w_qkv = jnp.asarray(rng.standard_normal((kvdp * H, d * (q + 2))) * H**-0.5, jnp.float32)  # one per rank
    k_cache = jnp.asarray(rng.standard_normal((B, 24, d)), jnp.float32)  # rank r holds row r
    v_cache = jnp.asarray(rng.standard_normal((B, 24, d)), jnp.float32)
    mask = _mask(rng, 20, B, q * kvdp, S)  # [S_ctx, B_attn * KVDP, q * KVDP, S]
    names = ("X", "W_qkv", "cos", "sin", "K_cache", "V_cache", "attention_mask", "W_out")
    values = (base["X"], w_qkv, base["cos"], base["sin"], k_cache, v_cache, mask, base["W_out"])
    specs = (P(), P("kvdp"), P(), P(), P("kvdp"), P("kvdp"), P(None, "kvdp"), P())
    flags = dict(KVDP=kvdp, KVDP_replica_group="kvdp")

    def body(*vals):
        out, K, V = attention_block_tkg(**dict(zip(names, vals)), **flags)
        return out[None], K, V

    outs = run_sharded(body, mesh_1d("kvdp"), specs, (P("kvdp"), P(None, "kvdp"), P("kvdp")), *values)
    out, K, V = (np.asarray(x) for x in outs)
    # oracle: each rank's queries first (its own W_qkv), then attention per rank, then gather
    per_rank = []
    for r in range(kvdp):
        a = dict(zip(names, values), W_qkv=w_qkv[r * H : (r + 1) * H])
        per_rank.append(a)
    all_q = []
    for a in per_rank:
        x = _f64(a["X"])
        heads = (x @ _f64(a["W_qkv"])).reshape(B, S, q + 2, d)
        qs = _rope(heads[:, :, :q], _f64(a["cos"]), _f64(a["sin"]), True).transpose(0, 2, 1, 3) * d**-0.5
        all_q.append(qs)
    attn_rows, k_rows, v_rows = [], [], []
    for r, a in enumerate(per_rank):
        local = dict(a, K_cache=a["K_cache"][r : r + 1], V_cache=a["V_cache"][r : r + 1])
        local["attention_mask"] = a["attention_mask"][:, r : r + 1]
        local.pop("W_out")
        attn, k_new, v_new = oracle(local, {}, rank=r, kvdp=kvdp, all_q=all_q)
        attn_rows.append(attn)
        k_rows.append(k_new)
        v_rows.append(v_new)
    gathered = np.concatenate(attn_rows, axis=0)  # [B, KVDP q, d, S]
    for r, a in enumerate(per_rank):
        mine = gathered[:, r * q : (r + 1) * q]  # [B, q, d, S]
        want = mine.transpose(0, 3, 1, 2).reshape(B * S, q * d) @ _f64(a["W_out"])
        assert_close(out[r], want, jnp.float32, reduction=H, ops=16)
    assert_close(K, np.concatenate(k_rows, axis=1), jnp.float32, reduction=H, ops=16)
    assert_close(V, np.concatenate(v_rows, axis=0), jnp.float32, reduction=H, ops=16)


def test_neuron_lowering_is_one_aliased_call():
    args, flags = make_args(jnp.bfloat16, B=2, S=1, q=2, d=64, H=256, s_max=256, s_ctx=256, update=True)
    names = list(args)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda *v: attention_block_tkg(**dict(zip(names, v)), **flags), *args.values())
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "attention_block_tkg" and cfg["output_names"] == ["out", "K_cache", "V_cache"]
    inputs = cfg["input_names"]
    assert cfg["aliases"] == [[inputs.index("K_cache"), 1], [inputs.index("V_cache"), 2]]
    assert "output_operand_aliases" in text and text.count("AwsNeuronCustomNativeKernel") == 1
    assert cfg["entry_point"] == "jax_nkilib_kernels.transformer:attention_block_tkg"


def test_neuron_lowering_without_update_has_no_alias():
    args, flags = make_args(jnp.bfloat16, B=2, S=1, q=2, d=64, H=256, s_max=256, s_ctx=256)
    names = list(args)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda *v: attention_block_tkg(**dict(zip(names, v)), **flags), *args.values())
    (cfg,) = kernel_configs(text)
    assert cfg["output_names"] == ["out", "K_out", "V_out"] and cfg["aliases"] == []
    assert "output_operand_aliases" not in text


@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(out_in_sb=True), ValueError, "out_in_sb"),
        (dict(skip_attention=True), ValueError, "skip_attention"),
        (dict(quantization_type_qkv="ROW"), ValueError, "quantization_type_qkv=ROW"),
        (dict(transposed_out=True, W_out=None, bias_out=None), ValueError, "transposed_out requires"),
        (dict(update_cache=True), ValueError, "kv_cache_update_idx"),
        (dict(rmsnorm_X_gamma=None), ValueError, "rmsnorm_X_gamma"),
        (dict(sin=None), ValueError, "cos and sin"),
        (dict(K_cache=jnp.zeros((3, 24))), ValueError, "K_cache"),
        (dict(KVDP=2), ValueError, "KVDP_replica_group"),
        (dict(k_scale=jnp.ones((1, 1))), ValueError, "k_scale and v_scale"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, match):
    args, flags = make_args()
    for key, value in change.items():
        (args if key in args or key in ("k_scale",) else flags)[key] = value
    args = {k: v for k, v in args.items() if v is not None}
    with pytest.raises(error, match=match):
        attention_block_tkg(**args, **flags)


def test_bad_mask_layout_names_the_expected_shape():
    args, flags = make_args()
    args["attention_mask"] = args["attention_mask"][:, :, :2]
    with pytest.raises(ValueError, match="attention_mask"):
        attention_block_tkg(**args, **flags)


def test_kvdp_lowering_marks_collectives_and_passes_rank_lists():
    b_attn, d, s_ctx = 1, 64, 256
    shapes = (
        jax.ShapeDtypeStruct((8, 1, 256), jnp.bfloat16),
        jax.ShapeDtypeStruct((256, d * 3), jnp.bfloat16),
        jax.ShapeDtypeStruct((b_attn, s_ctx, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((b_attn, s_ctx, d), jnp.bfloat16),
        jax.ShapeDtypeStruct((s_ctx, b_attn, 8, 1), jnp.uint8),
    )
    body = jax.shard_map(
        lambda *a: attention_block_tkg(*a, KVDP=8, KVDP_replica_group="kvdp"),
        mesh=mesh_1d("kvdp"),
        in_specs=(P(),) * 5,
        out_specs=(P(), P(), P()),
        check_vma=False,
    )
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(body, *shapes)
    (cfg,) = kernel_configs(text)
    assert cfg["has_collectives"] is True and cfg["params"]["KVDP_replica_group"] == [list(range(8))]
    assert 'has_collectives = "1"' in text


def test_neuron_limits_fall_back_or_raise(monkeypatch):
    monkeypatch.setattr(neuron_lowering, "_warned", set())  # the warning is once per call site and reasons
    args, flags = make_args(jnp.bfloat16, B=2, S=1, q=2, d=64, H=256, s_max=256, s_ctx=256, qk_norm=True)
    names = list(args)

    def call(*v):
        return attention_block_tkg(**dict(zip(names, v)), **flags)

    with jax_nkilib.neuron.dry_run(), pytest.warns(jax_nkilib.neuron.NeuronFallbackWarning, match="d=128"):
        text = neuron_text(call, *args.values())
    assert kernel_configs(text) == []
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(on_unsupported="error"):
        with pytest.raises(Exception, match="Q/K RMSNorm needs d=128"):
            neuron_text(call, *args.values())


@pytest.mark.parametrize("weights", [jnp.float8_e4m3, jnp.float8_e4m3fn])
def test_static_fp8_projections(weights):
    args, flags = make_args(B=2, S=1, q=2, d=16, norm=True)
    rng = np.random.default_rng(7)
    args["W_qkv"] = jnp.asarray(rng.standard_normal(args["W_qkv"].shape) * 4, weights)
    args["W_out"] = jnp.asarray(rng.standard_normal(args["W_out"].shape) * 4, weights)
    args.update(
        weight_dequant_scale_qkv=jnp.asarray([[0.02, 0.03, 0.05]], jnp.float32),
        input_dequant_scale_qkv=jnp.full((1, 1), 0.05, jnp.float32),
        weight_dequant_scale_out=jnp.full((128, 1), 0.02, jnp.float32),
        input_dequant_scale_out=jnp.full((128, 1), 0.01, jnp.float32),
    )
    flags.update(quantization_type_qkv="STATIC", quantization_type_out="STATIC")
    outs = attention_block_tkg(**args, **flags)
    # FP8 activations: a value near an FP8 rounding boundary may round the other way than in float64 (2^-4 relative)
    for got, want in zip(outs, oracle(args, flags)):
        error = np.max(np.abs(np.asarray(got, np.float64) - want)) / np.max(np.abs(want))
        assert error < 2**-4, error
    with pytest.raises(TypeError, match="FP8 `W_qkv`"):
        attention_block_tkg(**dict(args, W_qkv=args["W_qkv"].astype(jnp.float32)), **flags)
    with pytest.raises(ValueError, match="need quantization_type_out=STATIC"):
        attention_block_tkg(
            **dict(args, W_out=args["W_out"].astype(jnp.float32)), **dict(flags, quantization_type_out="NONE")
        )


@pytest.mark.parametrize("layout", ["flat", "transposed", "block"])
def test_donated_caches_are_updated_in_place_on_cpu(layout):
    """Under ``donate_argnums`` the compiled reference aliases the caches and never copies them whole."""
    args, flags = make_args(B=2, S=1, q=2, update=True, s_max=1024, s_ctx=20, transposed=layout == "transposed")
    if layout == "block":
        pool = jnp.zeros((64, 16, 16), jnp.float32)
        args.update(
            K_cache=pool,
            V_cache=pool + 1,
            active_blocks_table=jnp.arange(32, dtype=jnp.int32).reshape(2, 16),
            attention_mask=jnp.ones((256, 2, 2, 1), jnp.uint8),
        )
    rest = {k: v for k, v in args.items() if k not in ("K_cache", "V_cache")}

    def step(K, V, rest):
        return attention_block_tkg(K_cache=K, V_cache=V, **rest, **flags)

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(args["K_cache"], args["V_cache"], rest).compile()
    text = compiled.as_text()
    shape = "f32[" + ",".join(map(str, args["K_cache"].shape)) + "]"
    assert "input_output_alias={ {1}: (0" in text and "{2}: (1" in text
    whole_copies = [
        line for line in text.splitlines() if f"{shape}" in line and (" copy(" in line or "transpose(" in line)
    ]
    assert whole_copies == []


def test_block_cache_mask_in_the_kernel_order_at_lnc2():
    """A block-cache mask from gen_mask_tkg_hbm under LNC 2 (the kernel's tile order) means the natural mask."""
    rng = np.random.default_rng(11)
    s_prior, block_len, q, d, length = 512, 16, 2, 16, 300
    args, flags = make_args(B=1, S=1, q=q, d=d, w_out=False)
    pool_k, pool_v = (jnp.asarray(rng.standard_normal((48, block_len, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(48)[: s_prior // block_len][None], jnp.int32)
    sizes = dict(bs=1, q_head=q, s_active=1, s_prior=s_prior, block_len=block_len)
    with jax_nkilib.config(lnc=2):
        mask = jax_nkilib.nki.gen_mask_tkg_hbm(
            jnp.full((1, 1), length, jnp.int32), None, jnp.ones((1, 1, q, 1), jnp.float32), **sizes
        )
        args.update(K_cache=pool_k, V_cache=pool_v, active_blocks_table=table, attention_mask=mask)
        outs = attention_block_tkg(**args, **flags)
    natural = (np.arange(s_prior) < length) | (np.arange(s_prior) >= s_prior - 1)
    expected = oracle(dict(args, attention_mask=jnp.broadcast_to(natural[:, None, None, None], mask.shape)), flags)
    _check(outs, expected, jnp.float32, 128)
    wrong = oracle(dict(args, attention_mask=mask), flags)[0]  # the tile order read as natural: another result
    assert not np.allclose(np.asarray(outs[0]), wrong, atol=1e-3)
