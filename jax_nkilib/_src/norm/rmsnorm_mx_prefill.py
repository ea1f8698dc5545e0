"""``rmsnorm_mx_prefill`` (catalog row 87, docs-only; ``nkilib.core.rmsnorm.rmsnorm_mx_prefill``): RMS norm of
token-major hidden states, MXFP8 quantization into one packed row per token, an optional fused router top-K and an
optional bfloat16 norm output. Bound version: the one with ``n_group``/``topk_group``/``routed_scaling_factor``,
``emit_norm_bf16`` and ``hidden_interleaved`` (the signature of its torch reference ``rmsnorm_mx_prefill_torch_ref``).

Operands: ``hidden_states [B, S, H]`` (``H % 512 == 0``), ``gamma [1, H]`` or ``[H]`` (natural H order),
``router_weights [H, E]`` (optional; rows pre-permuted to the kernel's swizzle, and for NOAUX_TC also
partition-major: see :func:`swizzle_router_weights`), ``router_bias [1, E]`` or ``[E]`` (optional, needs
``router_weights``; required by NOAUX_TC), ``residual [B, S, H]`` (optional).

Outputs, in the kernel's order (``T = B*S``):

* ``norm_quant_packed``: float8_e4m3fn ``[T, H + scale_region]``, each row the fp8 elements (natural H) then the e8m0
  scale bytes (as fp8 bit patterns); with a router and ``pack_affinities``: the same bytes followed by the
  affinities ``[E]`` and zero padding to ``R`` bytes (``R % 4 == 0``), viewed as the affinity dtype;
* ``expert_index`` int32 ``[T, top_k]`` (SIGMOID / SOFTMAX router);
* ``expert_affinities`` ``[T, E]``, bfloat16 (float32 for NOAUX_TC) (router, unless ``pack_affinities``);
* ``output_residual`` ``[T, H]`` in residual's dtype, the pre-norm sum in the inputs' H order (``residual``);
* ``norm_bf16`` bfloat16 ``[T, H]``, the unquantized norm in natural H order (``emit_norm_bf16``).

The math, the byte layouts and the scale convention (the reference's alternative emax: scale ``clip(E - 7, 0, 255)``)
are in :mod:`.rmsnorm_mx_prefill_math`. Numerics follow the torch reference: the norm in float32, rounded once to
the compute dtype (``router_weights``' dtype with a router, else the input's) before quantization and routing. The
device kernel rounds ``hidden * gamma`` and ``inv_rms`` to the compute dtype first and scales the logits by
``inv_rms`` after the matmul, so its bytes can differ from these by one compute-dtype rounding (what the reference
tolerates). Unused scale bytes are undefined on the device and 0 here; top-K ties pick the lower expert here (the
device's ``max8``/``find_index8`` order is not specified).

NOAUX_TC follows the kernel (and its docstring): the bias only selects, the affinities normalize the pre-bias sigmoid
scores. The torch reference's code also adds ``router_bias`` to the logits before the sigmoid (so twice), which its
own comments and the kernel contradict; its test then compares with a loose cosine bound. NOAUX_TC weights are
partition-major as its kernel path and test load them. ``n_group``, ``topk_group`` and ``routed_scaling_factor`` are
ignored by SIGMOID/SOFTMAX, as in the kernel. Not bound (``ValueError``): ``qmx_output_dtype`` other than
float8_e4m3fn (x4).

Gradients: ``output_residual`` and ``norm_bf16`` are differentiable (JAX math without the roundings); the packed
row, the indices and the affinities are not (zero cotangents). Neuron limits (else the reference runs): 16-bit
``hidden_states`` and ``router_weights``, ``E <= 512``, ``top_k <= 8``, NOAUX_TC ``n_group <= 8``; quantize_mx needs
Trn3.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.common_types import RouterActFnType
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param, enum_member
from . import rmsnorm_mx_prefill_reference as math

KERNEL_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MAX_EXPERTS = 512
MAX_TOP_K = 8


def swizzle_router_weights(weights, router_act_fn=RouterActFnType.SIGMOID):
    """Natural ``[H, E]`` router weights -> the row order ``rmsnorm_mx_prefill`` takes for ``router_act_fn``: the
    kernel's swizzle (``W[swizzle_h_index(H)]``), and for NOAUX_TC those rows partition-major."""
    weights = jnp.asarray(weights)
    if weights.ndim != 2 or weights.shape[0] % math.H_BLOCK:
        raise ValueError(f"swizzle_router_weights: expected [H, E] weights with H % 512 == 0; got {weights.shape}")
    noaux = enum_member(RouterActFnType, router_act_fn, "swizzle_router_weights: `router_act_fn`")
    return jnp.take(weights, math.router_h_index(weights.shape[0], noaux == RouterActFnType.NOAUX_TC), axis=0)


# ------------------------------------------------------------------------------------------------ output shapes
def _noaux(params) -> bool:
    return params["router_act_fn"] == RouterActFnType.NOAUX_TC


def _affinity_dtype(params):
    return np.dtype(math.NOAUX_AFFINITY_DTYPE if _noaux(params) else math.AFFINITY_DTYPE)


def _produced(params, present) -> list[str]:
    """The names of the outputs a call with these params and present operands returns, in the kernel's order."""
    router = "router_weights" in present
    names = ["norm_quant_packed"]
    if router and not _noaux(params):
        names.append("expert_index")
    if router and not params["pack_affinities"]:
        names.append("expert_affinities")
    if "residual" in present:
        names.append("output_residual")
    if params["emit_norm_bf16"]:
        names.append("norm_bf16")
    return names


def _outputs(call: CallInfo):
    """The outputs of the module docstring, over ``T = B * S`` tokens."""
    p, dims, avals = call.params, call.dims, call.avals
    present = [name for name, aval in avals.items() if aval is not None]
    tokens, hidden, affinity = dims["B"] * dims["S"], dims["H"], _affinity_dtype(p)
    if "router_weights" in present and p["pack_affinities"]:  # the row viewed as affinity-dtype elements
        row = math.packed_row_bytes(hidden, p["pack_scales"], dims["E"] * affinity.itemsize) // affinity.itemsize
        packed = ((tokens, row), affinity)
    else:
        packed = ((tokens, math.packed_row_bytes(hidden, p["pack_scales"], 0)), jnp.float8_e4m3fn)
    every = {
        "norm_quant_packed": lambda: packed,
        "expert_index": lambda: ((tokens, p["top_k"]), jnp.int32),
        "expert_affinities": lambda: ((tokens, dims["E"]), affinity),
        "output_residual": lambda: ((tokens, hidden), avals["residual"].dtype),
        "norm_bf16": lambda: ((tokens, hidden), jnp.bfloat16),
    }
    return [(name, *every[name]()) for name in _produced(p, present)]


# ------------------------------------------------------------------------------------------------ reference
def reference_rmsnorm_mx_prefill(
    hidden_states,
    gamma,
    router_weights=None,
    router_bias=None,
    residual=None,
    *,
    eps,
    top_k,
    router_act_fn,
    n_group,
    topk_group,
    routed_scaling_factor,
    qmx_output_dtype,
    pack_scales,
    pack_affinities,
    unpadded_hidden_size,
    emit_norm_bf16,
    hidden_interleaved,
):
    """JAX reference: the kernel's outputs (see the module doc)."""
    del qmx_output_dtype  # checked: the one format
    x = math.prenorm_sum(hidden_states, residual, rounded=True)
    norm = math.normalized(
        x, gamma, eps=eps, unpadded_hidden_size=unpadded_hidden_size, hidden_interleaved=hidden_interleaved
    )
    compute_dtype = hidden_states.dtype if router_weights is None else router_weights.dtype
    y = norm.astype(compute_dtype)
    row = math.quantized_row_bytes(y, pack_scales)
    outs = []
    if router_weights is None:
        outs.append(jax.lax.bitcast_convert_type(row, math.ELEMENT_DTYPE))
    else:
        if router_act_fn == RouterActFnType.NOAUX_TC:
            index = ()
            affinities = math.router_noaux_tc(
                y,
                router_weights,
                router_bias,
                top_k=top_k,
                n_group=n_group,
                topk_group=topk_group,
                routed_scaling_factor=routed_scaling_factor,
            )
            affinities = affinities.astype(math.NOAUX_AFFINITY_DTYPE)
        else:
            del n_group, topk_group, routed_scaling_factor  # NOAUX_TC only, as in the kernel
            index, affinities = math.router_topk(
                y, router_weights, router_bias, top_k=top_k, softmax=router_act_fn == RouterActFnType.SOFTMAX
            )
            index, affinities = (index,), affinities.astype(math.AFFINITY_DTYPE)
        if pack_affinities:
            outs += [math.with_affinities(row, affinities), *index]
        else:
            outs += [jax.lax.bitcast_convert_type(row, math.ELEMENT_DTYPE), *index, affinities]
    if residual is not None:
        outs.append(x.astype(residual.dtype))
    if emit_norm_bf16:
        outs.append(norm.astype(jnp.bfloat16))
    return tuple(outs)


# ------------------------------------------------------------------------------------------------ checks
def _check(call: CallInfo) -> None:
    dims, p, avals, function = call.dims, call.params, call.avals, call.function
    h = dims["H"]
    if h % math.H_BLOCK:
        raise ValueError(
            f"{function}: H={h} must be a multiple of 512 (the kernel quantizes H512 tiles; pad H with "
            "zeros and pass unpadded_hidden_size)"
        )
    actual = p["unpadded_hidden_size"]
    if actual is not None and not 0 < actual <= h:
        raise ValueError(f"{function}: unpadded_hidden_size must be in (0, H={h}]; got {actual}")
    if p["qmx_output_dtype"] != np.dtype(math.ELEMENT_DTYPE):
        raise ValueError(
            f"{function}: qmx_output_dtype must be float8_e4m3fn (the float8_e4m3fn_x4 packing; the only "
            f"format bound); got {p['qmx_output_dtype']}"
        )
    router = avals.get("router_weights") is not None
    if avals.get("router_bias") is not None and not router:
        raise ValueError(f"{function}: router_bias [1, E] is given without router_weights [H, E]")
    if router and not 1 <= p["top_k"] <= dims["E"]:
        raise ValueError(
            f"{function}: top_k must be in [1, E={dims['E']}] (experts selected per token); got {p['top_k']}"
        )
    if router and _noaux(p):
        if avals.get("router_bias") is None:
            raise ValueError(
                f"{function}: router_act_fn=NOAUX_TC needs router_bias [1, E] (the "
                "e_score_correction_bias that selects the experts)"
            )
        if p["n_group"] < 1 or dims["E"] % p["n_group"]:
            raise ValueError(
                f"{function}: n_group must be a positive divisor of E={dims['E']} for NOAUX_TC; got {p['n_group']}"
            )
        if not 1 <= p["topk_group"] <= p["n_group"]:
            raise ValueError(
                f"{function}: topk_group must be in [1, n_group={p['n_group']}] for NOAUX_TC; got {p['topk_group']}"
            )


def _neuron_limits(call: CallInfo) -> list[str]:
    avals, dims, p, unmet = call.avals, call.dims, call.params, []
    if avals["hidden_states"].dtype not in KERNEL_DTYPES:
        unmet.append(f"hidden_states must be bfloat16 or float16; got {avals['hidden_states'].dtype}")
    if avals.get("router_weights") is not None:
        if avals["router_weights"].dtype not in KERNEL_DTYPES:
            unmet.append(
                f"router_weights (the compute dtype) must be bfloat16 or float16; got {avals['router_weights'].dtype}"
            )
        if dims["E"] > MAX_EXPERTS:
            unmet.append(f"E={dims['E']} must be <= {MAX_EXPERTS}")
        if p["top_k"] > MAX_TOP_K:
            unmet.append(f"top_k={p['top_k']} must be <= {MAX_TOP_K}")
        if _noaux(p) and p["n_group"] > MAX_TOP_K:  # max8-based group selection
            unmet.append(f"NOAUX_TC needs n_group <= {MAX_TOP_K}; got n_group={p['n_group']}")
    return unmet


# ------------------------------------------------------------------------------------------------ gradients
def _vjp(kernel, operands, params, outs, cotangents):
    """Gradients of ``output_residual`` and ``norm_bf16`` through the unrounded math."""
    names = [name for name in ("hidden_states", "gamma", "residual") if operands[name] is not None]
    produced = _produced(params, [name for name, value in operands.items() if value is not None])
    wanted_names = [name for name in ("output_residual", "norm_bf16") if name in produced]
    if not wanted_names:
        return {}

    def outputs(named):
        x = math.prenorm_sum(named["hidden_states"], named["residual"], rounded=False)
        results = {
            "output_residual": x,
            "norm_bf16": math.normalized(
                x,
                named["gamma"],
                eps=params["eps"],
                unpadded_hidden_size=params["unpadded_hidden_size"],
                hidden_interleaved=params["hidden_interleaved"],
            ),
        }
        return tuple(results[name] for name in wanted_names)

    return pull_back(outputs, operands, names, tuple(cotangents[produced.index(name)] for name in wanted_names))


RMSNORM_MX_PREFILL_SPEC = KernelSpec(
    name="rmsnorm_mx_prefill",
    entry_point="nkilib.core.rmsnorm.rmsnorm_mx_prefill:rmsnorm_mx_prefill",
    operands=(
        Operand.of("hidden_states", "B, S, H", doc="token-major hidden states (natural or 4-way interleaved H)"),
        Operand.of("gamma", "1, H", "H", doc="RMS norm weights, natural H order"),
        Operand.of("router_weights", "H, E", optional=True, doc="router weights, rows in the kernel's swizzle order"),
        Operand.of("router_bias", "1, E", "E", optional=True, doc="added to the router logits"),
        Operand.of("residual", "B, S, H", optional=True, doc="added to hidden_states before the norm"),
    ),
    params=(
        Param("eps", 1e-6, float, "added to the mean square"),
        Param("top_k", 1, int, "experts selected per token (router)"),
        Param("router_act_fn", RouterActFnType.SIGMOID, RouterActFnType, "SIGMOID, SOFTMAX or NOAUX_TC"),
        Param("n_group", 1, int, "NOAUX_TC: expert groups"),
        Param("topk_group", 1, int, "NOAUX_TC: groups kept"),
        Param("routed_scaling_factor", 1.0, float, "NOAUX_TC: affinity multiplier"),
        Param("qmx_output_dtype", "float8_e4m3fn", "dtype-x4", "MX element format: float8_e4m3fn (x4) only"),
        Param("pack_scales", True, bool, "fold 4 H512 tiles' scales into one 128-byte block"),
        Param("pack_affinities", False, bool, "router: append the affinities to the packed row"),
        Param("unpadded_hidden_size", None, int, "the mean's denominator (default H)"),
        Param("emit_norm_bf16", False, bool, "also return the bfloat16 norm"),
        Param("hidden_interleaved", False, bool, "hidden_states/residual in the 4-way interleaved H order"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_rmsnorm_mx_prefill,
    check=_check,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {"hidden_states": "B", "residual": "B", "gamma": None, "router_weights": None, "router_bias": None},
            outputs={
                "norm_quant_packed": 0,
                "expert_index": 0,
                "expert_affinities": 0,
                "output_residual": 0,
                "norm_bf16": 0,
            },
        ),
    ),
    mac_count=lambda call: call.dims["B"] * call.dims["S"] * call.dims["H"] * (4 + call.dims.get("E", 0)),
    nondifferentiable_outputs=("norm_quant_packed", "expert_index", "expert_affinities"),
    family="norm",
    catalog="row 87",
    support={
        "idiomatic": "",
        "vjp": "JAX for output_residual and norm_bf16; the packed MX row, indices and affinities have zero cotangents",
        "notes": "MXFP8 e4m3 packed rows [T, H + scales] with the reference's alternative emax, router "
        "SIGMOID/SOFTMAX top-K or NOAUX_TC; Neuron (Trn3): 16-bit hidden_states and router_weights, "
        f"E <= {MAX_EXPERTS}, top_k <= {MAX_TOP_K}",
    },
)

rmsnorm_mx_prefill = make_kernel(RMSNORM_MX_PREFILL_SPEC, vjp=_vjp)
