"""NkiCompiler against a stand-in for the `nki` framework-integration API (the real SDK is not installable here).

The stand-in implements the documented interface (`CompileKernel(func, lnc=, target=).build_config(...)` returning
an object with `backend_config_b64`, `output_specs`, `operand_output_aliases`, `has_collectives`), so these tests
check how jax_nkilib drives it and emits its result; they cannot check the real SDK.
"""

import base64
import json
import sys
import types

import jax
import numpy as np
import pytest

import jax_nkilib
from jax_nkilib._src.neuron.compilers import device_dtypes, kernel_arguments, library_enum, replica_group_arguments
from jax_nkilib.neuron import NeuronOutputMismatchError, NkiApiError
from jax_nkilib.nki import RoPE
from tests.support.data import angles, random
from tests.support.hlo import kernel_configs, neuron_text

X = random((64, 2, 4, 16))
COS, SIN = angles((32, 2, 16))


def library_rope(x_in, cos, sin, lnc_shard=False, contiguous_layout=True, relayout_in_sbuf=False):
    raise AssertionError("the kernel body is compiled by nki, never called by jax_nkilib")


class FakeCompileKernel:
    calls = []

    def __init__(self, func, lnc, target):
        self.func, self.lnc, self.target = func, lnc, target

    def build_config(self, *arg_specs, **kwargs):
        FakeCompileKernel.calls.append((self.func, self.lnc, self.target, arg_specs, kwargs))
        cfg = {"func_name": self.func.__name__, "kernel_format": "bir", "grid": self.lnc, "has_collectives": True,
               "mac_count": 7}
        return types.SimpleNamespace(
            backend_config_b64=base64.b64encode(json.dumps(cfg).encode()).decode(),
            output_specs=[jax.ShapeDtypeStruct(arg_specs[0].shape, arg_specs[0].dtype)],
            operand_output_aliases={0: 0},
            has_collectives=True,
        )


@pytest.fixture
def fake_sdk(monkeypatch):
    nki = types.ModuleType("nki")
    framework = types.ModuleType("nki.framework")
    compiled = types.ModuleType("nki.framework.compiled")
    compiled.CompileKernel = FakeCompileKernel
    nki.framework, framework.compiled = framework, compiled
    modules = {"nki": nki, "nki.framework": framework, "nki.framework.compiled": compiled}
    for name in ("nkilib", "nkilib.core", "nkilib.core.embeddings"):
        modules[name] = types.ModuleType(name)
    rope_module = types.ModuleType("nkilib.core.embeddings.rope")
    rope_module.RoPE = library_rope
    modules["nkilib.core.embeddings.rope"] = rope_module
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeCompileKernel.calls.clear()
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn1")
    return compiled


def test_nki_compiler_emits_the_sdk_config(fake_sdk):
    with jax_nkilib.config(lnc=2):
        text = neuron_text(RoPE, X, COS, SIN)
    (cfg,) = kernel_configs(text)
    assert cfg == {"func_name": "library_rope", "kernel_format": "bir", "grid": 2, "has_collectives": True,
                   "mac_count": 7}
    (func, lnc, target, arg_specs, kwargs), = FakeCompileKernel.calls
    assert func is library_rope and lnc == 2 and target == "trn1"
    assert [tuple(a.shape) for a in arg_specs] == [(64, 2, 4, 16), (32, 2, 16), (32, 2, 16)]
    assert kwargs == {"lnc_shard": True, "contiguous_layout": True, "relayout_in_sbuf": False}
    assert "output_operand_aliases = [#stablehlo.output_operand_alias<output_tuple_indices = [], operand_index = 0" \
           in text
    assert 'mhlo.frontend_attributes = {has_collectives = "1"}' in text


def test_output_mismatch_is_an_error(fake_sdk, monkeypatch):
    original = FakeCompileKernel.build_config

    def wrong_outputs(self, *arg_specs, **kwargs):
        result = original(self, *arg_specs, **kwargs)
        result.output_specs = [jax.ShapeDtypeStruct((1,), np.float32)]
        return result

    monkeypatch.setattr(FakeCompileKernel, "build_config", wrong_outputs)
    with pytest.raises(NeuronOutputMismatchError, match="abstract evaluation expects"):
        neuron_text(RoPE, X, COS, SIN)


def test_missing_framework_api_is_named(fake_sdk, monkeypatch):
    monkeypatch.delattr(fake_sdk, "CompileKernel")
    with pytest.raises(NkiApiError, match="CompileKernel"):
        neuron_text(RoPE, X, COS, SIN)


def test_missing_entry_point_is_named(fake_sdk, monkeypatch):
    monkeypatch.delattr(sys.modules["nkilib.core.embeddings.rope"], "RoPE")
    with pytest.raises(NkiApiError, match="nkilib.core.embeddings.rope:RoPE"):
        neuron_text(RoPE, X, COS, SIN)


def test_tensors_after_static_parameters_or_gaps_go_by_keyword():
    def kernel(q, k, v, scale=1.0, k_scale=None, v_scale=None):  # tensors after a static parameter
        raise AssertionError("never called")

    specs = {name: jax.ShapeDtypeStruct((2,), np.float32) for name in ("q", "k", "v", "v_scale")}
    args, kwargs = kernel_arguments(kernel, specs, {"scale": 0.5})
    assert len(args) == 3 and set(kwargs) == {"scale", "v_scale"}
    gap = {name: specs[name] for name in ("q", "v")}  # k absent: v must not land on k
    args, kwargs = kernel_arguments(kernel, gap, {})
    assert len(args) == 1 and set(kwargs) == {"v"}


def test_enum_flags_become_the_librarys_members(monkeypatch):
    import enum

    class NormType(enum.Enum):  # the library's own class, distinct from jax_nkilib's copy
        RMS_NORM = 1

    module = types.ModuleType("nkilib.core.utils.common_types")
    module.NormType = NormType
    monkeypatch.setitem(sys.modules, "nkilib.core.utils.common_types", module)
    assert library_enum(jax_nkilib.nki.NormType.RMS_NORM) is NormType.RMS_NORM
    assert library_enum(0.5) == 0.5
    with pytest.raises(NkiApiError, match="no member"):
        library_enum(jax_nkilib.nki.NormType.LAYER_NORM)


def test_replica_groups_reach_library_kernels_as_replica_group_objects(monkeypatch):
    class ReplicaGroup:  # the SDK's nki.collectives.ReplicaGroup
        def __init__(self, groups):
            self.groups = groups

    module = types.ModuleType("nki.collectives")
    module.ReplicaGroup = ReplicaGroup
    monkeypatch.setitem(sys.modules, "nki.collectives", module)
    from jax_nkilib._src.attention.kv_parallel import ATTENTION_KV_PARALLEL_SEGMENTED_CTE_SPEC as library_spec
    from jax_nkilib._src.parallel.collectives import all_reduce_hbm_kernel

    adapter_spec = all_reduce_hbm_kernel.spec

    ranks = ((0, 2, 4, 6), (1, 3, 5, 7))
    wrapped = replica_group_arguments(library_spec, {"replica_groups": ranks, "scale": 1.0})
    assert isinstance(wrapped["replica_groups"], ReplicaGroup) and wrapped["replica_groups"].groups == [
        [0, 2, 4, 6], [1, 3, 5, 7]]
    assert wrapped["scale"] == 1.0
    adapter_name = next(p.name for p in adapter_spec.params if p.kind == "axis")
    assert replica_group_arguments(adapter_spec, {adapter_name: ranks}) == {adapter_name: ranks}  # adapters: lists


def test_dtype_params_reach_library_kernels_as_nki_language_dtypes(monkeypatch):
    language = types.ModuleType("nki.language")
    language.float32, language.float8_e4m3fn_x4 = "nl.float32", "nl.float8_e4m3fn_x4"
    monkeypatch.setitem(sys.modules, "nki.language", language)
    from jax_nkilib._src.attention.cte import ATTENTION_CTE_SPEC
    from jax_nkilib._src.quant.rmsnorm_mx_prefill import rmsnorm_mx_prefill

    static = {"softmax_dtype": np.dtype(np.float32), "mm_out_dtype": None, "scale": 1.0}
    assert device_dtypes(ATTENTION_CTE_SPEC, static) == {"softmax_dtype": "nl.float32", "mm_out_dtype": None,
                                                         "scale": 1.0}
    x4 = device_dtypes(rmsnorm_mx_prefill.spec, {"qmx_output_dtype": np.dtype(jax.numpy.float8_e4m3fn)})
    assert x4 == {"qmx_output_dtype": "nl.float8_e4m3fn_x4"}  # the packed x4 type the kernel allocates
    with pytest.raises(NkiApiError, match="no dtype float16"):
        device_dtypes(ATTENTION_CTE_SPEC, {"softmax_dtype": np.dtype(np.float16)})
