"""Arg specs of the normalization kernels and of ``jax_nkilib.rms_norm`` / ``layer_norm`` / ``quantize_fp8`` /
``dequantize_fp8``."""

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, drop_last_axis, normal, register

_DATA = (("data", 8),)


def _tkg(b, s, h, beta=False):
    """rmsnorm_tkg / layernorm_tkg's ``input [B, S, H]``, ``gamma [1, H]`` (and ``beta [1, H]``)."""

    def build(rng):
        x, gamma = normal(rng, (b, s, h)), normal(rng, (1, h))
        return (x, gamma, normal(rng, (1, h))) if beta else (x, gamma)

    return build


def _quant(b, s, h, residual=False):
    """rmsnorm_quant_kernel's ``hidden [B, S, H]`` and ``ln_w [H]``; with ``residual`` also no input scale, a
    pre-norm gamma and a residual."""

    def build(rng):
        hidden, ln_w = normal(rng, (b, s, h), scale=3.0), normal(rng, (h,))
        return (hidden, ln_w, None, normal(rng, (h,)), normal(rng, (b, s, h))) if residual else (hidden, ln_w)

    return build


def _norm(b, s, h, bias=False):
    def build(rng):
        x, w = normal(rng, (b, s, h)), normal(rng, (h,))
        return (x, w, normal(rng, (h,))) if bias else (x, w)

    return build


def _quantized(rng):
    q, scale = jax_nkilib.quantize_fp8(normal(rng, (8, 5, 48), scale=3.0))
    return q, scale


_KERNEL_ORDER = Sharding(_DATA, (P("data"), P()), P(None, "data"))

register(
    ArgSpec(
        "rmsnorm_tkg",
        nki.rmsnorm_tkg,
        ("input", "gamma"),
        _tkg(8, 2, 256),
        kernels=("rmsnorm_tkg",),
        grad=("input", "gamma"),
        grad_order=2,
        sharding=_KERNEL_ORDER,
        bad=BadInput("input", drop_last_axis, "layout"),
    ),
    ArgSpec(
        "layernorm_tkg",
        nki.layernorm_tkg,
        ("input", "gamma", "beta"),
        _tkg(8, 2, 256, beta=True),
        kernels=("layernorm_tkg",),
        grad=("input", "gamma", "beta"),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P(), P()), P(None, "data")),
        bad=BadInput("gamma", drop_last_axis, "gamma"),
    ),
    ArgSpec(
        "rmsnorm_quant_kernel",
        nki.rmsnorm_quant_kernel,
        ("hidden", "ln_w"),
        _quant(2, 16, 40),
        kwargs={"lower_bound": 2.0},
        kernels=("rmsnorm_quant_kernel",),
        batch=("hidden",),
        sharding=Sharding(_DATA, (P(None, "data"), P()), P(None, "data")),
        bad=BadInput("ln_w", lambda w: w[:7], "ln_w"),
    ),
    ArgSpec(
        "rmsnorm_quant_kernel.residual",
        nki.rmsnorm_quant_kernel,
        ("hidden", "ln_w", "input_dequant_scale", "pre_norm_gamma", "residual"),
        _quant(2, 5, 40, residual=True),
        kernels=("rmsnorm_quant_kernel",),
        grad=("hidden", "pre_norm_gamma", "residual"),
        grad_output=lambda out: out[1],
        batch=(),
        notes="not vmapped here: with the residual add, XLA:CPU's excess precision (bf16 intermediates kept in "
        "f32 in some fusions) can move a row's FP8 scale between the batched and the single program",
    ),
    ArgSpec(
        "rms_norm",
        jax_nkilib.rms_norm,
        ("x", "weight"),
        _norm(8, 3, 256),
        kernels=("rmsnorm_tkg",),
        only_kernels=False,
        grad=("x", "weight"),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        bad=BadInput("weight", lambda w: w[:7], "weight"),
    ),
    ArgSpec(
        "layer_norm",
        jax_nkilib.layer_norm,
        ("x", "weight", "bias"),
        _norm(8, 3, 256, bias=True),
        kwargs={"eps": 1e-5},
        kernels=("layernorm_tkg",),
        only_kernels=False,
        grad=("x", "weight", "bias"),
        grad_order=2,
        sharding=Sharding(_DATA, (P("data"), P(), P()), P("data")),
        bad=BadInput("bias", lambda w: w[:7], "bias"),
    ),
    ArgSpec(
        "quantize_fp8",
        jax_nkilib.quantize_fp8,
        ("x",),
        lambda rng: (normal(rng, (8, 5, 48)),),
        kernels=("rmsnorm_quant_kernel",),
        only_kernels=False,
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P("data"))),
        neuron=lambda rng: (normal(rng, (2, 3, 64)),),
        bad=BadInput("mode", lambda _: "blocks", "mode"),
    ),
    ArgSpec(
        "quantize_fp8.ocp_static",
        jax_nkilib.quantize_fp8,
        ("x",),
        lambda rng: (normal(rng, (8, 5, 48)),),
        kwargs=dict(mode="static", scale=0.02, dtype=jnp.float8_e4m3fn),
        kernels=("rmsnorm_quant_kernel",),
        only_kernels=False,
        sharding=Sharding(_DATA, (P("data"),), (P("data"), P())),
    ),
    ArgSpec(
        "dequantize_fp8",
        jax_nkilib.dequantize_fp8,
        ("q", "scale"),
        _quantized,
        kernels=(),
        only_kernels=False,
        sharding=Sharding(_DATA, (P("data"), P("data")), P("data")),
        bad=BadInput("scale", drop_last_axis, "scale"),
    ),
)
