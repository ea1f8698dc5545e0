"""The README's main example runs, trains, and explains its kernel calls; its Neuron forward is kernels plus glue."""

import collections
import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

import jax_nkilib
from tests.support.hlo import kernel_configs, operations

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"
KERNELS = ["rmsnorm_tkg", "qkv", "RoPE", "RoPE", "attention_cte", "output_projection_cte", "rmsnorm_tkg", "mlp"]


def load():
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quickstart_trains_and_explains(capsys):
    losses = load().main()
    assert losses[-1] < losses[0]
    printed = capsys.readouterr().out
    assert "8 jax_nkilib kernel call(s); 8 would run as NKI kernels on Neuron" in printed
    assert all(f"{name}(" in printed for name in KERNELS)


def test_block_forward_on_neuron_is_one_kernel_per_op_plus_layout_glue():
    qs = load()
    params = qs.init_params(jax.random.key(0))
    x = jnp.zeros((qs.BATCH, qs.SEQ, qs.MODEL), jnp.float32)
    with jax_nkilib.neuron.dry_run():
        text = (
            jax.jit(qs.transformer_block)
            .trace(params, x, *qs.rotary_tables(qs.SEQ, qs.HEAD_DIM))
            .lower(lowering_platforms=("neuron",))
            .as_text()
        )
    assert [cfg["func_name"] for cfg in kernel_configs(text)] == KERNELS
    glue = collections.Counter(op for op in operations(text) if op != "stablehlo.custom_call")
    # the two residual adds; layout changes (transposes, reshapes), the q/k/v split and the RoPE table broadcasts
    assert glue["stablehlo.add"] == 2
    assert set(glue) <= {
        "stablehlo.add",
        "stablehlo.transpose",
        "stablehlo.reshape",
        "stablehlo.slice",
        "stablehlo.broadcast_in_dim",
    }


def test_training_step_on_neuron_runs_the_loss_and_optimizer_kernels():
    """The train step's Neuron census: the forward's kernels, then cross_entropy_forward/backward for the loss,
    attention_bwd and RoPE's backward for the gradient, and one fused adamw_kernel per parameter (7)."""
    qs = load()
    params = qs.init_params(jax.random.key(0))
    x, labels = jnp.zeros((qs.BATCH, qs.SEQ, qs.MODEL), jnp.float32), jnp.zeros((qs.BATCH, qs.SEQ), jnp.int32)
    args = (params, qs.OPTIMIZER.init(params), x, labels, *qs.rotary_tables(qs.SEQ, qs.HEAD_DIM))
    census = jax_nkilib.neuron.op_census(qs.train_step, *args)
    assert census.kernels == (
        *KERNELS,
        "cross_entropy_forward",
        "cross_entropy_backward",
        "attention_bwd",
        "RoPE",
        "RoPE",
        *["adamw_kernel"] * len(params),
    )


def test_block_exports_for_several_platforms():
    """jax.export of the block for CPU and CUDA runs here; for CPU and Neuron (dry run) it keeps the kernel calls,
    with jax_nkilib.neuron.EXPORT_DISABLED_CHECKS allowing them."""
    qs = load()
    params = qs.init_params(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (qs.BATCH, qs.SEQ, qs.MODEL), jnp.float32)
    args = (params, x, *qs.rotary_tables(qs.SEQ, qs.HEAD_DIM))
    block = jax.jit(qs.transformer_block)
    exported = export.export(block, platforms=["cpu", "cuda"])(*args)
    assert exported.platforms == ("cpu", "cuda")
    np.testing.assert_array_equal(exported.call(*args), block(*args))
    with jax_nkilib.neuron.dry_run():
        exported = export.export(
            block, platforms=["cpu", "neuron"], disabled_checks=jax_nkilib.neuron.EXPORT_DISABLED_CHECKS
        )(*args)
    assert exported.platforms == ("cpu", "neuron")
    assert [cfg["func_name"] for cfg in kernel_configs(exported.mlir_module())] == KERNELS
    np.testing.assert_array_equal(exported.call(*args), block(*args))  # here, the CPU lowering of the export
