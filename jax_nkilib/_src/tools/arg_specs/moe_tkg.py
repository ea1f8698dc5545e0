"""Arg specs of the token-generation MoE kernels (``moe_tkg``, ``moe_block_tkg``, ``topk_reduce``)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)
_EXPERTS = ("hidden_input", "expert_gate_up_weights", "expert_down_weights", "expert_affinities", "expert_index")


def distinct_experts(rng, tokens, experts, top_k):
    """``[T, K]`` int32 expert ids, distinct within each row."""
    return jnp.asarray(np.argsort(rng.uniform(size=(tokens, experts)), axis=1)[:, :top_k], jnp.int32)


def _moe_tkg(t, h, i, e, k, dtype=jnp.float32, *, rank=False, bias=False, fp8=False, experts=None):
    """moe_tkg's operands: hidden ``[T, H]``, weights ``[E_L, H, 2, I]`` / ``[E_L, I, H]``, affinities ``[T, E]``
    (``E = experts`` or ``E_L``), indices ``[T, K]`` over the ``E`` experts, then ``rank_id`` (rank 1 of
    ``E / E_L``), biases, FP8 weights with row scales, as asked."""
    experts = experts or e

    def build(rng):
        gate_up, down = normal(rng, (e, h, 2, i), scale=h**-0.5), normal(rng, (e, i, h), scale=i**-0.5)
        scales = ()
        if fp8:
            gate_up, down = gate_up.astype(jnp.float8_e4m3), down.astype(jnp.float8_e4m3)
            scales = (
                jnp.asarray(rng.uniform(0.5, 1.5, (e, 2, i)), jnp.float32),
                jnp.asarray(rng.uniform(0.5, 1.5, (e, h)), jnp.float32),
            )
        out = (
            normal(rng, (t, h), dtype),
            gate_up.astype(dtype) if not fp8 else gate_up,
            down.astype(dtype) if not fp8 else down,
            jnp.asarray(rng.uniform(0.1, 1.0, (t, experts)), dtype),
            distinct_experts(rng, t, experts, k),
        )
        if rank:
            out += (jnp.full((1, 1), 1, jnp.int32),)
        if bias:
            out += (normal(rng, (e, 2, i), dtype, 0.1), normal(rng, (e, h), dtype, 0.1))
        return out + scales

    return build


def _moe_tkg_mxfp4(t, h, i, e, k, dtype=jnp.float32):
    """moe_tkg's operands with MXFP4 weights: uint16 ``float4_e2m1fn_x4`` words ``[E, 128, 2, H/512, I]`` /
    ``[E, min(128, I/4), ceil(I/512), H]`` (any nibble is an e2m1 code) with uint8 scales near 2**-6."""
    p_i, n_i = min(128, i // 4), -(-i // 512)

    def build(rng):
        words = lambda shape: jnp.asarray(rng.integers(0, 2**16, shape), jnp.uint16)
        scales = lambda shape: jnp.asarray(rng.integers(118, 124, shape), jnp.uint8)
        return (
            normal(rng, (t, h), dtype),
            words((e, 128, 2, h // 512, i)),
            words((e, p_i, n_i, h)),
            jnp.asarray(rng.uniform(0.1, 1.0, (t, e)), dtype),
            distinct_experts(rng, t, e, k),
            scales((e, 16, 2, h // 512, i)),
            scales((e, p_i // 8, n_i, h)),
        )

    return build


_SELECTIVE_SHARDING = Sharding(_DATA, (P("data"), P(), P(), P("data"), P("data"), P(), P()), P("data"))

register(
    ArgSpec(
        "moe_tkg",
        nki.moe_tkg,
        _EXPERTS + ("expert_gate_up_bias", "expert_down_bias"),
        _moe_tkg(8, 16, 8, 4, 2, bias=True),
        kwargs={"is_all_expert": False, "expert_affinities_scaling_mode": "POST_SCALE"},
        positional=5,
        kernels=("moe_tkg",),
        grad=_EXPERTS[:4] + ("expert_gate_up_bias", "expert_down_bias"),
        sharding=_SELECTIVE_SHARDING,
        neuron=_moe_tkg(4, 256, 128, 4, 2, jnp.bfloat16, bias=True),
        bad=BadInput("expert_down_weights", drop_last_axis, "layout"),
        notes="8 tokens, 4 experts, top-2: every local expert evaluated on every token (the dense path)",
    ),
    ArgSpec(
        "moe_tkg.decode_fp8",
        nki.moe_tkg,
        _EXPERTS + ("expert_gate_up_weights_scale", "expert_down_weights_scale"),
        _moe_tkg(2, 16, 8, 8, 2, fp8=True),
        kwargs={
            "is_all_expert": False,
            "expert_affinities_scaling_mode": "POST_SCALE",
            "activation_fn": "Swish",
            "up_clamp_upper_limit": 8.0,
            "up_clamp_lower_limit": -6.0,
        },
        positional=5,
        kernels=("moe_tkg",),
        grad=("hidden_input", "expert_affinities", "expert_gate_up_weights_scale", "expert_down_weights_scale"),
        batch=("hidden_input", "expert_affinities", "expert_index"),
        neuron=_moe_tkg(4, 256, 128, 8, 2, jnp.bfloat16, fp8=True),
        bad=BadInput("expert_down_weights_scale", lambda s: None, "expert_gate_up_weights_scale"),
        notes="2 tokens, 8 experts, top-2: only the chosen experts evaluated (the gathered path); FP8 row weights",
    ),
    ArgSpec(
        "moe_tkg.mxfp4",
        nki.moe_tkg,
        _EXPERTS + ("expert_gate_up_weights_scale", "expert_down_weights_scale"),
        _moe_tkg_mxfp4(8, 512, 64, 3, 2),
        kwargs={"is_all_expert": False, "expert_affinities_scaling_mode": "POST_SCALE"},
        positional=5,
        kernels=("moe_tkg",),
        grad=("hidden_input", "expert_affinities"),
        check_grads=False,
        batch=("hidden_input", "expert_affinities", "expert_index"),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P("data"), P("data"), P(), P()), P("data")),
        neuron=_moe_tkg_mxfp4(4, 512, 64, 3, 2, jnp.bfloat16),
        bad=BadInput("expert_down_weights_scale", lambda s: s.astype(jnp.float32), "expert_down_weights_scale"),
        notes="the VJP is straight-through the MXFP8 activation round trips, so no numerical gradient check",
    ),
    ArgSpec(
        "moe_tkg.all_expert",
        nki.moe_tkg,
        _EXPERTS + ("rank_id",),
        _moe_tkg(8, 16, 8, 2, 2, rank=True, experts=6),
        kwargs={"is_all_expert": True, "expert_affinities_scaling_mode": "POST_SCALE", "mask_unselected_experts": True},
        kernels=("moe_tkg",),
        grad=_EXPERTS[:4],
        batch=("hidden_input", "expert_affinities", "expert_index"),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P("data"), P("data"), P()), P("data")),
        neuron=_moe_tkg(4, 256, 128, 2, 2, jnp.bfloat16, rank=True, experts=6),
        bad=BadInput("rank_id", lambda r: None, "rank_id"),
        notes="rank 1 of 3 holds experts 2 and 3 of 6; affinities masked by the top-2 choices",
    ),
)


def pack_token_ids(values, token_ids):
    """``values [N, H]`` (16-bit floats) with the int32 ``token_ids [N]`` appended as two 16-bit columns."""
    ids = jax.lax.bitcast_convert_type(jnp.asarray(token_ids, jnp.int32), values.dtype)  # [N, 2]
    return jnp.concatenate([values, ids], axis=1)


def _topk_reduce(t, k, h, dtype=jnp.bfloat16, padding=3):
    """topk_reduce's ``input [T*K + padding, H + 2]``: each token's K rows shuffled, padding rows with id -1."""

    def build(rng):
        ids = np.concatenate([np.repeat(np.arange(t), k), np.full(padding, -1)])
        ids = ids[rng.permutation(ids.size)]
        return (pack_token_ids(normal(rng, (ids.size, h), dtype), ids),)

    return build


register(
    ArgSpec(
        "topk_reduce",
        nki.topk_reduce,
        ("input",),
        _topk_reduce(5, 3, 12),
        kwargs={"T": 5, "K": 3},
        kernels=("topk_reduce",),
        sharding=Sharding(_DATA, (P(),), P()),
        neuron=_topk_reduce(16, 4, 256),
        neuron_kwargs={"T": 16, "K": 4},
        bad=BadInput("input", drop_last_axis, "layout"),
        notes="bfloat16/float16 only, so no float64 gradient check (tests/moe/test_topk_reduce.py checks the VJP)",
    ),
)


def _moe_block(b, s, h, i, e, dtype=jnp.float32, *, local=None, rank=False):
    """moe_block_tkg's ``inp [B, S, H]``, ``gamma [1, H]``, ``router_weights [H, E]``, expert weights for
    ``E_L = local or E`` experts (and ``rank_id`` = 1)."""
    local = local or e

    def build(rng):
        out = (
            normal(rng, (b, s, h), dtype),
            normal(rng, (1, h), dtype, 0.3) + 1,
            normal(rng, (h, e), dtype, h**-0.5 * 2),
            normal(rng, (local, h, 2, i), dtype, h**-0.5),
            normal(rng, (local, i, h), dtype, i**-0.5),
        )
        return out + (jnp.full((1, 1), 1, jnp.int32),) if rank else out

    return build


_BLOCK = ("inp", "gamma", "router_weights", "expert_gate_up_weights", "expert_down_weights")


def _moe_block_mxfp4(b, s, h, i, e, dtype=jnp.float32, *, local):
    """moe_block_tkg's operands with MXFP4 experts: ``inp``, ``gamma``, ``router_weights`` as :func:`_moe_block`,
    x4 words and uint8 scales as :func:`_moe_tkg_mxfp4`, ``rank_id`` = 1 and a ``residual [B, S, H]``."""

    def build(rng):
        inp, gamma, router = _moe_block(b, s, h, i, e, dtype)(rng)[:3]
        experts = _moe_tkg_mxfp4(b * s, h, i, local, 1, dtype)(rng)
        words, scales = experts[1:3], experts[5:7]
        rank = jnp.full((1, 1), 1, jnp.int32)
        return (inp, gamma, router, *words, *scales, rank, normal(rng, (b, s, h), dtype, 0.5))

    return build


register(
    ArgSpec(
        "moe_block_tkg",
        nki.moe_block_tkg,
        _BLOCK,
        _moe_block(8, 1, 16, 8, 4),
        kwargs={
            "top_k": 2,
            "expert_affinities_scaling_mode": "POST_SCALE",
            "router_act_fn": "SOFTMAX",
            "router_mm_dtype": jnp.float64,
        },
        positional=5,
        kernels=("moe_block_tkg",),
        grad=_BLOCK,
        batch=("inp",),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P(), P()), (P("data"), P("data"))),
        neuron=_moe_block(2, 2, 256, 128, 4, jnp.bfloat16),
        neuron_kwargs={"top_k": 2, "expert_affinities_scaling_mode": "POST_SCALE", "router_act_fn": "SOFTMAX"},
        neuron_lnc=2,
        bad=BadInput("router_weights", drop_last_axis, "layout"),
        notes="router_mm_dtype=float64 off Neuron so that the float64 gradient check sees no rounding; the Neuron "
        "call (LNC=2) uses the kernel's bfloat16",
    ),
    ArgSpec(
        "moe_block_tkg.mxfp4_all_expert",
        nki.moe_block_tkg,
        _BLOCK + ("expert_gate_up_weights_scale", "expert_down_weights_scale", "rank_id", "residual"),
        _moe_block_mxfp4(8, 1, 512, 64, 4, local=2),
        kwargs={
            "top_k": 2,
            "expert_affinities_scaling_mode": "POST_SCALE",
            "is_all_expert": True,
            "router_mm_dtype": jnp.float64,
        },
        positional=5,
        kernels=("moe_block_tkg",),
        grad=("inp", "gamma", "residual"),
        check_grads=False,
        batch=("inp", "residual"),
        sharding=Sharding(
            _DATA, (P("data"), P(), P(), P(), P(), P(), P(), P(), P("data")), (P("data"), P("data"), P("data"))
        ),
        neuron=_moe_block_mxfp4(1, 4, 512, 64, 4, jnp.bfloat16, local=2),
        neuron_kwargs={"top_k": 2, "expert_affinities_scaling_mode": "POST_SCALE", "is_all_expert": True},
        neuron_lnc=2,
        bad=BadInput("residual", drop_last_axis, "residual"),
        notes="MXFP4 experts, rank 1 of 2, the fused residual add; the VJP is straight-through the MXFP8 "
        "activation round trips, so no numerical gradient check",
    ),
    ArgSpec(
        "moe_block_tkg.all_expert",
        nki.moe_block_tkg,
        _BLOCK + ("rank_id",),
        _moe_block(8, 1, 16, 8, 6, local=3, rank=True),
        kwargs={
            "top_k": 2,
            "expert_affinities_scaling_mode": "POST_SCALE",
            "is_all_expert": True,
            "router_mm_dtype": jnp.float64,
            "skip_router_logits": True,
        },
        positional=5,
        kernels=("moe_block_tkg",),
        batch=("inp",),
        sharding=Sharding(_DATA, (P("data"), P(), P(), P(), P(), P()), P("data")),
        neuron=_moe_block(2, 2, 256, 128, 6, jnp.bfloat16, local=3, rank=True),
        neuron_kwargs={"top_k": 2, "expert_affinities_scaling_mode": "POST_SCALE", "is_all_expert": True},
        neuron_lnc=2,
        bad=BadInput("rank_id", lambda r: None, "rank_id"),
    ),
)


def _router(b, s, h, e, dtype=jnp.float32):
    """The fused router kernels' ``hidden_states [B, S, H]``, ``gamma [1, H]``, ``router_weights [H, E]``,
    ``router_bias [1, E]``."""
    return lambda rng: (
        normal(rng, (b, s, h), dtype),
        normal(rng, (1, h), dtype, 0.3) + 1,
        normal(rng, (h, e), dtype, 3 * h**-0.5),
        normal(rng, (1, e), dtype, 0.5),
    )


_ROUTER = ("hidden_states", "gamma", "router_weights", "router_bias")
_ROUTER_SHARDING = Sharding(_DATA, (P("data"), P(), P(), P()), (P("data"), P("data"), P("data")))
_NORM_OUTPUT = lambda out: out[0]  # the affinities are bfloat16 by contract: outside a float64 gradient check

register(
    ArgSpec(
        "rmsnorm_router_topk_a2av",
        nki.rmsnorm_router_topk_a2av,
        _ROUTER,
        _router(8, 1, 16, 6),
        kwargs={"top_k": 2, "router_act_fn": "SOFTMAX"},
        kernels=("rmsnorm_router_topk_a2av",),
        grad=_ROUTER[:2],
        grad_output=_NORM_OUTPUT,
        batch=("hidden_states",),
        sharding=_ROUTER_SHARDING,
        neuron=_router(2, 4, 256, 16, jnp.bfloat16),
        bad=BadInput("router_bias", drop_last_axis, "router_bias"),
    ),
    ArgSpec(
        "rmsnorm_router_topk_tkg",
        nki.rmsnorm_router_topk_tkg,
        _ROUTER,
        _router(8, 1, 16, 6),
        kwargs={"top_k": 2, "router_mm_dtype": jnp.float64},
        kernels=("rmsnorm_router_topk_tkg",),
        grad=_ROUTER[:2],
        grad_output=_NORM_OUTPUT,
        batch=("hidden_states",),
        sharding=_ROUTER_SHARDING,
        neuron=_router(2, 128, 256, 16, jnp.bfloat16),
        neuron_kwargs={"top_k": 2},
        neuron_lnc=2,
        bad=BadInput("quantization_type", lambda _: "MX", "quantization_type"),
        notes="router_mm_dtype=float64 off Neuron (the norm output's dtype) for the float64 gradient check",
    ),
)


register(
    ArgSpec(
        "mx_moe_block_tkg_wrapper",
        nki.mx_moe_block_tkg_wrapper,
        _BLOCK + ("expert_gate_up_weights_scale", "expert_down_weights_scale", "rank_id", "residual"),
        _moe_block_mxfp4(8, 1, 512, 64, 4, local=2),
        kwargs={
            "top_k": 2,
            "router_act_fn": "SIGMOID",
            "expert_affinities_scaling_mode": "POST_SCALE",
            "hidden_act_fn": "SiLU",
            "router_mm_dtype": jnp.float64,
            "is_all_expert": True,
        },
        positional=5,
        kernels=("mx_moe_block_tkg_wrapper",),
        grad=("inp", "gamma", "residual"),
        check_grads=False,
        batch=("inp", "residual"),
        sharding=Sharding(
            _DATA, (P("data"), P(), P(), P(), P(), P(), P(), P(), P("data")), (P("data"), P("data"), P("data"))
        ),
        neuron=_moe_block_mxfp4(1, 4, 512, 64, 4, jnp.bfloat16, local=2),
        neuron_kwargs={
            "top_k": 2,
            "router_act_fn": "SIGMOID",
            "expert_affinities_scaling_mode": "POST_SCALE",
            "hidden_act_fn": "SiLU",
            "router_mm_dtype": jnp.bfloat16,
            "is_all_expert": True,
        },
        neuron_lnc=2,
        bad=BadInput("router_act_fn", lambda _: None, "router_act_fn"),
        notes="moe_block_tkg.mxfp4_all_expert's call through the wrapper: the same outputs (tests/moe)",
    ),
)
