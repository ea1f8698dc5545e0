"""The routing adapters (jax_nkilib_kernels/routing.py) as NkiCompiler drives them, against the stand-in of the
Neuron SDK (tests/support/nki_standin.py): what each adapter receives (plain values: enum names, a config as the
tuple of its fields) and the outputs it declares. The stand-in cannot trace the kernels' bodies."""

import jax.numpy as jnp
import numpy as np
import pytest

from jax_nkilib.nki import GpsimdTopkConfig, RotationalTopkConfig, gpsimd_topk, rotational_topk, router_topk
from tests.support import nki_standin
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text

LIBRARY = (
    "nkilib.core.router_topk.router_topk:router_topk",
    "nkilib.core.topk.rotational_topk:rotational_topk",
    "nkilib.core.topk.rotational_topk:prepare_rotational_constants",
    "nkilib.core.topk.rotational_topk_utils:create_topk_config",
    "nkilib.core.topk.rotational_topk_utils:create_rotational_topk_config",
    "nkilib.experimental.topk.gpsimd_topk:gpsimd_topk",
    "nkilib.experimental.topk.gpsimd_topk:create_gpsimd_topk_config",
)


@pytest.fixture
def sdk(monkeypatch):
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {entry: nki_standin.library_function(entry) for entry in LIBRARY})
    return standin


def test_top_k_adapters_get_their_config_as_a_tuple(sdk):
    seen = []

    def outputs(inp, config=None):
        seen.append(config)
        k = config[0]
        return np.empty((inp.shape[0], k), inp.dtype), np.empty((inp.shape[0], k), np.uint32)

    sdk.rule("rotational_topk", outputs)
    sdk.rule("gpsimd_topk", outputs)
    x = random((16, 300), jnp.bfloat16)
    rotational = neuron_text(lambda x: rotational_topk(x, config=RotationalTopkConfig(5, sorted=False)), x)
    gpsimd = neuron_text(lambda x: gpsimd_topk(x, config=GpsimdTopkConfig(k=7)), x)
    assert seen == [(5, False), (7, True)]
    for text in (rotational, gpsimd):
        (config,) = kernel_configs(text)
        assert config["kernel_format"] == "bir"


def test_router_topk_adapter_gets_enum_names_and_declares_its_outputs(sdk):
    seen = {}

    def outputs(x, w, w_bias=None, act_fn=None, k=None, x_hbm_layout=None, return_eager_affi=False, **flags):
        seen.update(act_fn=act_fn, k=k, x_hbm_layout=x_hbm_layout, bias=w_bias is not None, **flags)
        tokens, experts = x.shape[x_hbm_layout == 0], w.shape[1]
        outs = [np.empty((tokens, experts), x.dtype), np.empty((tokens, k), np.uint32)]
        outs.append(np.empty((tokens, experts), x.dtype))
        return outs + ([np.empty((tokens, k), np.float32)] if return_eager_affi else [])

    sdk.rule("router_topk", outputs)
    x, w, b = random((256, 32), jnp.bfloat16), random((256, 16), jnp.bfloat16, 1), random((16,), jnp.bfloat16, 2)
    flags = dict(act_fn="SIGMOID", k=4, x_hbm_layout=0, x_sb_layout=0, router_pre_norm=False)
    text = neuron_text(
        lambda x, w, b: router_topk(x, w, b, use_indirect_dma_scatter=True, return_eager_affi=True, **flags), x, w, b
    )
    (config,) = kernel_configs(text)
    assert config["func_name"] == "router_topk"
    assert seen["act_fn"] == "SIGMOID" and seen["k"] == 4 and seen["x_hbm_layout"] == 0 and seen["bias"]
    assert seen["use_indirect_dma_scatter"] is True and seen["router_pre_norm"] is False
