"""Adapters for the NKI Library's MXFP8 kernels: the SwiGLU MLP forward/backward (``experimental/mlp_mxfp8``) and the
fused RMS norm + MX quantization subkernel ``rmsnorm_mx_quantize_tkg`` (``core/subkernels``).

``mlp_forward_mxfp8_nki`` takes a scratch ``intermediate_hbm`` and caller-allocated checkpoint buffers: the adapter
allocates them (in ``dtype``) for the ``save_*`` flags and returns the output and the saved checkpoints.
``mlp_backward_mxfp8_nki`` takes its clamp limits as a ``ClampLimits`` object: the adapter builds it from the four
fields. ``rmsnorm_mx_quantize_tkg`` writes SBUF buffers and needs LNC=2: the adapter allocates them (the scale buffer
zeroed, so the partitions ``nisa.quantize_mx`` leaves alone read 0) and stores them to HBM as the library's test
wrapper does: each core its own token half of ``output`` and the half of the quantized outputs it received.
Pre-quantized x4 words arrive as uint32 and are viewed as ``float8_e4m3fn_x4``; dtype parameters arrive as dtype
names. Not yet run on Trainium (Trn3) by this project.
"""

import nki
import nki.isa as nisa
import nki.language as nl

from jax_nkilib_kernels._library import load

_library_rmsnorm_mx = load("core.subkernels.rmsnorm_mx_quantize_tkg", "rmsnorm_mx_quantize_tkg")
ClampLimits = load("experimental.mlp_mxfp8.mlp_bwd_mxfp8.config", "ClampLimits")
_library_bwd = load("experimental.mlp_mxfp8.mlp_bwd_mxfp8.mlp_bwd_mxfp8_kernel", "mlp_backward_mxfp8_nki")
_library_fwd = load("experimental.mlp_mxfp8.mlp_fwd_mxfp8.mlp_fwd_mxfp8_kernel", "mlp_forward_mxfp8_nki")

P_MAX = 128


def _dtype(name):
    """The ``nl`` dtype of a dtype name (``"bfloat16"``) or dtype object."""
    return getattr(nl, getattr(name, "name", str(name)))


def _x4(words, scales):
    """Pre-quantized words (uint32) as the library's x4 type; raw operands unchanged."""
    return words if scales is None else words.view(nl.float8_e4m3fn_x4)


@nki.jit
def mlp_forward_mxfp8_nki(
    hidden,
    gate_up_weights,
    down_weights,
    hidden_scales=None,
    gate_up_scales=None,
    down_scales=None,
    run_with_lnc2=True,
    gate_up_tiles_m=8,
    gate_up_tiles_n=1,
    gate_up_tiles_k=8,
    down_tiles_m=8,
    down_tiles_n=1,
    down_tiles_k=8,
    fp8_x4_dtype="float8_e4m3fn",
    save_gate_pre=False,
    save_gate_act=False,
    save_up=False,
    save_hidden=False,
    dtype="bfloat16",
    spill_reload=True,
    use_scale_packing=True,
    hidden_is_swizzled=False,
    gate_up_is_swizzled=False,
    down_is_swizzled=False,
):
    """``(output [S, H], *the saved checkpoints [S, I])``."""
    rows, cols = hidden.shape
    seq = cols // 4 if hidden_is_swizzled else (cols if hidden_scales is not None else rows)
    down_rows, down_cols = down_weights.shape
    inter = down_cols if (down_scales is None and not down_is_swizzled) else 4 * down_rows
    buffer = nl.shared_hbm
    out_dtype = _dtype(dtype)
    scratch = nl.ndarray((seq, inter), dtype=out_dtype, buffer=buffer)
    saved = [
        nl.ndarray((seq, inter), dtype=out_dtype, buffer=buffer) if flag else None
        for flag in (save_gate_pre, save_gate_act, save_up, save_hidden)
    ]
    output = _library_fwd(
        _x4(hidden, hidden_scales),
        _x4(gate_up_weights, gate_up_scales),
        _x4(down_weights, down_scales),
        scratch,
        run_with_lnc2=run_with_lnc2,
        gate_up_tiles_m=gate_up_tiles_m,
        gate_up_tiles_n=gate_up_tiles_n,
        gate_up_tiles_k=gate_up_tiles_k,
        down_tiles_m=down_tiles_m,
        down_tiles_n=down_tiles_n,
        down_tiles_k=down_tiles_k,
        fp8_x4_dtype=_dtype(getattr(fp8_x4_dtype, "name", str(fp8_x4_dtype)) + "_x4"),
        save_gate_pre=saved[0],
        save_gate_act=saved[1],
        save_up=saved[2],
        save_hidden=saved[3],
        dtype=out_dtype,
        spill_reload=spill_reload,
        use_scale_packing=use_scale_packing,
        hidden_scales=hidden_scales,
        gate_up_scales=gate_up_scales,
        down_scales=down_scales,
        hidden_is_swizzled=hidden_is_swizzled,
        gate_up_is_swizzled=gate_up_is_swizzled,
        down_is_swizzled=down_is_swizzled,
    )
    kept = [buffer for buffer in saved if buffer is not None]
    return (output, *kept) if kept else output


@nki.jit
def mlp_backward_mxfp8_nki(
    output_grad,
    hidden_states,
    down_proj_weight=None,
    gate_up_weights=None,
    gate_up_weight_T=None,
    gate_up_weight_T_scales=None,
    gate_up_weights_scales=None,
    down_weight_T=None,
    down_weight_T_scales=None,
    output_grad_T=None,
    output_grad_T_scales=None,
    hidden_states_T=None,
    hidden_states_T_scales=None,
    gate_pre=None,
    gate_act=None,
    up=None,
    intermediate=None,
    run_with_lnc2=True,
    fp8_x4_dtype="float8_e4m3fn",
    spill_reload=True,
    use_scale_packing=True,
    linear_clamp_upper_limit=None,
    linear_clamp_lower_limit=None,
    non_linear_clamp_upper_limit=None,
    non_linear_clamp_lower_limit=None,
):
    """``(hidden_states_grad [S, H], gate_up_weight_grad [2I, H], down_proj_weight_grad [H, I])``."""
    limits = (
        linear_clamp_upper_limit,
        linear_clamp_lower_limit,
        non_linear_clamp_upper_limit,
        non_linear_clamp_lower_limit,
    )
    clamp_limits = None
    if any(limit is not None for limit in limits):
        clamp_limits = ClampLimits(
            linear_clamp_upper_limit=limits[0],
            linear_clamp_lower_limit=limits[1],
            non_linear_clamp_upper_limit=limits[2],
            non_linear_clamp_lower_limit=limits[3],
        )
    return _library_bwd(
        output_grad,
        hidden_states,
        down_proj_weight=down_proj_weight,
        gate_up_weights=_x4(gate_up_weights, gate_up_weights_scales),
        gate_up_weight_T=_x4(gate_up_weight_T, gate_up_weight_T_scales),
        gate_up_weight_T_scales=gate_up_weight_T_scales,
        gate_up_weights_scales=gate_up_weights_scales,
        down_weight_T=_x4(down_weight_T, down_weight_T_scales),
        down_weight_T_scales=down_weight_T_scales,
        output_grad_T=_x4(output_grad_T, output_grad_T_scales),
        output_grad_T_scales=output_grad_T_scales,
        hidden_states_T=_x4(hidden_states_T, hidden_states_T_scales),
        hidden_states_T_scales=hidden_states_T_scales,
        gate_pre=gate_pre,
        gate_act=gate_act,
        up=up,
        intermediate=intermediate,
        run_with_lnc2=run_with_lnc2,
        matmul_config=None,
        fp8_x4_dtype=_dtype(getattr(fp8_x4_dtype, "name", str(fp8_x4_dtype)) + "_x4"),
        spill_reload=spill_reload,
        use_scale_packing=use_scale_packing,
        clamp_limits=clamp_limits,
    )


@nki.jit
def rmsnorm_mx_quantize_tkg(input, gamma, residual=None, eps=1e-6, hidden_actual=None, hidden_dim_tp=True):
    """``(output [128, T, H/128], output_quant [128, H/512, T], output_scale [128, H/512, T][, output_residual])``
    in HBM from the SBUF subkernel (LNC=2)."""
    batch, seq, hidden = input.shape
    tokens, per_core = batch * seq, batch * seq // 2
    program = nl.program_id(0)
    out_shape, quant_shape = (P_MAX, tokens, hidden // P_MAX), (P_MAX, hidden // 512, tokens)
    out_sb = nl.ndarray(out_shape, dtype=input.dtype, buffer=nl.sbuf)
    quant_sb = nl.ndarray(quant_shape, dtype=nl.float8_e4m3fn_x4, buffer=nl.sbuf)
    scale_sb = nl.ndarray(quant_shape, dtype=nl.uint8, buffer=nl.sbuf)
    nisa.memset(scale_sb, value=0)
    output_residual = None
    if residual is not None:
        output_residual = nl.ndarray((tokens, hidden), dtype=residual.dtype, buffer=nl.shared_hbm)
    _library_rmsnorm_mx(
        input,
        gamma,
        out_sb,
        quant_sb,
        scale_sb,
        residual=residual,
        output_residual=output_residual,
        eps=eps,
        hidden_actual=hidden_actual,
        hidden_dim_tp=hidden_dim_tp,
    )
    output = nl.ndarray(out_shape, dtype=input.dtype, buffer=nl.shared_hbm)
    output_quant = nl.ndarray(quant_shape, dtype=nl.float8_e4m3fn_x4, buffer=nl.shared_hbm)
    output_scale = nl.ndarray(quant_shape, dtype=nl.uint8, buffer=nl.shared_hbm)
    own, received = nl.ds(per_core * program, per_core), nl.ds(per_core * (1 - program), per_core)
    nisa.dma_copy(dst=output[:, own, :], src=out_sb[:, own, :])
    nisa.dma_copy(dst=output_quant[:, :, received], src=quant_sb[:, :, received])
    nisa.dma_copy(dst=output_scale[:, :, received], src=scale_sb[:, :, received])
    if residual is not None:
        return output, output_quant, output_scale, output_residual
    return output, output_quant, output_scale
