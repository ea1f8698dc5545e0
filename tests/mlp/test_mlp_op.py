"""jax_nkilib.mlp (idiomatic): against the float64 oracle and plain jnp, transformations, sharding, Neuron lowering."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_nkilib
from tests.mlp.test_mlp_kernel import mlp_oracle
from tests.support.data import random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text, operations
from tests.support.numerics import assert_close, assert_no_worse_than_plain
from tests.support.sharding import mesh_1d, shard

HID, INTER = 32, 24


def weights(dtype=jnp.float32, seed=1):
    shapes = ((HID, INTER), (HID, INTER), (INTER, HID))
    return tuple(random(shape, dtype, seed + k, 0.25) for k, shape in enumerate(shapes))


def test_swiglu_default_matches_plain_jnp():
    x = random((2, 3, HID), jnp.float32)
    wg, wu, wd = weights()
    plain = (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
    assert_close(jax_nkilib.mlp(x, wg, wu, wd), mlp_oracle(x, wg, wu, wd)[0], jnp.float32, reduction=HID)
    assert_close(jax_nkilib.mlp(x, wg, wu, wd), plain, jnp.float32, reduction=HID)


def test_bfloat16_is_no_worse_than_plain():
    x = random((4, 5, HID), jnp.bfloat16)
    wg, wu, wd = weights(jnp.bfloat16)
    f64 = [np.asarray(a, np.float64) for a in (x, wg, wu, wd)]
    exact = (f64[0] @ f64[1] / (1 + np.exp(-(f64[0] @ f64[1]))) * (f64[0] @ f64[2])) @ f64[3]
    plain = (jax.nn.silu(x @ wg) * (x @ wu)) @ wd
    assert_no_worse_than_plain(jax_nkilib.mlp(x, wg, wu, wd), plain, exact)


@pytest.mark.parametrize(
    "activation, kernel_act",
    [
        ("silu", "SiLU"),
        ("swish", "SiLU"),
        ("gelu", "GELU"),
        ("gelu_tanh", "GELU_Tanh_Approx"),
        ("gelu_sigmoid", "Swish"),
        ("relu", "ReLU"),
    ],
)
def test_activations(activation, kernel_act):
    x = random((7, HID), jnp.float32)  # [tokens, hidden]
    wg, wu, wd = weights()
    out = jax_nkilib.mlp(x, wg, wu, wd, activation=activation)
    assert out.shape == (7, HID)
    assert_close(out, mlp_oracle(x[None], wg, wu, wd, act=kernel_act)[0][0], jnp.float32, reduction=HID)


def test_norms_residual_biases_clamps_and_plain_mlp():
    x, res = random((2, 4, HID), jnp.float32), random((2, 4, HID), jnp.float32, 9)
    wg, wu, wd = weights()
    gamma, beta = random((HID,), jnp.float32, 5) + 1, random((HID,), jnp.float32, 6, 0.1)
    bg, bu = random((INTER,), jnp.float32, 7, 0.2), random((INTER,), jnp.float32, 8, 0.2)
    bd = random((HID,), jnp.float32, 10)
    out, summed = jax_nkilib.mlp(
        x,
        wg,
        wu,
        wd,
        norm="layer",
        norm_weight=gamma,
        norm_bias=beta,
        residual=res,
        return_residual=True,
        gate_bias=bg,
        up_bias=bu,
        down_bias=bd,
        gate_clamp=(-0.5, 0.7),
        up_clamp=(None, 0.4),
    )
    want, want_sum = mlp_oracle(
        x,
        wg,
        wu,
        wd,
        norm="layer",
        gamma=gamma,
        beta=beta,
        gate_b=bg,
        up_b=bu,
        down_b=bd,
        fused_add=res,
        store=True,
        gate_clamp=(0.7, -0.5),
        up_clamp=(0.4, None),
    )
    assert_close(out, want, jnp.float32, reduction=HID)
    assert_close(summed, np.asarray(x, np.float64) + np.asarray(res, np.float64), jnp.float32)
    rms = jax_nkilib.mlp(x, wg, wu, wd, norm="rms", residual=res)  # no weight: unscaled RMS norm
    assert_close(rms, mlp_oracle(x, wg, wu, wd, norm="rms_skip", fused_add=res)[0], jnp.float32, reduction=HID)
    plain = jax_nkilib.mlp(x, None, wu, wd, activation="gelu", up_bias=bu)  # no gate: act(x w_up + b) w_down
    assert_close(plain, mlp_oracle(x, wu, wu, wd, act="GELU", skip_gate=True, up_b=bu)[0], jnp.float32, reduction=HID)


def test_more_than_96_tokens_take_the_cte_path():
    x = random((2, 50, HID), jnp.bfloat16)
    wg, wu, wd = weights(jnp.bfloat16)
    out = jax_nkilib.mlp(x, wg, wu, wd, norm="rms")
    assert_close(out, mlp_oracle(x, wg, wu, wd, norm="rms_skip")[0], jnp.bfloat16, ops=2)


def test_gradients_float64():
    x, res = random((2, 3, 8), jnp.float64), random((2, 3, 8), jnp.float64, 9)
    wg, wu, wd = random((8, 6), jnp.float64, 1), random((8, 6), jnp.float64, 2), random((6, 8), jnp.float64, 3)
    gamma, bd = random((8,), jnp.float64, 4) + 1, random((8,), jnp.float64, 5)

    def loss(x_, res_, wg_, wu_, wd_, gamma_, bd_):
        out, summed = jax_nkilib.mlp(
            x_,
            wg_,
            wu_,
            wd_,
            norm="rms",
            norm_weight=gamma_,
            residual=res_,
            return_residual=True,
            down_bias=bd_,
            activation="gelu_tanh",
        )
        return out * jnp.tanh(summed)

    check_grads(loss, (x, res, wg, wu, wd, gamma, bd), order=1, modes=["rev"])
    check_grads(lambda w: jax_nkilib.mlp(x, None, w, wd, activation="gelu"), (wu,), order=1, modes=["rev"])


def test_shard_map_over_the_batch():
    mesh = mesh_1d()
    x = random((8, 4, HID), jnp.bfloat16)
    wg, wu, wd = weights(jnp.bfloat16)
    specs = (P("data"), P(), P(), P())
    fn = jax.jit(
        jax.shard_map(lambda *a: jax_nkilib.mlp(*a, norm="rms"), mesh=mesh, in_specs=specs, out_specs=P("data"))
    )
    assert_close(
        fn(*shard(mesh, specs, x, wg, wu, wd)), mlp_oracle(x, wg, wu, wd, norm="rms_skip")[0], jnp.bfloat16, ops=2
    )


def test_neuron_lowering_is_the_kernel_and_reshapes():
    x = random((2, 3, 4, 256), jnp.bfloat16)
    wg, wu, wd = (random(shape, jnp.bfloat16, s) for s, shape in enumerate([(256, 128), (256, 128), (128, 256)]))
    with jax_nkilib.neuron.dry_run():
        text = neuron_text(
            lambda *a: jax_nkilib.mlp(*a, norm="rms", residual=a[0], return_residual=True), x, wg, wu, wd
        )
    (cfg,) = kernel_configs(text)
    assert operations(text).count("stablehlo.custom_call") == 1
    assert set(compute_operations(text)) <= {"stablehlo.reshape"}
    assert cfg["input_specs"][0] == [[6, 4, 256], "bfloat16"]
    assert cfg["params"]["normalization_type"] == "RMS_NORM_SKIP_GAMMA" and cfg["params"]["store_fused_add_result"]


def test_float32_cte_computes_in_float32_unless_bfloat16_is_asked_for():
    x = random((2, 50, HID), jnp.float32)  # 100 tokens: the CTE path
    wg, wu, wd = weights()
    gamma = random((HID,), jnp.float32, 7, 0.2) + 1
    call = lambda **kw: jax_nkilib.mlp(x, wg, wu, wd, norm="rms", norm_weight=gamma, **kw)  # noqa: E731
    exact = mlp_oracle(*(t.astype(jnp.float64) for t in (x, wg, wu, wd)), norm="rms", gamma=gamma[None])[0]
    for precision in (None, "default", "highest", "float32", jax.lax.Precision.DEFAULT):
        assert_close(call(precision=precision), exact, jnp.float32, reduction=HID)
    with jax.default_matmul_precision("tensorfloat32"):
        assert_close(jax.jit(lambda: call())(), exact, jnp.float32, reduction=HID)
    kernel = lambda: jax_nkilib.nki.mlp(x, wg, wu, wd, gamma[None], normalization_type="RMS_NORM")  # noqa: E731
    eager = kernel()  # layer 1: the kernel's numerics, bfloat16 compute on the CTE path
    assert np.array_equal(np.asarray(eager), np.asarray(eager.astype(jnp.bfloat16).astype(jnp.float32)))
    asked = [(call(precision="bfloat16"), eager), (call(precision=jax.lax.DotAlgorithmPreset.BF16_BF16_BF16), eager)]
    with jax.default_matmul_precision("bfloat16"):
        asked.append((jax.jit(lambda: call())(), jax.jit(kernel)()))  # (XLA's fusions may round a tie otherwise)
    for out, exact in asked:
        np.testing.assert_array_equal(out, exact)
        assert_close(out, mlp_oracle(x, wg, wu, wd, norm="rms", gamma=gamma[None])[0], jnp.bfloat16, ops=2)
    with pytest.raises(ValueError, match=r"jax_nkilib.mlp: `precision` must be None"):
        call(precision="fp32")


def test_float32_cte_explain_notes_the_kernels_bfloat16_compute():
    x = random((2, 64, 128), jnp.float32)
    wg, wu, wd = (random(shape, jnp.float32, s) for s, shape in enumerate([(128, 64), (128, 64), (64, 128)]))
    (report,) = jax_nkilib.explain(jax_nkilib.mlp, x, wg, wu, wd)
    assert report.runs_kernel and report.params["float32_compute"] == "float32"
    (note,) = report.notes
    assert "float32 inputs compute in bfloat16 in the NKI kernel (mlp's CTE path" in note and "in float32" in note
    (tkg,) = jax_nkilib.explain(jax_nkilib.mlp, x[:1, :2], wg, wu, wd)
    (bf16,) = jax_nkilib.explain(jax_nkilib.mlp, *(t.astype(jnp.bfloat16) for t in (x, wg, wu, wd)))
    assert tkg.notes == bf16.notes == ()
    with jax_nkilib.neuron.dry_run():  # one kernel call, the same whatever the precision
        configs = [
            kernel_configs(neuron_text(lambda *a: jax_nkilib.mlp(*a, precision=p), x, wg, wu, wd))
            for p in (None, "bfloat16")
        ]
    assert configs[0] == configs[1] and len(configs[0]) == 1
    assert "float32_compute" not in configs[0][0]["params"]
