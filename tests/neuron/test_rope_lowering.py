"""Lowering RoPE kernels for the `neuron` platform with the dry-run compiler: the custom calls and nothing else."""

import jax
import jax.numpy as jnp
import pytest

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronSdkMissingError, NeuronUnsupportedError
from jax_nkilib.nki import RoPE, rope_hf
from tests.support.data import angles, random
from tests.support.hlo import compute_operations, kernel_configs, neuron_text, operations

X = random((64, 2, 4, 16))
COS, SIN = angles((32, 2, 16))
Q, K = random((2, 4, 128, 64)), random((2, 2, 128, 64))
C, S = angles((128, 64))


@pytest.fixture(autouse=True)
def dry_run():
    with jax_nkilib.neuron.dry_run():
        yield


def test_layer1_rope_is_exactly_one_custom_call():
    text = neuron_text(RoPE, X, COS, SIN)
    assert operations(text) == ["stablehlo.custom_call"]
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "RoPE" and cfg["kernel_format"] == "dry-run"
    assert cfg["entry_point"] == "nkilib.core.embeddings.rope:RoPE"
    assert cfg["grid"] == 1 and cfg["has_collectives"] is False
    assert cfg["params"] == {"lnc_shard": False, "contiguous_layout": True, "relayout_in_sbuf": False}
    assert cfg["input_names"] == ["x_in", "cos", "sin"]


def test_lnc2_sets_grid_and_sharding_flag():
    with jax_nkilib.config(lnc=2):
        (cfg,) = kernel_configs(neuron_text(RoPE, X, COS, SIN))
        assert cfg["grid"] == 2 and cfg["params"]["lnc_shard"] is True
        (cfg,) = kernel_configs(neuron_text(lambda *a: RoPE(*a, lnc_shard=False), X, COS, SIN))
        assert cfg["grid"] == 2 and cfg["params"]["lnc_shard"] is False


def test_jit_cache_respects_lnc():
    fn = jax.jit(lambda *a: RoPE(*a))
    grids = []
    for lnc in (1, 2, 1):
        with jax_nkilib.config(lnc=lnc):
            grids.append(
                kernel_configs(fn.trace(X, COS, SIN).lower(lowering_platforms=("neuron",)).as_text())[0]["grid"]
            )
    assert grids == [1, 2, 1]


def test_rope_hf_is_one_custom_call_with_two_results():
    text = neuron_text(lambda *a: rope_hf(*a), Q, K, C, S)
    assert operations(text) == ["stablehlo.custom_call"]
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "rope_hf" and cfg["entry_point"] == "jax_nkilib_kernels.rope:rope_hf"
    assert cfg["input_names"] == ["q", "k", "cos", "sin"] and cfg["output_names"] == ["q_out", "k_out"]
    assert "-> (tensor<2x4x128x64xf32>, tensor<2x2x128x64xf32>)" in text


def test_rope_hf_reverse_mode_runs_the_backward_flag_kernel():
    loss = lambda q, k: jnp.sum(rope_hf(q, k, C, S)[0] * rope_hf(q, k, C, S)[1][:, :1])  # noqa: E731
    cfgs = kernel_configs(neuron_text(jax.grad(loss, argnums=(0, 1)), Q, K))
    assert [cfg["params"]["backward"] for cfg in cfgs].count(True) >= 1
    assert all(cfg["func_name"] == "rope_hf" for cfg in cfgs)


def test_idiomatic_rope_is_the_kernel_plus_transposes():
    x = random((2, 16, 4, 64))
    cos, sin = angles((16, 32))
    text = neuron_text(jax_nkilib.rope, x, cos, sin)
    assert operations(text).count("stablehlo.custom_call") == 1
    ops = compute_operations(text)
    assert set(ops) == {"stablehlo.transpose", "stablehlo.reshape"}
    assert ops.count("stablehlo.transpose") == 4  # x in, x out, cos, sin
    # the shared tables need no broadcast: the batch folds into the kernel's heads
    ((x_in, _), (cos_in, _), _) = kernel_configs(text)[0]["input_specs"]
    assert x_in == [64, 1, 2 * 4, 16] and cos_in == [32, 1, 16]


def test_idiomatic_rope_with_batched_tables_broadcasts_them():
    x = random((2, 16, 4, 64))
    cos, sin = angles((1, 16, 32))
    assert kernel_configs(neuron_text(jax_nkilib.rope, x, cos, sin))[0]["input_specs"][1][0] == [32, 1, 16]
    cos, sin = angles((2, 16, 32))
    text = neuron_text(jax_nkilib.rope, x, cos, sin)
    assert kernel_configs(text)[0]["input_specs"][0][0] == [64, 2, 4, 16]
    assert compute_operations(text).count("stablehlo.transpose") == 4


def test_idiomatic_rope_gradient_uses_the_kernel_for_dx():
    x = random((2, 16, 4, 64))
    cos, sin = angles((16, 32))
    text = neuron_text(jax.grad(lambda a: jnp.sum(jax_nkilib.rope(a, cos, sin) ** 2)), x)
    cfgs = kernel_configs(text)
    assert len(cfgs) == 2 and all(cfg["func_name"] == "RoPE" for cfg in cfgs)


def test_unsupported_head_size_falls_back_with_a_warning():
    x, (cos, sin) = random((96, 2, 4, 16)), angles((48, 2, 16))
    with pytest.warns(NeuronFallbackWarning, match="d_head must be 64 or 128, got 96"):
        text = neuron_text(RoPE, x, cos, sin)
    assert "AwsNeuronCustomNativeKernel" not in text


def test_unsupported_head_size_raises_under_error_policy():
    x, (cos, sin) = random((96, 2, 4, 16)), angles((48, 2, 16))
    with jax_nkilib.config(on_unsupported="error"):
        with pytest.raises(NeuronUnsupportedError, match="d_head must be 64 or 128, got 96"):
            neuron_text(RoPE, x, cos, sin)


def test_float64_falls_back():
    with pytest.warns(NeuronFallbackWarning, match="float64"):
        text = neuron_text(RoPE, X.astype(jnp.float64), COS, SIN)
    assert "AwsNeuronCustomNativeKernel" not in text


def test_rope_hf_sequence_limit_depends_on_lnc():
    with jax_nkilib.config(lnc=2):
        with pytest.warns(NeuronFallbackWarning, match="multiple of 128 \\* LNC = 256"):
            text = neuron_text(lambda *a: rope_hf(*a), Q, K, C, S)
        assert "AwsNeuronCustomNativeKernel" not in text


def test_explain_reports_kernels_and_fallbacks():
    x96, (c48, s48) = random((96, 2, 4, 16)), angles((48, 2, 16))
    report = jax_nkilib.explain(lambda a, b: (RoPE(a, COS, SIN), RoPE(b, c48, s48)), X, x96)
    assert [r.kernel for r in report] == ["RoPE", "RoPE"]
    assert report[0].runs_kernel and report[0].inputs[0] == ("x_in", (64, 2, 4, 16), "float32")
    assert report[1].neuron.startswith("fallback: d_head must be 64 or 128")
    assert "1 would run as NKI kernels" in str(report)
    with jax_nkilib.config(lnc=2, on_unsupported="error"):
        report = jax_nkilib.explain(lambda b: RoPE(b, c48, s48), x96)
        assert report[0].lnc == 2 and report[0].neuron.startswith("error:")


def test_missing_nki_says_how_to_install(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "nki", None)  # make `import nki` fail even where it is installed
    # Shapes no other test lowers: JAX would reuse an earlier lowering of the same call (by a stand-in SDK) without
    # importing nki (clearing JAX's caches instead costs this worker ~10 s of recompiling).
    x, cos = random((64, 3, 4, 16), seed=41), angles((32, 3, 16), seed=42)
    with jax_nkilib.neuron.dry_run(False):
        with pytest.raises(NeuronSdkMissingError, match="Neuron SDK.*pip repository.*dry_run"):
            neuron_text(RoPE, x, *cos)


def test_neuron_hlo_tool():
    text = jax_nkilib.neuron_hlo(RoPE, X, COS, SIN)
    assert "AwsNeuronCustomNativeKernel" in text and "func.func public @main" in text


@pytest.mark.parametrize("dtype, pieces", [(jnp.bfloat16, 4), (jnp.float32, 8)])
def test_realistic_rope_is_split_to_fit_sbuf(dtype, pieces):
    """batch 4, seq 2048, 32 heads, head_dim 128 exceeds one call's SBUF; it becomes equal kernel calls."""
    x = jax.ShapeDtypeStruct((4, 2048, 32, 128), dtype)
    cos = jax.ShapeDtypeStruct((2048, 64), dtype)
    text = neuron_text(jax_nkilib.rope, x, cos, cos)
    cfgs = kernel_configs(text)
    assert len(cfgs) == pieces
    assert all(cfg["input_specs"][0][0] == [128, 1, 4 * 32 // pieces, 2048] for cfg in cfgs)  # batch in heads
    assert set(compute_operations(text)) <= {
        "stablehlo.transpose",
        "stablehlo.reshape",
        "stablehlo.broadcast_in_dim",
        "stablehlo.slice",
        "stablehlo.concatenate",
    }
    (report,) = jax_nkilib.explain(jax_nkilib.rope, x, cos, cos)
    assert report.runs_kernel and f"split into {pieces} calls along n_heads" in report.neuron


def test_split_pieces_compute_the_same_values():
    """The split lowering, run on CPU through the reference, equals the unsplit call."""
    from jax_nkilib._src.framework.validation import check_call
    from jax_nkilib._src.neuron.lowering import _split_lowering
    from jax_nkilib._src.neuron.planning import plan_neuron_call

    x, (cos, sin) = random((64, 3, 8, 4000), jnp.bfloat16), angles((32, 3, 4000), jnp.bfloat16)
    params = dict(lnc_shard=False, contiguous_layout=True, relayout_in_sbuf=False, lnc=1)
    call = check_call(RoPE.spec, {"x_in": x, "cos": cos, "sin": sin}, params)
    plan = plan_neuron_call(RoPE.spec, call)
    assert plan.kind == "split" and plan.dim == "n_heads" and plan.pieces == 2
    split = _split_lowering(RoPE.spec, RoPE.primitive, plan, call, ("x_in", "cos", "sin"), params)
    (out,) = split(x, cos, sin)
    assert (out == RoPE(x, cos, sin)).all()
