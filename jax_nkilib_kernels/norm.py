"""Adapters for the NKI Library's normalization kernels (``nkilib.core.rmsnorm``, ``nkilib.core.subkernels``).

``rmsnorm_quant_kernel`` takes its flags as one ``RmsNormQuantKernelArgs`` object: the adapter builds it from the
keyword arguments (enum members arrive by name and are mapped to the library's) and passes the
2.32 arguments (``pre_norm_gamma``, ``residual``, ``dtype_mode``) only when they are used, so older libraries work.
``rmsnorm_tkg`` and ``layernorm_tkg`` are subkernels that write a caller-allocated output: the adapters allocate it
in shared HBM (the kernels then stage it in SBUF and store it) and return it. Not yet run on Trainium by this project.
"""

import nki
import nki.language as nl

from jax_nkilib_kernels._library import body, load

_library_rmsnorm_quant = load("core.rmsnorm.rmsnorm_quant", "rmsnorm_quant_kernel")
RmsNormQuantKernelArgs = load("core.rmsnorm.rmsnorm_quant", "RmsNormQuantKernelArgs")
NormType = load("core.utils.common_types", "NormType")
QuantizationType = load("core.utils.common_types", "QuantizationType")
DtypeMode = load("core.utils.common_types", "DtypeMode", optional=True)  # 2.32: used only for OCP/AUTO
_library_layernorm_tkg = load("core.subkernels.layernorm_tkg", "layernorm_tkg")
_library_rmsnorm_tkg = load("core.subkernels.rmsnorm_tkg", "rmsnorm_tkg")

# Call the undecorated kernel body inside our kernel so that it is traced inline.
_rmsnorm_quant_body = body(_library_rmsnorm_quant)
P_MAX = 128


def _library_enum(enum_class, value):
    """The library's member of ``enum_class`` with the name of ``value`` (a jax_nkilib member or a name)."""
    return enum_class[getattr(value, "name", value)]


@nki.jit
def rmsnorm_quant_kernel(
    hidden,
    ln_w=None,
    input_dequant_scale=None,
    pre_norm_gamma=None,
    residual=None,
    lower_bound=0.0,
    norm_type="RMS_NORM",
    quantization_type="ROW",
    eps=1e-6,
    dtype_mode="NON_OCP",
):
    """``out`` (and ``residual_out`` with ``residual``) from the library kernel with ``RmsNormQuantKernelArgs``."""
    kargs = RmsNormQuantKernelArgs(
        lower_bound=lower_bound,
        norm_type=_library_enum(NormType, norm_type),
        quantization_type=_library_enum(QuantizationType, quantization_type),
        eps=eps,
    )
    newer = {}
    if pre_norm_gamma is not None:
        newer["pre_norm_gamma"] = pre_norm_gamma
    if residual is not None:
        newer["residual"] = residual
    if getattr(dtype_mode, "name", dtype_mode) != "NON_OCP":
        newer["dtype_mode"] = _library_enum(DtypeMode, dtype_mode)
    return _rmsnorm_quant_body(hidden, ln_w, kargs, input_dequant_scale, **newer)


@nki.jit
def rmsnorm_tkg(
    input,
    gamma,
    eps=1e-6,
    hidden_actual=None,
    hidden_dim_tp=False,
    single_core_forced=False,
    shard_on_h=False,
    use_heap_memory=False,
):
    """``out [128, B*S, H/128]`` in HBM from the ``rmsnorm_tkg`` subkernel."""
    batch, seq, hidden = input.shape
    out = nl.ndarray((P_MAX, batch * seq, hidden // P_MAX), dtype=input.dtype, buffer=nl.shared_hbm)
    _library_rmsnorm_tkg(
        input,
        gamma,
        out,
        eps=eps,
        hidden_actual=hidden_actual,
        hidden_dim_tp=hidden_dim_tp,
        single_core_forced=single_core_forced,
        shard_on_h=shard_on_h,
        use_heap_memory=use_heap_memory,
    )
    return out


@nki.jit
def layernorm_tkg(input, gamma, beta=None, eps=1e-6, shard_on_h=False, use_heap_memory=False):
    """``out [128, B*S, H/128]`` in HBM from the ``layernorm_tkg`` subkernel."""
    batch, seq, hidden = input.shape
    out = nl.ndarray((P_MAX, batch * seq, hidden // P_MAX), dtype=input.dtype, buffer=nl.shared_hbm)
    _library_layernorm_tkg(
        input, gamma, out, beta=beta, eps=eps, shard_on_h=shard_on_h, use_heap_memory=use_heap_memory
    )
    return out
