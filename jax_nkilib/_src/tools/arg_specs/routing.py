"""Arg specs of the routing and top-k kernels (``router_topk``, ``topk``, ``rotational_topk``, ``gpsimd_topk``,
``cascaded_max``, ``find_nonzero_indices``, ``indexed_flatten``, ``argsort_unstable``) and of ``jax_nkilib.topk`` /
``argmax`` / ``router``."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)


def _router_kernel(t, h, e, layout=1, bias=True):
    """``router_topk``'s ``x [T, H]`` (or ``[H, T]``), ``w [H, E]`` and ``w_bias [E]``."""

    def build(rng):
        x = normal(rng, (t, h) if layout == 1 else (h, t))
        w, b = normal(rng, (h, e), scale=0.2), normal(rng, (e,), scale=0.5)
        return (x, w, b) if bias else (x, w)

    return build


def _sparse(t, c):
    """``find_nonzero_indices``' ``input_tensor [T, C]``: about one entry in three nonzero."""
    return lambda rng: (jnp.asarray((rng.uniform(0.0, 1.0, (t, c)) < 0.3) * rng.integers(1, 9, (t, c)), jnp.int32),)


def _flatten(e, t, offsets, start=None):
    """``indexed_flatten``'s ``input_tensor [E, T]`` (distinct token ids), ``row_offsets`` (and its start)."""

    def build(rng):
        data = jnp.asarray(np.arange(e * t).reshape(e, t), jnp.int32)
        extra = () if start is None else (jnp.asarray([start], jnp.int32),)
        return (data, jnp.asarray(offsets, jnp.int32), *extra)

    return build


def _router(shape, h, e, bias=True):
    def build(rng):
        x, w = normal(rng, (*shape, h)), normal(rng, (h, e), scale=0.2)
        return (x, w, normal(rng, (e,), scale=0.5)) if bias else (x, w)

    return build


_ROUTER_T_H = dict(act_fn="SOFTMAX", k=4, x_hbm_layout=1, x_sb_layout=0, norm_topk_prob=True)
_ROUTER_H_T = dict(
    act_fn="SIGMOID",
    k=3,
    x_hbm_layout=0,
    x_sb_layout=0,
    router_pre_norm=False,
    use_indirect_dma_scatter=True,
    return_eager_affi=True,
)
_ROUTING_OUT = jax_nkilib.Routing(P("data"), P("data"), P("data"))

register(
    ArgSpec(
        "router_topk",
        nki.router_topk,
        ("x", "w", "w_bias"),
        _router_kernel(16, 128, 16),
        kwargs=_ROUTER_T_H,
        kernels=("router_topk",),
        grad=("x", "w", "w_bias"),
        grad_output=lambda out: (out[0], out[2]),
        sharding=Sharding(_DATA, (P("data"), P(), P()), (P("data"),) * 3),
        bad=BadInput("w", drop_last_axis, "w"),
    ),
    ArgSpec(
        "router_topk.h_t_sigmoid_eager",
        nki.router_topk,
        ("x", "w", "w_bias"),
        _router_kernel(16, 256, 12, layout=0),
        kwargs=_ROUTER_H_T,
        kernels=("router_topk",),
        grad=("x", "w", "w_bias"),
        grad_output=lambda out: (out[0], out[2], out[3]),
        sharding=Sharding(_DATA, (P(None, "data"), P(), P()), (P("data"),) * 4),
        bad=BadInput("x", lambda x: x[:100], "x"),
    ),
    ArgSpec(
        "router_topk.full_softmax_no_bias",
        nki.router_topk,
        ("x", "w"),
        _router_kernel(8, 128, 32, bias=False),
        kwargs=dict(act_fn="SOFTMAX", k=2, x_hbm_layout=1, x_sb_layout=0),
        kernels=("router_topk",),
        grad=("x", "w"),
        grad_output=lambda out: (out[0], out[2]),
        bad=BadInput("k", lambda _: 33, "k"),
    ),
    ArgSpec(
        "router_topk.k_past_8_falls_back",
        nki.router_topk,
        ("x", "w"),
        _router_kernel(8, 128, 32, bias=False),
        kwargs=dict(act_fn="SOFTMAX", k=10, x_hbm_layout=1, x_sb_layout=0),
        kernels=(),
        only_kernels=False,
        neuron_fallback="k=10 must be <= 8",
        bad=BadInput("act_fn", lambda _: "NOAUX_TC", "act_fn"),
    ),
    ArgSpec(
        "topk",
        nki.topk,
        ("inp",),
        lambda rng: (normal(rng, (8, 3, 64)),),
        kwargs={"k": 5},
        kernels=("topk",),
        grad=("inp",),
        grad_output=lambda out: out[0],
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        bad=BadInput("k", lambda _: 65, "k must be in"),
    ),
    ArgSpec(
        "rotational_topk",
        nki.rotational_topk,
        ("inp",),
        lambda rng: (normal(rng, (16, 100)),),
        kwargs={"config": nki.RotationalTopkConfig(orig_k=7, sorted=True)},
        kernels=("rotational_topk",),
        grad=("inp",),
        grad_output=lambda out: out[0],
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        bad=BadInput("config", lambda _: 7, "RotationalTopkConfig"),
    ),
    ArgSpec(
        "gpsimd_topk",
        nki.gpsimd_topk,
        ("inp",),
        lambda rng: (normal(rng, (16, 100)),),
        kwargs={"config": nki.GpsimdTopkConfig(k=6)},
        neuron=lambda rng: (normal(rng, (16, 100), jnp.bfloat16),),
        kernels=("gpsimd_topk",),
        grad=("inp",),
        grad_output=lambda out: out[0],
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        bad=BadInput("config", lambda _: nki.RotationalTopkConfig(6), "GpsimdTopkConfig"),
    ),
    ArgSpec(
        "argsort_unstable",
        nki.argsort_unstable,
        ("data",),
        lambda rng: (jnp.asarray(rng.permutation(64)[None, :] - 20, jnp.int32),),
        kwargs={"descending": True},
        kernels=("argsort_unstable",),
        bad=BadInput("output_in_sbuf", lambda _: True, "output_in_sbuf"),
    ),
    ArgSpec(
        "argsort_unstable.float_vector",
        nki.argsort_unstable,
        ("data",),
        lambda rng: (normal(rng, (40,)),),
        kernels=("argsort_unstable",),
        sharding=Sharding(_DATA, (P(),), P()),
        bad=BadInput("data", lambda x: x.astype(jnp.bfloat16), "data"),
    ),
    ArgSpec(
        "cascaded_max",
        nki.cascaded_max,
        ("input_tensor",),
        lambda rng: (normal(rng, (8, 2, 256)),),
        kernels=("cascaded_max",),
        grad=("input_tensor",),
        grad_output=lambda out: out[0],
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        bad=BadInput("input_tensor", lambda x: x[0, 0], "input_tensor"),
    ),
    ArgSpec(
        "find_nonzero_indices",
        nki.find_nonzero_indices,
        ("input_tensor",),
        _sparse(256, 8),
        kernels=("find_nonzero_indices",),
        neuron_lnc=2,
        sharding=Sharding(_DATA, (P(None, "data"),), (P("data"), P("data"))),
        bad=BadInput("n_cols", lambda _: 3, "col_start_id"),
    ),
    ArgSpec(
        "find_nonzero_indices.columns",
        nki.find_nonzero_indices,
        ("input_tensor", "col_start_id"),
        lambda rng: (*_sparse(256, 8)(rng), jnp.asarray([2], jnp.int32)),
        kwargs={"n_cols": 4},
        kernels=("find_nonzero_indices",),
        neuron_lnc=2,
        bad=BadInput("input_tensor", lambda x: x.astype(jnp.uint8), "input_tensor"),
    ),
    ArgSpec(
        "find_nonzero_indices.lnc1_falls_back",
        nki.find_nonzero_indices,
        ("input_tensor",),
        _sparse(256, 8),
        kernels=(),
        only_kernels=False,
        neuron_fallback="requires LNC=2",
    ),
    ArgSpec(
        "indexed_flatten",
        nki.indexed_flatten,
        ("input_tensor", "row_offsets"),
        _flatten(4, 64, [0, 16, 40, -3]),
        kwargs={"f_len": 4, "output_len": 128},
        kernels=("indexed_flatten",),
        neuron_lnc=2,
        sharding=Sharding(_DATA, (P(), P()), P()),
        bad=BadInput("row_offsets", lambda r: r[:3], "row_offsets"),
    ),
    ArgSpec(
        "indexed_flatten.offsets_start",
        nki.indexed_flatten,
        ("input_tensor", "row_offsets", "row_offsets_start"),
        _flatten(3, 32, [7, 0, 2, 5, 9], start=1),
        kwargs={"f_len": 2, "output_len": 128, "padding_val": -7},
        kernels=("indexed_flatten",),
        neuron_lnc=2,
        bad=BadInput("f_len", lambda _: 5, "f_len"),
    ),
    ArgSpec(
        "indexed_flatten.lnc1_falls_back",
        nki.indexed_flatten,
        ("input_tensor", "row_offsets"),
        _flatten(4, 64, [0, 16, 40, -3]),
        kwargs={"f_len": 4, "output_len": 128},
        kernels=(),
        only_kernels=False,
        neuron_fallback="requires LNC=2",
    ),
    ArgSpec(
        "jax_nkilib.topk",
        jax_nkilib.topk,
        ("x",),
        lambda rng: (normal(rng, (8, 3, 64)),),
        kwargs={"k": 5},
        kernels=("topk",),
        only_kernels=False,
        grad=("x",),
        grad_output=lambda out: out[0],
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        bad=BadInput("k", lambda _: 0, "k"),
    ),
    ArgSpec(
        "argmax",
        jax_nkilib.argmax,
        ("x",),
        lambda rng: (normal(rng, (8, 3, 256)),),
        kernels=("cascaded_max",),
        only_kernels=False,
        sharding=Sharding(_DATA, (P("data"),), P("data")),
        bad=BadInput("x", lambda x: x.astype(jnp.bool_), "x"),
    ),
    ArgSpec(
        "router",
        jax_nkilib.router,
        ("x", "w_router", "bias"),
        _router((8, 3), 128, 16),
        positional=2,
        kwargs={"top_k": 2, "normalize": True},
        kernels=("router_topk",),
        only_kernels=False,
        grad=("x", "w_router", "bias"),
        grad_output=lambda out: (out.weights, out.logits),
        sharding=Sharding(_DATA, (P("data"), P(), P()), _ROUTING_OUT),
        bad=BadInput("w_router", lambda w: w[:100], "w_router"),
    ),
    ArgSpec(
        "router.sigmoid_selection_bias",
        jax_nkilib.router,
        ("x", "w_router", "selection_bias"),
        _router((8, 2), 96, 12),
        positional=2,
        kwargs={"top_k": 3, "activation": "sigmoid", "normalize": True},
        kernels=(),
        only_kernels=False,
        grad=("x", "w_router"),
        grad_output=lambda out: (out.weights, out.logits),
        sharding=Sharding(_DATA, (P("data"), P(), P()), _ROUTING_OUT),
        bad=BadInput("activation", lambda _: "relu", "activation"),
    ),
    ArgSpec(
        "router.top_k_past_8_falls_back",
        jax_nkilib.router,
        ("x", "w_router"),
        _router((4,), 128, 16, bias=False),
        positional=2,
        kwargs={"top_k": 9, "activation_before_topk": False},
        kernels=(),
        only_kernels=False,
        neuron_fallback="k=9 must be <= 8",
        grad=("x", "w_router"),
        grad_output=lambda out: (out.weights, out.logits),
        bad=BadInput("top_k", lambda _: 17, "top_k"),
    ),
)
