"""``moe_tkg`` (catalog 1.11; nki-library ``core/moe/moe_tkg/moe_tkg.py``, torch ref ``moe_tkg_torch.py``): the
token-generation mixture-of-experts MLP, a subkernel that the adapter ``jax_nkilib_kernels/moe_tkg.py`` wraps.

Operands (``T`` tokens, ``H`` hidden, ``I`` intermediate, ``E`` global experts, ``E_L`` experts held here, ``K``
top-k), all row-major JAX arrays:

* ``hidden_input [T, H]`` (float; the kernel takes bfloat16/float16);
* ``expert_gate_up_weights [E_L, H, 2, I]``: ``[e, :, 0, :]`` is expert ``e``'s gate projection ``[H, I]``,
  ``[e, :, 1, :]`` its up projection (``x @ W``, in -> out); ``expert_down_weights [E_L, I, H]``;
* ``expert_affinities [T, E]`` (float; scores over the *global* experts) and ``expert_index [T, K]`` (int32 or
  uint32 expert ids);
* ``rank_id [1, 1]`` (int32/uint32, all-expert mode with ``POST_SCALE``);
* ``expert_gate_up_bias [E_L, 2, I]``, ``expert_down_bias [E_L, H]``;
* FP8 row scales (float32, one per output column; both or neither; required for FP8 weights):
  ``expert_gate_up_weights_scale [E_L, 2, I]``, ``expert_down_weights_scale [E_L, H]``.

MX weights instead: x4 words, uint16 for MXFP4 (``float4_e2m1fn_x4``) or uint32 for MXFP8 (``float8_e4m3fn_x4``),
``expert_gate_up_weights [E_L, 128, 2, H/512, I]`` (lane ``j`` of word ``[e, p, c, t, i]`` is row ``j H/4 + 128 t +
p`` of projection ``c``), ``expert_down_weights [E_L, P_I, N_I, H]`` (``P_I = min(128, I/4)``, ``N_I =
ceil(I/512)``, lanes along ``I`` as the MLP TKG MX layout), uint8 scales ``[E_L, 16, 2, H/512, I]`` /
``[E_L, P_I/8, N_I, H]`` (required), gate/up bias ``[E_L, P_I, 2, N_I, 4]``; ``I % 32 == 0``. The hidden states
and the intermediate then take the kernel's MXFP8 round trips (:mod:`..mlp.mlp_reference`).

Output ``out [T, H]`` in ``output_dtype`` (default: ``hidden_input``'s). Modes (expert math in
:mod:`.expert_mlp`):

* selective (``is_all_expert=False``): ``out[t] = sum_k c_tk * y_{index[t, k]}(x_t)`` with ``c_tk =
  affinities[t, index[t, k]]`` under ``POST_SCALE``, 1 under ``NO_SCALE``. Indices address the ``E_L`` weights
  directly; a row with an index outside ``[0, E_L)`` comes out NaN.
* all-expert (``is_all_expert=True``): ``out[t] = sum_j c_tj * y_j(x_t)`` over the local experts ``j < E_L``, which
  are global experts ``rank_id * E_L + j``. ``NO_SCALE``: ``c = 1`` (affinities and indices unused).
  ``POST_SCALE``: ``c_tj = affinities[t, rank_id * E_L + j]``, times (``mask_unselected_experts``) the number of
  times token ``t`` lists that expert in ``expert_index``. ``is_all_expert_dynamic`` / ``block_size`` select the
  kernel's block-skipping loop for MX weights; they do not change the result.

Not bound: the SBUF-resident input and output (``hidden_input_scale``, ``output_in_sbuf``),
``expert_affinities_eager`` (read only by the MX selective path) and the static-quantization input scales (the
kernel asserts they are None). ``PRE_SCALE*`` modes are refused as the kernel refuses them. Reverse mode
differentiates this reference (no backward kernel), straight through the MX activation round trips: hidden states,
affinities, float weights, biases and row scales get gradients; FP8 and MX weights and integer operands none.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework import runtime_checks
from ..framework.common_types import ActFnType, ExpertAffinityScaleMode
from ..framework.hardware import PARTITIONS
from ..framework.primitive import make_kernel, pull_back
from ..framework.spec import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    CallInfo,
    FoldPlan,
    KernelSpec,
    Operand,
    Param,
    accumulation_dtype,
)
from ..mlp.mlp_reference import mx_quantize_hidden
from .expert_mlp import EXPERT_WEIGHTS, Datapath, dense_combination, gathered_combination, local_affinities

SELECTIVE_MAX_TOKENS = 128  # the selective path holds the tokens on the 128 partitions
INDEX_DTYPES = (jnp.int32, jnp.uint32)
KERNEL_ACTIVATIONS = ("SiLU", "GELU", "GELU_Tanh_Approx", "Swish")
KERNEL_HIDDEN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
UNSUPPORTED_SCALING = (ExpertAffinityScaleMode.PRE_SCALE, ExpertAffinityScaleMode.PRE_SCALE_DELAYED)
# MX x4 weight words (the kernel takes float4_e2m1fn_x4 and float8_e4m3fn_x4) and their element types
MX_WORD_FORMATS = {
    jnp.dtype(jnp.uint16): jnp.dtype(jnp.float4_e2m1fn),
    jnp.dtype(jnp.uint32): jnp.dtype(jnp.float8_e4m3fn),
    jnp.dtype(jnp.int32): jnp.dtype(jnp.float8_e4m3fn),
}
MX_INTERMEDIATE_MULTIPLE = 32  # the MX down layout [min(128, I/4), ceil(I/512), H] x4 bound here


def _coefficient(affinity, io, acc):
    """The all-expert path's affinity as the kernel multiplies it: rounded to the io dtype."""
    return affinity.astype(io).astype(acc)


def mx_format(words_dtype):
    """The MX element type of x4 weight words (uint16: ``float4_e2m1fn``; 32-bit: ``float8_e4m3fn``), or ``None``
    for dense weights."""
    return MX_WORD_FORMATS.get(jnp.dtype(words_dtype))


def moe_tkg_forward(operands, p, exact: bool = False):
    """The kernel's math on operands by name (see the module docstring), in the accumulation dtype. ``exact``
    leaves out the MXFP8 activation round trips (the straight-through function the VJP differentiates)."""
    x = operands["hidden_input"]
    io, acc = x.dtype, accumulation_dtype(x.dtype)
    fmt = mx_format(operands["expert_gate_up_weights"].dtype)
    xa = x.astype(acc)
    if fmt is not None and not exact:
        xa = mx_quantize_hidden(xa)
    weights = [operands[name] for name in EXPERT_WEIGHTS]
    local = weights[0].shape[0]
    index, affinities = operands["expert_index"], operands["expert_affinities"]
    post_scale = p["expert_affinities_scaling_mode"] == ExpertAffinityScaleMode.POST_SCALE
    if p["is_all_expert"]:
        path = Datapath(io, round_intermediate=False, mx_format=fmt, quantize=not exact)
        if post_scale:
            local_aff = local_affinities(
                affinities, index, operands["rank_id"], local, p["mask_unselected_experts"], acc
            )
            coefficients = _coefficient(local_aff, io, acc)
        else:
            coefficients = jnp.ones((x.shape[0], local), acc)
        return dense_combination(xa, weights, coefficients, p, path)
    path = Datapath(io, round_intermediate=True, mx_format=fmt, quantize=not exact)
    tokens, top_k = index.shape
    index = index.astype(jnp.int32)
    valid = (index >= 0) & (index < local)
    if post_scale:  # the selective path scales by the affinity as given (the all-expert path rounds it to io)
        picked = jnp.take_along_axis(affinities, jnp.clip(index, 0, affinities.shape[1] - 1), axis=1)
        per_choice = picked.astype(acc)
    else:
        per_choice = jnp.ones(index.shape, acc)
    if tokens * top_k <= local:  # few tokens, many experts: evaluate only the chosen ones
        out = gathered_combination(xa, weights, index, per_choice, p, path)
    else:
        chosen = (index[:, :, None] == jnp.arange(local)[None, None, :]).astype(acc)  # [T, K, E_L]
        coefficients = jnp.einsum("tk,tke->te", per_choice, chosen)
        out = dense_combination(xa, weights, coefficients, p, path)
    return jnp.where(jnp.all(valid, axis=1, keepdims=True), out, jnp.nan)


def reference_moe_tkg(
    hidden_input, expert_gate_up_weights, expert_down_weights, expert_affinities, expert_index, **rest
):
    """JAX reference of ``moe_tkg``: ``(out [T, H],)``; ``rest`` holds the optional operands (by name) and the
    params."""
    operands = dict(
        hidden_input=hidden_input,
        expert_gate_up_weights=expert_gate_up_weights,
        expert_down_weights=expert_down_weights,
        expert_affinities=expert_affinities,
        expert_index=expert_index,
        rank_id=rest["rank_id"],
        **{name: rest[name] for name in EXPERT_WEIGHTS[2:]},
    )
    out = moe_tkg_forward(operands, rest)
    return (out.astype(rest["output_dtype"] or hidden_input.dtype),)


# ---------------------------------------------------------------------------------------------------- checks
def check_expert_flags(call: CallInfo, activation: str = "activation_fn") -> None:
    """The flag rules ``moe_tkg`` and ``moe_block_tkg`` share (the kernel's own assertions); ``activation`` names
    the experts' activation param."""
    p, f = call.params, call.function
    if p[activation].name not in KERNEL_ACTIVATIONS:
        raise ValueError(f"{f}: `{activation}` must be one of {', '.join(KERNEL_ACTIVATIONS)}; got {p[activation]}")
    if p["expert_affinities_scaling_mode"] in UNSUPPORTED_SCALING:
        raise ValueError(
            f"{f}: `expert_affinities_scaling_mode` must be NO_SCALE or POST_SCALE (the kernel does not support "
            f"{p['expert_affinities_scaling_mode'].name}); got {p['expert_affinities_scaling_mode'].name}"
        )
    weights = call.avals["expert_gate_up_weights"]
    scales = [call.avals.get(n) is not None for n in ("expert_gate_up_weights_scale", "expert_down_weights_scale")]
    if any(scales) and not all(scales):
        raise ValueError(
            f"{f}: FP8 row scales come in pairs: give both `expert_gate_up_weights_scale` [E_L, 2, I] and "
            "`expert_down_weights_scale` [E_L, H], or neither"
        )
    _check_weight_format(call)
    fp8 = [jnp.dtype(call.avals[n].dtype) in FP8_DTYPES for n in ("expert_gate_up_weights", "expert_down_weights")]
    if any(fp8) and not all(scales):
        raise ValueError(
            f"{f}: FP8 expert weights ({weights.dtype}) need their row scales `expert_gate_up_weights_scale` "
            "[E_L, 2, I] and `expert_down_weights_scale` [E_L, H]"
        )


def _check_weight_format(call: CallInfo) -> None:
    """Dense (float or FP8) weights with dense biases and float row scales, or MX x4 words with MX biases and uint8
    scales, never a mix."""
    f, avals = call.function, call.avals
    words = [mx_format(avals[n].dtype) for n in ("expert_gate_up_weights", "expert_down_weights")]
    if words[0] != words[1]:
        raise TypeError(
            f"{f}: `expert_gate_up_weights` and `expert_down_weights` must both be MX x4 words of one type or both "
            f"dense; got {avals['expert_gate_up_weights'].dtype} and {avals['expert_down_weights'].dtype}"
        )
    mx = words[0] is not None
    ranks = {
        "expert_gate_up_weights": (4, 5),
        "expert_down_weights": (3, 4),
        "expert_gate_up_bias": (3, 5),
        "expert_gate_up_weights_scale": (3, 5),
        "expert_down_weights_scale": (2, 4),
    }
    for name, (dense_rank, mx_rank) in ranks.items():
        aval = avals.get(name)
        if aval is not None and aval.ndim != (mx_rank if mx else dense_rank):
            kind = "MX (x4 words)" if mx else "dense"
            raise ValueError(
                f"{f}: with {kind} expert weights, `{name}` must have rank {mx_rank if mx else dense_rank}; got shape "
                f"{tuple(aval.shape)}"
            )
    for name in ("expert_gate_up_weights_scale", "expert_down_weights_scale"):
        aval = avals.get(name)
        if aval is not None and (jnp.dtype(aval.dtype) == jnp.uint8) != mx:
            raise TypeError(f"{f}: `{name}` must be uint8 MX scales with MX weights, float row scales otherwise")
    if mx:
        inter, dims = call.dims["I"], call.dims
        if inter % MX_INTERMEDIATE_MULTIPLE:
            raise ValueError(f"{f}: MX expert weights are bound for I % {MX_INTERMEDIATE_MULTIPLE} == 0; got I={inter}")
        want = (min(128, inter // 4), -(-inter // 512))
        if (dims["P_I"], dims["N_I"]) != want:
            raise ValueError(
                f"{f}: MX `expert_down_weights` must be [E_L, P_I={want[0]}, N_I={want[1]}, H] for I={inter}; got "
                f"{tuple(avals['expert_down_weights'].shape)}"
            )
        if not all(avals.get(n) is not None for n in ("expert_gate_up_weights_scale", "expert_down_weights_scale")):
            raise ValueError(f"{f}: MX expert weights need their uint8 scales (both weight scales)")


def _check_block_size(call: CallInfo) -> None:
    p, f, tokens = call.params, call.function, call.dims["T"]
    if not p["is_all_expert"]:
        raise ValueError(f"{f}: `is_all_expert_dynamic=True` requires `is_all_expert=True`")
    size = p["block_size"]
    if size is None:
        raise ValueError(f"{f}: `is_all_expert_dynamic=True` requires `block_size` (a divisor of T={tokens})")
    if size <= 0 or tokens % size or tokens // size < 2:
        raise ValueError(f"{f}: `block_size` must divide T={tokens} into at least 2 blocks; got {size}")
    if not (size < 32 and size % 8 == 0 or size < 128 and size % 32 == 0 or size % 128 == 0):
        raise ValueError(f"{f}: `block_size` must be a multiple of 8 below 32, of 32 below 128, or of 128; got {size}")
    if p["mask_unselected_experts"] and p["expert_affinities_scaling_mode"] != ExpertAffinityScaleMode.NO_SCALE:
        raise ValueError(f"{f}: `mask_unselected_experts` cannot be combined with `is_all_expert_dynamic`")


def _check_moe_tkg(call: CallInfo) -> None:
    check_expert_flags(call)
    p, f, dims = call.params, call.function, call.dims
    post_scale = p["expert_affinities_scaling_mode"] == ExpertAffinityScaleMode.POST_SCALE
    if p["is_all_expert"] and post_scale:
        if call.avals.get("rank_id") is None:
            raise ValueError(f"{f}: all-expert mode with POST_SCALE needs `rank_id` [1, 1] (this rank's expert block)")
        if dims["E"] < dims["E_L"]:
            raise ValueError(
                f"{f}: `expert_affinities` [T, E] must cover the E_L={dims['E_L']} local experts; got E={dims['E']}"
            )
    if p["is_all_expert_dynamic"]:
        _check_block_size(call)
    if p["output_dtype"] is not None and jnp.dtype(p["output_dtype"]) not in FLOAT_DTYPES:
        raise TypeError(f"{f}: `output_dtype` must be a float dtype; got {p['output_dtype']}")


def _runtime_checks(call: CallInfo, operands) -> None:
    index, local = operands["expert_index"].astype(jnp.int32), call.dims["E_L"]
    if not call.params["is_all_expert"]:
        runtime_checks.check_all(
            (index >= 0) & (index < local),
            f"{call.function}: `expert_index` {{index}} is {{}}, outside [0, E_L={local})",
            index,
        )
    elif operands.get("rank_id") is not None and call.params["expert_affinities_scaling_mode"].name == "POST_SCALE":
        rank = operands["rank_id"].astype(jnp.int32)
        runtime_checks.check_all(
            (rank >= 0) & ((rank + 1) * local <= call.dims["E"]),
            f"{call.function}: `rank_id` is {{}}: experts rank_id*E_L .. +E_L must lie in [0, E={call.dims['E']})",
            rank,
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    unmet, dims = [], call.dims
    hidden = jnp.dtype(call.avals["hidden_input"].dtype)
    if hidden not in KERNEL_HIDDEN_DTYPES:
        unmet.append(f"the kernel takes bfloat16 or float16 hidden states; got {hidden}")
    for name in ("expert_gate_up_weights", "expert_down_weights"):
        dtype = jnp.dtype(call.avals[name].dtype)
        if dtype not in FP8_DTYPES and dtype not in MX_WORD_FORMATS and dtype != hidden:
            unmet.append(f"`{name}` must be FP8 or have the hidden states' dtype {hidden}; got {dtype}")
    if not call.params["is_all_expert"] and dims["T"] > SELECTIVE_MAX_TOKENS:
        unmet.append(f"selective mode takes T <= {SELECTIVE_MAX_TOKENS} tokens; got T={dims['T']}")
    if dims["H"] % PARTITIONS:
        unmet.append(f"H % {PARTITIONS} == 0; got H={dims['H']}")
    elif call.params["is_all_expert"] and (dims["H"] // PARTITIONS) % call.lnc:
        unmet.append(f"all-expert mode splits H/128 over the LNC={call.lnc} cores; got H={dims['H']}")
    return unmet


def _outputs(call: CallInfo):
    dtype = call.params["output_dtype"] or call.avals["hidden_input"].dtype
    return [("out", (call.dims["T"], call.dims["H"]), dtype)]


def _mac_count(call: CallInfo) -> int:
    d = call.dims
    experts = d["E_L"] if call.params["is_all_expert"] else d["K"]
    return 3 * d["T"] * experts * d["H"] * d["I"]


# The expert weight operands moe_tkg and moe_block_tkg share, in the kernels' order
_WEIGHT_DTYPES = FLOAT_DTYPES + FP8_DTYPES + tuple(MX_WORD_FORMATS)


def _mx_device_dtype(params, dtype) -> str | None:
    """MX words reach a library kernel as its x4 type (``float4_e2m1fn_x4`` / ``float8_e4m3fn_x4``); the moe_tkg
    adapter views them itself."""
    fmt = MX_WORD_FORMATS.get(jnp.dtype(dtype))
    return None if fmt is None else f"{fmt.name}_x4"


_SCALE_DTYPES = FLOAT_DTYPES + (jnp.dtype(jnp.uint8),)
# Dense layouts first, then the MX ones (x4 words; H/512 and I tiles; P_I = min(128, I/4), N_I = ceil(I/512))
EXPERT_WEIGHT_OPERANDS = (
    Operand.of(
        "expert_gate_up_weights",
        "E_L, H, 2, I",
        "E_L, 128, 2, H/512, I",
        dtypes=_WEIGHT_DTYPES,
        doc="[:, :, 0] gate, [:, :, 1] up; MX: x4 words, lane j of [e, p, c, t, i] is row j H/4 + 128 t + p",
        device_dtype=_mx_device_dtype,
    ),
    Operand.of(
        "expert_down_weights",
        "E_L, I, H",
        "E_L, P_I, N_I, H",
        dtypes=_WEIGHT_DTYPES,
        doc="down projection; MX: x4 words along I in the MLP TKG MX layout",
        device_dtype=_mx_device_dtype,
    ),
)


EXPERT_BIASES_AND_SCALES = (
    Operand.of("expert_gate_up_bias", "E_L, 2, I", "E_L, P_I, 2, N_I, 4", optional=True, doc="gate/up bias"),
    Operand.of("expert_down_bias", "E_L, H", optional=True, doc="down bias"),
    Operand.of(
        "expert_gate_up_weights_scale",
        "E_L, 2, I",
        "E_L, 16, 2, H/512, I",
        dtypes=_SCALE_DTYPES,
        optional=True,
        doc="FP8 row dequant scales (float), or MX uint8 scales",
    ),
    Operand.of(
        "expert_down_weights_scale",
        "E_L, H",
        "E_L, P_I/8, N_I, H",
        dtypes=_SCALE_DTYPES,
        optional=True,
        doc="FP8 row dequant scales (float), or MX uint8 scales",
    ),
)


# The clamp params moe_tkg and moe_block_tkg share, in the kernels' order
CLAMP_PARAMS = tuple(
    Param(name, None, float, f"{name.split('_')[0]} projection clamp ({name.split('_')[2]} bound)")
    for name in ("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit", "up_clamp_lower_limit")
)


MOE_TKG_SPEC = KernelSpec(
    name="moe_tkg",
    entry_point="jax_nkilib_kernels.moe_tkg:moe_tkg",
    operands=(
        Operand.of("hidden_input", "T, H", doc="hidden states"),
        *EXPERT_WEIGHT_OPERANDS,
        Operand.of("expert_affinities", "T, E", doc="routing affinities over the E global experts"),
        Operand.of("expert_index", "T, K", dtypes=INDEX_DTYPES, doc="top-K expert ids per token"),
        Operand.of("rank_id", "1, 1", dtypes=INDEX_DTYPES, optional=True, doc="all-expert: this rank's block"),
        *EXPERT_BIASES_AND_SCALES,
    ),
    params=(
        Param("is_all_expert", None, bool, "every local expert on every token (else the top-K)", required=True),
        Param("mask_unselected_experts", False, bool, "all-expert POST_SCALE: zero unselected experts' affinities"),
        Param("expert_affinities_scaling_mode", "NO_SCALE", ExpertAffinityScaleMode, "NO_SCALE or POST_SCALE"),
        Param("activation_fn", "SiLU", ActFnType, "gate activation"),
        Param("output_dtype", None, "dtype", "output dtype (default: hidden_input's)"),
        *CLAMP_PARAMS,
        Param("is_all_expert_dynamic", False, bool, "all-expert: skip token blocks with no routed token (MX)"),
        Param("block_size", None, int, "token block of the dynamic all-expert loop"),
    ),
    outputs=(),
    output_avals=_outputs,
    reference=reference_moe_tkg,
    check=_check_moe_tkg,
    runtime_checks=_runtime_checks,
    neuron_limits=_neuron_limits,
    fold_plans=(
        FoldPlan(
            {
                "hidden_input": "T",
                "expert_affinities": "T",
                "expert_index": "T",
                **dict.fromkeys(("rank_id",) + EXPERT_WEIGHTS),
            },
            outputs={"out": 0},
        ),
    ),
    neuron_split_dims=("T",),
    mac_count=_mac_count,
    family="moe",
    catalog="1.11",
    support={
        "idiomatic": "moe (decode: <= 128 tokens)",
        "vjp": "JAX (the reference differentiated; no backward kernel)",
        "notes": "bf16/fp16, FP8-row and MXFP4/MXFP8 (x4 words) weights; selective and all-expert (rank_id, "
        "masking, dynamic); SBUF I/O and the MX-only eager affinities n/a; selective T <= 128 on Neuron; device "
        "adapter jax_nkilib_kernels/moe_tkg.py",
    },
)


def _straight_through_vjp(kernel, operands, params, outs, cotangents):
    """Reverse mode of the reference without the MXFP8 activation round trips (for dense weights, the reference
    itself): the hidden states, affinities, float weights, biases and row scales get cotangents."""
    names = [
        name
        for name, value in operands.items()
        if value is not None and jnp.issubdtype(value.dtype, jnp.floating) and jnp.dtype(value.dtype) not in FP8_DTYPES
    ]
    out_dtype = params["output_dtype"] or operands["hidden_input"].dtype
    forward = lambda named: (moe_tkg_forward(named, params, exact=True).astype(out_dtype),)  # noqa: E731
    return pull_back(forward, operands, names, cotangents)


moe_tkg = make_kernel(MOE_TKG_SPEC, _straight_through_vjp)
moe_tkg.__doc__ += "\nSemantics (from the module documentation):\n\n" + __doc__
