"""examples/llama_generate.py and examples/llama_train.py at tiny sizes."""

import importlib.util
import pathlib

import numpy as np
import pytest

from tests.support.numerics import tolerance

pytest.importorskip("optax")
from jax_nkilib.models import llama  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
DECODE_KERNELS = ["qkv", "attention_tkg", "output_projection_tkg", "mlp"]


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_llama_generate_decodes_and_explains_one_step_as_kernels(capsys):
    config = llama.LlamaConfig(vocab=128, hidden=128, layers=1, heads=4, kv_heads=2, intermediate=128, max_len=128)
    result = load("llama_generate").main(batch=2, prompt_len=4, steps=6, config=config)
    assert result["greedy"].shape == result["sampled"].shape == (2, 6)
    assert result["tokens_per_second"] > 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed
    # one decode step: per layer qkv (norm + rope fused), decode attention, output projection, MLP; the final norm
    calls = [report.kernel for report in result["explanation"]]
    assert calls == DECODE_KERNELS + ["rmsnorm_tkg"], calls
    assert "5 jax_nkilib kernel call(s); 5 would run as NKI kernels on Neuron" in printed
    # tensor-parallel over the 2 kv heads: each device's attention half is one fused attention_block_tkg
    calls = [report.kernel for report in result["tensor_parallel_explanation"]]
    assert calls == ["attention_block_tkg", "mlp", "rmsnorm_tkg"], calls
    assert "tensor-parallel over 2 devices (one kv head each)" in printed


def test_llama_train_on_a_2x4_mesh_matches_one_device(capsys):
    config = llama.LlamaConfig(vocab=128, hidden=128, layers=1, heads=4, kv_heads=4, intermediate=128, max_len=32)
    result = load("llama_train").main(steps=2, config=config)
    assert result["losses"][1] < result["losses"][0]
    np.testing.assert_allclose(result["losses"], result["one_device_losses"], rtol=1e-5)
    # sums over the 4 tensor-parallel shards add in another order than on one device
    assert result["difference"] <= tolerance("float32", reduction=128, ops=64)
    assert tuple(result["layout"])[:2] == (None, "model")  # w_qkv split over its kv heads
    assert "losses, 2x4 mesh:" in capsys.readouterr().out
