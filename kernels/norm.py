"""Adapters for the NKI Library's normalization kernels (``nkilib.core.rmsnorm``, ``nkilib.core.subkernels``).

``rmsnorm_quant_kernel`` takes its flags as one ``RmsNormQuantKernelArgs`` object: the adapter builds it from the
keyword arguments (jax_nkilib passes its own enum members; they are mapped to the library's by name) and passes the
2.32 arguments (``pre_norm_gamma``, ``residual``, ``dtype_mode``) only when they are used, so older libraries work.
``rmsnorm_tkg`` and ``layernorm_tkg`` are subkernels that write a caller-allocated output: the adapters allocate it
in shared HBM (the kernels then stage it in SBUF and store it) and return it. Not yet run on Trainium by this project.
"""

import nki
import nki.language as nl

try:  # neuronx-cc bundles the library as `nkilib`; the source tree installs it as `nkilib_src.nkilib`
    from nkilib.core.rmsnorm.rmsnorm_quant import RmsNormQuantKernelArgs
    from nkilib.core.rmsnorm.rmsnorm_quant import rmsnorm_quant_kernel as _library_rmsnorm_quant
    from nkilib.core.subkernels.layernorm_tkg import layernorm_tkg as _library_layernorm_tkg
    from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg as _library_rmsnorm_tkg
    from nkilib.core.utils import common_types as _types
except ImportError:  # pragma: no cover - depends on how the NKI Library is installed
    from nkilib_src.nkilib.core.rmsnorm.rmsnorm_quant import RmsNormQuantKernelArgs
    from nkilib_src.nkilib.core.rmsnorm.rmsnorm_quant import rmsnorm_quant_kernel as _library_rmsnorm_quant
    from nkilib_src.nkilib.core.subkernels.layernorm_tkg import layernorm_tkg as _library_layernorm_tkg
    from nkilib_src.nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg as _library_rmsnorm_tkg
    from nkilib_src.nkilib.core.utils import common_types as _types

# Call the undecorated kernel body inside our kernel so that it is traced inline.
_rmsnorm_quant_body = getattr(_library_rmsnorm_quant, "func", _library_rmsnorm_quant)
P_MAX = 128


def _library_enum(enum_class, value):
    """The library's member of ``enum_class`` with the name of ``value`` (a jax_nkilib member or a name)."""
    return enum_class[getattr(value, "name", value)]


@nki.jit
def rmsnorm_quant_kernel(hidden, ln_w=None, input_dequant_scale=None, pre_norm_gamma=None, residual=None,
                         lower_bound=0.0, norm_type="RMS_NORM", quantization_type="ROW", eps=1e-6,
                         dtype_mode="NON_OCP"):
    """``out`` (and ``residual_out`` with ``residual``) from the library kernel with ``RmsNormQuantKernelArgs``."""
    kargs = RmsNormQuantKernelArgs(lower_bound=lower_bound, norm_type=_library_enum(_types.NormType, norm_type),
                                   quantization_type=_library_enum(_types.QuantizationType, quantization_type),
                                   eps=eps)
    newer = {}
    if pre_norm_gamma is not None:
        newer["pre_norm_gamma"] = pre_norm_gamma
    if residual is not None:
        newer["residual"] = residual
    if getattr(dtype_mode, "name", dtype_mode) != "NON_OCP":
        newer["dtype_mode"] = _library_enum(_types.DtypeMode, dtype_mode)
    return _rmsnorm_quant_body(hidden, ln_w, kargs, input_dequant_scale, **newer)


@nki.jit
def rmsnorm_tkg(input, gamma, eps=1e-6, hidden_actual=None, hidden_dim_tp=False, single_core_forced=False,
                shard_on_h=False, use_heap_memory=False):
    """``out [128, B*S, H/128]`` in HBM from the ``rmsnorm_tkg`` subkernel."""
    batch, seq, hidden = input.shape
    out = nl.ndarray((P_MAX, batch * seq, hidden // P_MAX), dtype=input.dtype, buffer=nl.shared_hbm)
    _library_rmsnorm_tkg(input, gamma, out, eps=eps, hidden_actual=hidden_actual, hidden_dim_tp=hidden_dim_tp,
                         single_core_forced=single_core_forced, shard_on_h=shard_on_h,
                         use_heap_memory=use_heap_memory)
    return out


@nki.jit
def layernorm_tkg(input, gamma, beta=None, eps=1e-6, shard_on_h=False, use_heap_memory=False):
    """``out [128, B*S, H/128]`` in HBM from the ``layernorm_tkg`` subkernel (``shard_on_h`` needs a 2.32 library)."""
    batch, seq, hidden = input.shape
    out = nl.ndarray((P_MAX, batch * seq, hidden // P_MAX), dtype=input.dtype, buffer=nl.shared_hbm)
    newer = {"shard_on_h": True} if shard_on_h else {}
    _library_layernorm_tkg(input, gamma, out, beta=beta, eps=eps, use_heap_memory=use_heap_memory, **newer)
    return out
