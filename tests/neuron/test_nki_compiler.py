"""NkiCompiler against a stand-in of the Neuron SDK's real framework-integration API (tests/support/nki_standin.py).

The stand-in mirrors NKI's own classes (frozen dataclasses, ``compile_kernel_to_nir`` returning a ``NirResult``,
``backend_config_b64`` as bytes, arguments bound by the kernel's signature) and the NKI Library's recorded
signatures, so these tests check how jax_nkilib drives the real API. They cannot check the real compiler.
"""

import base64
import dataclasses
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib.neuron import NeuronFallbackWarning, NeuronOutputMismatchError, NeuronUnsupportedError, NkiApiError
from jax_nkilib.nki import ActFnType, RoPE, all_reduce_hbm_kernel, attention_cte, mlp, qkv
from tests.support import nki_standin
from tests.support.data import angles, random
from tests.support.hlo import kernel_configs, neuron_text, operations
from tests.support.sharding import mesh_1d, shard

X = random((64, 2, 4, 16))
COS, SIN = angles((32, 2, 16))
ROPE = "nkilib.core.embeddings.rope:RoPE"
MLP = "nkilib.core.mlp.mlp:mlp"
QKV = "nkilib.core.qkv.qkv:qkv"
ATTENTION_CTE = "nkilib.core.attention.attention_cte:attention_cte"
ALL_REDUCE = "nkilib.experimental.collectives.collectives:all_reduce_hbm_kernel"


def like(array, dtype=None, shape=None):
    return np.empty(array.shape if shape is None else shape, array.dtype if dtype is None else dtype)


def mlp_outputs(hidden_tensor, store_fused_add_result=False, output_dtype=None, **_):
    """mlp returns a list: [out [B, S, H]] (+ [hidden + fused_add] with store_fused_add_result)."""
    dtype = hidden_tensor.dtype if output_dtype is None else output_dtype
    return [like(hidden_tensor, dtype)] + ([like(hidden_tensor, dtype)] if store_fused_add_result else [])


@pytest.fixture
def sdk(monkeypatch):
    """The stand-in SDK with RoPE, mlp, qkv, attention_cte and all_reduce_hbm_kernel in its library."""
    standin = nki_standin.StandIn()
    library = {entry: nki_standin.library_function(entry) for entry in (ROPE, MLP, QKV, ATTENTION_CTE, ALL_REDUCE)}
    nki_standin.install(monkeypatch, standin, library)
    standin.rule("RoPE", lambda x_in, **_: like(x_in))
    standin.rule("mlp", mlp_outputs)
    standin.rule("all_reduce_hbm_kernel", lambda input, **_: like(input))
    return standin


def decoded(text):
    (cfg,) = kernel_configs(text)
    return cfg


def test_rope_compiles_to_nkis_own_config(sdk):
    with jax_nkilib.config(lnc=2, target="trn1"):
        text = neuron_text(RoPE, X, COS, SIN)
    assert operations(text) == ["stablehlo.custom_call"]
    cfg = decoded(text)  # NKI's build_config, bytes base64 decoded: not a dict jax_nkilib wrote
    assert cfg["func_name"] == "RoPE" and cfg["kernel_format"] == "bir" and cfg["grid"] == 2
    assert cfg["platform_target"] == "gen2" and cfg["klir_binary"]["input_names"] == ["x_in", "cos", "sin"]
    (compilation,) = sdk.compilations
    kernel, inputs, options = compilation["kernel"], compilation["inputs"], compilation["options"]
    library_rope = sys.modules["nkilib.core.embeddings.rope"].RoPE
    assert isinstance(library_rope, nki_standin.Kernel)  # the library's @nki.jit object...
    assert kernel.func is library_rope.func  # ...whose raw function CompileKernel is built around
    assert (kernel.lnc, kernel.target) == (2, "trn1") and kernel.artifacts_dir == options.artifacts_dir
    assert options.target == "trn1" and options.lnc == 2  # the options CompileKernel itself compiles with
    assert list(inputs) == ["x_in", "cos", "sin", "lnc_shard", "contiguous_layout", "relayout_in_sbuf"]
    for name, value in zip(("x_in", "cos", "sin"), (X, COS, SIN)):
        assert type(inputs[name]) is np.ndarray and inputs[name].shape == value.shape
        assert inputs[name].dtype == value.dtype
    assert inputs["lnc_shard"] is True  # follows the LNC degree


def test_idiomatic_rope_reaches_the_same_kernel(sdk):
    x = random((2, 32, 4, 64), jnp.bfloat16)
    cos, sin = angles((2, 32, 32), jnp.bfloat16)
    text = neuron_text(lambda *a: jax_nkilib.rope(*a), x, cos, sin)
    assert decoded(text)["func_name"] == "RoPE"
    (compilation,) = sdk.compilations
    assert compilation["inputs"]["x_in"].dtype == np.dtype(jnp.bfloat16)  # ml_dtypes bfloat16, as nkipy passes it
    assert compilation["inputs"]["x_in"].shape == (64, 2, 4, 32)  # the kernel layout [d, B, n_heads, S]


def mlp_case(**flags):
    hidden = random((1, 4, 128))
    gate, up, down = random((128, 256), seed=1), random((128, 256), seed=2), random((256, 128), seed=3)
    fn = lambda h, g, u, d, r: mlp(h, g, u, d, fused_add_tensor=r, **flags)  # noqa: E731
    return fn, (hidden, gate, up, down, random((1, 4, 128), seed=4))


def test_mlp_is_a_tuple_shaped_call_in_signature_order(sdk):
    fn, args = mlp_case(activation_fn=ActFnType.GELU)
    text = neuron_text(fn, *args)
    cfg = decoded(text)
    assert cfg["func_name"] == "mlp"
    assert "-> tuple<tensor<1x4x128xf32>>" in text and "stablehlo.get_tuple_element" in text  # a list return
    (compilation,) = sdk.compilations
    inputs = compilation["inputs"]
    tensors = [name for name, value in inputs.items() if isinstance(value, np.ndarray)]
    assert tensors == [
        "hidden_tensor",
        "gate_proj_weights_tensor",
        "up_proj_weights_tensor",
        "down_proj_weights_tensor",
        "fused_add_tensor",
    ]
    assert "mx_weight_dtype" not in inputs  # jax_nkilib's own parameter never reaches the kernel
    library_act = nki_standin.ENUMS["ActFnType"]
    assert inputs["activation_fn"] is library_act.GELU  # the library's own member, not jax_nkilib's copy
    assert inputs["quantization_type"] is nki_standin.ENUMS["QuantizationType"].NONE


def test_mlp_two_outputs_keep_their_order(sdk):
    fn, args = mlp_case(store_fused_add_result=True)
    text = neuron_text(fn, *args)
    assert "-> tuple<tensor<1x4x128xf32>, tensor<1x4x128xf32>>" in text


def test_operands_follow_the_kernels_signature_not_the_specs(sdk):
    """qkv with the KV-cache write: the kernel takes k_cache, v_cache, k_scale, v_scale after bias...sin_cache."""
    sdk.rule(
        "qkv",
        lambda input, k_cache, v_cache, d_head=None, num_q_heads=None, **_: [
            np.empty((input.shape[0], input.shape[1], num_q_heads * d_head), input.dtype),
            k_cache,
            v_cache,
        ],
    )
    x, w = random((1, 128, 128)), random((128, 6 * 16), seed=1)
    k_cache, v_cache = random((1, 256, 16), seed=2), random((1, 256, 16), seed=3)
    scale = jnp.ones((128, 1), jnp.float32)
    gamma = random((1, 128), seed=4)
    fn = lambda *a: qkv(
        a[0],
        a[1],
        gamma_norm_weights=a[2],
        k_cache=a[3],
        v_cache=a[4],
        k_scale=a[5],  # noqa: E731
        v_scale=a[6],
        fused_norm_type="RMS_NORM",
        num_q_heads=4,
        num_kv_heads=1,
        d_head=16,
    )
    text = neuron_text(fn, x, w, gamma, k_cache, v_cache, scale, scale)
    (compilation,) = sdk.compilations
    tensors = [name for name, value in compilation["inputs"].items() if isinstance(value, np.ndarray)]
    assert tensors == ["input", "fused_qkv_weights", "gamma_norm_weights", "k_cache", "v_cache", "k_scale", "v_scale"]
    call = next(line for line in text.splitlines() if "AwsNeuronCustomNativeKernel" in line)
    assert (
        "(tensor<1x128x128xf32>, tensor<128x96xf32>, tensor<1x128xf32>, tensor<1x256x16xf32>, "
        "tensor<1x256x16xf32>, tensor<128x1xf32>, tensor<128x1xf32>)" in call
    )
    # the returned caches alias their inputs (positions 3 and 4 in the kernel's order): in place
    assert (
        "output_tuple_indices = [1], operand_index = 3" in text
        and "output_tuple_indices = [2], operand_index = 4" in text
    )


def test_packed_words_reach_the_kernel_as_nki_x4_tensors(sdk):
    """MX weights are uint32 words in JAX and float8_e4m3fn_x4 tensors for the kernel (NkiTensor in shared HBM)."""
    sdk.rule("qkv", lambda input, fused_qkv_weights, **_: like(input, shape=(1, 128, 96)))
    x = random((1, 128, 512))
    words = jnp.zeros((128, 96), jnp.uint32)
    scales = jnp.full((16, 96), 127, jnp.uint8)
    text = neuron_text(
        lambda a, b, c: qkv(
            a,
            b,
            qkv_w_scale=c,
            quantization_type="MX",
            weight_layout="MX_CONTIGUOUS",
            num_q_heads=4,
            num_kv_heads=1,
            d_head=16,
        ),
        x,
        words,
        scales,
    )
    assert decoded(text)["func_name"] == "qkv"
    weights = sdk.compilations[0]["inputs"]["fused_qkv_weights"]
    assert isinstance(weights, nki_standin.NkiTensor) and weights.dtype == "float8_e4m3fn_x4"
    assert weights.shape == (128, 96) and weights.buffer == "shared_hbm"


def test_packed_outputs_match_their_word_dtype(sdk):
    """NKI reports x4 outputs by their packed dtype name; jax_nkilib holds them as the unsigned word of that size."""
    from jax_nkilib._src.neuron.compiled import jax_dtype_name, mismatched_outputs

    assert [jax_dtype_name(n) for n in ("float8_e4m3fn_x4", "float8_e5m2_x4", "float4_e2m1fn_x4")] == [
        "uint32",
        "uint32",
        "uint16",
    ]
    aval = jax.core.ShapedArray((4, 8), jnp.uint32)
    assert mismatched_outputs([((4, 8), "float8_e4m3fn_x4")], [aval]) == []
    assert mismatched_outputs([((4, 8), "float4_e2m1fn_x4")], [aval]) != []
    e4m3 = jax.core.ShapedArray((2,), jnp.float8_e4m3fn)
    assert mismatched_outputs([((2,), "float8_e4m3")], [e4m3]) == []  # Trainium's E4M3 name for the same bytes


def test_replica_groups_and_collectives(sdk):
    mesh = mesh_1d("x", 4)
    fn = jax.shard_map(
        lambda v: all_reduce_hbm_kernel(v, replica_group="x"), mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    text = neuron_text(fn, shard(mesh, (P("x"),), random((8, 16))))
    assert decoded(text)["has_collectives"] is True and 'has_collectives = "1"' in text
    group = sdk.compilations[0]["inputs"]["replica_group"]
    assert isinstance(group, nki_standin.ReplicaGroup) and group._value == [[0, 1, 2, 3]]


def test_dtype_params_are_nki_language_dtypes(sdk):
    q, k, v = random((2, 128, 64)), random((2, 64, 128), seed=1), random((2, 128, 64), seed=2)
    sdk.rule("attention_cte", lambda q, **_: like(q))
    neuron_text(lambda *a: attention_cte(*a, softmax_dtype=jnp.float32), q, k, v)
    inputs = sdk.compilations[0]["inputs"]
    assert inputs["softmax_dtype"] == "float32"  # nki.language.float32 (a dtype name in NKI >= 0.4)
    assert all(not isinstance(value, (jax.Array, jax.ShapeDtypeStruct)) for value in inputs.values())


def test_output_mismatch_is_an_error(sdk):
    sdk.rule("RoPE", lambda x_in, **_: np.empty((1,), np.float32))
    with pytest.raises(NeuronOutputMismatchError, match=r"output 0 is \(1,\) float32 where abstract evaluation"):
        neuron_text(RoPE, X, COS, SIN)


def test_a_changed_signature_is_named(sdk, monkeypatch):
    """A library whose RoPE lost a parameter jax_nkilib passes: the error names the parameter and the versions."""

    def old_rope(x_in, cos, sin, lnc_shard=False):
        raise AssertionError

    monkeypatch.setattr(sys.modules["nkilib.core.embeddings.rope"], "RoPE", nki_standin.jit(old_rope))
    with pytest.raises(NkiApiError, match=r"takes no parameter `contiguous_layout`, `relayout_in_sbuf`.*0.4.0"):
        neuron_text(RoPE, X, COS, SIN)


def test_missing_framework_api_is_named(sdk, monkeypatch):
    monkeypatch.delattr(sys.modules["nki.framework.compiled"], "CompileKernel")
    with pytest.raises(NkiApiError, match="nki.framework.compiled.CompileKernel"):
        neuron_text(RoPE, X, COS, SIN)


def test_a_kernel_the_installed_library_lacks_falls_back(sdk, monkeypatch):
    monkeypatch.delattr(sys.modules["nkilib.core.embeddings.rope"], "RoPE")
    with pytest.warns(
        NeuronFallbackWarning,
        match=r"installed NKI Library has no nkilib.core.embeddings.rope:RoPE.*"
        r"installed: nki 0.4.0",
    ):
        text = neuron_text(RoPE, X, COS, SIN)
    assert kernel_configs(text) == [] and sdk.compilations == []
    with jax_nkilib.config(on_unsupported="error"), pytest.raises(NeuronUnsupportedError, match="has no"):
        neuron_text(RoPE, X, COS, SIN)


def test_standin_mirrors_the_real_api():
    """The stand-in behaves as NKI's source: a frozen Kernel as CompileKernel's func fails, unknown arguments fail,
    compile returns (FrameworkConfig, cache key) with bytes."""
    standin = nki_standin.StandIn()
    compile_kernel = standin.compile_kernel_class()

    def kernel(a, b=1):
        raise AssertionError

    standin.rule("kernel", lambda a, b=1: a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        compile_kernel(nki_standin.jit(kernel))
    compiled = compile_kernel(kernel, lnc=2, target="trn2")
    with pytest.raises(TypeError):
        compiled.compile(np.zeros(3), c=2)
    with pytest.raises(TypeError):
        compiled.compile(b=2)
    config, key = compiled.compile(np.zeros(3, np.float32))
    assert isinstance(config.backend_config_b64, bytes) and isinstance(key, str)
    assert json.loads(base64.b64decode(config.backend_config_b64))["grid"] == 2
    assert config.operand_output_aliases == {0: 0}  # the rule returns its input: in place
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.has_collectives = True
    with pytest.raises(ValueError, match="Invalid target"):
        nki_standin.CompileOptions(target="tpu")


def test_an_adapter_whose_library_function_is_missing_falls_back(sdk):
    """rope_hf's adapter calls nkilib.core.embeddings.rope_hf, absent from this stand-in library: the adapter module
    still loads, and the call falls back naming the missing function."""
    from jax_nkilib.nki import rope_hf

    q, k = random((2, 4, 128, 64)), random((2, 2, 128, 64), seed=1)
    cos, sin = angles((128, 64))
    with pytest.warns(
        NeuronFallbackWarning,
        match=r"lacks nkilib.core.embeddings.rope_hf.rope_hf, which "
        r"jax_nkilib_kernels.rope:rope_hf calls",
    ):
        text = neuron_text(lambda *a: rope_hf(*a), q, k, cos, sin)
    assert kernel_configs(text) == []


def test_optional_library_names_do_not_disable_an_adapter(sdk, monkeypatch):
    """rmsnorm_quant's adapter needs DtypeMode only for OCP/AUTO modes (a 2.32 enum): its absence is not missing."""
    import jax_nkilib_kernels.norm as norm
    from jax_nkilib_kernels._library import MissingLibraryFunction, missing_dependencies

    assert isinstance(norm.DtypeMode, MissingLibraryFunction) or norm.DtypeMode is nki_standin.ENUMS["DtypeMode"]
    monkeypatch.setattr(
        norm, "DtypeMode", MissingLibraryFunction("nkilib.core.utils.common_types.DtypeMode", "absent", optional=True)
    )
    monkeypatch.setattr(
        norm,
        "RmsNormQuantKernelArgs",
        nki_standin.library_class("nkilib.core.rmsnorm.rmsnorm_quant:RmsNormQuantKernelArgs"),
    )
    monkeypatch.setattr(norm, "_rmsnorm_quant_body", lambda *a, **k: None)
    assert missing_dependencies(norm.rmsnorm_quant_kernel) == []
    monkeypatch.setattr(norm, "NormType", MissingLibraryFunction("nkilib.core.utils.common_types.NormType", "absent"))
    assert missing_dependencies(norm.rmsnorm_quant_kernel) == ["nkilib.core.utils.common_types.NormType"]
