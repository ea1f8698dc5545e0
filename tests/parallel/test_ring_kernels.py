"""The NKI ring attention kernels (ring_attention_spmd_fwd / _bwd / ring_attention_unpermute) on 8 CPU devices.

Each rank holds ``S`` tokens of a global sequence, sharded along the sequence axis of the global arrays (storage
index ``t = rank * S + i``). Contiguous: token ``t`` is at position ``t``; striped: at ``i * nw + rank``. The
oracle is NumPy float64 attention over the whole global sequence with those positions.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib._src.attention.ring_attention_bwd import ring_attention_spmd_bwd
from jax_nkilib._src.attention.ring_attention_fwd import ring_attention_spmd_fwd
from jax_nkilib._src.attention.ring_attention_unpermute import ring_attention_unpermute
from jax_nkilib.neuron import NeuronFallbackWarning
from tests.support.hlo import kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, mesh_1d, reshard, shard

NW, B, H, D = 8, 1, 2, 16
SEQ_LAST = P(None, None, None, "cp")  # [b, h, d, S] sharded along S
SEQ_MID = P(None, None, "cp", None)  # [b, h, S, d] sharded along S
COLLECTIVES = {
    "stablehlo.all_gather",
    "stablehlo.all_to_all",
    "stablehlo.reduce_scatter",
    "stablehlo.collective_permute",
    "stablehlo.all_reduce",
}


# ----------------------------------------------------------------------------------------------------- oracle
def positions(total: int, nw: int, striped: bool):
    """Global position of each storage index ``t = rank * S + i``."""
    t = np.arange(total)
    seq = total // nw
    return (t % seq) * nw + t // seq if striped else t


def visible(total, nw, *, causal, striped, bound_min=None, bound_max=None):
    """``[bh or 1, T, T]`` booleans: may query ``t`` see key ``u`` (storage order)?"""
    pos = positions(total, nw, striped)
    ok = np.ones((1, total, total), bool)
    if causal:
        ok &= pos[None, None, :] <= pos[None, :, None]
    if bound_min is not None:  # [bh, S] bounds on the local key index, the same on every rank
        seq = total // nw
        local = np.arange(total) % seq
        lo = np.asarray(bound_min, np.float64)[:, local]  # per query (storage order)
        hi = np.asarray(bound_max, np.float64)[:, local]
        ok = ok & (lo[:, :, None] <= local[None, None, :]) & (local[None, None, :] < hi[:, :, None])
    return ok


def attention_oracle(q, k, v, ok, scale):
    """q, k, v [bh, T, d] float64; returns (o, lse, P) with empty rows o = 0, lse = 0 (the kernel's convention)."""
    s = np.where(ok, scale * q @ np.swapaxes(k, 1, 2), -np.inf)
    m = s.max(-1, keepdims=True)
    e = np.where(ok, np.exp(s - np.where(np.isfinite(m), m, 0.0)), 0.0)
    total = e.sum(-1, keepdims=True)
    p = e / np.where(total > 0, total, 1.0)
    lse = np.where(
        total[..., 0] > 0,
        np.where(np.isfinite(m[..., 0]), m[..., 0], 0.0) + np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0)),
        0.0,
    )
    return p @ v, lse, p


def attention_grads_oracle(q, k, v, dy, ok, scale):
    """Gradients of ``sum(o * dy)`` (softmax Jacobian): ``(dq, dk, dv)`` [bh, T, d]."""
    _, _, p = attention_oracle(q, k, v, ok, scale)
    dp = dy @ np.swapaxes(v, 1, 2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    return scale * ds @ k, scale * np.swapaxes(ds, 1, 2) @ q, np.swapaxes(p, 1, 2) @ dy


def f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64) if x.dtype == jnp.bfloat16 else np.asarray(x, np.float64)


def rows(x):
    """[b, h, T, d] -> [b*h, T, d] float64."""
    x = f64(x)
    return x.reshape(-1, *x.shape[2:])


# ------------------------------------------------------------------------------------------------ harness
def problem(seq, dtype=jnp.float32, nw=NW, b=B, h=H, d=D, seed=0):
    """Global q, k, v [b, h, nw * S, d] (storage order) rounded to ``dtype``."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((b, h, nw * seq, d)), dtype) for _ in range(3))


def seq_last(x):
    return jnp.swapaxes(x, 2, 3)


def run(fn, *args, in_specs, out_specs, mesh=None):
    mesh = mesh or mesh_1d("cp")
    in_specs = (in_specs,) if isinstance(in_specs, P) else in_specs
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    placed = shard(mesh, in_specs, *args)
    return jax.jit(body)(*(placed if len(args) > 1 else (placed,)))


def forward(
    q,
    k,
    v,
    bound_min=None,
    bound_max=None,
    *,
    mesh=None,
    axes="cp",
    nw=NW,
    out_specs=SEQ_MID,
    kv_specs=(SEQ_LAST, SEQ_LAST, SEQ_MID),
    **flags,
):
    """ring_attention_spmd_fwd on global [b, h, T, d] q, k, v given in the kernel layouts of ``flags``."""
    q_in = q if flags.get("tp_q") else seq_last(q)
    k_in = k if flags.get("tp_k") else seq_last(k)
    specs = (SEQ_MID if flags.get("tp_q") else kv_specs[0], SEQ_MID if flags.get("tp_k") else kv_specs[1], kv_specs[2])
    call = functools.partial(ring_attention_spmd_fwd, replica_groups=axes, num_workers=nw, **flags)
    if bound_min is None:
        return run(call, q_in, k_in, v, in_specs=specs, out_specs=out_specs, mesh=mesh)
    return run(call, q_in, k_in, v, bound_min, bound_max, in_specs=specs + (P(), P()), out_specs=out_specs, mesh=mesh)


MODES = {
    "full": dict(),
    "causal": dict(use_causal_mask=True),
    "striped": dict(use_causal_mask=True, striped_input=True),
}


def oracle_for(q, k, v, nw=NW, scale=None, bound_min=None, bound_max=None, **flags):
    causal, striped = flags.get("use_causal_mask", False), flags.get("striped_input", False)
    scale = 1.0 if causal else (scale or 1 / np.sqrt(q.shape[-1]))
    ok = visible(q.shape[2], nw, causal=causal, striped=striped, bound_min=bound_min, bound_max=bound_max)
    return attention_oracle(rows(q), rows(k), rows(v), ok, scale)


# ------------------------------------------------------------------------------------------------ forward
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", list(MODES))
def test_forward_matches_oracle(dtype, mode):
    q, k, v = problem(12, dtype)  # 12 tokens per rank: the forward has no multiple-of-128 limit
    out = forward(q, k, v, **MODES[mode])
    assert out.shape == q.shape and out.dtype == dtype
    want, _, _ = oracle_for(q, k, v, **MODES[mode])
    assert_close(out.reshape(B * H, -1, D), want, dtype, reduction=q.shape[2])


def test_transposed_layouts_scale_and_default_scale():
    q, k, v = problem(10)
    out = forward(q, k, v, tp_q=True, tp_k=True, softmax_scale=0.3)
    assert_close(out.reshape(B * H, -1, D), oracle_for(q, k, v, scale=0.3)[0], jnp.float32, reduction=80)
    out = forward(q, k, v, tp_q=True)  # default scale 1/sqrt(d); k pre-transposed
    assert_close(out.reshape(B * H, -1, D), oracle_for(q, k, v)[0], jnp.float32, reduction=80)


@pytest.mark.parametrize("lse_dtype", [jnp.float32, jnp.bfloat16])
def test_training_returns_lse_in_tiles(lse_dtype):
    q, k, v = problem(128, jnp.bfloat16, nw=4)
    mesh = make_mesh((4, 2), ("cp", "tp"))
    out, lse = forward(
        q, k, v, mesh=mesh, nw=4, training=True, lse_dtype=lse_dtype, out_specs=(SEQ_MID, SEQ_LAST), **MODES["striped"]
    )
    want_o, want_lse, _ = oracle_for(q, k, v, nw=4, **MODES["striped"])
    assert lse.shape == (B, H, 128, 4) and lse.dtype == lse_dtype
    # rank r's lse [.., 128, 1] holds query t * 128 + r of its own 128 tokens
    got_lse = np.swapaxes(f64(lse), 2, 3).reshape(B * H, -1)
    assert_close(got_lse, want_lse, lse_dtype, ops=8)
    assert_close(out.reshape(B * H, -1, D), want_o, jnp.bfloat16, reduction=512)


def packing_bounds(seq=12, bh=B * H):
    """Local-key-index bounds [bh, S] for documents of local lengths 4, 5, 3 (head 1: one document of 9 then a
    padding token that sees nothing, then 2)."""
    lo = np.zeros((bh, seq), np.float32)
    hi = np.zeros((bh, seq), np.float32)
    for start, end in ((0, 4), (4, 9), (9, 12)):
        lo[0, start:end], hi[0, start:end] = start, end
    lo[1, :9], hi[1, :9] = 0, 9
    lo[1, 9], hi[1, 9] = 9, 9  # padding: no visible key
    lo[1, 10:], hi[1, 10:] = 10, 12
    return lo, hi


def test_sequence_packing_bounds():
    q, k, v = problem(12)
    lo, hi = packing_bounds()
    out = forward(q, k, v, jnp.asarray(lo[..., None]), jnp.asarray(hi[..., None]), **MODES["striped"])
    want, _, _ = oracle_for(q, k, v, bound_min=lo, bound_max=hi, **MODES["striped"])
    assert_close(out.reshape(B * H, -1, D), want, jnp.float32, reduction=96)
    padded = np.asarray(out)[0, 1, 9::12]  # the padding token of every rank
    assert np.all(np.asarray(padded) == 0)
    # vmap over q only: the unbatched bounds follow the folded batch rows
    call = functools.partial(ring_attention_spmd_fwd, replica_groups="cp", num_workers=NW, **MODES["striped"])
    body = lambda q_, *rest: jax.vmap(call, in_axes=(0, None, None, None, None))(q_, *rest)  # noqa: E731
    out = run(
        body,
        jnp.stack([seq_last(q), -seq_last(q)]),
        seq_last(k),
        v,
        jnp.asarray(lo[..., None]),
        jnp.asarray(hi[..., None]),
        in_specs=(P(None, *SEQ_LAST), SEQ_LAST, SEQ_MID, P(), P()),
        out_specs=P(None, *SEQ_MID),
    )
    want, _, _ = oracle_for(-q, k, v, bound_min=lo, bound_max=hi, **MODES["striped"])
    assert_close(out[1].reshape(B * H, -1, D), want, jnp.float32, reduction=96)


@pytest.mark.parametrize("mode", ["causal", "striped"])
def test_ring_over_one_axis_of_a_4x2_mesh(mode):
    """Two rings of 4 ([[0, 2, 4, 6], [1, 3, 5, 7]]): heads sharded over `tp`, sequence over `cp`."""
    q, k, v = problem(12, nw=4)
    mesh = make_mesh((4, 2), ("cp", "tp"))
    specs = (P(None, "tp", None, "cp"), P(None, "tp", None, "cp"), P(None, "tp", "cp", None))
    out = forward(q, k, v, mesh=mesh, nw=4, kv_specs=specs, out_specs=P(None, "tp", "cp", None), **MODES[mode])
    assert_close(out.reshape(B * H, -1, D), oracle_for(q, k, v, nw=4, **MODES[mode])[0], jnp.float32, reduction=48)


def test_ring_over_two_mesh_axes():
    """replica_groups=("x", "y"): one ring of 8 in x-major order."""
    q, k, v = problem(6)
    mesh = make_mesh((4, 2), ("x", "y"))
    seq_mid, seq_last_ = P(None, None, ("x", "y"), None), P(None, None, None, ("x", "y"))
    out = forward(
        q,
        k,
        v,
        mesh=mesh,
        axes=("x", "y"),
        kv_specs=(seq_last_, seq_last_, seq_mid),
        out_specs=seq_mid,
        **MODES["striped"],
    )
    assert_close(out.reshape(B * H, -1, D), oracle_for(q, k, v, **MODES["striped"])[0], jnp.float32, reduction=48)


# ------------------------------------------------------------------------------------------------ backward
def loss_fn(flags, mesh, specs, dy):
    call = functools.partial(ring_attention_spmd_fwd, replica_groups="cp", num_workers=NW, **flags)

    def loss(q, k, v):
        body = jax.shard_map(call, mesh=mesh, in_specs=specs, out_specs=SEQ_MID)
        placed = (reshard(x, NamedSharding(mesh, s)) for x, s in zip((q, k, v), specs))
        return jnp.sum(body(*placed).astype(dy.dtype) * dy)

    return loss


@pytest.mark.parametrize("mode", list(MODES) + ["transposed"])
def test_vjp_binds_the_backward_kernel_and_matches_oracle(mode):
    """S = 128: the forward runs with training=True and the VJP is ring_attention_spmd_bwd."""
    flags = dict(tp_q=True, tp_k=True, softmax_scale=0.3) if mode == "transposed" else MODES[mode]
    q, k, v = problem(128, jnp.float32, nw=NW, h=1)
    dy = jnp.asarray(np.random.default_rng(7).standard_normal(v.shape), jnp.float32)
    mesh = mesh_1d("cp")
    tp = mode == "transposed"
    loss = loss_fn(flags, mesh, (SEQ_MID, SEQ_MID, SEQ_MID) if tp else (SEQ_LAST, SEQ_LAST, SEQ_MID), dy)
    args = (q, k, v) if tp else (seq_last(q), seq_last(k), v)
    jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
    assert "ring_attention_spmd_bwd" in jaxpr
    dq, dk, dv = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
    causal = flags.get("use_causal_mask", False)
    ok = visible(q.shape[2], NW, causal=causal, striped=flags.get("striped_input", False))
    scale = 1.0 if causal else flags.get("softmax_scale", 1 / np.sqrt(D))
    want = attention_grads_oracle(rows(q), rows(k), rows(v), rows(dy), ok, scale)
    for got, expected in zip((dq, dk, dv) if tp else (seq_last(dq), seq_last(dk), dv), want):
        assert got.dtype == jnp.float32
        assert_close(got.reshape(expected.shape), expected, jnp.float32, reduction=q.shape[2], ops=8)


@pytest.mark.parametrize("mode", ["full", "striped"])
def test_check_grads_float64(mode):
    """Float64 (and S % 128 != 0): the VJP is the same math in JAX; checked against finite differences."""
    q, k, v = problem(6, jnp.float64, h=1)
    dy = jnp.asarray(np.random.default_rng(3).standard_normal(v.shape))
    loss = loss_fn(MODES[mode], mesh_1d("cp"), (SEQ_LAST, SEQ_LAST, SEQ_MID), dy)
    check_grads(jax.jit(loss), (seq_last(q), seq_last(k), v), order=1, modes=["rev"], atol=1e-6, rtol=1e-6)


def test_vmap_of_grad_float32_kernel_path():
    q, k, v = problem(128, h=1)
    mesh = mesh_1d("cp")
    specs = (SEQ_LAST, SEQ_LAST, SEQ_MID)
    dys = jnp.asarray(np.random.default_rng(5).standard_normal((2,) + v.shape), jnp.float32)
    grads = jax.jit(
        jax.vmap(lambda dy: jax.grad(loss_fn(MODES["causal"], mesh, specs, dy), argnums=2)(seq_last(q), seq_last(k), v))
    )(dys)
    ok = visible(q.shape[2], NW, causal=True, striped=False)
    for i in range(2):
        want = attention_grads_oracle(rows(q), rows(k), rows(v), rows(dys[i]), ok, 1.0)[2]
        assert_close(grads[i].reshape(want.shape), want, jnp.float32, reduction=1024, ops=8)


def test_backward_kernel_directly_with_packing_and_bf16():
    seq = 128
    q, k, v = problem(seq, jnp.bfloat16, nw=4)
    dy = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.bfloat16)
    lo = np.zeros((B * H, seq), np.float32)
    hi = np.zeros((B * H, seq), np.float32)
    lo[:, :50], hi[:, :50], lo[:, 50:], hi[:, 50:] = 0, 50, 50, seq
    ok = visible(4 * seq, 4, causal=True, striped=True, bound_min=lo, bound_max=hi)
    o, lse, _ = attention_oracle(rows(q), rows(k), rows(v), ok, 0.25)
    o = jnp.asarray(o.reshape(q.shape), jnp.bfloat16)
    # the forward's lse tiles: global [b, h, 128, 4 ranks * 1 tile]
    lse_tiles = jnp.asarray(np.swapaxes(lse.reshape(B, H, 4, 128), 2, 3), jnp.float32)
    mesh = make_mesh((4, 2), ("cp", "tp"))
    call = functools.partial(
        ring_attention_spmd_bwd,
        use_causal_mask=True,
        softmax_scale=0.25,
        num_workers=4,
        replica_groups="cp",
        striped_attention=True,
    )
    grads = run(
        call,
        *(seq_last(x) for x in (q, k, v, o, dy)),
        lse_tiles,
        jnp.asarray(lo),
        jnp.asarray(hi),
        in_specs=(SEQ_LAST,) * 6 + (P(), P()),
        out_specs=(SEQ_LAST,) * 3,
        mesh=mesh,
    )
    want = attention_grads_oracle(rows(q), rows(k), rows(v), rows(dy), ok, 0.25)
    for got, expected in zip(grads, want):
        assert got.dtype == jnp.float32 and got.shape == (B, H, D, 4 * seq)
        assert_close(seq_last(got).reshape(expected.shape), expected, jnp.bfloat16, reduction=512)


# ------------------------------------------------------------------------------------------------ unpermute
def unpermute_oracle(x, nw):
    """Global storage [bs, nw * S, d] of striped shards -> storage of contiguous shards (= the global sequence)."""
    x = f64(x)
    total = x.shape[1]
    out = np.empty_like(x)
    out[:, positions(total, nw, striped=True)] = x  # token at storage t sits at its global position
    return out


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_unpermute_matches_oracle(dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, NW * 16, 5)), dtype)
    call = functools.partial(ring_attention_unpermute, replica_groups="cp", num_workers=NW)
    out = run(call, x, in_specs=P(None, "cp"), out_specs=P(None, "cp"))
    assert out.dtype == dtype
    np.testing.assert_array_equal(f64(out), unpermute_oracle(x, NW))


def test_unpermute_on_4x2_mesh():
    mesh = make_mesh((4, 2), ("cp", "tp"))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2, 4 * 8, 4)))
    call = functools.partial(ring_attention_unpermute, replica_groups="cp", num_workers=4)
    out = run(call, x, in_specs=P("tp", "cp"), out_specs=P("tp", "cp"), mesh=mesh)
    np.testing.assert_array_equal(np.asarray(out), unpermute_oracle(x, 4))


# ------------------------------------------------------------------------------------------------ Neuron
@pytest.fixture
def dry_run():
    with jax_nkilib.neuron.dry_run():
        yield


def neuron_module(fn, *args, in_specs, out_specs):
    mesh = make_mesh((4, 2), ("cp", "tp"))
    in_specs = (in_specs,) if isinstance(in_specs, P) else in_specs
    body = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    placed = shard(mesh, in_specs, *args)
    return neuron_text(body, *(placed if len(args) > 1 else (placed,)))


KV_SPECS_4X2 = (P(None, "tp", None, "cp"), P(None, "tp", None, "cp"), P(None, "tp", "cp", None))
GROUPS_4X2 = [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_neuron_forward_is_one_collective_kernel_call(dry_run):
    q, k, v = problem(128, jnp.bfloat16, nw=4)
    call = functools.partial(
        ring_attention_spmd_fwd, replica_groups="cp", num_workers=4, use_causal_mask=True, striped_input=True
    )
    text = neuron_module(call, seq_last(q), seq_last(k), v, in_specs=KV_SPECS_4X2, out_specs=KV_SPECS_4X2[2])
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "ring_attention_spmd_fwd" and cfg["has_collectives"] is True and cfg["grid"] == 1
    assert cfg["entry_point"] == "nkilib.experimental.attention.ring_attention_fwd:ring_attention_spmd_fwd"
    assert cfg["params"]["replica_groups"] == GROUPS_4X2 and cfg["params"]["num_workers"] == 4
    assert cfg["input_names"] == ["q", "k", "v"] and cfg["output_names"] == ["o"]
    assert 'has_collectives = "1"' in text
    assert operations(text).count("stablehlo.custom_call") == 1 and not COLLECTIVES & set(operations(text))


@pytest.mark.parametrize("lnc", [1, 2])
def test_neuron_training_step_is_forward_and_backward_kernels(dry_run, lnc):
    q, k, v = problem(128, jnp.bfloat16, nw=4)
    call = functools.partial(ring_attention_spmd_fwd, replica_groups="cp", num_workers=4, use_causal_mask=True)

    def step(q_, k_, v_):
        out, vjp = jax.vjp(call, q_, k_, v_)
        return vjp(out)

    with jax_nkilib.config(lnc=lnc):
        text = neuron_module(step, seq_last(q), seq_last(k), v, in_specs=KV_SPECS_4X2, out_specs=KV_SPECS_4X2)
    fwd, bwd = kernel_configs(text)
    assert fwd["func_name"] == "ring_attention_spmd_fwd" and fwd["params"]["training"] is True
    assert fwd["output_names"] == ["o", "lse"]
    assert bwd["func_name"] == "ring_attention_spmd_bwd" and bwd["has_collectives"] is True
    assert bwd["params"] == {
        "use_causal_mask": True,
        "mixed_precision": True,
        "softmax_scale": 1.0,
        "num_workers": 4,
        "lnc_size": lnc,
        "replica_groups": GROUPS_4X2,
        "striped_attention": False,
    }
    assert fwd["grid"] == bwd["grid"] == lnc
    assert operations(text).count("stablehlo.custom_call") == 2 and not COLLECTIVES & set(operations(text))


def test_neuron_unpermute_kernel_and_float32_fallback(dry_run):
    x = jnp.zeros((2, 64, 8), jnp.bfloat16)
    call = functools.partial(ring_attention_unpermute, replica_groups="cp", num_workers=4)
    text = neuron_module(call, x, in_specs=P("tp", "cp"), out_specs=P("tp", "cp"))
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "ring_attention_unpermute" and cfg["params"]["replica_groups"] == GROUPS_4X2
    assert operations(text).count("stablehlo.custom_call") == 1 and not COLLECTIVES & set(operations(text))
    with pytest.warns(NeuronFallbackWarning, match="bfloat16 or float16"):
        text = neuron_module(call, x.astype(jnp.float32), in_specs=P("tp", "cp"), out_specs=P("tp", "cp"))
    assert kernel_configs(text) == [] and "stablehlo.all_to_all" in operations(text)


def test_neuron_trn1_target_falls_back(dry_run):
    x = jnp.zeros((2, 64, 8), jnp.bfloat16)
    call = functools.partial(ring_attention_unpermute, replica_groups="cp", num_workers=4)
    with jax_nkilib.config(target="trn1"), pytest.warns(NeuronFallbackWarning, match="Trainium2 or later"):
        text = neuron_module(call, x, in_specs=P("tp", "cp"), out_specs=P("tp", "cp"))
    assert kernel_configs(text) == []


def test_neuron_backward_with_mismatched_lnc_size_falls_back(dry_run):
    q = jnp.zeros((1, 2, 16, 4 * 128), jnp.bfloat16)
    lse = jnp.zeros((1, 2, 128, 4), jnp.float32)
    call = functools.partial(ring_attention_spmd_bwd, num_workers=4, replica_groups="cp", lnc_size=2)
    with pytest.warns(NeuronFallbackWarning, match="lnc_size=2 must equal the LNC degree 1"):
        text = neuron_module(
            call,
            q,
            q,
            q,
            q,
            q,
            lse,
            in_specs=(P(None, "tp", None, "cp"),) * 6,
            out_specs=(P(None, "tp", None, "cp"),) * 3,
        )
    assert kernel_configs(text) == []


# ------------------------------------------------------------------------------------------------ bad inputs
FWD_ERRORS = [
    (dict(num_workers=4), ValueError, "has 8 ranks"),
    (dict(replica_groups=None), ValueError, "`replica_groups` is required"),
    (dict(replica_groups="nope"), ValueError, "not bound here"),
    (dict(replica_groups=3), TypeError, "mesh axis name"),
    (dict(use_causal_mask=True, softmax_scale=0.5), ValueError, "pre-scale q"),
    (dict(striped_input=True), ValueError, "striped_input=True requires use_causal_mask=True"),
    (dict(training=True), ValueError, "multiple of 128"),
    (dict(lse_dtype=jnp.float16), TypeError, "lse_dtype"),
    (dict(tp_q=True), ValueError, "must have layout [b, h, d, S]"),
]


@pytest.mark.parametrize("flags, error, fragment", FWD_ERRORS)
def test_forward_bad_flags(flags, error, fragment):
    q, k, v = problem(12)
    flags = dict(dict(replica_groups="cp", num_workers=NW), **flags)
    with pytest.raises(error, match=None) as info:
        run(
            functools.partial(ring_attention_spmd_fwd, **flags),
            seq_last(q),
            seq_last(k),
            v,
            in_specs=(SEQ_LAST, SEQ_LAST, SEQ_MID),
            out_specs=SEQ_MID,
        )
    assert fragment in str(info.value)


def test_forward_bad_operands():
    q, k, v = problem(12)
    call = functools.partial(ring_attention_spmd_fwd, replica_groups="cp", num_workers=NW)
    specs = (SEQ_LAST, SEQ_LAST, SEQ_MID)
    with pytest.raises(ValueError, match="`k`"):  # GQA: fewer KV heads
        run(call, seq_last(q), seq_last(k[:, :1]), v[:, :1], in_specs=specs, out_specs=SEQ_MID)
    with pytest.raises(TypeError, match="share one dtype"):
        run(call, seq_last(q), seq_last(k).astype(jnp.bfloat16), v, in_specs=specs, out_specs=SEQ_MID)
    lo, hi = (jnp.asarray(b[..., None]) for b in packing_bounds())
    with pytest.raises(ValueError, match="require use_causal_mask=True and striped_input=True"):
        run(call, seq_last(q), seq_last(k), v, lo, hi, in_specs=specs + (P(), P()), out_specs=SEQ_MID)
    striped = functools.partial(call, use_causal_mask=True, striped_input=True)
    with pytest.raises(ValueError, match="both bound_min and bound_max"):
        run(
            lambda a, b, c, d: striped(a, b, c, d),
            seq_last(q),
            seq_last(k),
            v,
            lo,
            in_specs=specs + (P(),),
            out_specs=SEQ_MID,
        )
    with pytest.raises(ValueError, match=r"\[b\*h, S, 1\]"):
        run(striped, seq_last(q), seq_last(k), v, lo[:1], hi[:1], in_specs=specs + (P(), P()), out_specs=SEQ_MID)


def test_backward_and_unpermute_bad_inputs():
    q = jnp.zeros((1, 2, 16, NW * 128), jnp.float32)
    lse = jnp.zeros((1, 2, 128, NW), jnp.float32)
    call = functools.partial(ring_attention_spmd_bwd, num_workers=NW, replica_groups="cp")
    specs = (SEQ_LAST,) * 6
    with pytest.raises(ValueError, match="striped_attention=True requires"):
        run(
            functools.partial(call, striped_attention=True),
            q,
            q,
            q,
            q,
            q,
            lse,
            in_specs=specs,
            out_specs=(SEQ_LAST,) * 3,
        )
    with pytest.raises(ValueError, match="`lse_ref`"):  # S = 120 per rank: no [B, N, 128, S/128] layout
        short = q[..., : NW * 120]
        run(call, short, short, short, short, short, lse, in_specs=specs, out_specs=(SEQ_LAST,) * 3)
    with pytest.raises(ValueError, match="lnc_size must be 1 or 2"):
        run(functools.partial(call, lnc_size=3), q, q, q, q, q, lse, in_specs=specs, out_specs=(SEQ_LAST,) * 3)
    unpermute = functools.partial(ring_attention_unpermute, replica_groups="cp", num_workers=NW)
    with pytest.raises(ValueError, match="multiple of num_workers=8"):
        run(unpermute, jnp.zeros((1, NW * 12, 4)), in_specs=P(None, "cp"), out_specs=P(None, "cp"))
