"""``jax_nkilib.nki.moe_cte`` against the float64 block-loop oracle (each bf16 implementation, scaling modes,
biases, clamps, activations, checkpoints, the padding-token-free ``skip_token`` layout, the hybrid loop), its output
layouts, its config handling and errors, its VJP (``blockwise_mm_bwd`` where the kernel can, JAX elsewhere) and its
Neuron lowering."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.neuron.lowering import NeuronFallbackWarning
from tests.moe.blockwise_oracles import blockwise_backward, blockwise_forward, routing
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close, f64

T, H, INTER, E, K, B = 11, 24, 12, 4, 2, 4


def problem(seed=0, tokens=T, top_k=K, experts=E, block=B, dtype=jnp.float32, bias=False):
    rng = np.random.default_rng(seed)
    index = np.stack([rng.permutation(experts)[:top_k] for _ in range(tokens)])
    weights = rng.uniform(0.2, 1.0, (tokens, top_k))
    affinities, slots, owners, conditions = routing(index, weights, experts, block)
    x = rng.standard_normal((tokens + 1, H))
    x[tokens] = 0
    ops = {
        "hidden_states": x,
        "expert_affinities_masked": affinities,
        "gate_up_proj_weight": rng.standard_normal((experts, H, 2, INTER)) * 0.3,
        "down_proj_weight": rng.standard_normal((experts, INTER, H)) * 0.3,
        "token_position_to_id": slots.astype(np.int32),
        "block_to_expert": owners.astype(np.int32),
        "conditions": conditions,
    }
    if bias:
        ops["gate_and_up_proj_bias"] = rng.standard_normal((experts, 2, INTER)) * 0.2
        ops["down_proj_bias"] = rng.standard_normal((experts, H)) * 0.2
    arrays = {
        name: jnp.asarray(v, dtype if np.issubdtype(np.asarray(v).dtype, np.floating) else jnp.int32)
        for name, v in ops.items()
    }
    return arrays


POSITIONAL = (
    "hidden_states",
    "expert_affinities_masked",
    "gate_up_proj_weight",
    "down_proj_weight",
    "token_position_to_id",
    "block_to_expert",
)


def call(ops, conditions=False, **kwargs):
    extra = {n: ops[n] for n in ("gate_and_up_proj_bias", "down_proj_bias") if n in ops}
    if conditions:
        extra["conditions"] = ops["conditions"]
    return nki.moe_cte(*(ops[n] for n in POSITIONAL), block_size=B, **extra, **kwargs)


def oracle(ops, **kwargs):
    o = {n: f64(v) for n, v in ops.items()}
    return blockwise_forward(
        o["hidden_states"],
        o["expert_affinities_masked"],
        o["gate_up_proj_weight"],
        o["down_proj_weight"],
        np.asarray(ops["token_position_to_id"]),
        np.asarray(ops["block_to_expert"]),
        B,
        gate_up_bias=o.get("gate_and_up_proj_bias"),
        down_bias=o.get("down_proj_bias"),
        **kwargs,
    )


OPTIONS = [  # moe_cte kwargs, oracle kwargs
    ({"implementation": "shard_on_i"}, {}),
    (
        {
            "implementation": "shard_on_i",
            "activation_function": "Swish",
            "expert_affinities_scaling_mode": "PRE_SCALE",
            "gate_clamp_upper_limit": 0.5,
            "up_clamp_lower_limit": -0.3,
        },
        {
            "activation": "Swish",
            "mode": "PRE_SCALE",
            "prescale_on_projections": True,
            "gate_clamp": (0.5, None),
            "up_clamp": (None, -0.3),
        },
    ),
    (
        {"implementation": "shard_on_i_dropping", "expert_affinity_multiply_on_I": True, "activation_function": "GELU"},
        {"multiply_on_I": True, "activation": "GELU"},
    ),
    (
        {
            "implementation": "shard_on_block",
            "expert_affinities_scaling_mode": "PRE_SCALE",
            "activation_function": "GELU_Tanh_Approx",
            "gate_clamp_lower_limit": -0.2,
            "up_clamp_upper_limit": 0.4,
        },
        {"mode": "PRE_SCALE", "activation": "GELU_Tanh_Approx", "gate_clamp": (None, -0.2), "up_clamp": (0.4, None)},
    ),
    ({"implementation": "shard_on_block", "expert_affinities_scaling_mode": "NO_SCALE"}, {"mode": "NO_SCALE"}),
    (
        {"implementation": "shard_on_i", "expert_affinities_scaling_mode": "PRE_SCALE_DELAYED"},
        {"mode": "PRE_SCALE", "prescale_on_projections": True},
    ),
]


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(str(v) for v in o[0].values()))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_output_matches_the_block_oracle(options, dtype):
    kwargs, oracle_kwargs = options
    ops = problem(1, dtype=dtype, bias=True)
    out = call(ops, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    out = out.sum(axis=1) if out.ndim == 3 else out
    expected, _, _ = oracle(ops, **oracle_kwargs)
    assert out.dtype == dtype and out.shape == (T + 1, H)
    assert_close(out[:T], expected[:T], dtype, reduction=H, ops=8)


def test_shard_on_block_accumulating_output_is_the_kernels_two_slots():
    ops = problem(2)
    out = call(ops, implementation="shard_on_block")
    assert out.shape == (T + 1, 2, H)
    np.testing.assert_array_equal(out[:, 1], 0)  # the kernel's final reduction leaves slot 1 zero
    single = call(ops, implementation="shard_on_block", is_tensor_update_accumulating=False)
    assert single.shape == (T + 1, H)
    assert_close(out[:T, 0], oracle(ops)[0][:T], jnp.float32, reduction=H)
    # without accumulation a block overwrites its rows: a top-2 token keeps its last expert's share
    assert_close(single[:T], oracle(ops, accumulate=False)[0][:T], jnp.float32, reduction=H)


@pytest.mark.parametrize("multiply_on_I", [False, True])
def test_checkpoints_are_gate_up_after_bias_and_clamp_and_down_before_the_affinity(multiply_on_I):
    ops = problem(3, bias=True)
    clamps = {"gate_clamp_upper_limit": 0.4, "up_clamp_lower_limit": -0.2}
    outs = call(
        ops,
        implementation="shard_on_i",
        checkpoint_activation=True,
        expert_affinity_multiply_on_I=multiply_on_I,
        **clamps,
    )
    out, gate_up_t, *down = outs
    exp_out, exp_gu, exp_down = oracle(ops, gate_clamp=(0.4, None), up_clamp=(None, -0.2), multiply_on_I=multiply_on_I)
    assert gate_up_t.shape == (exp_gu.shape[0], 2, INTER, B)
    assert_close(gate_up_t, exp_gu, jnp.float32, reduction=H)
    assert len(down) == (0 if multiply_on_I else 1)
    if down:
        assert_close(down[0], exp_down, jnp.float32, reduction=INTER)
    assert_close(out[:T], exp_out[:T], jnp.float32, reduction=H)


def test_checkpoint_dtypes_are_the_weights():
    ops = problem(4)
    ops = dict(ops, down_proj_weight=ops["down_proj_weight"].astype(jnp.bfloat16))
    out, gate_up_t, down = call(ops, implementation="shard_on_i_dropping")
    assert (out.dtype, gate_up_t.dtype, down.dtype) == (jnp.float32, jnp.float32, jnp.bfloat16)


def test_hybrid_runs_the_static_blocks_and_the_used_ones():
    ops = problem(5)
    n_blocks, used = ops["block_to_expert"].shape[0], int(ops["conditions"].sum())
    # blocks past the used ones hold only the padding token: give them a real token to see which ones run
    slots = ops["token_position_to_id"].at[used * B :].set(0)
    ops = dict(ops, token_position_to_id=slots)
    for static in (None, used, n_blocks):
        got = call(ops, conditions=True, implementation="shard_on_i_hybrid", num_static_block=static)
        count = max(n_blocks - E if static is None else static, used)
        expected, _, _ = oracle(ops, active=np.arange(n_blocks) < count)
        assert_close(got, expected, jnp.float32, reduction=H)


def test_skip_token_layout_has_no_padding_row():
    ops = problem(6)
    slots = jnp.where(ops["token_position_to_id"] == T, -1, ops["token_position_to_id"])
    skipped = dict(
        ops,
        hidden_states=ops["hidden_states"][:T],
        token_position_to_id=slots,
        expert_affinities_masked=ops["expert_affinities_masked"][: T * E],
    )
    got = call(skipped, implementation="shard_on_i", skip_dma=nki.SkipMode(skip_token=True))
    assert got.shape == (T, H)
    assert_close(got, oracle(ops)[0][:T], jnp.float32, reduction=H)


def test_spec_object_and_fields_are_the_same_call():
    ops = problem(7)
    spec = nki.MoECTESpec(
        nki.MoECTEImplementation.shard_on_i, shard_on_I=nki.ShardOnIConfig(checkpoint_activation=True)
    )
    by_spec = call(ops, spec=spec)
    by_fields = call(ops, implementation="shard_on_i", checkpoint_activation=True)
    for a, b in zip(by_spec, by_fields):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="checkpoint_activation"):
        call(
            ops,
            spec=spec,
            checkpoint_activation=False,
            expert_affinity_multiply_on_I=True,
            implementation="shard_on_block",
        )


@pytest.mark.parametrize(
    "kwargs, drop, error, match",
    [
        ({}, (), TypeError, "implementation"),
        ({"implementation": "shard_on_i_mx"}, (), TypeError, "gate_up_proj_weight"),
        ({"implementation": "shard_on_i_hybrid"}, (), TypeError, "conditions"),
        ({"implementation": "shard_on_i"}, ("down_proj_bias",), ValueError, "down_proj_bias"),
        (
            {"implementation": "shard_on_block", "expert_affinities_scaling_mode": "PRE_SCALE_DELAYED"},
            (),
            ValueError,
            "PRE_SCALE_DELAYED",
        ),
        ({"implementation": "shard_on_block", "block_sharding_strategy": "HI_LO"}, (), ValueError, "PING_PONG"),
        ({"implementation": "shard_on_block", "checkpoint_activation": True}, (), ValueError, "checkpoint_activation"),
        ({"implementation": "shard_on_i", "skip_dma": "yes"}, (), TypeError, "skip_dma"),
    ],
)
def test_bad_calls_name_the_argument(kwargs, drop, error, match):
    ops = problem(8, bias=True)
    ops = {n: v for n, v in ops.items() if n not in drop}
    with pytest.raises(error, match=match):
        call(ops, **kwargs)


def test_block_size_must_divide_the_slots():
    ops = problem(9)
    with pytest.raises(ValueError, match="token_position_to_id"):
        nki.moe_cte(*(ops[n] for n in POSITIONAL), block_size=B + 1, implementation="shard_on_i")


# ---------------------------------------------------------------------------------------------------- reverse mode
def primitives(fn, *args):
    return {eqn.primitive.name for eqn in jax.make_jaxpr(fn)(*args).eqns}


def grads_of(ops, **kwargs):
    floats = (
        "hidden_states",
        "expert_affinities_masked",
        "gate_up_proj_weight",
        "down_proj_weight",
        "gate_and_up_proj_bias",
        "down_proj_bias",
    )
    names = [n for n in floats if n in ops]
    dy = jnp.asarray(np.random.default_rng(0).standard_normal((T + 1, H)), ops["hidden_states"].dtype)

    def loss(*values):
        out = call(dict(ops, **dict(zip(names, values))), **kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.sum((out.sum(axis=1) if out.ndim == 3 else out) * dy)

    values = [ops[n] for n in names]
    return dict(zip(names, jax.grad(loss, argnums=tuple(range(len(names))))(*values))), dy, loss, values


@pytest.mark.parametrize("implementation", ["shard_on_i", "shard_on_i_dropping", "shard_on_block"])
def test_gradients_match_the_float64_oracle(implementation):
    ops = problem(10, dtype=jnp.float64, bias=True)
    clamps = {"gate_clamp_upper_limit": 0.6, "up_clamp_lower_limit": -0.5}
    grads, dy, loss, values = grads_of(ops, implementation=implementation, **clamps)
    o = {n: f64(v) for n, v in ops.items()}
    slots, owners = np.asarray(ops["token_position_to_id"]), np.asarray(ops["block_to_expert"])
    _, ckpt_gu, ckpt_down = oracle(ops, gate_clamp=(0.6, None), up_clamp=(None, -0.5))
    expected = blockwise_backward(
        o["hidden_states"],
        o["expert_affinities_masked"],
        o["gate_up_proj_weight"],
        o["down_proj_weight"],
        ckpt_gu,
        ckpt_down,
        slots,
        owners,
        f64(dy),
        B,
        linear_clamp=(None, -0.5),
        non_linear_clamp=(0.6, None),
    )
    names = (
        "hidden_states",
        "expert_affinities_masked",
        "gate_up_proj_weight",
        "down_proj_weight",
        "gate_and_up_proj_bias",
        "down_proj_bias",
    )
    for name, want in zip(names, expected):
        assert_close(grads[name], want, jnp.float64, reduction=H * B)
    uses_kernel = "blockwise_mm_bwd" in primitives(jax.grad(loss), *values)
    assert uses_kernel == (implementation != "shard_on_block")


@pytest.mark.slow  # CI: check_grads of the moe_cte.shard_on_block arg spec
def test_reference_vjp_where_the_backward_kernel_does_not_apply():
    ops = problem(11, dtype=jnp.float64)
    for kwargs in (
        {"implementation": "shard_on_i", "expert_affinities_scaling_mode": "PRE_SCALE"},
        {"implementation": "shard_on_i", "activation_function": "GELU"},
        {"implementation": "shard_on_i", "expert_affinity_multiply_on_I": True},
        {"implementation": "shard_on_i", "is_tensor_update_accumulating": False},
    ):
        _, _, loss, values = grads_of(ops, **kwargs)
        assert "blockwise_mm_bwd" not in primitives(jax.grad(loss), *values)
        check_grads(jax.jit(loss), values, order=1, modes=["rev"])


def test_bf16_gradient_through_the_backward_kernel():
    ops = problem(12, dtype=jnp.bfloat16)
    grads, dy, _, _ = grads_of(ops, implementation="shard_on_i")
    exact, _, _, _ = grads_of(
        {n: v.astype(jnp.float64) if v.dtype == jnp.bfloat16 else v for n, v in ops.items()},
        implementation="shard_on_i",
    )
    for name in grads:
        assert grads[name].dtype == jnp.bfloat16
        assert_close(grads[name], f64(exact[name]), jnp.bfloat16, reduction=H * B, ops=8)


# --------------------------------------------------------------------------------------------------------- Neuron
def lowered_kernels(fn, *args, lnc=1):
    with jax_nkilib.neuron.dry_run(), jax_nkilib.config(lnc=lnc):
        text = jax.jit(fn).trace(*args).lower(lowering_platforms=("neuron",)).as_text()
    return [config["func_name"] for config in kernel_configs(text)]


def test_training_step_lowers_to_moe_cte_and_blockwise_mm_bwd():
    tokens, block, hidden = 255, 256, 512
    shapes = {
        "hidden_states": (tokens + 1, hidden),
        "expert_affinities_masked": ((tokens + 1) * 2, 1),
        "gate_up_proj_weight": (2, hidden, 2, 32),
        "down_proj_weight": (2, 32, hidden),
    }
    floats = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes.values()]
    slots, owners = jax.ShapeDtypeStruct((2 * block,), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32)

    def loss(x, a, gu, dn, slots, owners):
        out = nki.moe_cte(x, a, gu, dn, slots, owners, block_size=block, implementation="shard_on_i")
        return jnp.sum(out.astype(jnp.float32) ** 2)

    step = jax.grad(loss, argnums=(0, 1, 2, 3))
    assert lowered_kernels(step, *floats, slots, owners) == ["moe_cte", "blockwise_mm_bwd"]


def test_shard_on_block_needs_lnc2_on_neuron():
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((129, 64), (258, 1), (2, 64, 2, 16), (2, 16, 64))]
    ints = [jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32)]
    fn = lambda *a: nki.moe_cte(*a, block_size=128, implementation="shard_on_block")  # noqa: E731
    assert lowered_kernels(fn, *shapes, *ints, lnc=2) == ["moe_cte"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lowered_kernels(fn, *shapes, *ints, lnc=1) == []
    assert any(issubclass(w.category, NeuronFallbackWarning) and "LNC=2" in str(w.message) for w in caught)
    with jax_nkilib.config(on_unsupported="error"), pytest.raises(Exception, match="LNC=2"):
        lowered_kernels(fn, *shapes, *ints, lnc=1)


# ------------------------------------------------------------------------------- blockwise_mm_baseline_shard_hidden
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("mode", ["POST_SCALE", "PRE_SCALE", "NO_SCALE", "PRE_SCALE_DELAYED"])
def test_shard_hidden_matches_the_block_oracle(mode, dtype):
    ops = problem(13, dtype=dtype)
    out = nki.blockwise_mm_baseline_shard_hidden(
        *(ops[n] for n in POSITIONAL), block_size=B, expert_affinities_scaling_mode=mode
    )
    # the kernel has no branch for PRE_SCALE_DELAYED: no affinity at all
    expected, _, _ = oracle(ops, mode="NO_SCALE" if mode == "PRE_SCALE_DELAYED" else mode)
    assert out.dtype == dtype and out.shape == (T + 1, H)
    assert_close(out[:T], expected[:T], dtype, reduction=H, ops=8)


def test_shard_hidden_fills_the_checkpoint_buffers_it_is_given():
    ops = problem(14)
    n_blocks = ops["block_to_expert"].shape[0]
    buffers = jnp.zeros((n_blocks, 2, INTER, B), jnp.bfloat16), jnp.zeros((n_blocks, B, H), jnp.float32)
    out, gate_up_t, down = nki.blockwise_mm_baseline_shard_hidden(*(ops[n] for n in POSITIONAL), *buffers, block_size=B)
    expected_out, expected_gu, expected_down = oracle(ops)
    assert gate_up_t.dtype == jnp.bfloat16 and down.dtype == jnp.float32
    assert_close(gate_up_t, expected_gu, jnp.bfloat16, reduction=H)
    assert_close(down, expected_down, jnp.float32, reduction=INTER)
    only_down = nki.blockwise_mm_baseline_shard_hidden(
        *(ops[n] for n in POSITIONAL), down_activations=buffers[1], block_size=B
    )
    assert len(only_down) == 2 and only_down[1].shape == (n_blocks, B, H)
    assert_close(out[:T], expected_out[:T], jnp.float32, reduction=H)


def test_shard_hidden_lowers_to_its_kernel_with_aliased_buffers():
    shapes = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in ((129, 64), (258, 1), (2, 64, 2, 16), (2, 16, 64))]
    ints = [jax.ShapeDtypeStruct((256,), jnp.int32), jax.ShapeDtypeStruct((2, 1), jnp.int32)]
    buffers = [jax.ShapeDtypeStruct((2, 2, 16, 128), jnp.bfloat16), jax.ShapeDtypeStruct((2, 128, 64), jnp.bfloat16)]
    fn = lambda *a: nki.blockwise_mm_baseline_shard_hidden(*a, block_size=128)  # noqa: E731
    assert lowered_kernels(fn, *shapes, *ints, *buffers, lnc=2) == ["blockwise_mm_baseline_shard_hidden"]


# ---------------------------------------------------------------------------------------------------- shard_map
def test_tensor_parallel_over_the_intermediate_dimension_inside_shard_map():
    """Each of 8 devices runs moe_cte on its I/8 slice of both weights (the kernel's I_TP); one psum of the
    partial outputs gives the single-device output, and the gradients (through blockwise_mm_bwd) agree too."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from tests.support.sharding import make_mesh

    rng = np.random.default_rng(15)
    ops = problem(15)
    inter = 16
    ops["gate_up_proj_weight"] = jnp.asarray(rng.standard_normal((E, H, 2, inter)) * 0.3, jnp.float32)
    ops["down_proj_weight"] = jnp.asarray(rng.standard_normal((E, inter, H)) * 0.3, jnp.float32)
    mesh = make_mesh((8,), ("tp",))
    specs = (P(), P(), P(None, None, None, "tp"), P(None, "tp", None), P(), P())
    args = [ops[n] for n in POSITIONAL]

    def local(*a):
        return jax.lax.psum(nki.moe_cte(*a, block_size=B, implementation="shard_on_i"), "tp")

    sharded = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P()))
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    single = lambda *a: nki.moe_cte(*a, block_size=B, implementation="shard_on_i")  # noqa: E731
    np.testing.assert_allclose(sharded(*placed), single(*args), rtol=1e-5, atol=1e-5)
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2, 3)))  # noqa: E731
    for got, want in zip(loss(sharded)(*placed), loss(single)(*args)):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
