"""Lowering attention for Neuron (dry run): the forward and its VJP are the two NKI kernels and nothing quadratic."""

import re

import jax
import jax.numpy as jnp
import pytest

import jax_nkilib
from jax_nkilib._src.neuron import lowering as neuron_lowering
from jax_nkilib.neuron import NeuronFallbackWarning
from jax_nkilib.nki import attention_bwd, attention_cte
from tests.support.data import random
from tests.support.hlo import kernel_configs, neuron_text

S = 256
Q, K, V = random((4, S, 64)), random((2, 64, S)), random((2, S, 64))


@pytest.fixture(autouse=True)
def dry_run():
    with jax_nkilib.neuron.dry_run():
        yield


def no_square_tensor(text: str, seq: int) -> bool:
    return not re.search(rf"tensor<[0-9x]*{seq}x{seq}x?[0-9x]*(f32|bf16|f16)>", text)


def test_forward_is_one_kernel_call():
    text = neuron_text(lambda q, k, v: attention_cte(q, k, v, scale=0.125), Q, K, V)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "attention_cte" and cfg["params"]["scale"] == 0.125
    assert cfg["params"]["softmax_dtype"] == "float32" and cfg["params"]["global_cp_deg"] is None
    assert cfg["input_names"] == ["q", "k", "v"] and cfg["output_names"] == ["o"]


def test_forward_and_vjp_are_exactly_two_kernel_calls():
    def forward_and_vjp(q, k, v, dy):
        out, vjp = jax.vjp(lambda a, b, c: attention_cte(a, b, c, scale=0.125), q, k, v)
        return out, vjp(dy)

    text = neuron_text(forward_and_vjp, Q, K, V, random((4, S, 64), seed=3))
    cfgs = kernel_configs(text)
    assert [cfg["func_name"] for cfg in cfgs] == ["attention_cte", "attention_bwd"]
    assert cfgs[0]["params"]["cache_softmax"] is True and cfgs[0]["output_names"] == ["o", "neg_max", "recip"]
    assert cfgs[1]["params"] == {
        "use_causal_mask": True,
        "mixed_precision": True,
        "softmax_scale": 0.125,
        "sliding_window": None,
    }
    assert cfgs[1]["input_specs"][0] == [[1, 4, 64, S], "float32"] and cfgs[1]["input_specs"][5][0] == [1, 4, 128, 2]
    assert no_square_tensor(text, S)


def test_idiomatic_attention_training_step_uses_both_kernels():
    q, k, v = random((2, S, 4, 64)), random((2, S, 2, 64)), random((2, S, 2, 64))
    sinks = random((4,), seed=5)
    loss = lambda *a: jnp.sum(jax_nkilib.attention(*a[:3], sinks=a[3], causal=True) ** 2)  # noqa: E731
    text = neuron_text(jax.grad(loss, argnums=(0, 1, 2, 3)), q, k, v, sinks)
    assert [cfg["func_name"] for cfg in kernel_configs(text)] == ["attention_cte", "attention_bwd"]
    assert no_square_tensor(text, S)


def test_prefix_caching_backward_is_jax_not_the_bwd_kernel():
    kp, vp = random((2, 64, 32)), random((2, 32, 64))
    used = jnp.array([16], jnp.int32)
    fn = jax.grad(lambda q: jnp.sum(attention_cte(q, K, V, kp, vp, used) ** 2))
    cfgs = kernel_configs(neuron_text(fn, Q))
    assert [cfg["func_name"] for cfg in cfgs] == ["attention_cte"]


def test_head_dim_above_128_falls_back(monkeypatch):
    monkeypatch.setattr(neuron_lowering, "_warned", set())  # the warning is once per call site and reasons
    q, k, v = random((2, 128, 192)), random((2, 192, 128)), random((2, 128, 192))
    with pytest.warns(NeuronFallbackWarning, match="head dim d=192 exceeds 128"):
        text = neuron_text(lambda *a: attention_cte(*a), q, k, v)
    assert "AwsNeuronCustomNativeKernel" not in text


def test_attention_bwd_key_tile_limit():
    q, k = random((1, 2, 64, 128)), random((1, 2, 64, 640))
    lse = random((1, 2, 128, 1))
    with pytest.warns(NeuronFallbackWarning, match="Sk=640 must be a multiple of 512"):
        text = neuron_text(lambda *a: attention_bwd(*a), q, k, k, q, q, lse)
    assert "AwsNeuronCustomNativeKernel" not in text
