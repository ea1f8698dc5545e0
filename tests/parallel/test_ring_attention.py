"""ring_attention on 8 CPU devices: every layout, causal and not, GQA, f32/bf16, gradients, vmap, 2-axis meshes,
the collectives in the compiled HLO, bad inputs; and the layout helpers (token_positions, to/from_ring_layout)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib._src.ops.ring_attention import _plan, _Ring, ring_attention
from jax_nkilib._src.sharding.sequence_layouts import LAYOUTS, from_ring_layout, to_ring_layout, token_positions
from tests.support.data import random
from tests.support.hlo import compiled_collectives
from tests.support.numerics import assert_close
from tests.support.sharding import make_mesh, mesh_1d, reshard, shard

N = 8


# ------------------------------------------------------------------------------------------------ float64 oracle
def oracle(q, k, v, dy=None, *, causal, scale=None):
    """Global attention in float64 from the definition: ``softmax(scale q k^T + mask) v`` with query head ``h`` on kv
    head ``h // (H / H_kv)`` and mask ``key_pos <= query_pos`` (natural order); with ``dy`` also the gradients of
    ``sum(o * dy)``: ``dv = P^T dy``, ``dS = P (dy v^T - rowsum(P dy v^T))``, ``dq = scale dS k``,
    ``dk = scale dS^T q``."""
    q, k, v = (np.asarray(jnp.asarray(x, jnp.float64)) for x in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    scale = 1.0 / np.sqrt(q.shape[3]) if scale is None else scale
    kr, vr = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    s = scale * np.einsum("bqhd,bkhd->bhqk", q, kr)
    seq = q.shape[1]
    ok = np.tril(np.ones((seq, seq), bool)) if causal else np.ones((seq, seq), bool)
    s = np.where(ok, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", p, vr)
    if dy is None:
        return out
    dy = np.asarray(jnp.asarray(dy, jnp.float64))
    dp = np.einsum("bqhd,bkhd->bhqk", dy, vr)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    dq = scale * np.einsum("bhqk,bkhd->bqhd", ds, kr)
    fold = lambda x: x.reshape(x.shape[:2] + (k.shape[2], groups, x.shape[3])).sum(3)  # noqa: E731
    dk = fold(scale * np.einsum("bhqk,bqhd->bkhd", ds, q))
    dv = fold(np.einsum("bhqk,bqhd->bkhd", p, dy))
    return out, (dq, dk, dv)


# ------------------------------------------------------------------------------------------------ harness
def qkv(batch=2, seq=64, heads=4, kv_heads=2, d=16, dtype=jnp.float32, lead=()):
    return (
        random(lead + (batch, seq, heads, d), dtype, 0),
        random(lead + (batch, seq, kv_heads, d), dtype, 1),
        random(lead + (batch, seq, kv_heads, d), dtype, 2),
    )


def global_ring(mesh, axis, layout, seq_spec=None, batch_spec=None, **kw):
    """A function of global, naturally ordered q, k, v: reorder to ``layout``, shard the sequence over ``axis``, run
    ring_attention in shard_map, put the result back in natural order."""
    seq_spec = axis if seq_spec is None else seq_spec
    spec = P(batch_spec, seq_spec)
    size = int(np.prod([mesh.shape[name] for name in ((axis,) if isinstance(axis, str) else axis)]))
    body = jax.shard_map(
        functools.partial(ring_attention, axis_name=axis, layout=layout, **kw),
        mesh=mesh,
        in_specs=(spec, spec, spec),
        out_specs=spec,
    )

    def run(q, k, v):
        placed = (
            reshard(to_ring_layout(x, layout=layout, axis_size=size), NamedSharding(mesh, spec)) for x in (q, k, v)
        )
        return from_ring_layout(body(*placed), layout=layout, axis_size=size)

    return run


def loss_grads(fn, q, k, v, dy):
    return jax.jit(jax.grad(lambda a, b, c: jnp.sum(fn(a, b, c).astype(jnp.float32) * dy), argnums=(0, 1, 2)))(q, k, v)


# ------------------------------------------------------------------------------------------------ numerics
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_matches_oracle_and_single_device(layout, causal, dtype):
    q, k, v = qkv(dtype=dtype)
    out = jax.jit(global_ring(mesh_1d("cp"), "cp", layout, causal=causal))(q, k, v)
    assert out.shape == q.shape and out.dtype == dtype
    seq = q.shape[1]
    assert_close(out, oracle(q, k, v, causal=causal), dtype, reduction=seq)
    single = jax_nkilib.attention(q, k, v, causal=causal)
    assert_close(out, np.asarray(single.astype(jnp.float64)), dtype, reduction=seq)


def _slow_unless(*fast):
    """Parametrize values ``layout, ...`` with every case not in ``fast`` marked slow (compiling a ring's backward
    takes ~10 s on a small CPU machine; CI keeps a covering subset)."""
    return lambda *values: pytest.param(*values, marks=() if values in fast else pytest.mark.slow)


_GRAD_CASE = _slow_unless(("zigzag", True), ("striped", True), ("contiguous", False))


@pytest.mark.parametrize(
    "layout,causal", [_GRAD_CASE(layout, causal) for layout in LAYOUTS for causal in (True, False)]
)
def test_gradients_match_oracle_and_single_device(layout, causal):
    q, k, v = qkv()
    dy = random(q.shape, jnp.float32, 3)
    ring = global_ring(mesh_1d("cp"), "cp", layout, causal=causal)
    grads = loss_grads(ring, q, k, v, dy)
    _, want = oracle(q, k, v, dy, causal=causal)
    single = loss_grads(functools.partial(jax_nkilib.attention, causal=causal), q, k, v, dy)
    for name, got, expected, other in zip("qkv", grads, want, single):
        assert got.dtype == jnp.float32, name
        assert_close(got, expected, jnp.float32, reduction=q.shape[1], ops=8)
        assert_close(got, np.asarray(other, np.float64), jnp.float32, reduction=q.shape[1], ops=8)


@pytest.mark.parametrize(
    "layout",
    ["zigzag", pytest.param("striped", marks=pytest.mark.slow), pytest.param("contiguous", marks=pytest.mark.slow)],
)
def test_bf16_gradients(layout):
    q, k, v = qkv(dtype=jnp.bfloat16)
    dy = random(q.shape, jnp.float32, 3)
    grads = loss_grads(global_ring(mesh_1d("cp"), "cp", layout), q, k, v, dy)
    _, want = oracle(q, k, v, dy, causal=True)
    for got, expected in zip(grads, want):
        assert got.dtype == jnp.bfloat16
        assert_close(got, expected, jnp.bfloat16, reduction=q.shape[1], ops=8)


@pytest.mark.parametrize(
    "layout,seq,kv_heads",
    [pytest.param("contiguous", 56, 1, marks=pytest.mark.slow), ("striped", 40, 4), ("zigzag", 48, 1)],
)
def test_odd_local_lengths_mqa_mha_and_scale(layout, seq, kv_heads):
    q, k, v = qkv(batch=1, seq=seq, heads=4, kv_heads=kv_heads, d=8)
    dy = random(q.shape, jnp.float32, 3)
    ring = global_ring(mesh_1d("cp"), "cp", layout, scale=0.3)
    out = jax.jit(ring)(q, k, v)
    want, want_grads = oracle(q, k, v, dy, causal=True, scale=0.3)
    assert_close(out, want, jnp.float32, reduction=seq)
    for got, expected in zip(loss_grads(ring, q, k, v, dy), want_grads):
        assert_close(got, expected, jnp.float32, reduction=seq, ops=8)


@pytest.mark.parametrize(
    "layout,causal",
    [
        _slow_unless(("contiguous", False))(layout, causal)
        for layout in LAYOUTS
        for causal in (True, False)
        if (layout, causal) != ("zigzag", True)  # the default: the ring_attention arg spec's check_grads
    ],
)
def test_check_grads_float64(layout, causal):
    """On inputs already in the ring layout (the layout permutation is a plain gather, not under test here); GQA."""
    mesh, spec = mesh_1d("cp"), P(None, "cp")
    q, k, v = (
        to_ring_layout(x, layout=layout, axis_size=N)
        for x in qkv(batch=1, seq=16, heads=2, kv_heads=1, d=4, dtype=jnp.float64)
    )
    body = jax.shard_map(
        functools.partial(ring_attention, axis_name="cp", layout=layout, causal=causal),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=spec,
    )
    ring = jax.jit(lambda *xs: body(*(reshard(x, NamedSharding(mesh, spec)) for x in xs)))
    check_grads(ring, (q, k, v), order=1, modes=("rev",), atol=1e-6, rtol=1e-6)


# ------------------------------------------------------------------------------------------------ transformations
@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_vmap_over_a_leading_axis_and_vmap_of_grad():
    """An extra leading axis (e.g. micro-batches) vmapped inside shard_map: each slice is its own ring problem."""
    mesh = mesh_1d("cp")
    q, k, v = qkv(batch=1, seq=32, lead=(3,))
    spec = P(None, None, "cp")
    attend = functools.partial(ring_attention, axis_name="cp", layout="striped")
    batched = jax.shard_map(jax.vmap(attend), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    grads = jax.shard_map(
        jax.vmap(jax.grad(lambda a, b, c: jnp.sum(attend(a, b, c) ** 2), argnums=(0, 1, 2))),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=(spec,) * 3,
    )
    ring_q, ring_k, ring_v = (to_ring_layout(x, layout="striped", axis_size=N, seq_axis=2) for x in (q, k, v))
    placed = shard(mesh, (spec,) * 3, ring_q, ring_k, ring_v)
    out = from_ring_layout(jax.jit(batched)(*placed), layout="striped", axis_size=N, seq_axis=2)
    dq = from_ring_layout(jax.jit(grads)(*placed)[0], layout="striped", axis_size=N, seq_axis=2)
    for i in range(3):
        assert_close(out[i], oracle(q[i], k[i], v[i], causal=True), jnp.float32, reduction=32)
        _, (want_dq, _, _) = oracle(q[i], k[i], v[i], 2 * oracle(q[i], k[i], v[i], causal=True), causal=True)
        assert_close(dq[i], want_dq, jnp.float32, reduction=32, ops=8)


def test_vmap_of_the_queries_alone():
    """``in_axes=(0, None, None)``: several query sets against one K/V."""
    mesh, layout = mesh_1d("cp"), "zigzag"
    q, _, _ = qkv(batch=1, seq=32, lead=(2,))
    _, k, v = qkv(batch=1, seq=32)
    attend = functools.partial(ring_attention, axis_name="cp", layout=layout)
    shared = jax.shard_map(
        jax.vmap(attend, in_axes=(0, None, None)),
        mesh=mesh,
        in_specs=(P(None, None, "cp"), P(None, "cp"), P(None, "cp")),
        out_specs=P(None, None, "cp"),
    )
    ring_q = to_ring_layout(q, layout=layout, axis_size=N, seq_axis=2)
    ring_k, ring_v = (to_ring_layout(x, layout=layout, axis_size=N) for x in (k, v))
    placed = shard(mesh, (P(None, None, "cp"), P(None, "cp"), P(None, "cp")), ring_q, ring_k, ring_v)
    out = from_ring_layout(jax.jit(shared)(*placed), layout=layout, axis_size=N, seq_axis=2)
    for i in range(2):
        assert_close(out[i], oracle(q[i], k, v, causal=True), jnp.float32, reduction=32)


@pytest.mark.slow  # heavy (several compiled transformations): run with `pytest -m slow`
def test_residuals_are_named_for_remat_policies():
    mesh, spec = mesh_1d("cp"), P(None, "cp")
    args = shard(mesh, (spec,) * 3, *qkv(batch=1, seq=16, heads=2, kv_heads=1, d=8))
    attend = jax.shard_map(
        functools.partial(ring_attention, axis_name="cp"), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
    )
    loss = lambda *xs: jnp.sum(jnp.sin(attend(*xs)))  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(*args))
    assert all(f"ring_attention.{name}" in text for name in ("q", "k", "v", "out", "lse"))
    policy = jax.checkpoint_policies.save_only_these_names("ring_attention.out", "ring_attention.lse")
    remat = jax.jit(jax.grad(jax.checkpoint(loss, policy=policy), argnums=(0, 1, 2)))(*args)
    for got, want in zip(remat, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_two_axis_mesh_ring_over_one_axis_batch_over_the_other(layout):
    mesh = make_mesh((2, 4), ("dp", "cp"))
    q, k, v = qkv(seq=32)
    dy = random(q.shape, jnp.float32, 3)
    ring = global_ring(mesh, "cp", layout, batch_spec="dp")
    want, want_grads = oracle(q, k, v, dy, causal=True)
    assert_close(jax.jit(ring)(q, k, v), want, jnp.float32, reduction=32)
    for got, expected in zip(loss_grads(ring, q, k, v, dy), want_grads):
        assert_close(got, expected, jnp.float32, reduction=32, ops=8)


def test_ring_over_a_tuple_of_axes():
    mesh = make_mesh((2, 4), ("x", "y"))
    q, k, v = qkv()
    out = jax.jit(global_ring(mesh, ("x", "y"), "zigzag"))(q, k, v)
    assert_close(out, oracle(q, k, v, causal=True), jnp.float32, reduction=64)


def test_nan_propagates_like_jax_nn_and_is_never_zeroed():
    """Issue 11: a NaN key poisons exactly the rows that see it (on whichever shard they live), a NaN query row
    its own row; the gradient of a NaN loss is NaN."""
    q, k, v = qkv(batch=1, seq=32)
    q, k = q.at[0, 3, 1].set(jnp.nan), k.at[0, 20, 0].set(jnp.nan)  # kv head 0 serves query heads 0 and 1
    ring = jax.jit(global_ring(mesh_1d("cp"), "cp", "zigzag", causal=True))
    out = np.asarray(ring(q, k, v))
    nan_rows = np.isnan(out).all(-1)
    assert np.array_equal(nan_rows, np.isnan(out).any(-1))  # rows are all-NaN or finite
    expected = np.zeros((1, 32, 4), bool)
    expected[0, 20:, :2] = True
    expected[0, 3, 1] = True
    np.testing.assert_array_equal(nan_rows, expected)
    want = oracle(q.at[0, 3, 1].set(0.0), k.at[0, 20, 0].set(0.0), v, causal=True)
    np.testing.assert_allclose(out[~expected], want[~expected], rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------ compiled HLO
def collectives(fn, *args) -> dict[str, int]:
    """Counts of collective instructions in the compiled (optimised) HLO."""
    return compiled_collectives(jax.jit(fn).lower(*args).compile().as_text())


def executed_permutes(fn, *args) -> int:
    """``ppermute``s one call executes: counted in the jaxpr, loop bodies times their trip count (the ring's steps
    are a rolled loop, so the compiled HLO holds each permute once)."""

    def count(jaxpr) -> int:
        total = 0
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ppermute":
                total += 1
                continue
            assert eqn.primitive.name != "while", "a loop with an unknown trip count"
            subs = [count(_inner(value)) for value in _sub_jaxprs(eqn.params)]
            if eqn.primitive.name == "scan":
                total += eqn.params["length"] * sum(subs)
            elif eqn.primitive.name == "cond":
                total += max(subs)
            else:
                total += sum(subs)
        return total

    return count(jax.make_jaxpr(fn)(*args).jaxpr)


def _inner(value):
    return value.jaxpr if hasattr(value, "jaxpr") and not hasattr(value, "eqns") else value


def _sub_jaxprs(params):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns") or hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item


def sharded_body(mesh, axis, spec, fn):
    return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_uses_exactly_two_permutes_per_ring_step(layout, causal):
    mesh, spec = mesh_1d("cp"), P(None, "cp")
    args = shard(mesh, (spec,) * 3, *qkv())
    body = sharded_body(
        mesh, "cp", spec, functools.partial(ring_attention, axis_name="cp", layout=layout, causal=causal)
    )
    assert set(collectives(body, *args)) == {"collective-permute"}
    assert executed_permutes(body, *args) == 2 * (N - 1)


def test_backward_permutes_k_v_and_their_gradient_accumulators():
    mesh, spec = mesh_1d("cp"), P(None, "cp")
    args = shard(mesh, (spec,) * 3, *qkv())
    attend = functools.partial(ring_attention, axis_name="cp", layout="zigzag")
    grads = jax.shard_map(
        jax.grad(lambda a, b, c: jnp.sum(attend(a, b, c)), argnums=(0, 1, 2)),
        mesh=mesh,
        in_specs=(spec,) * 3,
        out_specs=(spec,) * 3,
    )
    # forward: K, V (n - 1 each); backward (the ring turned the other way): K, V (n - 1 each), and dK, dV (n each:
    # they leave home with the step-0 gradients and travel the whole ring)
    assert set(collectives(grads, *args)) == {"collective-permute"}
    assert executed_permutes(grads, *args) == 4 * (N - 1) + 2 * N


def test_two_axis_mesh_permutes_only_along_the_ring_axis():
    mesh, spec = make_mesh((2, 4), ("dp", "cp")), P("dp", "cp")
    args = shard(mesh, (spec,) * 3, *qkv(seq=32))
    body = sharded_body(mesh, "cp", spec, functools.partial(ring_attention, axis_name="cp"))
    assert set(collectives(body, *args)) == {"collective-permute"}
    assert executed_permutes(body, *args) == 2 * 3
    text = jax.jit(body).lower(*args).compile().as_text()
    permutes = re.findall(r"collective-permute\(.*?source_target_pairs=\{((?:\{\d+,\d+\},?)+)\}", text)
    assert permutes
    # devices (dp, cp) are numbered dp * 4 + cp: every pair stays inside one dp row and moves cp -> cp + 1
    for found in permutes:
        pairs = [tuple(map(int, pair)) for pair in re.findall(r"\{(\d+),(\d+)\}", found)]
        assert sorted(pairs) == sorted((row * 4 + cp, row * 4 + (cp + 1) % 4) for row in range(2) for cp in range(4))


# ------------------------------------------------------------------------------------------------ causal work plan
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_step_computes_exactly_the_visible_pairs(layout):
    """For every (rank, step) the static piece chosen by ``rank >= step`` with its mask sees exactly the (query, key)
    pairs the global causal mask allows, never a fully masked piece; striped and zigzag shards do equal work (striped:
    up to the diagonal, ``j <= i`` versus ``j < i`` on the same blocks)."""
    length = 6
    ring = _Ring(("cp",), N, True, layout, 1.0)
    for t in range(N):
        work = set()
        for r in range(N):
            s = (r - t) % N
            q_pos, k_pos = (np.asarray(token_positions(layout, N, rank, length)) for rank in (r, s))
            visible = k_pos[None, :] <= q_pos[:, None]
            plan = _plan(ring, length, t)
            piece = plan[0] if len(plan) == 1 or r >= t else plan[1]
            got = np.zeros((length, length), bool)
            if piece is not None:
                i = np.arange(piece.q_start, piece.q_stop)[:, None] - piece.q_start
                j = np.arange(piece.k_start, piece.k_stop)[None, :] - piece.k_start
                rows = (j <= i + piece.q_base) if piece.causal else np.ones(i.shape[:1] + j.shape[1:], bool)
                got[piece.q_start : piece.q_stop, piece.k_start : piece.k_stop] = rows
                assert rows.any()
            np.testing.assert_array_equal(got, visible, err_msg=f"{layout} rank {r} step {t}")
            work.add(visible.sum() if piece is not None else 0)
        if layout != "contiguous" and t:
            assert max(work) - min(work) <= (length if layout == "striped" else 0), (layout, t, work)


# ------------------------------------------------------------------------------------------------ layouts
@pytest.mark.parametrize("layout", LAYOUTS)
def test_to_ring_layout_gives_each_shard_its_token_positions(layout):
    seq, n = 24, 4
    x = jnp.arange(seq)[None, :, None] * jnp.ones((2, 1, 3), jnp.int32)
    ring = to_ring_layout(x, layout=layout, axis_size=n)
    for r in range(n):
        expected = np.asarray(token_positions(layout, n, r, seq // n))
        np.testing.assert_array_equal(np.asarray(ring[0, r * 6 : (r + 1) * 6, 0]), expected)
    np.testing.assert_array_equal(from_ring_layout(ring, layout=layout, axis_size=n), x)
    positions = np.concatenate([np.asarray(token_positions(layout, n, r, seq // n)) for r in range(n)])
    assert sorted(positions) == list(range(seq))


def test_token_positions_values_and_traced_rank():
    np.testing.assert_array_equal(token_positions("zigzag", 4, 1, 4), [2, 3, 12, 13])
    np.testing.assert_array_equal(token_positions("striped", 4, 1, 3), [1, 5, 9])
    np.testing.assert_array_equal(token_positions("contiguous", 4, 1, 3), [3, 4, 5])
    traced = jax.jit(lambda r: token_positions("zigzag", 4, r, 4))(jnp.int32(3))
    np.testing.assert_array_equal(traced, [6, 7, 8, 9])


def test_layouts_keep_an_explicit_sharding():
    mesh = mesh_1d("cp")
    x = shard(mesh, (P(None, "cp"),), jnp.arange(2 * 32, dtype=jnp.float32).reshape(2, 32))
    y = jax.jit(lambda a: to_ring_layout(a, layout="zigzag", axis_size=N))(x)
    assert y.sharding.spec == P(None, "cp")
    np.testing.assert_array_equal(from_ring_layout(y, layout="zigzag", axis_size=N), x)


@pytest.mark.parametrize(
    "call,error,fragment",
    [
        (lambda: token_positions("diagonal", 2, 0, 4), ValueError, "layout"),
        (lambda: token_positions("zigzag", 2, 0, 3), ValueError, "even"),
        (lambda: token_positions("striped", 0, 0, 4), ValueError, "axis_size"),
        (lambda: token_positions("striped", 2, 2, 4), ValueError, "rank"),
        (lambda: token_positions("striped", 2, 0, 0), ValueError, "local_len"),
        (lambda: to_ring_layout(jnp.ones((1, 10)), layout="striped", axis_size=4), ValueError, "multiple of axis_size"),
        (lambda: to_ring_layout(jnp.ones((1, 12)), layout="zigzag", axis_size=4), ValueError, "even"),
        (lambda: from_ring_layout(jnp.ones((1, 8)), layout="zigzag", axis_size=2, seq_axis=2), ValueError, "seq_axis"),
        (lambda: to_ring_layout([1, 2], layout="zigzag", axis_size=2), TypeError, "`x`"),
    ],
)
def test_layout_bad_arguments(call, error, fragment):
    with pytest.raises(error, match=re.escape(fragment)):
        call()


# ------------------------------------------------------------------------------------------------ bad inputs
def _in_shard_map(q, k, v, **kw):
    mesh, spec = mesh_1d("cp"), P(None, "cp")
    body = jax.shard_map(lambda a, b, c: ring_attention(a, b, c, **kw), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)
    return jax.jit(body).trace(*shard(mesh, (spec,) * 3, q, k, v))


@pytest.mark.parametrize(
    "change,kw,error,fragment",
    [
        ({}, dict(axis_name="sp"), ValueError, "'sp' is not bound"),
        ({}, dict(axis_name=3), TypeError, "axis_name"),
        ({}, dict(axis_name="cp", layout="ring"), ValueError, "layout"),
        ({"seq": 24}, dict(axis_name="cp", layout="zigzag"), ValueError, "even number of tokens per shard"),
        ({"heads": 3}, dict(axis_name="cp"), ValueError, "multiple of kv heads"),
        ({"v": (2, 64, 2, 8)}, dict(axis_name="cp"), ValueError, "same shape"),
        ({"k": (2, 32, 2, 16), "v": (2, 32, 2, 16)}, dict(axis_name="cp"), ValueError, "agree on batch, seq"),
        ({"q": (2, 64, 4)}, dict(axis_name="cp"), ValueError, "[batch, seq, heads, head_dim]"),
        ({"dtype_k": jnp.bfloat16}, dict(axis_name="cp"), TypeError, "one floating dtype"),
        ({}, dict(axis_name="cp", causal=1), TypeError, "causal"),
        ({}, dict(axis_name="cp", scale="1"), TypeError, "scale"),
        ({}, dict(axis_name="cp", scale=float("nan")), ValueError, "`scale` must be a finite Python float"),
        ({"k": (2, 64, 0, 16), "v": (2, 64, 0, 16)}, dict(axis_name="cp"), ValueError, "`k` has kv_heads = 0"),
    ],
)
def test_bad_inputs_raise_at_trace_time(change, kw, error, fragment):
    q, k, v = qkv(seq=change.get("seq", 64), heads=change.get("heads", 4))
    q = jnp.ones(change["q"]) if "q" in change else q
    k = jnp.ones(change["k"]) if "k" in change else k
    v = jnp.ones(change["v"]) if "v" in change else v
    k = k.astype(change.get("dtype_k", k.dtype))
    with pytest.raises(error, match=re.escape(fragment)):
        _in_shard_map(q, k, v, **kw)
