"""``jax_nkilib.mlp``: a gated (SwiGLU by default) or plain MLP in JAX layouts, with optional fused residual add,
RMS/Layer norm, biases and clamps, lowered to the NKI ``mlp`` kernel."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument
from ..framework.common_types import ActFnType, QuantizationType
from ..framework.spec import FLOAT_DTYPES
from ..framework.validation import check_operand_layouts, static_bool, static_bounds, static_float
from ..mlp.mlp import mlp as mlp_kernel
from ..mlp.mlp_reference import TKG_TOKEN_THRESHOLD, is_tkg
from ..norm.fused_norm import norm_type_of
from ..quant.weights import QuantizedWeight, check_weight, fp8_data, input_scale_tile, scale_tile
from ..sharding import auto
from .precision import float32_compute

ACTIVATIONS = {
    "silu": ActFnType.SiLU,
    "swish": ActFnType.SiLU,  # jax.nn.swish is SiLU
    "gelu": ActFnType.GELU,
    "gelu_tanh": ActFnType.GELU_Tanh_Approx,
    "gelu_sigmoid": ActFnType.Swish,  # the kernel's "Swish": x * sigmoid(1.702 x)
    "relu": ActFnType.ReLU,
}
_WHERE = "jax_nkilib.mlp"


def _array(name, value, ndim=None, fp8=False):
    """A float array (FP8 only with ``fp8``: weights, refused with advice by :func:`_weight`)."""
    return array_argument(_WHERE, name, value, rank=ndim, dtypes="floating" if fp8 else "kernel")


def _weight(name, w, ndim=None):
    """A float weight array or a :class:`QuantizedWeight` (validated); returns it."""
    if isinstance(w, QuantizedWeight):
        check_weight(_WHERE, name, w)
        return w
    w = _array(name, w, ndim, fp8=True)
    if jnp.dtype(w.dtype) in (jnp.dtype(jnp.float8_e4m3), jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)):
        raise TypeError(
            f"{_WHERE}: `{name}` is a raw FP8 array; pass FP8 weights with their scales as "
            "jax_nkilib.quantize_weight_fp8(w, mode=...) (a QuantizedWeight)"
        )
    return w


def _quantization(w_gate, w_up, w_down) -> QuantizationType:
    """NONE for float weights; ROW or STATIC when all given weights are QuantizedWeights of that mode."""
    given = {"w_up": w_up, "w_down": w_down, **({} if w_gate is None else {"w_gate": w_gate})}
    quantized = [name for name, w in given.items() if isinstance(w, QuantizedWeight)]
    if not quantized:
        return QuantizationType.NONE
    modes = {w.mode for w in given.values() if isinstance(w, QuantizedWeight)}
    if len(quantized) != len(given) or len(modes) != 1:
        raise ValueError(
            f"{_WHERE}: quantized weights must be all of {', '.join(given)}, with one mode; got "
            + ", ".join(f"{name}: {w.mode if isinstance(w, QuantizedWeight) else 'float'}" for name, w in given.items())
        )
    (mode,) = modes
    if mode == "static" and w_gate is not None:
        _same_input_scale(w_gate.input_scale, w_up.input_scale)
    return {"row": QuantizationType.ROW, "static": QuantizationType.STATIC}[mode]


def _same_input_scale(a, b) -> None:
    """The kernel has one gate/up input scale: w_gate's and w_up's must agree (checked when concrete)."""
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):  # traced: w_up's is used
        return
    if np.asarray(a) != np.asarray(b):
        raise ValueError(
            f"{_WHERE}: w_gate and w_up (mode='static') must share one input_scale (the kernel's "
            f"gate_up_in_scale); got {float(np.asarray(a))} and {float(np.asarray(b))}"
        )


def _data(w):
    return fp8_data(w) if isinstance(w, QuantizedWeight) else w


def _scales(quant, w_gate, w_up, w_down) -> dict:
    """The kernel's scale operands: ROW ``[128, I]`` (gate, up) / ``[128, H]`` (down) copies of the column scales;
    STATIC ``[128, 1]`` weight scales and the gate/up (``w_up``'s) and down input scales."""
    if quant == QuantizationType.NONE:
        return {}
    out = {
        "gate_w_scale": None if w_gate is None else scale_tile(w_gate),
        "up_w_scale": scale_tile(w_up),
        "down_w_scale": scale_tile(w_down),
    }
    if quant == QuantizationType.STATIC:
        out.update(gate_up_in_scale=input_scale_tile(w_up), down_in_scale=input_scale_tile(w_down))
    return out


_HIDDEN, _INTER = ("hidden", "1, hidden"), ("inter", "1, inter")  # a vector [n] or the kernels' row [1, n]
LAYOUTS = {
    "x": "..., hidden",
    "w_up": "hidden, inter",
    "w_gate": "hidden, inter",
    "w_down": "inter, hidden",
    "norm_weight": _HIDDEN,
    "norm_bias": _HIDDEN,
    "gate_bias": _INTER,
    "up_bias": _INTER,
    "down_bias": _HIDDEN,
}


def _row(value, size):
    """A checked ``[size]`` or ``[1, size]`` vector as the kernel's ``[1, size]`` row."""
    return None if value is None else jnp.asarray(value).reshape(1, size)


def _clamp(name, value):
    """``(lower, upper)``: static floats or None, not NaN, ``lower <= upper``."""
    return (None, None) if value is None else static_bounds(_WHERE, name, value)


def _output_dtype(value):
    if value is None:
        return None
    try:
        dtype = np.dtype(jnp.dtype(value))
    except TypeError:
        dtype = None
    if dtype is None or dtype not in FLOAT_DTYPES:  # (np.dtype == None compares to float64)
        raise TypeError(
            f"{_WHERE}: `output_dtype` must be None or one of float32, bfloat16, float16, float64; got {value!r}"
        )
    return dtype


MLP_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.mlp",
        free=auto.LEADING,
        collective={
            "i": (
                "intermediate",
                "Megatron: w_gate/w_up split by columns, w_down by rows; local MLPs + one "
                "all-reduce (psum), then down_bias",
            )
        },
        note="tokens may take the other kernel path (TKG <= 96 local tokens); quantized weights must be replicated",
    )
)


def _plan_mlp(
    x, w_gate, w_up, w_down, norm_weight, norm_bias, residual, gate_bias, up_bias, down_bias, *, quantized: bool
):
    rows = auto.leading(x.ndim - 1, _WHERE) + "h"
    hi, ih = (None, None) if quantized else ("hi", "ih")  # quantized weights must be replicated
    return auto.plan(
        MLP_SHARDING,
        [
            auto.ShardedArgument("x", x, rows),
            auto.ShardedArgument("w_gate", w_gate, hi),
            auto.ShardedArgument("w_up", w_up, hi),
            auto.ShardedArgument("w_down", w_down, ih),
            auto.ShardedArgument("norm_weight", norm_weight, "h"),
            auto.ShardedArgument("norm_bias", norm_bias, "h"),
            auto.ShardedArgument("residual", residual, rows),
            auto.ShardedArgument("gate_bias", gate_bias, "i"),
            auto.ShardedArgument("up_bias", up_bias, "i"),
            auto.ShardedArgument("down_bias", down_bias, "h"),
        ],
    )


def mlp(
    x,
    w_gate,
    w_up,
    w_down,
    *,
    activation: str = "silu",
    norm: str | None = None,
    norm_weight=None,
    norm_bias=None,
    eps: float = 1e-6,
    residual=None,
    return_residual: bool = False,
    gate_bias=None,
    up_bias=None,
    down_bias=None,
    gate_clamp=None,
    up_clamp=None,
    output_dtype=None,
    precision=None,
):
    """A transformer MLP on ``x [..., hidden]``::

        s = x + residual                     (when ``residual`` is given)
        n = norm(s)                          ``"rms"``: s / rms(s) * norm_weight (no weight: unscaled);
                                             ``"layer"``: (s - mean) / std * norm_weight + norm_bias
        h = act(n w_gate + gate_bias) * (n w_up + up_bias)    (``w_gate=None``: h = act(n w_up + up_bias))
        out = h w_down + down_bias

    ``w_gate, w_up [hidden, inter]``, ``w_down [inter, hidden]``, biases and norm parameters 1-D. ``activation``:
    ``"silu"`` (= ``"swish"``, so the default is SwiGLU), ``"gelu"`` (erf), ``"gelu_tanh"``, ``"gelu_sigmoid"``
    (``x sigmoid(1.702 x)``) or ``"relu"``. ``gate_clamp`` / ``up_clamp`` are ``(lower, upper)`` bounds applied to
    the gate / up projections before the activation (static floats or ``None`` for an open side; not NaN, ``lower
    <= upper``). ``eps`` (of the norm) is a static finite float >= 0. Returns ``out`` with ``x``'s shape (dtype
    ``output_dtype``, default ``x``'s), and ``(out, x + residual)`` when ``return_residual`` (a static bool); with no
    tokens (``x.size == 0``) the result is empty, without a kernel call.

    Quantized weights: ``w_gate``, ``w_up`` and ``w_down`` may instead all be ``jax_nkilib.QuantizedWeight`` of one
    mode (from ``jax_nkilib.quantize_weight_fp8``; ``W ~= data * scale``), the kernel's FP8 ROW / STATIC
    quantization: each projection is ``(a data) * scale * a_scale``. The TKG path (<= 96 tokens) keeps the activations
    ``a`` in the compute dtype (``a_scale = 1``); the CTE path quantizes the gate/up input and the intermediate to
    the consuming weight's FP8 format (ROW: per token, ``a_scale = max(absmax / 240, 1e-6)``; STATIC: ``fp8(clip(a /
    input_scale, +-240))``, ``a_scale = input_scale``, ``w_up``'s for gate and up, which must equal ``w_gate``'s).
    Not with ``down_bias`` on the CTE path (the kernel has none there). Quantized weights get no gradient; ``x`` and
    the other float arguments get the kernel's VJP (activation quantization passed straight through).

    Precision: float32 inputs compute in float32 off Neuron (JAX's convention, as ``x @ w``), unless bfloat16
    compute, the kernel's, is asked for: ``precision="bfloat16"`` (or ``jax.lax.DotAlgorithmPreset.BF16_BF16_F32`` /
    ``BF16_BF16_BF16``), or, with ``precision=None`` (the default), ``jax.default_matmul_precision("bfloat16")``
    (read at trace time). Other values (``"default"``, ``"highest"``, ``"float32"``, a ``jax.lax.Precision``...)
    keep float32. No effect on bfloat16, float16 or float64 inputs, nor on the TKG path (<= 96 tokens).

    Differentiable in every array argument. It is one ``jax_nkilib.nki.mlp`` call on ``x`` reshaped to
    ``[batch, seq, hidden]``: on Neuron the kernel, whose CTE path (more than 96 tokens) computes float32 inputs in
    bfloat16 whatever ``precision`` says (``jax_nkilib.explain`` notes it for such calls); ``jax_nkilib.nki.mlp`` is
    the kernel's numerics everywhere.
    """
    x = _array("x", x)
    weights = {"w_up": w_up, "w_gate": w_gate, "w_down": w_down}
    weights = {name: None if w is None and name == "w_gate" else _weight(name, w) for name, w in weights.items()}
    dims = check_operand_layouts(
        _WHERE,
        LAYOUTS,
        dtypes=dict.fromkeys(weights),  # checked by _weight (a QuantizedWeight's layout is its data's)
        positive=("hidden", "inter"),
        x=x,
        **{name: w.data if isinstance(w, QuantizedWeight) else w for name, w in weights.items()},
        norm_weight=norm_weight,
        norm_bias=norm_bias,
        gate_bias=gate_bias,
        up_bias=up_bias,
        down_bias=down_bias,
    )
    auto.leading(x.ndim - 1, _WHERE)
    hidden, inter = dims["hidden"], dims["inter"]
    quant = _quantization(w_gate, w_up, w_down)
    eps = static_float(_WHERE, "eps", eps, minimum=0.0)
    return_residual = static_bool(_WHERE, "return_residual", return_residual)
    (gate_low, gate_high), (up_low, up_high) = _clamp("gate_clamp", gate_clamp), _clamp("up_clamp", up_clamp)
    output_dtype = _output_dtype(output_dtype)
    compute = float32_compute(_WHERE, precision)
    sharded = _plan_mlp(
        x,
        w_gate,
        w_up,
        w_down,
        norm_weight,
        norm_bias,
        residual,
        gate_bias,
        up_bias,
        down_bias,
        quantized=quant != QuantizationType.NONE,
    )
    if sharded:
        flags = dict(
            activation=activation,
            norm=norm,
            eps=eps,
            return_residual=return_residual,
            gate_clamp=gate_clamp,
            up_clamp=up_clamp,
            output_dtype=output_dtype,
            precision=compute,
        )

        def local(x, w_gate, w_up, w_down, norm_weight, norm_bias, residual, gate_bias, up_bias, down_bias, axes):
            if "i" not in axes:
                return mlp(
                    x,
                    w_gate,
                    w_up,
                    w_down,
                    norm_weight=norm_weight,
                    norm_bias=norm_bias,
                    residual=residual,
                    gate_bias=gate_bias,
                    up_bias=up_bias,
                    down_bias=down_bias,
                    **flags,
                )
            # Megatron: gate/up column-parallel, down row-parallel; one all-reduce, then the down bias
            outs = mlp(
                x,
                w_gate,
                w_up,
                w_down,
                norm_weight=norm_weight,
                norm_bias=norm_bias,
                residual=residual,
                gate_bias=gate_bias,
                up_bias=up_bias,
                **flags,
            )
            out = outs[0] if return_residual else outs
            out = jax.lax.psum(out, axes["i"])
            if down_bias is not None:
                out = out + jnp.asarray(down_bias).astype(out.dtype)
            return (out, outs[1]) if return_residual else out

        rows = auto.leading(x.ndim - 1) + "h"
        return sharded.run(local, (rows, rows) if return_residual else rows)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_WHERE}: `activation` must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    norm_type_of(_WHERE, norm)  # a valid name
    if norm is None and (norm_weight is not None or norm_bias is not None):
        raise ValueError(f"{_WHERE}: `norm_weight`/`norm_bias` need norm='rms' or norm='layer'")
    if norm == "rms" and norm_bias is not None:
        raise ValueError(f"{_WHERE}: `norm_bias` is only supported with norm='layer'")
    if residual is not None and (_array("residual", residual).shape != x.shape):
        raise ValueError(f"{_WHERE}: `residual` must have x's shape {tuple(x.shape)}; got {tuple(residual.shape)}")
    if return_residual and residual is None:
        raise ValueError(f"{_WHERE}: return_residual=True needs `residual`")
    gamma = _row(norm_weight, hidden)
    if norm == "layer" and gamma is None:
        gamma = jnp.ones((1, hidden), x.dtype)
    norm_type = norm_type_of(_WHERE, norm, has_gamma=gamma is not None)
    if w_gate is None and (gate_bias is not None or gate_clamp is not None):
        raise ValueError(f"{_WHERE}: `gate_bias` and `gate_clamp` need `w_gate` (w_gate=None computes act(n w_up))")
    if x.size == 0:  # no tokens: nothing for a kernel to compute
        out = jnp.zeros(x.shape, output_dtype or x.dtype)
        return (out, x + jnp.asarray(residual).astype(x.dtype)) if return_residual else out
    lead = x.shape[:-1]
    shape3 = (math.prod(lead[:-1]), lead[-1], hidden) if lead else (1, 1, hidden)
    tokens = math.prod(shape3[:2])
    if quant != QuantizationType.NONE and not is_tkg(tokens, False) and down_bias is not None:
        raise ValueError(
            f"{_WHERE}: `down_bias` with quantized weights needs the TKG path (<= {TKG_TOKEN_THRESHOLD} "
            f"tokens): the kernel's CTE path has no FP8 down-projection bias; got {tokens} tokens"
        )
    operands = {
        "hidden_tensor": x.reshape(shape3),
        "gate_proj_weights_tensor": _data(w_up if w_gate is None else w_gate),  # unread with skip_gate_proj
        "up_proj_weights_tensor": _data(w_up),
        "down_proj_weights_tensor": _data(w_down),
        "normalization_weights_tensor": gamma,
        "gate_proj_bias_tensor": None if w_gate is None else _row(gate_bias, inter),
        "up_proj_bias_tensor": _row(up_bias, inter),
        "down_proj_bias_tensor": _row(down_bias, hidden),
        "normalization_bias_tensor": _row(norm_bias, hidden),
        "fused_add_tensor": None if residual is None else jnp.asarray(residual).reshape(shape3),
        **_scales(quant, w_gate, w_up, w_down),
    }
    params = mlp_kernel.params(
        store_fused_add_result=return_residual,
        activation_fn=ACTIVATIONS[activation],
        normalization_type=norm_type,
        output_dtype=output_dtype,
        eps=eps,
        skip_gate_proj=w_gate is None,
        gate_clamp_upper_limit=gate_high,
        gate_clamp_lower_limit=gate_low,
        up_clamp_upper_limit=up_high,
        up_clamp_lower_limit=up_low,
        quantization_type=quant,
        float32_compute=compute,
    )
    outs = mlp_kernel.call(operands, params)
    outs = tuple(out.reshape(x.shape) for out in outs)
    return outs if return_residual else outs[0]
