"""Gradients of every differentiable idiomatic op under ``jit`` on explicit 1-D and 2-D meshes (issue 11).

Each op's operands name their dimensions with the planner's letters (``"bsnd"``); a *split* maps letters to mesh
axes, and the splits tried are every one the op's sharding rule (the README's table) allows: each letter over each
mesh axis, and on a 2-D mesh each pair of letters over ``data`` and ``model``. A split call must give the
single-device gradients, and its forward program must hold one manual computation (the op's own plan, nothing
nested; none when the split uses only size-1 mesh axes, which JAX lowers without one). Before the fix an op whose
operands used only some axes of a 2-D mesh (the batch over ``data`` alone) nested a second ``shard_map`` in its
plan, and its gradient failed to compile or hung in JAX's lowering; every test here therefore runs in a subprocess
under a time limit (``tests/support/isolation.py``). CI runs the 4x2 mesh with the batch over ``data`` alone, and
with a tensor-parallel split over ``model`` for the ops that ``test_sharded_training``'s block leaves out; the whole
matrix is ``-m slow``.
"""

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib._src.sharding.auto import RULES
from jax_nkilib._src.tools.arg_specs import deformable
from tests.support.data import angles, random
from tests.support.hlo import manual_computations
from tests.support.isolation import time_limit
from tests.support.numerics import relative_error, tolerance

B, S, H, N, K, D, F = 8, 16, 128, 16, 8, 16, 256
MESHES = {
    "8": ((8,), ("data",)),
    "8x1": ((8, 1), ("data", "model")),
    "4x2": ((4, 2), ("data", "model")),
    "2x4": ((2, 4), ("data", "model")),
}
BOUND = tolerance(jnp.float32, reduction=4096, ops=16)  # psum'd partial sums add in another order


@dataclasses.dataclass(frozen=True)
class Case:
    """``fn(**args)``; ``dims`` names each operand's dimensions with the rule's letters (absent: replicated);
    gradients are taken for ``diff``."""

    rule: str
    fn: Callable
    args: dict
    dims: dict
    diff: tuple
    ci: tuple = ()  # splits CI runs on the 4x2 mesh (the block in test_sharded_training adds the README's layout)


def _cases() -> dict[str, Case]:
    x3, x4 = random((B, S, H), seed=0), random((B, S, N, D), seed=1)
    cos, sin = angles((S, D // 2))
    gain, bias = random((H,), seed=2), random((H,), seed=3)
    q, k, v = random((B, S, N, D), seed=4), random((B, S, K, D), seed=5), random((B, S, K, D), seed=6)
    w_q, w_k, w_v = (random((H, n * D), seed=7 + i, scale=0.1) for i, n in enumerate((N, K, K)))
    w_o = random((N * D, H), seed=10, scale=0.1)
    w_gate, w_up, w_down = (
        random((H, F), seed=11, scale=0.1),
        random((H, F), seed=12, scale=0.1),
        random((F, H), seed=13, scale=0.1),
    )
    q1, k1, v1 = random((B, 1, N, D), seed=14), random((B, 1, K, D), seed=15), random((B, 1, K, D), seed=16)
    k_cache, v_cache = random((B, K, 32, D), seed=17), random((B, K, 32, D), seed=18)
    cache_len = jnp.arange(3, 3 + B, dtype=jnp.int32)
    cos1, sin1 = angles((B, 1, D // 2))
    tokens = random((B, 8, H), seed=19)  # <= 96 tokens: the MLP's TKG path sharded or not (no bfloat16 CTE path)
    x_mx, w_mx = random((B, S, 256), seed=20), random((256, H), seed=21, scale=0.1)
    moe_logits = random((B, 8, 8), seed=22)
    moe_gate_up, moe_down = random((8, H, 2, 32), seed=23, scale=0.1), random((8, 32, H), seed=24, scale=0.1)
    data, tp = {"0": "data"}, {"0": "data", "1": "model"}
    return {
        "rms_norm": Case(
            "jax_nkilib.rms_norm",
            lambda x, w: jax_nkilib.rms_norm(x, w),
            {"x": x3, "w": gain},
            {"x": "01h"},
            ("x", "w"),
            (data, tp),
        ),
        "layer_norm": Case(
            "jax_nkilib.layer_norm",
            lambda x, w, b: jax_nkilib.layer_norm(x, w, b),
            {"x": x3, "w": gain, "b": bias},
            {"x": "01h"},
            ("x", "w", "b"),
            (data, tp),
        ),
        "selective_scan": Case(
            "jax_nkilib.selective_scan",
            lambda u, dt, a, b, c: jax_nkilib.selective_scan(u, dt, a, b, c, delta_softplus=True),
            {
                "u": random((B, 8, 12), seed=40),
                "dt": random((B, 8, 12), seed=41),
                "a": -jnp.exp(random((8, 4), seed=42)),
                "b": random((B, 4, 12), seed=43),
                "c": random((B, 4, 12), seed=44),
            },
            {"u": "bdl", "dt": "bdl", "a": "dn", "b": "bnl", "c": "bnl"},
            ("u", "dt", "a", "b", "c"),  # CI: tests/scan covers it inside shard_map; the splits are -m slow
        ),
        "ssd": Case(
            "jax_nkilib.ssd",
            lambda x, dt, a, b, c: jax_nkilib.ssd(x, dt, a, b, c, chunk_size=4, dt_softplus=True),
            {
                "x": random((B, 12, 8, 3), seed=45),
                "dt": random((B, 12, 8), seed=46),
                "a": -jnp.exp(random((8,), seed=47)),
                "b": random((B, 12, 1, 4), seed=48),
                "c": random((B, 12, 1, 4), seed=49),
            },
            {"x": "blhp", "dt": "blh", "a": "h", "b": "bl_n", "c": "bl_n"},
            ("x", "dt", "a", "b", "c"),  # CI: tests/scan covers it inside shard_map; the splits are -m slow
        ),
        "ssd_seq_idx": Case(  # packed sequences: the JAX scan with resets, seq_idx split with the batch
            "jax_nkilib.ssd",
            lambda x, dt, a, b, c, seq_idx: jax_nkilib.ssd(
                x, dt, a, b, c, chunk_size=4, dt_softplus=True, seq_idx=seq_idx
            ),
            {
                "x": random((B, 12, 8, 3), seed=45),
                "dt": random((B, 12, 8), seed=46),
                "a": -jnp.exp(random((8,), seed=47)),
                "b": random((B, 12, 1, 4), seed=48),
                "c": random((B, 12, 1, 4), seed=49),
                "seq_idx": jnp.asarray(np.repeat(np.arange(3) + np.arange(B)[:, None] % 2, 4, axis=1), jnp.int32),
            },
            {"x": "blhp", "dt": "blh", "a": "h", "b": "bl_n", "c": "bl_n", "seq_idx": "bl"},
            ("x", "dt", "a", "b", "c"),  # -m slow (CI: tests/parallel/test_auto_sharding.py runs it sharded)
        ),
        "cumsum": Case(
            "jax_nkilib.cumsum",
            lambda x: jax_nkilib.cumsum(x, axis=1),
            {"x": x3},
            {"x": "0s2"},
            ("x",),
            (data, {"0": "data", "s": "model"}),
        ),
        "conv": Case(
            "jax_nkilib.conv",
            lambda x, w: jax_nkilib.conv(x, w, (1,), [(2, 1)], dimension_numbers=("NWC", "WIO", "NWC")),
            {"x": x3, "w": random((4, H, 8), seed=40, scale=0.1)},
            {"x": "n__"},
            ("x", "w"),
            ({"n": "data"},),
        ),
        "pad": Case(
            "jax_nkilib.pad",
            lambda x: jax_nkilib.pad(x, ((0, 0), (0, 0), (2, 1)), "reflect"),
            {"x": x3},
            {"x": "01_"},
            ("x",),
            (data, tp),
        ),
        "deformable_attention": Case(
            "jax_nkilib.deformable_attention",
            lambda v, s, a: jax_nkilib.deformable_attention(v, deformable.SPATIAL_SHAPES, s, a),
            dict(zip("vsa", deformable.forward_operands(np.random.default_rng(0)))),
            {"v": "b___", "s": "b_____", "a": "b____"},
            ("v", "s", "a"),  # no CI split (about 5 s of compiles); tests/attention covers the kernels' shard_map
        ),
        "rope": Case(
            "jax_nkilib.rope",
            lambda x, cos, sin: jax_nkilib.rope(x, cos, sin),
            {"x": x4, "cos": cos, "sin": sin},
            {"x": "0snd", "cos": "s_", "sin": "s_"},
            ("x", "cos", "sin"),
            (data,),
        ),
        "attention": Case(
            "jax_nkilib.attention",
            lambda q, k, v: jax_nkilib.attention(q, k, v, causal=True),
            {"q": q, "k": k, "v": v},
            {"q": "bsnd", "k": "bsnd", "v": "bsnd"},
            ("q", "k", "v"),
            ({"b": "data"},),
        ),
        "dot_product_attention": Case(  # the blockwise route: a bias (split with the heads) and a soft cap
            "jax_nkilib.dot_product_attention",
            lambda q, k, v, bias: jax_nkilib.dot_product_attention(q, k, v, bias, is_causal=True, logits_soft_cap=5.0),
            {"q": q, "k": k, "v": v, "bias": random((1, N, S, S), seed=22)},
            {"q": "b_n_", "k": "b_n_", "v": "b_n_", "bias": "_n__"},
            ("q", "k", "v", "bias"),
            ({"b": "data"},),
        ),
        "decode_attention": Case(
            "jax_nkilib.decode_attention",
            lambda q, k, v, kc, vc, n: jax_nkilib.decode_attention(q, k, v, kc, vc, n)[0],
            {"q": q1, "k": k1, "v": v1, "kc": k_cache, "vc": v_cache, "n": cache_len},
            {"q": "bsnd", "k": "bsnd", "v": "bsnd", "kc": "bn_d", "vc": "bn_d", "n": "b"},
            ("q", "k", "v", "kc", "vc"),
            ({"b": "data"}, {"b": "data", "n": "model"}),
        ),
        "decode_block": Case(  # QKV weights grouped by kv head; the heads split: local blocks + one all-reduce
            "jax_nkilib.decode_block",
            lambda x, kc, vc, n, w, wo, g, c, sn: jax_nkilib.decode_block(
                x, (kc, vc), n, qkv_weight=w, out_weight=wo, num_q_heads=N, num_kv_heads=K, rope=(c, sn), norm_weight=g
            ),
            {
                "x": x3[:, :1],
                "kc": k_cache,
                "vc": v_cache,
                "n": cache_len,
                "w": random((H, K, N // K + 2, D), seed=25, scale=0.1),
                "wo": w_o,
                "g": gain,
                "c": cos1,
                "sn": sin1,
            },
            {"x": "b__", "kc": "bn__", "vc": "bn__", "n": "b", "w": "_n__", "wo": "n_", "c": "b__", "sn": "b__"},
            ("x", "w", "wo", "g"),
            ({"b": "data"}, {"b": "data", "n": "model"}),
        ),
        "qkv_projection": Case(
            "jax_nkilib.qkv_projection",
            lambda x, wq, wk, wv, g, c, sn: jax_nkilib.qkv_projection(
                x, (wq, wk, wv), num_q_heads=N, num_kv_heads=K, norm="rms", norm_weight=g, rope=(c, sn)
            ),
            {"x": x3, "wq": w_q, "wk": w_k, "wv": w_v, "g": gain, "c": cos, "sn": sin},  # rope's tables
            {"x": "bsh", "wq": "hn", "wk": "hn", "wv": "hn", "c": "s_", "sn": "s_"},
            ("x", "wq", "wk", "wv", "g", "c", "sn"),
            ({"b": "data"},),
        ),
        "output_projection": Case(
            "jax_nkilib.output_projection",
            lambda a, w, b: jax_nkilib.output_projection(a, w, b),
            {"a": x4, "w": w_o, "b": bias},
            {"a": "bsnd", "w": "nh", "b": "h"},
            ("a", "w", "b"),
            ({"b": "data"},),
        ),
        "mlp": Case(
            "jax_nkilib.mlp",
            lambda x, g, u, d: jax_nkilib.mlp(x, g, u, d),
            {"x": tokens, "g": w_gate, "u": w_up, "d": w_down},
            {"x": "01h", "g": "hi", "u": "hi", "d": "ih"},
            ("x", "g", "u", "d"),
            (data,),
        ),
        "moe": Case(
            "jax_nkilib.moe",
            lambda x, logits, gu, d: jax_nkilib.moe(x, logits, gu, d, top_k=2, normalize=True),
            {"x": tokens, "logits": moe_logits, "gu": moe_gate_up, "d": moe_down},
            {"x": "01h", "logits": "01_", "gu": "eh_i", "d": "eih"},
            ("x", "logits", "gu", "d"),
            ({"0": "data", "e": "model"},),  # tensor parallelism: tests/moe/test_moe_op.py
        ),
        "moe_block": Case(
            "jax_nkilib.moe_block",
            lambda x, g, r, gu, d: jax_nkilib.moe_block(x, g, r, gu, d, top_k=2),
            {"x": tokens, "g": gain, "r": random((H, 8), seed=25, scale=0.1), "gu": moe_gate_up, "d": moe_down},
            {"x": "01h"},
            ("x", "g", "r", "gu", "d"),
            (data,),
        ),
        "router": Case(
            "jax_nkilib.router",
            lambda x, w: jax_nkilib.router(x, w, top_k=2, normalize=True).weights,
            {"x": tokens, "w": random((H, 8), seed=25, scale=0.1)},
            {"x": "01h"},
            ("x", "w"),
            (data,),
        ),
        "topk": Case(
            "jax_nkilib.topk",
            lambda x: jax_nkilib.topk(x, 3)[0],
            {"x": moe_logits},
            {"x": "01_"},
            ("x",),
            (data,),
        ),
        "embedding_lookup": Case(  # the table's gradient: scatter-add per shard, summed over the ids' axes
            "jax_nkilib.embedding_lookup",
            jax_nkilib.embedding_lookup,
            {"table": random((40, H), seed=26), "ids": jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) % 37},
            {"table": "vd", "ids": "01"},
            ("table",),
            (data, {"0": "data", "d": "model"}),
        ),
        "cross_entropy": Case(  # ignore_index: the mean's count is all-reduced too
            "jax_nkilib.cross_entropy",
            lambda x, y: jax_nkilib.cross_entropy(x, y, ignore_index=0, z_loss=1e-3),
            {"x": x3, "y": jnp.asarray(np.random.default_rng(26).integers(0, 4, (B, S)), jnp.int32)},
            {"x": "01_", "y": "01"},
            ("x",),
            (data,),
        ),
        "mla_attention": Case(  # the batch splits; the weights' gradients are summed over it
            "jax_nkilib.mla_attention",
            jax_nkilib.mla_attention,
            {
                "x": random((B, S, 8), seed=27),
                "wq_a": random((8, 6), seed=28, scale=0.4),
                "q_norm_weight": random((6,), seed=29),
                "wq_b": random((6, 2, 8), seed=30, scale=0.4),
                "wkv_a": random((8, 8), seed=31, scale=0.4),
                "kv_norm_weight": random((4,), seed=32),
                "wkv_b": random((4, 2, 10), seed=33, scale=0.5),
                "wo": random((2, 6, 8), seed=34, scale=0.4),
                "cos": cos[:, :2],
                "sin": sin[:, :2],
            },
            {"x": "bs_"},
            ("x", "wq_a", "wq_b", "wkv_b", "wo"),
        ),
        "mxfp8_matmul": Case(
            "jax_nkilib.mxfp8_matmul",
            lambda x, w: jax_nkilib.mxfp8_matmul(x, w),
            {"x": x_mx, "w": w_mx},
            {"x": "01k", "w": "kn"},
            ("x", "w"),
            (data, {"0": "data", "k": "model"}),
        ),
    }


CASES = _cases()


def test_every_differentiable_op_in_the_sharding_table_has_a_case():
    differentiable = set(RULES) - {
        "jax_nkilib.quantize_fp8",
        "jax_nkilib.dequantize_fp8",
        "jax_nkilib.quantize_mx",
        "jax_nkilib.dequantize_mx",
        "jax_nkilib.all_gather_matmul",
        "jax_nkilib.matmul_reduce_scatter",
        "jax_nkilib.ring_attention",
        "jax_nkilib.argmax",  # integer output
    }
    assert {case.rule for case in CASES.values()} == differentiable


def splits(case: Case, axis_names: tuple[str, ...]) -> list[dict]:
    """Every split the case's rule allows on a mesh with these axes."""
    rule = RULES[case.rule]
    letters = [
        letter
        for letter in dict.fromkeys("".join(case.dims.values()))
        if letter in rule.free or letter in rule.collective
    ]
    found = [{letter: axis} for axis in axis_names for letter in letters]
    if len(axis_names) == 2:
        found += [{first: "data", second: "model"} for first in letters for second in letters if first != second]
    return found


def spec(dims: str | None, split: dict) -> P:
    return P() if dims is None else P(*[split.get(letter) for letter in dims])


@functools.cache
def _single_device(op: str):
    case = CASES[op]
    return _gradients(case)(*case.args.values())


def _gradients(case: Case):
    names = list(case.args)

    def loss(*values):  # against fixed random cotangents, so that no gradient vanishes by symmetry
        outs = jax.tree.leaves(case.fn(*values))
        return sum(jnp.sum(out.astype(jnp.float32) * random(out.shape, seed=99 + i)) for i, out in enumerate(outs))

    return jax.jit(jax.grad(loss, argnums=tuple(names.index(name) for name in case.diff)))


def check_split(op: str, mesh, split: dict) -> None:
    case = CASES[op]
    with jax.set_mesh(mesh):
        placed = [
            jax.device_put(value, NamedSharding(mesh, spec(case.dims.get(name), split)))
            for name, value in case.args.items()
        ]
        manual = manual_computations(jax.jit(case.fn).lower(*placed).as_text())
        grads = _gradients(case)(*placed)
    expected = int(any(mesh.shape[axis] > 1 for axis in split.values()))  # none over size-1 axes only
    assert manual == expected, f"{op} split {split}: {manual} manual computations in the forward program"
    for name, got, want in zip(case.diff, grads, _single_device(op)):
        error = relative_error(got, want)
        assert error <= BOUND, f"{op} split {split}: d/d{name} differs from one device by {error:.2e}"


def _mesh(shape: str):
    sizes, names = MESHES[shape]
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Explicit,) * len(names))


def test_splits_cover_the_table():
    assert splits(CASES["attention"], ("data",)) == [{"b": "data"}, {"s": "data"}, {"n": "data"}]
    assert len(splits(CASES["output_projection"], ("data", "model"))) == 4 + 4 + 12


@time_limit(300)
def test_gradients_with_the_batch_over_data_alone_and_with_tensor_parallelism_on_a_2d_mesh():
    """The issue's layouts on 4x2: every op with only its batch split (over `data`; `model` unused), and for the
    ops outside the training block also with the batch over `data` and a tensor-parallel dimension over `model`."""
    mesh = _mesh("4x2")
    for op, case in CASES.items():
        for split in case.ci:
            check_split(op, mesh, split)


@pytest.mark.slow
@pytest.mark.parametrize("shape", sorted(MESHES))
@pytest.mark.parametrize("op", sorted(CASES))
@time_limit(600)
def test_gradients_of_every_split(op, shape):
    mesh = _mesh(shape)
    for split in splits(CASES[op], MESHES[shape][1]):
        check_split(op, mesh, split)
