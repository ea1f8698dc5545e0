"""Arg specs of the quantization kernels (FP8 tiles, MXFP8 matmuls and quantizers, MX RMS norms) and of
``jax_nkilib.mxfp8_matmul`` / ``quantize_mx`` / ``dequantize_mx``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register, uniform

_DATA = (("data", 8),)


def spread(rng, shape, dtype=jnp.float32):
    """Normal values times per-element powers of two over a wide range (quantizer blocks mix magnitudes)."""
    return jnp.asarray(rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 8, shape), dtype)


def _static(p, f):
    """static_quantization's ``hidden_state [P, F]`` and ``input_dequant_scale [P, 1]``."""
    return lambda rng: (spread(rng, (p, f), jnp.bfloat16), uniform(rng, (p, 1), 0.01, 0.05))


def _rmsnorm_mx(b, s, h, dtype=jnp.bfloat16, residual=True):
    """rmsnorm_mx_quantize_tkg / rmsnorm_mx_prefill's ``[B, S, H]`` input, ``gamma [1, H]`` and residual."""

    def build(rng):
        out = (normal(rng, (b, s, h), dtype, 3.0), normal(rng, (1, h), dtype))
        return out + (normal(rng, (b, s, h), dtype),) if residual else out

    return build


def _matmul(m, n, k, dtype=jnp.bfloat16):
    """matmul_mxfp8's raw (unswizzled) ``lhs [M, K]`` and ``rhs [N, K]``."""
    return lambda rng: (spread(rng, (m, k), dtype) * 2.0**-10, spread(rng, (n, k), dtype) * 2.0**-10)


def _backward(m, n, k, dtype=jnp.bfloat16):
    """matmul_mxfp8_backward's ``output_grad [M, N]``, ``weights [N, K]``, ``input_activation [M, K]``."""
    return lambda rng: (spread(rng, (m, n), dtype), spread(rng, (n, k), dtype), spread(rng, (m, k), dtype))


def _mx_quantized(rng):
    return jax_nkilib.quantize_mx(spread(rng, (8, 3, 64)), axis=-1)


_RAW = dict(lhs_is_swizzled=False, rhs_is_swizzled=False, output_dtype=jnp.float32)
_E4M3 = jnp.float8_e4m3

register(
    ArgSpec(
        "static_quantization",
        nki.static_quantization,
        ("hidden_state", "input_dequant_scale"),
        _static(16, 12),
        kwargs={"dtype": _E4M3},
        kernels=("static_quantization",),
        sharding=Sharding(_DATA, (P("data"), P("data")), (P("data"), P("data"))),
        neuron=_static(128, 512),
        bad=BadInput("input_dequant_scale", lambda s: s[:-1], "input_dequant_scale"),
    ),
    ArgSpec(
        "row_quantization",
        nki.row_quantization,
        ("hidden_state",),
        lambda rng: (spread(rng, (16, 10), jnp.bfloat16),),
        kernels=("row_quantization",),
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        neuron=lambda rng: (spread(rng, (128, 512), jnp.bfloat16),),
        bad=BadInput("hidden_state", lambda x: x[0], "hidden_state"),
    ),
    ArgSpec(
        "row_quantization.3d",
        nki.row_quantization,
        ("hidden_state",),
        lambda rng: (spread(rng, (4, 16, 6)),),
        kwargs={"output_dtype": _E4M3},
        kernels=("row_quantization",),
        sharding=Sharding(_DATA, (P(None, "data"),), (P(None, "data"), P(None, "data"))),
        neuron=lambda rng: (spread(rng, (128, 4, 128), jnp.bfloat16),),
    ),
    ArgSpec(
        "pre_combine_dequant_scales",
        nki.pre_combine_dequant_scales,
        ("input_dequant_scale", "weight_dequant_scale"),
        lambda rng: (uniform(rng, (16, 1), 0.01, 0.05), uniform(rng, (16, 3), 0.1, 2.0)),
        kernels=("pre_combine_dequant_scales",),
        grad=("input_dequant_scale", "weight_dequant_scale"),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P("data")), P("data")),
        neuron=lambda rng: (uniform(rng, (128, 1), 0.01, 0.05), uniform(rng, (128, 4), 0.1, 2.0)),
        bad=BadInput("weight_dequant_scale", lambda w: w[:-1], "weight_dequant_scale"),
    ),
    ArgSpec(
        "matmul_mxfp8",
        nki.matmul_mxfp8,
        ("lhs", "rhs"),
        _matmul(32, 16, 256),
        kwargs=_RAW,
        kernels=("matmul_mxfp8",),
        grad=("lhs", "rhs"),
        check_grads=False,
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        neuron=_matmul(256, 384, 512),
        neuron_kwargs=dict(lhs_is_swizzled=False, rhs_is_swizzled=False),
        bad=BadInput("rhs", lambda r: r[:, :-32], "rhs"),
    ),
    ArgSpec(
        "matmul_mxfp8_backward",
        nki.matmul_mxfp8_backward,
        ("output_grad", "weights", "input_activation"),
        _backward(16, 8, 64),
        kwargs={"output_dtype": jnp.float32},
        kernels=("matmul_mxfp8_backward",),
        sharding=Sharding(_DATA, (P(), P(None, "data"), P(None, "data")), (P(None, "data"), P(None, "data"))),
        neuron=_backward(128, 512, 512),
        neuron_kwargs={},
        bad=BadInput("weights", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "quantize_block_mxfp8_kernel",
        nki.quantize_block_mxfp8_kernel,
        ("src_tensor",),
        lambda rng: (spread(rng, (64, 256), jnp.bfloat16),),
        kwargs={"return_fp8_dtype": "float8_e5m2"},
        kernels=("quantize_block_mxfp8_kernel",),
        sharding=Sharding(_DATA, (P("data"),), (P(None, "data"), P(None, "data"))),
        neuron=lambda rng: (spread(rng, (16, 1024), jnp.bfloat16),),
        bad=BadInput("return_fp8_dtype", lambda _: "float8_e4m3", "return_fp8_dtype"),
    ),
    ArgSpec(
        "rmsnorm_mx_quantize_tkg",
        nki.rmsnorm_mx_quantize_tkg,
        ("input", "gamma", "residual"),
        _rmsnorm_mx(8, 1, 512, jnp.float32),
        kernels=("rmsnorm_mx_quantize_tkg",),
        grad=("input", "gamma", "residual"),
        grad_output=lambda out: (out[0], out[3]),
        batch=("input", "residual"),
        sharding=Sharding(
            _DATA,
            (P("data"), P(), P("data")),
            (P(None, "data"), P(None, None, "data"), P(None, None, "data"), P("data")),
        ),
        neuron=_rmsnorm_mx(64, 4, 1024),
        neuron_lnc=2,
        bad=BadInput("gamma", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "rmsnorm_mx_prefill",
        nki.rmsnorm_mx_prefill,
        ("hidden_states", "gamma"),
        _rmsnorm_mx(8, 2, 512, residual=False),
        kwargs={"emit_norm_bf16": True},
        kernels=("rmsnorm_mx_prefill",),
        batch=("hidden_states",),
        sharding=Sharding(_DATA, (P("data"), P()), (P("data"),) * 2),
        neuron=_rmsnorm_mx(2, 64, 1024, residual=False),
        bad=BadInput("gamma", lambda g: g[:, :-1], "gamma"),
    ),
    ArgSpec(
        "mxfp8_matmul",
        jax_nkilib.mxfp8_matmul,
        ("x", "w"),
        lambda rng: (spread(rng, (8, 2, 64), jnp.bfloat16), spread(rng, (64, 16), jnp.bfloat16)),
        kernels=("matmul_mxfp8",),
        only_kernels=False,
        grad=("x", "w"),
        check_grads=False,
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        neuron=lambda rng: (jnp.zeros((2, 64, 512), jnp.bfloat16), jnp.zeros((512, 1024), jnp.bfloat16)),
        bad=BadInput("w", lambda w: w[:-32], "w"),
    ),
    ArgSpec(
        "quantize_mx",
        jax_nkilib.quantize_mx,
        ("x",),
        lambda rng: (spread(rng, (8, 3, 512), jnp.bfloat16),),
        kernels=("quantize_block_mxfp8_kernel",),
        only_kernels=False,
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        neuron=lambda rng: (jnp.zeros((8, 1024), jnp.bfloat16),),
        bad=BadInput("x", lambda x: x[..., :48], "x"),
    ),
    ArgSpec(
        "dequantize_mx",
        jax_nkilib.dequantize_mx,
        ("data", "scales"),
        _mx_quantized,
        kernels=(),
        only_kernels=False,
        sharding=Sharding(_DATA, (P("data"), P("data")), P("data")),
        bad=BadInput("scales", drop_last_axis, "scales"),
    ),
)
