"""``jax_nkilib.nki.blockwise_mm_bwd`` against the float64 backward oracle (from checkpoints: SiLU and Swish,
clamps, biases, ``skip_token``), its agreement with differentiating the forward, its outputs and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_nkilib import nki
from tests.moe.blockwise_oracles import blockwise_backward, blockwise_forward, routing
from tests.support.numerics import assert_close, f64

T, H, INTER, E, K, B = 9, 16, 8, 4, 2, 4


def problem(seed, dtype=jnp.float32, activation="SiLU", clamps=((None, None), (None, None)), bias=False):
    """Forward operands, the forward's checkpoints (from the oracle) and an output cotangent (zero padding row)."""
    rng = np.random.default_rng(seed)
    index = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    affinities, slots, owners, _ = routing(index, rng.uniform(0.2, 1.0, (T, K)), E, B)
    x = rng.standard_normal((T + 1, H))
    x[T] = 0
    gate_up, down = rng.standard_normal((E, H, 2, INTER)) * 0.4, rng.standard_normal((E, INTER, H)) * 0.4
    biases = (rng.standard_normal((E, 2, INTER)) * 0.2, rng.standard_normal((E, H)) * 0.2) if bias else (None, None)
    cast = lambda v: np.asarray(jnp.asarray(v, dtype), np.float64)  # noqa: E731  (the oracle sees rounded inputs)
    x, affinities, gate_up, down = map(cast, (x, affinities, gate_up, down))
    linear, non_linear = clamps
    _, ckpt_gu, ckpt_down = blockwise_forward(
        x,
        affinities,
        gate_up,
        down,
        slots,
        owners,
        B,
        activation=activation,
        gate_up_bias=biases[0],
        down_bias=biases[1],
        gate_clamp=non_linear,
        up_clamp=linear,
    )
    dy = rng.uniform(-1, 1, (T + 1, H))
    dy[T] = 0
    ckpt_gu, ckpt_down, dy = map(cast, (ckpt_gu, ckpt_down, dy))
    return x, affinities, gate_up, down, ckpt_gu, ckpt_down, slots, owners, dy


def run(arrays, dtype, **kwargs):
    x, a, gu, dn, cgu, cdn, slots, owners, dy = arrays
    floats = [jnp.asarray(v, dtype) for v in (x, a, gu, dn, cgu, cdn)]
    ints = [jnp.asarray(slots, jnp.int32), jnp.asarray(owners, jnp.int32)]
    return nki.blockwise_mm_bwd(*floats, *ints, jnp.asarray(dy, dtype), block_size=B, **kwargs)


CASES = [
    ({}, {}),
    ({"activation_type": "Swish"}, {"activation": "Swish"}),
    (
        {"clamp_limits": nki.ClampLimits(linear_clamp_lower_limit=-0.5, non_linear_clamp_upper_limit=0.5)},
        {"clamps": ((None, -0.5), (0.5, None))},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=["silu", "swish", "clamps"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gradients_match_the_float64_oracle(case, dtype):
    kwargs, problem_kwargs = case
    arrays = problem(1, dtype, **problem_kwargs)
    got = run(arrays, dtype, bias=True, compute_dtype=jnp.float32, **kwargs)
    activation = problem_kwargs.get("activation", "SiLU")
    linear, non_linear = problem_kwargs.get("clamps", ((None, None), (None, None)))
    expected = blockwise_backward(
        *arrays[:8], arrays[8], B, activation=activation, linear_clamp=linear, non_linear_clamp=non_linear
    )
    assert len(got) == 6
    for g, want, reduction in zip(got, expected, (2 * INTER, H, B * K, B * K, B * K, B * K)):
        assert_close(g, want, dtype, reduction=reduction * H, ops=8)
    assert [g.dtype for g in got[:4]] == [dtype] * 4 and got[4].dtype == got[5].dtype == jnp.float32


def test_without_bias_four_outputs_in_the_operands_dtypes():
    arrays = problem(2)
    got = run(arrays, jnp.float32)
    assert [g.shape for g in got] == [(T + 1, H), ((T + 1) * E, 1), (E, H, 2, INTER), (E, INTER, H)]


def test_skip_token_layout():
    arrays = problem(3)
    x, a, gu, dn, cgu, cdn, slots, owners, dy = arrays
    skipped = (x[:T], a[: T * E], gu, dn, cgu, cdn, np.where(slots == T, -1, slots), owners, dy[:T])
    got = run(skipped, jnp.float32, skip_dma=nki.SkipMode(skip_token=True))
    expected = blockwise_backward(*arrays[:8], dy, B)
    assert got[0].shape == (T, H)
    assert_close(got[0], expected[0][:T], jnp.float32, reduction=2 * INTER * H)
    assert_close(got[1], expected[1][: T * E], jnp.float32, reduction=H)


def test_is_the_vjp_of_the_forward_on_its_own_checkpoints():
    """With moe_cte's checkpoints, the kernel's gradients equal JAX's derivative of moe_cte's reference."""
    arrays = problem(4, jnp.float64, bias=True)
    x, a, gu, dn, _, _, slots, owners, dy = (jnp.asarray(v) for v in arrays)
    rng = np.random.default_rng(5)
    b_gu, b_dn = jnp.asarray(rng.standard_normal((E, 2, INTER))), jnp.asarray(rng.standard_normal((E, H)))
    slots, owners = slots.astype(jnp.int32), owners.astype(jnp.int32)

    def forward(x, a, gu, dn, b_gu, b_dn):
        out = nki.moe_cte(
            x,
            a,
            gu,
            dn,
            slots,
            owners,
            gate_and_up_proj_bias=b_gu,
            down_proj_bias=b_dn,
            block_size=B,
            implementation="shard_on_block",
        )
        return out.sum(axis=1)

    _, pullback = jax.vjp(forward, x, a, gu, dn, b_gu, b_dn)
    expected = pullback(dy)
    _, ckpt_gu, ckpt_down = nki.moe_cte(
        x,
        a,
        gu,
        dn,
        slots,
        owners,
        gate_and_up_proj_bias=b_gu,
        down_proj_bias=b_dn,
        block_size=B,
        implementation="shard_on_i",
        checkpoint_activation=True,
    )
    got = nki.blockwise_mm_bwd(
        x, a, gu, dn, ckpt_gu, ckpt_down, slots, owners, dy, block_size=B, bias=True, compute_dtype=jnp.float64
    )
    for g, want in zip(got, expected):
        np.testing.assert_allclose(g, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda ops: ops.update(cgu=ops["cgu"][:, :, :, :2]), ValueError, "dimension 1 .B."),
        (lambda ops: ops.update(a=ops["a"][:-1]), ValueError, "expert_affinities_masked"),
        (lambda ops: ops.update(dy=ops["dy"][:, :-1]), ValueError, "output_hidden_states_grad"),
    ],
)
def test_bad_inputs_name_the_argument(change, error, match):
    names = ("x", "a", "gu", "dn", "cgu", "cdn", "slots", "owners", "dy")
    ops = dict(zip(names, problem(6)))
    change(ops)
    with pytest.raises(error, match=match):
        run(tuple(ops[n] for n in names), jnp.float32)
    with pytest.raises(TypeError, match="clamp_limits"):
        run(problem(6), jnp.float32, clamp_limits=0.5)


def test_f64_oracle_helpers_agree():  # the oracle's checkpoints are what moe_cte checkpoints
    arrays = problem(7)
    x, a, gu, dn, cgu, cdn, slots, owners, _ = arrays
    _, got_gu, got_dn = nki.moe_cte(
        *(jnp.asarray(v) for v in (x, a, gu, dn)),
        jnp.asarray(slots, jnp.int32),
        jnp.asarray(owners, jnp.int32),
        block_size=B,
        implementation="shard_on_i",
        checkpoint_activation=True,
    )
    assert_close(got_gu, f64(jnp.asarray(cgu, jnp.float32)), jnp.float32, reduction=H)
    assert_close(got_dn, f64(jnp.asarray(cdn, jnp.float32)), jnp.float32, reduction=INTER)
