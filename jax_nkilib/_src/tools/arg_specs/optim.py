"""Arg specs of the foreach kernels (elementwise family and norms) and the fused Adam/AdamW kernels: flat ``[N]``
operands (N = 200, not a multiple of 128: the kernels' tail path), scalars as ``[128, 1]`` tensors.

No shard_map case here: ``numel`` is the global N, while a shard needs its own (``tests/optim`` runs the kernels
inside ``jax.shard_map`` with ``numel = N / 8``)."""

import jax.numpy as jnp
import numpy as np

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, drop_last_axis, normal, register

N = 200


def _scalar(value):
    return jnp.full((128, 1), value, jnp.float32)


def _flat(count, positive=(), scalar=None):
    """``count`` flat [N] tensors (those at ``positive`` indices > 0.5 in magnitude, positive) and a scalar."""

    def build(rng):
        tensors = [normal(rng, (N,)) for _ in range(count)]
        for i in positive:
            tensors[i] = jnp.abs(tensors[i]) + 0.5
        return (*tensors, _scalar(scalar)) if scalar is not None else tuple(tensors)

    return build


# (kernel, flat operand names, scalar operand name, indices of operands kept positive: divisors, sqrt)
_ELEMENTWISE = (
    (nki.add_scalar_kernel, ("data",), "scalar_tensor", ()),
    (nki.sub_scalar_kernel, ("data",), "scalar_tensor", ()),
    (nki.mul_scalar_kernel, ("data",), "scalar_tensor", ()),
    (nki.div_scalar_kernel, ("data",), "scalar_tensor", ()),
    (nki.add_tensor_kernel, ("data1", "data2"), "alpha_tensor", ()),
    (nki.sub_tensor_kernel, ("data1", "data2"), "alpha_tensor", ()),
    (nki.mul_tensor_kernel, ("data1", "data2"), None, ()),
    (nki.div_tensor_kernel, ("data1", "data2"), None, (1,)),
    (nki.addcdiv_kernel, ("data", "data1", "data2"), "value_tensor", (2,)),
    (nki.addcmul_kernel, ("data", "data1", "data2"), "value_tensor", ()),
    (nki.lerp_kernel, ("data", "end"), "weight_tensor", ()),
    (nki.sqrt_kernel, ("data",), None, (0,)),
)


def _elementwise_spec(kernel, tensors, scalar, positive) -> ArgSpec:
    operands = tensors + ((scalar,) if scalar else ())
    return ArgSpec(
        kernel.__name__,
        kernel,
        operands,
        _flat(len(tensors), positive, -1.5 if scalar else None),
        kwargs={"numel": N},
        kernels=(kernel.__name__,),
        grad=tensors,
        bad=BadInput("numel", lambda n: n + 1, "numel"),
    )


def _norm_spec(kernel) -> ArgSpec:
    return ArgSpec(
        kernel.__name__,
        kernel,
        ("data",),
        _flat(1),
        kwargs={"numel": N},
        kernels=(kernel.__name__,),
        grad=("data",),
        neuron_lnc=2,
        bad=BadInput("data", drop_last_axis, "layout"),
    )


def _adam(amsgrad: bool, decoupled: bool):
    def build(rng):
        param, grad, m = (normal(rng, (N,)) for _ in range(3))
        v = jnp.abs(normal(rng, (N,))) + 0.1
        above = jnp.asarray(rng.uniform(size=N) < 0.5)  # v_max above or below v, never tied (max is kinked there)
        v_max = jnp.where(above, v + 0.05 + jnp.abs(normal(rng, (N,))), v - 0.05)
        wd = 1.0 - 1e-3 * 0.01 if decoupled else 0.01
        step, inv_bc2_sqrt = 1e-3 / (1 - 0.9**3), 1 / np.sqrt(1 - 0.999**3)
        return (
            param,
            grad,
            m,
            v,
            v_max if amsgrad else jnp.zeros((1,), jnp.float32),
            _scalar(step),
            _scalar(inv_bc2_sqrt),
            _scalar(wd),
        )

    return build


_ADAM_OPERANDS = (
    "param_ptr",
    "grad_ptr",
    "exp_avg_ptr",
    "exp_avg_sq_ptr",
    "max_exp_avg_sq_ptr",
    "step_size_ptr",
    "inv_bc2_sqrt_ptr",
    "wd_factor_ptr",
)
_ADAM_FLAT = _ADAM_OPERANDS[:4]


def _adam_spec(kernel, amsgrad: bool) -> ArgSpec:
    name = kernel.__name__ + (".amsgrad" if amsgrad else "")
    return ArgSpec(
        name,
        kernel,
        _ADAM_OPERANDS,
        _adam(amsgrad, kernel is nki.adamw_kernel),
        kwargs={"numel": N, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "amsgrad": amsgrad},
        kernels=(kernel.__name__,),
        grad=_ADAM_FLAT + (("max_exp_avg_sq_ptr",) if amsgrad else ()),
        bad=BadInput("exp_avg_ptr", lambda m: m[:-1], "N"),
    )


register(
    *(_elementwise_spec(*row) for row in _ELEMENTWISE),
    *(_norm_spec(kernel) for kernel in (nki.l1_norm_kernel, nki.l2_norm_kernel, nki.linf_norm_kernel)),
    ArgSpec(
        "l2_norm_kernel.lnc1_falls_back",
        nki.l2_norm_kernel,
        ("data",),
        _flat(1),
        kwargs={"numel": N},
        kernels=(),
        only_kernels=False,
        neuron_fallback="requires LNC=2",
    ),
    *(_adam_spec(kernel, amsgrad) for kernel in (nki.adam_kernel, nki.adamw_kernel) for amsgrad in (False, True)),
)
