"""Automatic sharding of the idiomatic ops on 8 CPU devices (explicit 2x4 mesh `data` x `model`).

Each op in the sharding table (``jax_nkilib._src.sharding.auto.RULES``) has a case here: called under ``jit`` on
inputs sharded over the mesh, it returns the single-device result, sharded as the rule says, with exactly the
collectives the rule implies (read from the compiled HLO). Unsupported shardings raise errors naming the axis.
"""

import functools
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.framework.compat import shard_map_batches_explicit_axes
from jax_nkilib._src.sharding.auto import RULES
from jax_nkilib._src.tools.arg_specs import deformable
from tests.support.data import angles, random
from tests.support.hlo import compiled_collectives as collectives
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close
from tests.support.sharding import use_mesh

B, S, H, N, K, D, F = 2, 16, 128, 8, 4, 16, 256
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _qkv(x, wq, wk, wv):
    return jax_nkilib.qkv_projection(x, (wq, wk, wv), num_q_heads=N, num_kv_heads=K, norm="rms")


def _decode_block(x, k_cache, v_cache, cache_len, wq, wk, wv, w_o, gain, cos, sin):
    return jax_nkilib.decode_block(
        x,
        (k_cache, v_cache),
        cache_len,
        qkv_weight=(wq, wk, wv),
        out_weight=w_o,
        num_q_heads=N,
        num_kv_heads=K,
        rope=(cos, sin),
        norm_weight=gain,
    )


def _quantized(fn):
    return lambda *args: tuple(jnp.asarray(o, jnp.float32) for o in fn(*args))


def _cases():
    x3, x4 = random((B, S, H), seed=0), random((B, S, N, D), seed=1)
    cos, sin = angles((S, D // 2))
    q, k, v = random((B, S, N, D), seed=2), random((B, S, K, D), seed=3), random((B, S, K, D), seed=4)
    gain = random((H,), seed=5)
    w_q, w_k, w_v = (
        random((H, N * D), seed=6, scale=0.1),
        random((H, K * D), seed=7, scale=0.1),
        random((H, K * D), seed=8, scale=0.1),
    )
    w_o, w_gate, w_up, w_down = (
        random(shape, seed=9 + i, scale=0.1) for i, shape in enumerate([(N * D, H), (H, F), (H, F), (F, H)])
    )
    caches = random((B, K, 64, D), seed=13), random((B, K, 64, D), seed=14)
    q1, k1, v1 = random((B, 1, N, D), seed=15), random((B, 1, K, D), seed=16), random((B, 1, K, D), seed=17)
    cache_len = jnp.array([5, 9], jnp.int32)
    cos1, sin1 = angles((B, 1, D // 2))
    q8, s8 = jax_nkilib.quantize_fp8(x3)
    data_mx, scales_mx = jax_nkilib.quantize_mx(x3)
    # op -> (function, arguments, their specs, expected collectives)
    return {
        "jax_nkilib.rope": (
            lambda x, c, s: jax_nkilib.rope(x, c, s),
            (x4, cos, sin),
            (P("data", "model"), P(), P()),
            {},
        ),
        "jax_nkilib.rms_norm": (jax_nkilib.rms_norm, (x3, gain), (P("data", "model"), P()), {}),
        "jax_nkilib.cumsum": (  # the summed axis over `model`: add the earlier shards' totals (one all-gather)
            lambda x: jax_nkilib.cumsum(x, axis=1),
            (x3,),
            (P("data", "model"),),
            {"all-gather": 1},
        ),
        "jax_nkilib.conv": (  # NWC 1-D conv (the conv1d kernel): the batch splits, the filters replicated
            lambda x, w: jax_nkilib.conv(x, w, (2,), "SAME", dimension_numbers=("NWC", "WIO", "NWC")),
            (x3, random((3, H, 8), seed=40, scale=0.1)),
            (P("data"), P()),
            {},
        ),
        "jax_nkilib.pad": (
            lambda x: jax_nkilib.pad(x, ((0, 0), (0, 0), (1, 2)), "edge"),
            (x3,),
            (P("data", "model"),),
            {},
        ),
        "jax_nkilib.topk": (lambda x: jax_nkilib.topk(x, 3), (x3,), (P("data", "model"),), {}),
        "jax_nkilib.deformable_attention": (
            lambda v, s, a: jax_nkilib.deformable_attention(v, deformable.SPATIAL_SHAPES, s, a),
            deformable.forward_operands(np.random.default_rng(0)),
            (P("data"), P("data"), P("data")),
            {},
        ),
        "jax_nkilib.argmax": (jax_nkilib.argmax, (x3,), (P("data", "model"),), {}),
        "jax_nkilib.router": (
            lambda x, w: jax_nkilib.router(x, w, top_k=2, normalize=True),
            (x3, w_gate[:, :16]),
            (P("data", "model"), P()),
            {},
        ),
        "jax_nkilib.layer_norm": (jax_nkilib.layer_norm, (x3, gain, gain), (P("data", "model"), P(), P()), {}),
        "jax_nkilib.quantize_fp8": (_quantized(jax_nkilib.quantize_fp8), (x3,), (P("data", "model"),), {}),
        "jax_nkilib.dequantize_fp8": (
            jax_nkilib.dequantize_fp8,
            (q8, s8),
            (P("data", "model"), P("data", "model")),
            {},
        ),
        "jax_nkilib.quantize_mx": (_quantized(jax_nkilib.quantize_mx), (x3,), (P("data", None, "model"),), {}),
        "jax_nkilib.dequantize_mx": (
            jax_nkilib.dequantize_mx,
            (data_mx, scales_mx),
            (P("data", None, "model"), P("data", None, "model")),
            {},
        ),
        "jax_nkilib.mxfp8_matmul": (
            jax_nkilib.mxfp8_matmul,
            (x3, w_gate),
            (P("data", None, "model"), P("model")),
            {"all-reduce": 1},
        ),
        "jax_nkilib.attention": (
            functools.partial(jax_nkilib.attention, causal=True),
            (q, k, v),
            (P("data", None, "model"),) * 3,
            {},
        ),
        "jax_nkilib.dot_product_attention": (  # the blockwise route: a bias split with the heads
            lambda q, k, v, bias, ids: jax_nkilib.dot_product_attention(
                q, k, v, bias, is_causal=True, query_segment_ids=ids
            ),
            (q, k, v, random((1, N, S, S), seed=18), jnp.repeat(jnp.arange(2), S // 2)[None].repeat(B, 0)),
            (P("data", None, "model"),) * 3 + (P(None, "model"), P("data")),
            {},
        ),
        "jax_nkilib.decode_attention": (
            jax_nkilib.decode_attention,
            (q1, k1, v1, *caches, cache_len),
            (P("data", None, "model"), P("data", None, "model"), P(), P("data", "model"), P(), P()),
            {},
        ),
        "jax_nkilib.decode_block": (  # one kv head per `model` shard: the fused block, then one all-reduce
            _decode_block,
            (x3[:, :1], *caches, cache_len, w_q, w_k, w_v, w_o, gain, cos1, sin1),
            (P("data"), P("data", "model"), P("data", "model"), P("data"))
            + (P(None, "model"),) * 3
            + (P("model"), P(), P(), P()),
            {"all-reduce": 1},
        ),
        "jax_nkilib.qkv_projection": (
            _qkv,
            (x3, w_q, w_k, w_v),
            (P("data"), P(None, "model"), P(None, "model"), P(None, "model")),
            {},
        ),
        "jax_nkilib.output_projection": (
            jax_nkilib.output_projection,
            (x4, w_o, gain),
            (P("data", None, "model"), P("model"), P()),
            {"all-reduce": 1},
        ),
        "jax_nkilib.moe": (  # experts over `model`, tokens over `data` only: local experts + one all-reduce
            lambda x, logits, gu, d: jax_nkilib.moe(x, logits, gu, d, top_k=2),
            (x3, random((B, S, 8), seed=19), random((8, H, 2, 32), seed=20, scale=0.1), random((8, 32, H), seed=21)),
            (P("data"), P("data"), P("model"), P("model")),
            {"all-reduce": 1},
        ),
        "jax_nkilib.moe_block": (  # tokens over `data`: no communication
            lambda x, g, r, gu, d: jax_nkilib.moe_block(x, g, r, gu, d, top_k=2),
            (x3, gain, random((H, 8), seed=22), random((8, H, 2, 32), seed=23, scale=0.1), random((8, 32, H), seed=24)),
            (P("data"), P(), P(), P(), P()),
            {},
        ),
        "jax_nkilib.embedding_lookup": (  # ids over `data`, the table's embedding axis over `model`: local gathers
            jax_nkilib.embedding_lookup,
            (random((50, H), seed=25), jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) * 7 % 50),
            (P(None, "model"), P("data")),
            {},
        ),
        "jax_nkilib.cross_entropy": (  # the mean over the tokens: one all-reduce of the partial sums
            lambda x, y: jax_nkilib.cross_entropy(x, y),
            (x3, jnp.asarray(np.random.default_rng(25).integers(0, H, (B, S)), jnp.int32)),
            (P("data", "model"), P("data", "model")),
            {"all-reduce": 1},
        ),
        "jax_nkilib.mla_attention": (  # the batch over `data`, the weights replicated: no collective
            jax_nkilib.mla_attention,
            (
                random((B, S, 8), seed=26),
                random((8, 6), seed=27, scale=0.4),
                random((6,), seed=28),
                random((6, 2, 8), seed=29, scale=0.4),
                random((8, 8), seed=30, scale=0.4),
                random((4,), seed=31),
                random((4, 2, 10), seed=32, scale=0.5),
                random((2, 6, 8), seed=33, scale=0.4),
                *angles((S, 2)),
            ),
            (P("data"),) + (P(),) * 9,
            {},
        ),
        "jax_nkilib.selective_scan": (  # batch over `data`, channels over `model`: no communication
            lambda u, dt, a, b, c, d: jax_nkilib.selective_scan(u, dt, a, b, c, d, delta_softplus=True),
            (
                random((B, 8, 12), seed=26),
                random((B, 8, 12), seed=27),
                -jnp.exp(random((8, 4), seed=28)),
                random((B, 4, 12), seed=29),
                random((B, 4, 12), seed=30),
                random((8,), seed=31),
            ),
            (P("data", "model"), P("data", "model"), P("model"), P("data"), P("data"), P("model")),
            {},
        ),
        "jax_nkilib.ssd": (  # batch over `data`, heads over `model`: no communication
            lambda x, dt, a, b, c: jax_nkilib.ssd(x, dt, a, b, c, chunk_size=4, dt_softplus=True),
            (
                random((B, 12, 8, 3), seed=32),
                random((B, 12, 8), seed=33),
                -jnp.exp(random((8,), seed=34)),
                random((B, 12, 1, 4), seed=35),
                random((B, 12, 1, 4), seed=36),
            ),
            (P("data", None, "model"), P("data", None, "model"), P("model"), P("data"), P("data")),
            {},
        ),
        "jax_nkilib.ssd.seq_idx": (  # packed sequences (the JAX scan): seq_idx over `data` with the batch
            lambda x, dt, a, b, c, seq_idx: jax_nkilib.ssd(x, dt, a, b, c, chunk_size=4, seq_idx=seq_idx),
            (
                random((B, 12, 8, 3), seed=32),
                jnp.abs(random((B, 12, 8), seed=33)),
                -jnp.exp(random((8,), seed=34)),
                random((B, 12, 1, 4), seed=35),
                random((B, 12, 1, 4), seed=36),
                jnp.asarray(np.repeat([[0, 1, 2], [0, 0, 1]], [5, 4, 3], axis=1), jnp.int32),
            ),
            (P("data", None, "model"), P("data", None, "model"), P("model"), P("data"), P("data"), P("data")),
            {},
        ),
        "jax_nkilib.mlp": (
            lambda x, g, u, d: jax_nkilib.mlp(x, g, u, d, norm="rms"),
            (x3, w_gate, w_up, w_down),
            (P("data"), P(None, "model"), P(None, "model"), P("model")),
            {"all-reduce": 1},
        ),
    }


CASES = _cases()


def test_every_op_in_the_sharding_table_has_a_case():
    assert set(RULES) - set(CASES) <= EXTERNAL_CASES, sorted(set(RULES) - set(CASES) - EXTERNAL_CASES)


# shard_map building blocks whose sharding entry is backed by their own test module
EXTERNAL_CASES = {"jax_nkilib.all_gather_matmul", "jax_nkilib.matmul_reduce_scatter", "jax_nkilib.ring_attention"}


@pytest.mark.parametrize("op", sorted(CASES))
def test_sharded_call_matches_single_device(mesh, op):
    fn, args, specs, expected = CASES[op]
    single = fn(*args)
    with use_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        jitted = jax.jit(fn)
        out = jitted(*placed)
        compiled = jitted.lower(*placed).compile().as_text()
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(single)):
        assert got.shape == want.shape
        assert_close(np.asarray(got, np.float64), np.asarray(want, np.float64), jnp.float32, reduction=H)
    assert collectives(compiled) == expected


def test_outputs_keep_the_input_sharding(mesh):
    fn, args, specs, _ = CASES["jax_nkilib.attention"]
    with use_mesh(mesh):
        out = jax.jit(fn)(*[jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)])
    assert out.sharding.spec == P("data", None, "model", None)


def test_a_sharded_sequence_selects_ring_attention(mesh):
    q, k, v = random((B, S, N, D), seed=2), random((B, S, K, D), seed=3), random((B, S, K, D), seed=4)
    with use_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, P("data", "model"))) for a in (q, k, v)]
        attend = jax.jit(functools.partial(jax_nkilib.attention, causal=True))
        out = attend(*placed)
        kinds = collectives(attend.lower(*placed).compile().as_text())
        grads = jax.jit(jax.grad(lambda *a: jax_nkilib.attention(*a, causal=True).sum(), argnums=(0, 1)))(*placed)
    assert set(kinds) == {"collective-permute"}  # K/V blocks around the `model` ring, nothing gathered
    assert out.sharding.spec == P("data", "model", None, None)
    assert_close(out, jax_nkilib.attention(q, k, v, causal=True), jnp.float32, reduction=S)
    for got, want in zip(
        grads, jax.grad(lambda *a: jax_nkilib.attention(*a, causal=True).sum(), argnums=(0, 1))(q, k, v)
    ):
        assert_close(got, want, jnp.float32, reduction=S, ops=16)


def test_megatron_block_has_exactly_two_all_reduces(mesh):
    """qkv (column-parallel) -> attention (heads) -> output projection (row-parallel) -> MLP (Megatron)."""
    x = random((B, S, H), seed=0)
    w_q, w_k, w_v = (
        random((H, N * D), seed=6, scale=0.1),
        random((H, K * D), seed=7, scale=0.1),
        random((H, K * D), seed=8, scale=0.1),
    )
    w_o, w_gate, w_up, w_down = (
        random(shape, seed=9 + i, scale=0.1) for i, shape in enumerate([(N * D, H), (H, F), (H, F), (F, H)])
    )

    def block(x, w_q, w_k, w_v, w_o, w_gate, w_up, w_down):
        q, k, v = _qkv(x, w_q, w_k, w_v)
        h = x + jax_nkilib.output_projection(jax_nkilib.attention(q, k, v, causal=True), w_o)
        return h + jax_nkilib.mlp(h, w_gate, w_up, w_down, norm="rms")

    args = (x, w_q, w_k, w_v, w_o, w_gate, w_up, w_down)
    specs = (
        P("data"),
        P(None, "model"),
        P(None, "model"),
        P(None, "model"),
        P("model"),
        P(None, "model"),
        P(None, "model"),
        P("model"),
    )
    with use_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
        out = jax.jit(block)(*placed)
        assert collectives(jax.jit(block).lower(*placed).compile().as_text()) == {"all-reduce": 2}
        grads = jax.jit(jax.grad(lambda *a: block(*a).sum(), argnums=(0, 4)))(*placed)
    assert_close(out, block(*args), jnp.float32, reduction=H * F)
    for got, want in zip(grads, jax.grad(lambda *a: block(*a).sum(), argnums=(0, 4))(*args)):
        assert_close(got, want, jnp.float32, reduction=H * F, ops=16)
    assert grads[1].sharding.spec == P("model", None)


def test_kernels_run_inside_the_manual_computation_at_per_device_shapes(mesh):
    q, k, v = random((B, S, N, D), seed=2), random((B, S, K, D), seed=3), random((B, S, K, D), seed=4)
    with use_mesh(mesh), jax_nkilib.neuron.dry_run():
        placed = [jax.device_put(a, NamedSharding(mesh, P("data", None, "model"))) for a in (q, k, v)]
        text = jax_nkilib.neuron_hlo(functools.partial(jax_nkilib.attention, causal=True), *placed)
    assert "sdy.manual_computation" in text
    (config,) = kernel_configs(text)
    assert config["func_name"] == "attention_cte"
    assert config["input_specs"][0][0] == [B // 2 * N // 4, S, D]  # local batch x local heads
    with use_mesh(mesh):
        (report,) = jax_nkilib.explain(functools.partial(jax_nkilib.attention, causal=True), *placed)
    assert report.context == "shard_map(mesh axes: data=2, model=4; manual: data, model)"
    assert report.inputs[0][1] == (B // 2 * N // 4, S, D)


def test_ops_inside_a_user_shard_map_run_on_local_shards(mesh):
    x = random((8, S, H), seed=0)
    with use_mesh(mesh):
        placed = jax.device_put(x, NamedSharding(mesh, P("data")))
        local = jax.jit(jax.shard_map(jax_nkilib.rms_norm, in_specs=P("data"), out_specs=P("data")))(placed)
    assert_close(local, jax_nkilib.rms_norm(x), jnp.float32, reduction=H)


def test_vmap_of_a_sharded_op(mesh):
    """Mapping over an unsharded axis keeps the plan (no collectives); mapping over an axis split over a mesh axis
    (which jax.shard_map may not name) is correct, eagerly and under jit, with that axis Auto: on Neuron the kernel
    sees the whole mapped axis (documented in the README). Eagerly this failed shard_map's divisibility check."""
    x = random((4, 8, S, H), seed=0)
    want = jax_nkilib.rms_norm(x)
    with use_mesh(mesh):
        for spec, tokens in (
            (P(None, "data", "model"), 4 * 8 // 8 * S),
            (P("data", "model"), 4 * 8 // 4 * S),
            (P("data"), 4 * 8 * S),
        ):
            placed = jax.device_put(x, NamedSharding(mesh, spec))
            mapped = jax.vmap(jax_nkilib.rms_norm)
            if spec[0] is not None and not shard_map_batches_explicit_axes():  # JAX 0.7: unsupported, an error
                with pytest.raises(Exception, match=r"needs jax>=0\.8|This reshape is not supported"):
                    jax.jit(mapped)(placed)
                continue
            assert_close(mapped(placed), want, jnp.float32, reduction=H)
            assert_close(jax.jit(mapped)(placed), want, jnp.float32, reduction=H)
            assert jax.jit(mapped)(placed).sharding.spec == spec + (None,) * (4 - len(spec))
            if spec == P(None, "data", "model"):
                assert collectives(jax.jit(mapped).lower(placed).compile().as_text()) == {}
            with jax_nkilib.neuron.dry_run():
                (config,) = kernel_configs(jax_nkilib.neuron_hlo(mapped, placed))
            assert config["input_specs"][0][0] == [tokens, 1, H]


@pytest.mark.skipif(not shard_map_batches_explicit_axes(), reason="vmap over an explicitly split axis needs JAX 0.8")
def test_vmap_over_the_axis_of_a_1d_mesh():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    x, w = random((8, 2, S, H), seed=0), random((H, 4 * D), seed=1, scale=0.1)
    project = jax.vmap(lambda x: jax_nkilib.qkv_projection(x, (w, w, w), num_q_heads=4, num_kv_heads=4)[0])
    placed = jax.device_put(x, NamedSharding(mesh, P("data")))  # no context mesh: the operands' mesh is used
    for fn in (project, jax.jit(project)):
        assert_close(fn(placed), project(x), jnp.float32, reduction=H)


@pytest.mark.parametrize(
    "op", ["jax_nkilib.output_projection", "jax_nkilib.qkv_projection", "jax_nkilib.mlp", "jax_nkilib.rope"]
)
def test_eager_calls_with_data_parallel_activations_and_replicated_weights(op):
    """The most common layout, called without jit on a 2-D mesh (this failed shard_map's divisibility check: the
    op's body planned a second shard_map over every mesh axis)."""
    fn, args, _, _ = CASES[op]
    mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)
    args = [jnp.concatenate([a] * 2) if a.ndim >= 3 else a for a in args]  # a batch of 4 splits over `data`
    with use_mesh(mesh):
        placed = [jax.device_put(a, NamedSharding(mesh, P("data") if a.ndim >= 3 else P())) for a in args]
        out = fn(*placed)
    for got, want in zip(jax.tree.leaves(out), jax.tree.leaves(fn(*args))):
        assert_close(got, want, jnp.float32, reduction=H)
        assert got.sharding.spec[0] == "data"


def _readme_snippets() -> list[str]:
    """The Python blocks of the README's "Sharding" section that build a mesh."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Sharding\n") :]
    section = section[: section.index("\n## ", 1)]
    return [block for block in re.findall(r"```python\n(.*?)```", section, re.S) if "make_mesh" in block]


@pytest.mark.skipif(not hasattr(jax, "set_mesh"), reason="the README's snippets use jax.set_mesh (JAX >= 0.8)")
def test_the_readme_sharding_snippets_run_as_written():
    """The README's explicit-mesh layout and its `explicit_axes` recipe for Auto axes (which failed with "Context
    mesh cannot be empty" and called Auto the default axis type), given inputs."""
    megatron, recipe = _readme_snippets()
    x = random((8, S, H), seed=0)
    weights = {
        "w_q": random((H, 32 * 8), seed=1, scale=0.1),
        "w_k": random((H, 8 * 8), seed=2, scale=0.1),
        "w_v": random((H, 8 * 8), seed=3, scale=0.1),
        "w_o": random((32 * 8, H), seed=4, scale=0.1),
    }
    scope = {"jax": jax, "jax_nkilib": jax_nkilib, "x": x, **weights}
    exec(megatron, scope)
    q, k, v = jax_nkilib.qkv_projection(
        x, (weights["w_q"], weights["w_k"], weights["w_v"]), num_q_heads=32, num_kv_heads=8
    )
    want = jax_nkilib.output_projection(jax_nkilib.attention(q, k, v, causal=True), weights["w_o"])
    assert_close(scope["y"], want, jnp.float32, reduction=H * 32)
    assert scope["y"].sharding.spec == P("data", None, None)
    scope = {"jax": jax, "jax_nkilib": jax_nkilib, "x": x}
    exec(recipe, scope)
    assert scope["mesh"].axis_types == (AxisType.Auto,)
    assert_close(scope["y"], jax_nkilib.rms_norm(x), jnp.float32, reduction=H)


def test_an_auto_mesh_computes_globally_and_explicit_axes_gives_the_plan():
    auto_mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))  # make_mesh's default is Explicit
    x = random((8, S, H), seed=0)
    placed = jax.device_put(x, NamedSharding(auto_mesh, P("data")))
    assert_close(jax.jit(jax_nkilib.rms_norm)(placed), jax_nkilib.rms_norm(x), jnp.float32, reduction=H)
    with use_mesh(auto_mesh), jax_nkilib.neuron.dry_run():
        assert "sdy.manual_computation" not in jax_nkilib.neuron_hlo(jax_nkilib.rms_norm, placed)  # global
    norm = jax.sharding.explicit_axes(jax_nkilib.rms_norm, axes=("data",), in_sharding=P("data"))  # the README's
    with use_mesh(auto_mesh):
        assert_close(jax.jit(norm)(placed), jax_nkilib.rms_norm(x), jnp.float32, reduction=H)
        with jax_nkilib.neuron.dry_run():
            text = jax_nkilib.neuron_hlo(norm, placed)
    assert "sdy.manual_computation" in text
    assert kernel_configs(text)[0]["input_specs"][0][0] == [S, 1, H]  # one device's S tokens, not all 8 * S


@pytest.mark.parametrize(
    "op, fn, args, specs, message",
    [
        (
            "rope head_dim",
            lambda x, c, s: jax_nkilib.rope(x, c, s),
            "x4 cos sin",
            (P(None, None, None, "model"), P(), P()),
            "axis 3 (head_dim) over mesh axis 'model'",
        ),
        ("rms_norm hidden", jax_nkilib.rms_norm, "x3", (P(None, None, "model"),), "axis 2 (hidden)"),
        (
            "attention window",
            lambda q, k, v: jax_nkilib.attention(q, k, v, sliding_window=4, causal=True),
            "q k v",
            (P(None, "model"),) * 3,
            "no sliding_window",
        ),
        (
            "attention heads vs batch",
            functools.partial(jax_nkilib.attention, causal=True),
            "q k v",
            (P("data"), P(None, None, "data"), P()),
            "mesh axis 'data' splits both batch and heads",
        ),
        (
            "attention mismatched",
            functools.partial(jax_nkilib.attention, causal=True),
            "q k v",
            (P(None, None, "data"), P(None, None, "model"), P()),
            "heads is split over mesh axis 'data' in `q` but over 'model' in `k`",
        ),
        (
            "qkv fused columns",
            lambda x, w: jax_nkilib.qkv_projection(x, w, num_q_heads=N, num_kv_heads=K),
            "x3 wqkv",
            (P(), P(None, "model")),
            "pass w as (w_q, w_k, w_v)",
        ),
        (
            "mlp hidden",
            lambda x, g, u, d: jax_nkilib.mlp(x, g, u, d),
            "x3 wg wu wd",
            (P(None, None, "model"), P(), P(), P()),
            "axis 2 (hidden)",
        ),
        (
            "quantize_mx partial blocks",
            lambda x: jax_nkilib.quantize_mx(x, axis=1),
            "x64",
            (P(None, "model"),),
            "multiple of 32",
        ),
    ],
)
def test_unsupported_shardings_raise_naming_the_axis(mesh, op, fn, args, specs, message):
    arrays = {
        "x3": random((B, S, H)),
        "x64": random((B, 64, H)),
        "x4": random((B, S, N, D)),
        "cos": angles((S, D // 2))[0],
        "sin": angles((S, D // 2))[1],
        "q": random((B, S, N, D)),
        "k": random((B, S, K, D)),
        "v": random((B, S, K, D)),
        "wqkv": random((H, (N + 2 * K) * D)),
        "wg": random((H, F)),
        "wu": random((H, F)),
        "wd": random((F, H)),
    }
    with use_mesh(mesh):
        placed = [jax.device_put(arrays[name], NamedSharding(mesh, s)) for name, s in zip(args.split(), specs)]
        with pytest.raises(ValueError, match=re.escape(message)):
            jax.jit(fn)(*placed)


@pytest.mark.parametrize(
    "table, seq_split",
    [((S, D // 2), False), ((B, S, D // 2), False), ((S, D // 2), True), ((1, S, D // 2), True)],
)
def test_qkv_projection_rope_tables_shard_as_ropes(mesh, table, seq_split):
    """qkv_projection's `rope`, jax_nkilib.rope's tables [seq, head_dim/2] or [batch, seq, head_dim/2], shards as
    rope's: with the batch (heads over `model`) or with the sequence."""
    x = random((B, S, H), seed=0)
    w = tuple(random((H, n * D), seed=6 + i, scale=0.1) for i, n in enumerate((N, K, K)))
    cos, sin = angles(table)
    fn = lambda x, c, s, *w: jax_nkilib.qkv_projection(x, w, num_q_heads=N, num_kv_heads=K, rope=(c, s))
    if seq_split:
        specs = (P("data", "model"), *(P(*(None,) * (len(table) - 2), "model"),) * 2, *(P(),) * 3)
    else:
        specs = (P("data"), *(P("data") if len(table) == 3 else P(),) * 2, *(P(None, "model"),) * 3)
    single = fn(x, cos, sin, *w)
    with use_mesh(mesh):
        out = jax.jit(fn)(*[jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, cos, sin, *w), specs)])
    for got, want in zip(out, single):
        assert_close(np.asarray(got, np.float64), np.asarray(want, np.float64), jnp.float32, reduction=H)
    assert out[0].sharding.spec[:2] == (("data", "model") if seq_split else ("data", None))
