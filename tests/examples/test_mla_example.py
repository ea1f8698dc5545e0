"""examples/mla_prefill.py: the MLA layer's prefill (dense and top-k sparse) matches the float64 oracle of DeepSeek
MLA, and its dense Neuron lowering is the norm, rotation and attention_cte kernels."""

import importlib.util
import pathlib

import numpy as np

from tests.mla import oracle
from tests.support.hlo import kernel_configs
from tests.support.numerics import assert_close, f64

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "mla_prefill.py"


def test_mla_example_matches_the_oracle_and_lowers_to_the_kernels(capsys):
    spec = importlib.util.spec_from_file_location("mla_prefill_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main()
    p, x, cos, sin = result["params"], f64(result["x"]), f64(result["cos"]), f64(result["sin"])
    h = oracle.rms_norm(x, f64(p["norm"]))
    weights = [f64(w) for w in module.attention_weights(p)]
    dense = x + oracle.mla(h, *weights, cos, sin)
    sparse = x + oracle.mla(h, *weights, cos, sin, indexer=tuple(map(f64, p["indexer"])), topk=module.TOPK)
    assert_close(result["dense"], dense, np.float32, reduction=module.MODEL, ops=16)
    assert_close(result["sparse"], sparse, np.float32, reduction=module.MODEL, ops=16)
    kernels = [config["func_name"] for config in kernel_configs(result["neuron_hlo"])]
    assert kernels == ["rmsnorm_tkg", "rmsnorm_tkg", "RoPE", "rmsnorm_tkg", "RoPE", "attention_cte"]
    assert "6 would run as NKI kernels" in capsys.readouterr().out
