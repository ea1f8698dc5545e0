"""``jax_nkilib.mlp``: a gated (SwiGLU by default) or plain MLP in JAX layouts, with optional fused residual add,
RMS/Layer norm, biases and clamps, lowered to the NKI ``mlp`` kernel."""

from __future__ import annotations

import math

import jax.numpy as jnp

from ..common_types import ActFnType, NormType
from .kernel import mlp as mlp_kernel

ACTIVATIONS = {
    "silu": ActFnType.SiLU, "swish": ActFnType.SiLU,  # jax.nn.swish is SiLU
    "gelu": ActFnType.GELU, "gelu_tanh": ActFnType.GELU_Tanh_Approx,
    "gelu_sigmoid": ActFnType.Swish,  # the kernel's "Swish": x * sigmoid(1.702 x)
    "relu": ActFnType.ReLU,
}
NORMS = (None, "rms", "layer")
_WHERE = "jax_nkilib.mlp"


def _array(name, value, ndim=None):
    if not (hasattr(value, "shape") and hasattr(value, "dtype")):
        raise TypeError(f"{_WHERE}: `{name}` must be an array; got {type(value).__name__}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"{_WHERE}: `{name}` must have a floating dtype; got {value.dtype}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"{_WHERE}: `{name}` must have rank {ndim}; got shape {tuple(value.shape)}")
    return jnp.asarray(value)


def _vector(name, value, size, what):
    if value is None:
        return None
    value = _array(name, value)
    if value.shape not in ((size,), (1, size)):
        raise ValueError(f"{_WHERE}: `{name}` must have layout [{what}] = ({size},); got {tuple(value.shape)}")
    return value.reshape(1, size)


def _clamp(name, value):
    if value is None:
        return None, None
    if not (isinstance(value, tuple) and len(value) == 2
            and all(v is None or isinstance(v, (int, float)) for v in value)):
        raise TypeError(f"{_WHERE}: `{name}` must be a (lower, upper) tuple of Python floats or None; got {value!r}")
    return tuple(None if v is None else float(v) for v in value)


def mlp(x, w_gate, w_up, w_down, *, activation: str = "silu", norm: str | None = None, norm_weight=None,
        norm_bias=None, eps: float = 1e-6, residual=None, return_residual: bool = False, gate_bias=None,
        up_bias=None, down_bias=None, gate_clamp=None, up_clamp=None, output_dtype=None):
    """A transformer MLP on ``x [..., hidden]``::

        s = x + residual                     (when ``residual`` is given)
        n = norm(s)                          ``"rms"``: s / rms(s) * norm_weight (no weight: unscaled);
                                             ``"layer"``: (s - mean) / std * norm_weight + norm_bias
        h = act(n w_gate + gate_bias) * (n w_up + up_bias)    (``w_gate=None``: h = act(n w_up + up_bias))
        out = h w_down + down_bias

    ``w_gate, w_up [hidden, inter]``, ``w_down [inter, hidden]``, biases and norm parameters 1-D. ``activation``:
    ``"silu"`` (= ``"swish"``, so the default is SwiGLU), ``"gelu"`` (erf), ``"gelu_tanh"``, ``"gelu_sigmoid"``
    (``x sigmoid(1.702 x)``) or ``"relu"``. ``gate_clamp`` / ``up_clamp`` are ``(lower, upper)`` bounds applied to
    the gate / up projections before the activation (either may be ``None``). Returns ``out`` with ``x``'s shape
    (dtype ``output_dtype``, default ``x``'s), and ``(out, x + residual)`` when ``return_residual``.

    Differentiable in every array argument. It is one ``jax_nkilib.nki.mlp`` call on ``x`` reshaped to
    ``[batch, seq, hidden]``, so it follows that kernel's numerics: calls with more than 96 tokens take the CTE path,
    which computes float32 inputs in bfloat16 (on CPU as on Neuron).
    """
    x = _array("x", x)
    if x.ndim < 1:
        raise ValueError(f"{_WHERE}: `x` must have layout [..., hidden]; got a scalar")
    hidden = x.shape[-1]
    w_up = _array("w_up", w_up, 2)
    inter = w_up.shape[1]
    if w_up.shape[0] != hidden:
        raise ValueError(f"{_WHERE}: `w_up` must have layout [hidden, inter] with hidden={hidden}; got "
                         f"{tuple(w_up.shape)}")
    if w_gate is not None and _array("w_gate", w_gate, 2).shape != w_up.shape:
        raise ValueError(f"{_WHERE}: `w_gate` must have layout [hidden, inter] = {tuple(w_up.shape)}; got "
                         f"{tuple(w_gate.shape)}")
    if _array("w_down", w_down, 2).shape != (inter, hidden):
        raise ValueError(f"{_WHERE}: `w_down` must have layout [inter, hidden] = ({inter}, {hidden}); got "
                         f"{tuple(w_down.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_WHERE}: `activation` must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    if norm not in NORMS:
        raise ValueError(f"{_WHERE}: `norm` must be None, 'rms' or 'layer'; got {norm!r}")
    if norm is None and (norm_weight is not None or norm_bias is not None):
        raise ValueError(f"{_WHERE}: `norm_weight`/`norm_bias` need norm='rms' or norm='layer'")
    if norm == "rms" and norm_bias is not None:
        raise ValueError(f"{_WHERE}: `norm_bias` is only supported with norm='layer'")
    if residual is not None and (_array("residual", residual).shape != x.shape):
        raise ValueError(f"{_WHERE}: `residual` must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    if return_residual and residual is None:
        raise ValueError(f"{_WHERE}: return_residual=True needs `residual`")
    gamma = _vector("norm_weight", norm_weight, hidden, "hidden")
    if norm == "layer" and gamma is None:
        gamma = jnp.ones((1, hidden), x.dtype)
    norm_type = {None: NormType.NO_NORM, "layer": NormType.LAYER_NORM,
                 "rms": NormType.RMS_NORM if gamma is not None else NormType.RMS_NORM_SKIP_GAMMA}[norm]
    (gate_low, gate_high), (up_low, up_high) = _clamp("gate_clamp", gate_clamp), _clamp("up_clamp", up_clamp)
    if w_gate is None and (gate_bias is not None or gate_clamp is not None):
        raise ValueError(f"{_WHERE}: `gate_bias` and `gate_clamp` need `w_gate` (w_gate=None computes act(n w_up))")

    lead = x.shape[:-1]
    shape3 = (math.prod(lead[:-1]), lead[-1], hidden) if lead else (1, 1, hidden)
    operands = {
        "hidden_tensor": x.reshape(shape3),
        "gate_proj_weights_tensor": w_up if w_gate is None else w_gate,  # unread with skip_gate_proj
        "up_proj_weights_tensor": w_up,
        "down_proj_weights_tensor": w_down,
        "normalization_weights_tensor": gamma,
        "gate_proj_bias_tensor": None if w_gate is None else _vector("gate_bias", gate_bias, inter, "inter"),
        "up_proj_bias_tensor": _vector("up_bias", up_bias, inter, "inter"),
        "down_proj_bias_tensor": _vector("down_bias", down_bias, hidden, "hidden"),
        "normalization_bias_tensor": _vector("norm_bias", norm_bias, hidden, "hidden"),
        "fused_add_tensor": None if residual is None else jnp.asarray(residual).reshape(shape3),
    }
    params = mlp_kernel.params(
        store_fused_add_result=return_residual, activation_fn=ACTIVATIONS[activation], normalization_type=norm_type,
        output_dtype=output_dtype, eps=eps, skip_gate_proj=w_gate is None, gate_clamp_upper_limit=gate_high,
        gate_clamp_lower_limit=gate_low, up_clamp_upper_limit=up_high, up_clamp_lower_limit=up_low)
    outs = mlp_kernel.call(operands, params)
    outs = tuple(out.reshape(x.shape) for out in outs)
    return outs if return_residual else outs[0]
