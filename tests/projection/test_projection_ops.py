"""jax_nkilib.output_projection and jax_nkilib.qkv_projection: float64 oracle on both device paths, KV-cache update
(fused and by XLA), jit, vmap, gradients, shard_map, Neuron lowering and bad inputs."""

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib import output_projection, qkv_projection
from tests.projection.test_output_projection import projection_oracle
from tests.projection.test_qkv import qkv_oracle
from tests.support.data import angles, random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close
from tests.support.sharding import mesh_1d, shard

NQ, NKV, D = 4, 2, 4
WIDTH = (NQ + 2 * NKV) * D


def split_heads(t, batch, seq):
    q_dim, kv_dim = NQ * D, NKV * D
    return (
        t[..., :q_dim].reshape(batch, seq, NQ, D),
        t[..., q_dim : q_dim + kv_dim].reshape(batch, seq, NKV, D),
        t[..., q_dim + kv_dim :].reshape(batch, seq, NKV, D),
    )


def tables(batch, seq, dtype=jnp.float32, seed=3):
    """jax_nkilib.rope's tables ``[batch, seq, head_dim/2]`` (qkv_projection's ``rope``)."""
    return angles((batch, seq, D // 2), dtype, seed)


def hf(rope):
    """The kernel's (HuggingFace) tables ``[batch, seq, head_dim]``: each half-width table repeated."""
    return (None, None) if rope is None else tuple(jnp.concatenate([t, t], -1) for t in rope)


# ------------------------------------------------------------------------------------------- output projection
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, seq", [(2, 3), (1, 97), (3, 1)])  # TKG, CTE (seq > 96), TKG
def test_output_projection_matches_the_oracle(dtype, batch, seq):
    attn = random((batch, seq, 3, 5), dtype, 0)
    w, bias = random((15, 9), jnp.float32, 1, 0.4), random((9,), jnp.float32, 2)
    out = output_projection(attn, w, bias)
    assert out.shape == (batch, seq, 9) and out.dtype == dtype
    want = projection_oracle(attn, w.astype(dtype), bias.astype(dtype)[None])
    assert_close(out, want, dtype, reduction=15)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_output_projection_gradients_with_a_bias_and_on_the_cte_path():
    """(jit, vmap, nested vmap, vmap of grad and check_grads without a bias are the conformance suite's: arg specs
    output_projection, output_projection.decode.)"""
    attn, w = random((2, 3, 2, 4), jnp.float64, 0), random((8, 5), jnp.float64, 1)
    bias = jnp.arange(5.0, dtype=jnp.float64)
    check_grads(output_projection, (attn, w, bias), order=2, modes=["rev"])
    long = random((1, 97, 2, 4), jnp.float64, 3)
    check_grads(output_projection, (long, w, bias), order=1, modes=["rev"])


@pytest.mark.parametrize(
    "seq, kernel, transposes", [(1, "output_projection_tkg", 1), (128, "output_projection_cte", 1)]
)
def test_output_projection_neuron_lowering(seq, kernel, transposes):
    attn, w = random((2, seq, 2, 64), jnp.bfloat16, 0), random((128, 256), jnp.bfloat16, 1)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(output_projection, attn, w)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == kernel
    ops = compute_operations(text)
    assert ops.count("stablehlo.transpose") == transposes and set(ops) <= {"stablehlo.transpose", "stablehlo.reshape"}


@pytest.mark.parametrize(
    "args, error, fragment",
    [
        (
            (jnp.zeros((2, 3, 4)), jnp.zeros((4, 5))),
            ValueError,
            "`attn` must have layout [batch, seq, heads, head_dim]",
        ),
        (
            (jnp.zeros((2, 3, 2, 4)), jnp.zeros((7, 5))),
            ValueError,
            "`w` must be [heads * head_dim, hidden] = [8, hidden]",
        ),
        (
            (jnp.zeros((2, 3, 2, 4), jnp.int32), jnp.zeros((8, 5))),
            TypeError,
            "`attn` [batch, seq, heads, head_dim] must",
        ),
        ((jnp.zeros((2, 3, 2, 4)), jnp.zeros((8, 5)), jnp.zeros((4,))), ValueError, "`bias` must have layout [hidden]"),
        (([1.0], jnp.zeros((8, 5))), TypeError, "`attn` must be an array"),
        (
            (jnp.zeros((2, 3, 2, 4), jnp.float8_e4m3), jnp.zeros((8, 5))),
            TypeError,
            "output_projection: `attn` [batch, seq, heads, head_dim] must have a floating dtype (float32, bfloat16",
        ),
        (
            (jnp.zeros((2, 3, 0, 4)), jnp.zeros((0, 5))),
            ValueError,
            "`attn` must have layout [batch, seq, heads, head_dim] with heads >= 1",
        ),
    ],
)
def test_output_projection_bad_inputs(args, error, fragment):
    with pytest.raises(error) as info:
        output_projection(*args)
    assert fragment in str(info.value)


# ---------------------------------------------------------------------------------------------- qkv projection
def qkv_problem(batch=2, seq=3, hidden=8, dtype=jnp.float32):
    return (
        random((batch, seq, hidden), dtype, 0),
        random((hidden, WIDTH), jnp.float32, 1, 0.4),
        random((WIDTH,), jnp.float32, 2, 0.3),
        random((hidden,), jnp.float32, 3, 0.2) + 1,
        random((hidden,), jnp.float32, 4, 0.2),
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("norm", [None, "rms", "layer"])
@pytest.mark.parametrize("seq, with_rope", [(3, False), (3, True), (97, False)])
def test_qkv_projection_matches_the_oracle(dtype, norm, seq, with_rope):
    x, w, bias, gamma, beta = qkv_problem(seq=seq, dtype=dtype)
    rope = tables(2, seq) if with_rope else None
    norm_kw = dict(norm_weight=gamma, norm_bias=beta if norm == "layer" else None) if norm else {}
    q, k, v = qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, bias=bias, norm=norm, rope=rope, **norm_kw)
    assert q.shape == (2, seq, NQ, D) and k.shape == v.shape == (2, seq, NKV, D) and q.dtype == dtype
    cast = lambda t: None if t is None else t.astype(dtype)[None]  # noqa: E731
    want, _ = qkv_oracle(
        x,
        w.astype(dtype),
        nq=NQ,
        nkv=NKV,
        d=D,
        bias=cast(bias),
        norm=norm,
        gamma=cast(gamma),
        beta=cast(beta) if norm == "layer" else None,
        cos=hf(rope)[0],
        sin=hf(rope)[1],
    )
    # float32 math on both paths (JAX's convention): the CTE path (RoPE or seq > 96) rounds to bfloat16 only when asked
    for got, expected in zip((q, k, v), split_heads(want, 2, seq)):
        assert_close(got, expected, dtype, reduction=8, ops=10)


def _nki_qkv(x, w, bias, rope=None):
    """jax_nkilib.nki.qkv (the kernel's numerics) on qkv_projection's problem: ``[B, S, I]``."""
    tables = {} if rope is None else dict(zip(("cos_cache", "sin_cache"), hf(rope)), fused_rope=True)
    return jax_nkilib.nki.qkv(x, w, bias[None], d_head=D, num_q_heads=NQ, num_kv_heads=NKV, **tables)


@pytest.mark.parametrize("seq, with_rope", [(97, False), (3, True)])  # the CTE path
def test_qkv_projection_float32_precision(seq, with_rope):
    x, w, bias, *_ = qkv_problem(seq=seq)
    rope = tables(2, seq) if with_rope else None
    project = lambda **kw: qkv_projection(  # noqa: E731
        x, w, num_q_heads=NQ, num_kv_heads=NKV, bias=bias, rope=rope, **kw
    )
    cos, sin = hf(rope)
    want = split_heads(qkv_oracle(x, w, nq=NQ, nkv=NKV, d=D, bias=bias[None], cos=cos, sin=sin)[0], 2, seq)
    for precision in (None, "default", "highest", "float32", jax.lax.Precision.HIGHEST):
        for got, expected in zip(project(precision=precision), want):
            assert_close(got, expected, jnp.float32, reduction=8, ops=10)
    with jax.default_matmul_precision("float32"):
        for got, expected in zip(jax.jit(lambda: project())(), want):
            assert_close(got, expected, jnp.float32, reduction=8, ops=10)
    eager = _nki_qkv(x, w, bias, rope)  # layer 1 keeps the kernel's numerics: bfloat16 buffers, as on Neuron
    assert np.array_equal(np.asarray(eager), np.asarray(eager.astype(jnp.bfloat16).astype(jnp.float32)))
    asked = [(project(precision=p), eager) for p in ("bfloat16", jax.lax.DotAlgorithmPreset.BF16_BF16_F32)]
    with jax.default_matmul_precision("bfloat16"):  # (jit against jit: XLA's fusions may round a tie otherwise)
        asked.append((jax.jit(lambda: project())(), jax.jit(lambda: _nki_qkv(x, w, bias, rope))()))
    for heads, kernel in asked:
        for got, expected, exact in zip(heads, want, split_heads(kernel, 2, seq)):
            np.testing.assert_array_equal(got, exact)  # the kernel's numerics, bit for bit
            assert_close(got, expected, jnp.bfloat16, reduction=8, ops=10)


def test_qkv_projection_precision_is_checked():
    x, w, *_ = qkv_problem()
    for bad in ("bf16", 3, (jax.lax.Precision.HIGHEST,) * 2):
        with pytest.raises(ValueError, match=r"qkv_projection: `precision` must be None"):
            qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, precision=bad)


def test_rms_without_weight():
    x, w, *_ = qkv_problem()
    q, k, v = qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, norm="rms", eps=1e-5)
    want, _ = qkv_oracle(x, w, nq=NQ, nkv=NKV, d=D, norm="rms_skip", eps=1e-5)
    assert_close(q, split_heads(want, 2, 3)[0], jnp.float32, reduction=8, ops=8)


@pytest.mark.parametrize("table_batch", [None, 1, 2])  # [seq, head_dim/2], [1 | batch, seq, head_dim/2]
def test_qkv_projection_rope_takes_the_tables_of_jax_nkilib_rope(table_batch):
    """qkv_projection(rope=(cos, sin)) is jax_nkilib.rope(., cos, sin) on the query and key heads, same tables."""
    x, w, bias, *_ = qkv_problem()
    cos, sin = tables(2, 3) if table_batch is None else tables(table_batch, 3)
    if table_batch is None:
        cos, sin = cos[0], sin[0]
    q_rot, k_rot, v_rot = qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, bias=bias, rope=(cos, sin))
    q, k, v = qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, bias=bias)
    for rotated, plain in ((q_rot, q), (k_rot, k)):
        assert rotated.dtype == jnp.float32
        assert_close(rotated, jax_nkilib.rope(plain, cos, sin), jnp.float32, reduction=8, ops=10)
    np.testing.assert_array_equal(v_rot, v)


@pytest.mark.parametrize("seq, with_rope", [(3, False), (3, True), (100, False)])  # TKG path, CTE, CTE
@pytest.mark.parametrize("positions", [False, True])
@pytest.mark.parametrize("kv_heads", [NKV, 1])  # XLA writes the new tokens; the CTE kernel's own write
def test_kv_cache_update_is_the_same_math_on_both_paths(seq, with_rope, positions, kv_heads):
    batch, max_len = 2, 128
    x, *_ = qkv_problem(batch, seq, dtype=jnp.bfloat16)
    width = (NQ + 2 * kv_heads) * D
    w, bias = random((8, width), jnp.float32, 1, 0.4), random((width,), jnp.float32, 2, 0.3)
    rope = tables(batch, seq) if with_rope else None
    shape = (batch, kv_heads, max_len, D)  # the KV-cache layout
    caches = tuple(random(shape, jnp.float32, 9 + i).astype(jnp.float8_e4m3fn) for i in range(2))
    pos = None
    if positions:
        pos = jnp.arange(seq, dtype=jnp.int32)[None] + jnp.array([[5], [20]], jnp.int32)
        pos = pos.at[1, 0].set(-1)  # skipped
    q, k_new, v_new = qkv_projection(
        x,
        w,
        num_q_heads=NQ,
        num_kv_heads=kv_heads,
        bias=bias,
        rope=rope,
        kv_cache=caches,
        cache_positions=pos,
        kv_scale=(0.5, 0.25),
    )
    q_ref, k_ref, v_ref = qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=kv_heads, bias=bias, rope=rope)
    np.testing.assert_array_equal(q, q_ref)
    positions_np = np.broadcast_to(np.arange(seq), (batch, seq)) if pos is None else np.asarray(pos)
    for new, old, fresh, scale in ((k_new, caches[0], k_ref, 0.5), (v_new, caches[1], v_ref, 0.25)):
        want = np.array(old)
        for b in range(batch):
            for s in range(seq):
                if 0 <= positions_np[b, s] < max_len:
                    value = np.asarray(fresh[b, s], np.float64) / scale
                    want[b, :, positions_np[b, s]] = np.clip(value, -448, 448).astype(ml_dtypes.float8_e4m3fn)
        np.testing.assert_array_equal(np.asarray(new).view(np.uint8), want.view(np.uint8))


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_qkv_projection_gradients_vmap_and_jit():
    x, w, bias, gamma, _ = (t.astype(jnp.float64) for t in qkv_problem())
    cos, sin = (t.astype(jnp.float64) for t in tables(2, 3))

    def fn(x, w, bias, gamma, cos):
        return qkv_projection(
            x, w, num_q_heads=NQ, num_kv_heads=NKV, bias=bias, norm="rms", norm_weight=gamma, rope=(cos, sin)
        )

    check_grads(fn, (x, w, bias, gamma, cos), order=1, modes=["rev"])
    check_grads(
        lambda x, w: qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, norm="layer"),
        (x, w),
        order=1,
        modes=["rev"],
    )
    xs = jnp.stack([x, -x])
    got = jax.jit(jax.vmap(lambda x: fn(x, w, bias, gamma, cos)))(xs)
    for a, b in zip(got, fn(-x, w, bias, gamma, cos)):
        np.testing.assert_allclose(a[1], b, rtol=1e-12)
    grad = jax.grad(lambda x: jnp.sum(fn(x, w, bias, gamma, cos)[1] ** 2))
    np.testing.assert_allclose(jax.vmap(grad)(xs)[1], grad(-x), rtol=1e-10)


def test_qkv_projection_shard_map():
    mesh = mesh_1d()
    x, w, bias, *_ = qkv_problem(batch=8)
    cos, sin = tables(8, 3)  # rope's tables [batch, seq, head_dim/2], sharded with x over the batch
    specs = (P("data"), P(), P("data"), P("data"))
    fn = jax.shard_map(
        lambda x, w, c, s: qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, rope=(c, s)),
        mesh=mesh,
        in_specs=specs,
        out_specs=(P("data"),) * 3,
    )
    got = jax.jit(fn)(*shard(mesh, specs, x, w, cos, sin))
    want, _ = qkv_oracle(x, w, nq=NQ, nkv=NKV, d=D, cos=hf((cos, sin))[0], sin=hf((cos, sin))[1])
    for a, b in zip(got, split_heads(want, 8, 3)):
        assert_close(a, b, jnp.bfloat16, reduction=8, ops=10)


def test_qkv_projection_neuron_lowering():
    x, w = random((1, 128, 256), jnp.bfloat16, 0), random((256, 16 * 64), jnp.bfloat16, 1)
    heads = dict(num_q_heads=8, num_kv_heads=4)
    caches = tuple(jnp.zeros((1, 4, 256, 64), jnp.float8_e4m3fn) for _ in range(2))  # [batch, kv_heads, max_len, d]
    with_cache = lambda heads: lambda x, w, k, v: qkv_projection(x, w, **heads, kv_cache=(k, v))  # noqa: E731
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(lambda x, w: qkv_projection(x, w, **heads), x, w)
        assert [cfg["func_name"] for cfg in kernel_configs(text)] == ["qkv"]
        assert "stablehlo.transpose" not in compute_operations(text)
        # 4 kv heads: the kernel's fused write takes [batch, max_len, kv_heads * d] caches, so XLA writes the new
        # tokens into ours; the one transpose is of the new tokens (1x128x4x64), never of a cache (1x4x256x64)
        text = neuron_text(with_cache(heads), x, w, *caches)
        assert [(cfg["func_name"], cfg["output_names"]) for cfg in kernel_configs(text)] == [("qkv", ["out"])]
        assert "stablehlo.dynamic_update_slice" in operations(text)
        assert re.findall(r"stablehlo.transpose .* -> tensor<(\S+)>", text) == ["1x4x128x64xf8E4M3FN"] * 2
        # one kv head (a tensor-parallel shard's usual count): [batch, 1, max_len, d] is the kernel's flat cache
        one = tuple(c[:, :1] for c in caches)
        w1 = w[:, : 10 * 64]
        text = neuron_text(with_cache(dict(num_q_heads=8, num_kv_heads=1)), x, w1, *one)
        (cfg,) = kernel_configs(text)
        assert cfg["func_name"] == "qkv" and cfg["aliases"] == [[2, 1], [3, 2]]
        assert cfg["output_names"] == ["q", "k_cache", "v_cache"]  # the fused cache write
        assert "stablehlo.transpose" not in compute_operations(text)
        text = neuron_text(with_cache(heads), x[:, :2], w, *caches)
        assert [(cfg["func_name"], cfg["output_names"], cfg["aliases"]) for cfg in kernel_configs(text)] == [
            ("qkv", ["out"], [])
        ]  # the TKG path: no cache write in the kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("batch, seq, with_rope", [(1, 128, False), (2, 128, True)])  # CTE path
def test_qkv_projection_heads_first_at_head_dim_128(dtype, batch, seq, with_rope):
    """head_dim 128 on the CTE path: the kernel writes NBSd ([heads, batch, seq, d]), the same values; at batch 1
    the heads reach attention_cte's rows with no data-moving transpose (its qkv -> attention census)."""
    d, nq, nkv = 128, 3, 1
    x, w = random((batch, seq, 128), dtype, 0), random((128, (nq + 2 * nkv) * d), jnp.float32, 1, 0.1)
    cos, sin = angles((batch, seq, d // 2), jnp.float32, 3) if with_rope else (None, None)
    project = lambda x, w: qkv_projection(  # noqa: E731
        x, w, num_q_heads=nq, num_kv_heads=nkv, norm="rms", rope=None if cos is None else (cos, sin)
    )
    want, _ = qkv_oracle(
        x,
        w.astype(dtype),
        nq=nq,
        nkv=nkv,
        d=d,
        norm="rms_skip",
        cos=hf((cos, sin))[0] if with_rope else None,
        sin=hf((cos, sin))[1] if with_rope else None,
    )
    widths = np.cumsum([0, nq * d, nkv * d, nkv * d])
    for got, lo, hi in zip(project(x, w), widths[:-1], widths[1:]):
        assert got.dtype == dtype
        assert_close(got, want[..., lo:hi].reshape(batch, seq, -1, d), dtype, reduction=128, ops=10)
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(project, x, w)
        (cfg,) = kernel_configs(text)
        assert cfg["params"]["output_layout"] == "NBSd", cfg["params"]
        assert f"-> tensor<{nq + 2 * nkv}x{batch}x{seq}x{d}x" in text  # [heads, batch, seq, d]
        w_o = random((nq * d, 128), dtype, 2)
        layer = lambda x, w: output_projection(jax_nkilib.attention(*project(x, w), causal=True), w_o)  # noqa: E731
        census = jax_nkilib.neuron.op_census(layer, x, w)
        assert census.kernels == ("qkv", "attention_cte", "output_projection_cte")
        assert census.glue["slice"] == 3  # q, k, v: contiguous ranges of heads
        # batch 2: q [heads, batch, ...] to attention's rows [batch * heads, ...] moves (k and v, one head, do not)
        assert census.moving_transposes == (0 if batch == 1 else 1)


def test_qkv_projection_float32_explain_and_neuron_lowering():
    x, w = random((1, 128, 256), jnp.float32, 0), random((256, 16 * 64), jnp.float32, 1)
    heads = dict(num_q_heads=8, num_kv_heads=4)
    (report,) = jax_nkilib.explain(lambda x, w: qkv_projection(x, w, **heads), x, w)
    assert report.runs_kernel and report.params["float32_compute"] == "float32"
    (note,) = report.notes
    assert "float32 inputs compute in bfloat16 in the NKI kernel (qkv's CTE path" in note and "in float32" in note
    assert "note: float32 inputs compute in bfloat16" in str(report)
    (asked,) = jax_nkilib.explain(lambda x, w: qkv_projection(x, w, **heads, precision="bfloat16"), x, w)
    assert asked.params["float32_compute"] == "bfloat16" and "computes in bfloat16 too" in asked.notes[0]
    for args in ((x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)), (x[:, :2], w)):  # bfloat16; float32 TKG
        (other,) = jax_nkilib.explain(lambda x, w: qkv_projection(x, w, **heads), *args)
        assert other.runs_kernel and other.notes == ()
    with jax_nkilib.neuron.dry_run():  # one kernel call, the same whatever the precision
        configs = [
            kernel_configs(neuron_text(lambda x, w: qkv_projection(x, w, **heads, precision=p), x, w))
            for p in (None, "bfloat16")
        ]
        assert configs[0] == configs[1] and len(configs[0]) == 1
        assert "float32_compute" not in configs[0][0]["params"]
        assert configs[0][0]["input_specs"][0] == [[1, 128, 256], "float32"]


@pytest.mark.parametrize(
    "kwargs, error, fragment",
    [
        (dict(num_q_heads=3), ValueError, ("with 7 heads", "got (8, 32)")),
        (dict(num_q_heads=0), ValueError, "`num_q_heads` must be an int in [1, 2147483647]; got 0"),
        (dict(norm="batch"), ValueError, "`norm` must be None, 'rms' or 'layer'"),
        (dict(norm_weight=jnp.ones(8)), ValueError, "norm_weight/norm_bias need norm='rms' or 'layer'"),
        (dict(norm="rms", norm_bias=jnp.ones(8)), ValueError, "norm_bias needs norm='layer'"),
        (dict(bias=jnp.ones(5)), ValueError, "`bias` must have layout [qkv_dim]"),
        (dict(rope=jnp.ones((2, 3, 4))), TypeError, "`rope` must be (cos, sin)"),
        (  # HuggingFace's [batch, seq, head_dim] tables (qkv_projection's before issue 13 item 8)
            dict(rope=(jnp.ones((2, 3, 4)), jnp.ones((2, 3, 4)))),
            ValueError,
            (
                "qkv_projection: `rope` must be (cos, sin), each [seq, head_dim/2] or [batch, seq, head_dim/2]",
                "`cos` must have layout [batch, seq, head_dim/2]",
                "got shape (2, 3, 4)",
            ),
        ),
        (dict(rope=(jnp.ones((3, 4)),) * 2), ValueError, ("`rope` must be (cos, sin)", "got shape (3, 4)")),
        (dict(rope=(jnp.ones((3, 2)), jnp.ones((2, 3, 2)))), ValueError, "must have the same shape"),
        (dict(rope=(jnp.ones((4, 3, 2)),) * 2), ValueError, "the batch axis of `rope`'s tables (4) must be 1"),
        (dict(kv_cache=jnp.ones(3)), TypeError, "`kv_cache` must be (k_cache, v_cache)"),
        (
            dict(kv_cache=(jnp.ones((2, 2, 8, 4)), jnp.ones((2, 1, 8, 4)))),
            ValueError,
            "`v_cache` must have layout [batch, kv_heads, max_len, head_dim]",
        ),
        (dict(kv_cache=(jnp.ones((2, 2, 2, 4)),) * 2), ValueError, "the caches hold 2 positions, fewer than the 3"),
        (  # a cache in q/k/v's [batch, max_len, kv_heads, head_dim] layout
            dict(kv_cache=(jnp.ones((2, 8, 2, 4)),) * 2),
            ValueError,
            ("`k_cache` must have layout [batch, kv_heads, max_len, head_dim]", "kv_heads"),
        ),
        (
            dict(kv_cache=(jnp.ones((2, 2, 8, 4)),) * 2, cache_positions=jnp.zeros((2, 3))),
            ValueError,
            "`cache_positions` must be an integer array [batch, seq]",
        ),
        (dict(kv_scale=(1.0, 1.0)), ValueError, "cache_positions and kv_scale need kv_cache"),
        # issue 11: static values and kernel-free messages
        (dict(num_q_heads=True), TypeError, "`num_q_heads` must be an int in [1, 2147483647]; got True"),
        (dict(num_kv_heads=2.0), TypeError, "`num_kv_heads` must be an int in [1, 2147483647]; got 2.0"),
        (dict(norm="rms", eps=-1.0), ValueError, ("qkv_projection", "`eps`", ">= 0")),
        (dict(norm="layer", eps=float("nan")), ValueError, ("qkv_projection", "`eps`", "nan")),
        (
            dict(rope=(jnp.ones((3, 2)),) * 2, num_q_heads=3, num_kv_heads=1, w=jnp.ones((8, 25))),
            ValueError,
            ("qkv_projection", "`rope`", "head_dim must be even; got head_dim=5"),
        ),
        (dict(w=jnp.ones((8, 0))), ValueError, ("`w` must be", "head_dim >= 1")),
        (dict(x=jnp.ones((2, 3, 8), jnp.float8_e5m2)), TypeError, ("qkv_projection", "`x`", "float8_e5m2")),
        (dict(x=jnp.ones((2, 3, 0)), w=jnp.ones((0, 32))), ValueError, ("`x`", "hidden >= 1")),
    ],
)
def test_qkv_projection_bad_inputs(kwargs, error, fragment):
    x, w, *_ = qkv_problem()
    args = dict(num_q_heads=NQ, num_kv_heads=NKV)
    args.update(kwargs)
    x, w = args.pop("x", x), args.pop("w", w)
    with pytest.raises(error) as info:
        qkv_projection(x, w, **args)
    for part in [fragment] if isinstance(fragment, str) else fragment:
        assert part in str(info.value)


@pytest.mark.parametrize(
    "parts, bias, fragment",
    [
        # issue 11's case: 4 q and 2 kv heads; 64 + 16 + 32 = 112 columns gave head_dim 14, heads cut across q/k/v
        (((64, 64), (64, 16), (64, 32)), None, "got w_q (64, 64), w_k (64, 16), w_v (64, 32)"),
        (((64, 64), (64, 32), (64, 16)), None, "num_kv_heads * head_dim"),
        (((64, 64), (32, 32), (64, 32)), None, "hidden=64"),
        (((64, 2), (64, 1), (64, 1)), None, "head_dim >= 1"),
        (((64, 64), (64, 32), (64, 32)), ((64,), (16,), (48,)), "`bias` b_k must be [32]"),
    ],
)
def test_qkv_projection_split_weights_are_checked_against_the_heads(parts, bias, fragment):
    x = jnp.ones((1, 2, 64))
    w = tuple(jnp.ones(shape) for shape in parts)
    bias = None if bias is None else tuple(jnp.ones(shape) for shape in bias)
    with pytest.raises(ValueError) as info:
        qkv_projection(x, w, num_q_heads=4, num_kv_heads=2, bias=bias)
    assert "jax_nkilib.qkv_projection" in str(info.value) and fragment in str(info.value)


def test_qkv_projection_split_weights_equal_the_fused_ones():
    x, w, bias, *_ = qkv_problem()
    cuts = (NQ * D, (NQ + NKV) * D)
    split = qkv_projection(
        x, tuple(jnp.split(w, cuts, axis=1)), num_q_heads=NQ, num_kv_heads=NKV, bias=tuple(jnp.split(bias, cuts))
    )
    for got, want in zip(split, qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, bias=bias)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "kv_scale, error, fragment",
    [
        (
            (0.0, 1.0),
            ValueError,
            "`kv_scale` (k_scale, a cache dequantization scale: the cache stores k / k_scale) "
            "must be finite and > 0; got 0.0",
        ),
        ((1.0, -2.0), ValueError, "`kv_scale` (v_scale"),
        ((np.nan, 1.0), ValueError, "got nan"),
        ((1.0, jnp.float32(np.inf)), ValueError, "got inf"),
        ((1.0, "2"), TypeError, "`kv_scale` entries must be float scalars; v_scale is str"),
    ],
)
def test_qkv_projection_kv_scale_is_checked(kv_scale, error, fragment):
    # issue 11: kv_scale=0 wrote +-3.4e38 (the cache dtype's max) into the cache
    x, w, *_ = qkv_problem()
    caches = (jnp.zeros((2, NKV, 8, D)),) * 2
    with pytest.raises(error) as info:
        qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, kv_cache=caches, kv_scale=kv_scale)
    assert "jax_nkilib.qkv_projection" in str(info.value) and fragment in str(info.value)


def test_qkv_projection_traced_values():
    x, w, *_ = qkv_problem()
    caches = (jnp.zeros((2, NKV, 8, D)),) * 2
    with pytest.raises(TypeError, match="qkv_projection: `eps` must be static .* not a traced value"):
        jax.jit(lambda a, e: qkv_projection(a, w, num_q_heads=NQ, num_kv_heads=NKV, norm="rms", eps=e))(x, 1e-6)
    with pytest.raises(TypeError, match="qkv_projection: `num_q_heads` must be static"):
        jax.jit(lambda a, n: qkv_projection(a, w, num_q_heads=n, num_kv_heads=NKV))(x, NQ)
    # a traced kv_scale is a runtime value: allowed (checked only when concrete)
    _, k_cache, _ = jax.jit(
        lambda a, s: qkv_projection(a, w, num_q_heads=NQ, num_kv_heads=NKV, kv_cache=caches, kv_scale=(s, s))
    )(x, 2.0)
    _, k_plain, _ = qkv_projection(x, w, num_q_heads=NQ, num_kv_heads=NKV, kv_cache=caches)
    np.testing.assert_allclose(k_cache, np.asarray(k_plain) / 2.0, rtol=1e-6)


def test_projections_of_no_tokens_are_empty():
    # was a kernel error naming its internal dimension ("dimension B is 0")
    _, w, *_ = qkv_problem()
    q, k, v = qkv_projection(jnp.ones((0, 3, 8)), w, num_q_heads=NQ, num_kv_heads=NKV)
    assert q.shape == (0, 3, NQ, D) and k.shape == v.shape == (0, 3, NKV, D)
    caches = (jnp.ones((2, NKV, 8, D)), jnp.full((2, NKV, 8, D), 2.0))
    q, k_cache, v_cache = qkv_projection(jnp.ones((2, 0, 8)), w, num_q_heads=NQ, num_kv_heads=NKV, kv_cache=caches)
    assert q.shape == (2, 0, NQ, D)
    np.testing.assert_array_equal(k_cache, caches[0])
    np.testing.assert_array_equal(v_cache, caches[1])
    out = output_projection(jnp.ones((0, 3, 2, 4), jnp.float32), jnp.ones((8, 5)), jnp.ones(5))
    assert out.shape == (0, 3, 5) and out.dtype == jnp.float32
    assert output_projection(jnp.ones((1, 3, 2, 4)), jnp.ones((8, 0))).shape == (1, 3, 0)
