"""examples/trainium_smoke.py cannot run here (no Trainium); every case lowers for Neuron, at LNC 1 and 2, through
NkiCompiler against the stand-in SDK (tests/support/nki_standin.py), with no kernel falling back.

The stand-in's output rules are the kernels' outputs as the catalog states them."""

import importlib.util
import pathlib
import sys

import jax
import numpy as np
import pytest

from tests.support import nki_standin
from tests.support.hlo import kernel_configs

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "trainium_smoke.py"
LIBRARY = (
    "nkilib.core.embeddings.rope:RoPE",
    "nkilib.core.rmsnorm.rmsnorm_quant:rmsnorm_quant_kernel",
    "nkilib.core.attention.attention_cte:attention_cte",
    "nkilib.core.attention.attention_bwd:attention_bwd",
    "nkilib.core.mlp.mlp:mlp",
    "nkilib.experimental.collectives.collectives:all_reduce_hbm_kernel",
)


def load():
    spec = importlib.util.spec_from_file_location("trainium_smoke", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through the module
    spec.loader.exec_module(module)
    return module


def attention_cte(q, tp_q=True, tp_out=False, cache_softmax=False, softmax_dtype="float32", **_):
    """q [B, Sq, d] (tp_q) or [B, d, Sq]; o [B, Sq, d] ([B, d, Sq] with tp_out), and with cache_softmax neg_max,
    recip [B, 128, Sq/128]."""
    batch, sq, d = q.shape if tp_q else (q.shape[0], q.shape[2], q.shape[1])
    out = np.empty((batch, d, sq) if tp_out else (batch, sq, d), q.dtype)
    if not cache_softmax:
        return out
    return out, np.empty((batch, 128, sq // 128), softmax_dtype), np.empty((batch, 128, sq // 128), softmax_dtype)


def rmsnorm_quant(hidden, residual=None, quantization_type="ROW", dtype_mode="NON_OCP", **_):
    """out [B, S, H + 4] FP8 for ROW (the fp32 scale in 4 trailing bytes), [B, S, H] for STATIC (+ residual_out)."""
    batch, seq, width = hidden.shape
    fp8 = "float8_e4m3fn" if getattr(dtype_mode, "name", dtype_mode) == "OCP" else "float8_e4m3"
    name = getattr(quantization_type, "name", quantization_type)
    out = np.empty((batch, seq, width + 4 if name == "ROW" else width), fp8)
    return out if residual is None else (out, np.empty(hidden.shape, hidden.dtype))


@pytest.fixture
def sdk(monkeypatch):
    standin = nki_standin.StandIn()
    library = {entry: nki_standin.library_function(entry) for entry in LIBRARY}
    library["nkilib.core.rmsnorm.rmsnorm_quant:RmsNormQuantKernelArgs"] = nki_standin.library_class(
        "nkilib.core.rmsnorm.rmsnorm_quant:RmsNormQuantKernelArgs"
    )
    nki_standin.install(monkeypatch, standin, library)
    like = lambda value, **_: np.empty(value.shape, value.dtype)  # noqa: E731
    standin.rule("RoPE", lambda x_in, **_: like(x_in))
    standin.rule("rmsnorm_quant_kernel", rmsnorm_quant)
    standin.rule("attention_cte", attention_cte)
    standin.rule(
        "attention_bwd",
        lambda q_ref, k_ref, v_ref, sinks_ref=None, **_: (
            (like(q_ref), like(k_ref), like(v_ref)) + ((like(sinks_ref),) if sinks_ref is not None else ())
        ),
    )
    standin.rule("mlp", lambda hidden_tensor, **_: [like(hidden_tensor)])
    standin.rule("all_reduce_hbm_kernel", lambda input, **_: like(input))
    return standin


@pytest.mark.parametrize("lnc", [1, 2])
def test_every_case_lowers_to_nki_kernels(sdk, lnc):
    smoke = load()
    kernels = []
    for case in smoke.CASES:
        sdk.compilations.clear()
        _, _, lowered, calls = smoke.lower(case, jax.devices()[:4], lnc)
        configs = kernel_configs(lowered.as_text())
        assert calls and all(report.runs_kernel for report in calls), case.name
        assert len(configs) == len(calls) == len(sdk.compilations), case.name
        assert all(cfg["kernel_format"] == "bir" and cfg["grid"] == lnc for cfg in configs), case.name
        kernels.append([cfg["func_name"] for cfg in configs])
    assert kernels == [
        ["RoPE"],
        ["rmsnorm_quant_kernel"],
        ["attention_cte", "attention_bwd"],
        ["mlp"],
        ["all_reduce_hbm_kernel"],
    ]


def test_without_a_neuron_device_it_says_so(capsys):
    assert load().main(["--lnc", "1"]) == 2
    assert "no Neuron device here" in capsys.readouterr().out
