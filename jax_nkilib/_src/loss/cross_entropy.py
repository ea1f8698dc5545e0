"""``cross_entropy_forward`` / ``cross_entropy_backward`` (catalog rows 26-27, section 1.22): fused cross-entropy
over a large vocabulary, NKI Library ``src/nkilib_src/nkilib/experimental/loss/cross_entropy.py`` (oracles
``cross_entropy_torch.py``, limits ``validation.py``; tests ``test/integration/nkilib/experimental/loss``).

* ``cross_entropy_forward(logits_hbm [N, V], targets_hbm [N] int32) -> (loss_hbm [N], lse_state_hbm [N])``:
  ``lse_i = log sum_j exp(x_ij)`` by an online log-sum-exp over vocabulary chunks of ``chunk_size`` and
  ``loss_i = lse_i - x_{i, t_i}``.
* ``cross_entropy_backward(logits_hbm, targets_hbm, lse_state_hbm) -> grad [N, V]``:
  ``grad_ij = s (exp(x_ij - lse_i) - [j == t_i])`` with ``s = 1/N`` for ``reduction="mean"`` and ``1`` for
  ``"sum"``. **It takes no upstream gradient**: it is the gradient of ``mean(loss)`` or ``sum(loss)``, i.e. it
  assumes the cotangent ``1/N`` (mean) or ``1`` (sum) on every row. ``inplace=True`` (the kernel's default) writes
  the gradient over the logits buffer: the output is then named ``logits_hbm``, has the logits' dtype and is
  aliased to that operand in the Neuron custom call (XLA copies the logits first if they are still needed);
  ``inplace=False`` returns a new ``grad_logits_hbm`` in ``dtype``.

Dtypes: logits bfloat16 or float32 (float64 too off Neuron, for float64 gradient checks), targets int32, ``dtype``
bfloat16 (default) or float32 for the outputs and the kernel's intermediates. The references compute in float32
(float64 for float64 logits, whose outputs are then float64) and round the outputs to ``dtype``; the kernel keeps its
running max/sum and exponentials in ``dtype`` (see ``neuron_notes``). A target outside ``[0, V)`` is undefined (the
kernel reads out of the row; the reference clips the index).

Reverse mode of the forward runs the backward kernel: with ``reduction="sum"`` (cotangent 1 on every row) and the
forward's batching and chunk (capped at the backward's SBUF limit), then row-scaled by the real cotangents:
``dlogits = (dloss + dlse)[:, None] * grad + dlse[:, None] * onehot(targets)`` (the one-hot term, ``softmax = grad +
onehot``, only when ``lse`` has a nonzero cotangent). The backward kernel is differentiable through its reference.

Neuron limits (``validation.py`` and the kernels' docstrings): ``chunk_size <= 65535`` (the docs' hardware limit;
``validation.py`` itself allows 65536) and ``<= V``; ``0 < positions_per_batch <= 128``;
``positions_per_batch * chunk_size * bytes(logits) <= 24 MiB``; the backward also ``2 * chunk_size * bytes(dtype)
<= 229376`` (its per-partition SBUF limit). Either LNC: the kernel splits the positions contiguously over the
cores (the last takes the remainder), with the same results.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import INT_DTYPES, CallInfo, FoldPlan, KernelSpec, Operand, Param
from .vocab_chunks import chunked_softmax_gradient, online_logsumexp, target_logits

LOGITS_DTYPES = (jnp.bfloat16, jnp.float32, jnp.float64)
KERNEL_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float32))
MAX_CHUNK = 65535  # free-dimension limit the kernel's docs give (validation.py checks F_MAX = 65536)
MAX_POSITIONS_PER_BATCH = 128  # SBUF partitions
MAX_ALLOCATION_BYTES = 24 * 1024 * 1024  # one [positions_per_batch, chunk_size] SBUF tile
BACKWARD_PARTITION_BYTES = 229376  # backward: 2 * chunk_size * bytes(dtype) per partition


def _kernel_dtype(value, where: str) -> np.dtype:
    try:
        dtype = np.dtype(jnp.dtype(value))
    except TypeError:
        raise TypeError(f"{where} must be a dtype (jnp.bfloat16 or jnp.float32); got {value!r}") from None
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"{where} must be jnp.bfloat16 or jnp.float32 (the kernel's compute dtypes); got {dtype}")
    return dtype


def output_dtype(logits_dtype, dtype) -> np.dtype:
    """The kernels' output dtype: ``dtype``, or float64 for float64 logits (off Neuron only)."""
    return np.dtype(jnp.float64) if np.dtype(logits_dtype) == np.dtype(jnp.float64) else np.dtype(dtype)


_TUNING = (
    Param("positions_per_batch", 32, int, "positions (rows) processed together: SBUF partitions, <= 128 on Neuron"),
    Param("chunk_size", 32768, int, "vocabulary columns per chunk of the online log-sum-exp (<= min(V, 65535))"),
    Param(
        "dtype",
        jnp.bfloat16,
        "dtype",
        "outputs' and intermediates' dtype (bfloat16 or float32)",
        normalizer=_kernel_dtype,
    ),
)


def _check(call: CallInfo) -> None:
    p, function = call.params, call.function
    for name in ("positions_per_batch", "chunk_size"):
        if p[name] < 1:
            raise ValueError(f"{function}: parameter `{name}` must be >= 1; got {p[name]}")
    if call.dims["V"] < 1:
        raise ValueError(f"{function}: `logits_hbm` [N, V] needs V >= 1; got shape {call.avals['logits_hbm'].shape}")
    lse = call.avals.get("lse_state_hbm")
    if lse is not None and np.dtype(lse.dtype) not in (
        np.dtype(jnp.bfloat16),
        np.dtype(jnp.float32),
        np.dtype(jnp.float64),
    ):
        raise TypeError(f"{function}: `lse_state_hbm` [N] must be bfloat16, float32 or float64; got {lse.dtype}")


def _neuron_limits(call: CallInfo) -> list[str]:
    p, dims = call.params, call.dims
    unmet = []
    for name in ("logits_hbm", "lse_state_hbm"):
        aval = call.avals.get(name)
        if aval is not None and np.dtype(aval.dtype) not in KERNEL_DTYPES:
            unmet.append(f"`{name}` must be bfloat16 or float32 on Neuron; got {np.dtype(aval.dtype)}")
    if dims["N"] < 1:
        unmet.append("the kernel needs N >= 1 positions")
    if p["chunk_size"] > min(dims["V"], MAX_CHUNK):
        unmet.append(f"chunk_size={p['chunk_size']} must be <= V={dims['V']} and <= {MAX_CHUNK}")
    if p["positions_per_batch"] > MAX_POSITIONS_PER_BATCH:
        unmet.append(f"positions_per_batch={p['positions_per_batch']} must be <= {MAX_POSITIONS_PER_BATCH}")
    tile = p["positions_per_batch"] * p["chunk_size"] * np.dtype(call.avals["logits_hbm"].dtype).itemsize
    if tile > MAX_ALLOCATION_BYTES:
        unmet.append(f"positions_per_batch * chunk_size * bytes(logits) = {tile} exceeds 24 MiB of SBUF")
    if "reduction" in p and 2 * p["chunk_size"] * np.dtype(p["dtype"]).itemsize > BACKWARD_PARTITION_BYTES:
        unmet.append(
            f"the backward's per-partition SBUF limit: 2 * chunk_size * bytes(dtype) = "
            f"{2 * p['chunk_size'] * np.dtype(p['dtype']).itemsize} exceeds {BACKWARD_PARTITION_BYTES}"
        )
    return unmet


def _neuron_notes(call: CallInfo) -> list[str]:
    if np.dtype(call.params["dtype"]) != np.dtype(jnp.bfloat16):
        return []
    return [
        "dtype=bfloat16: the NKI kernel keeps its running max, sum of exponentials and exponentials in bfloat16; "
        "the JAX reference off Neuron computes in float32 and rounds only the outputs"
    ]


# ----------------------------------------------------------------------------------------------- forward
def reference_cross_entropy_forward(logits_hbm, targets_hbm, *, positions_per_batch, chunk_size, dtype):
    """``(loss, lse)`` in ``dtype``: the online log-sum-exp over chunks of ``chunk_size`` columns."""
    del positions_per_batch  # how many rows the kernel processes together: no numeric effect
    lse = online_logsumexp(logits_hbm, chunk_size)
    loss = lse - target_logits(logits_hbm, targets_hbm)
    out = output_dtype(logits_hbm.dtype, dtype)
    return loss.astype(out), lse.astype(out)


def backward_chunk_size(chunk_size: int, dtype) -> int:
    """The forward's chunk, capped at the backward kernel's per-partition SBUF limit for ``dtype``."""
    return min(chunk_size, BACKWARD_PARTITION_BYTES // (2 * np.dtype(dtype).itemsize))


def _forward_vjp(kernel, operands, params, outs, cotangents):
    """``dlogits = (dloss + dlse) grad_sum + dlse onehot``, ``grad_sum`` from ``cross_entropy_backward`` (sum)."""
    logits, targets = operands["logits_hbm"], operands["targets_hbm"]
    dloss, dlse = cotangents
    wide = jnp.promote_types(logits.dtype, jnp.float32)
    row_scale = jnp.zeros(logits.shape[:1], wide)
    for cotangent in (dloss, dlse):
        if cotangent is not None:
            row_scale = row_scale + cotangent.astype(wide)
    grad_params = cross_entropy_backward.params(
        reduction="sum",
        positions_per_batch=params["positions_per_batch"],
        chunk_size=backward_chunk_size(params["chunk_size"], params["dtype"]),
        dtype=params["dtype"],
    )
    (grad,) = cross_entropy_backward.call(
        {"logits_hbm": logits, "targets_hbm": targets, "lse_state_hbm": outs[1]}, grad_params
    )
    dlogits = row_scale[:, None] * grad.astype(wide)
    if dlse is not None:
        onehot = jnp.arange(logits.shape[1], dtype=jnp.int32)[None, :] == targets[:, None]
        dlogits = dlogits + jnp.where(onehot, dlse.astype(wide)[:, None], 0)
    return {"logits_hbm": dlogits.astype(logits.dtype), "targets_hbm": None}


CROSS_ENTROPY_FORWARD_SPEC = KernelSpec(
    name="cross_entropy_forward",
    entry_point="nkilib.experimental.loss.cross_entropy:cross_entropy_forward",
    operands=(
        Operand.of("logits_hbm", "N, V", dtypes=LOGITS_DTYPES, doc="logits, positions flattened (2-D)"),
        Operand.of("targets_hbm", "N", dtypes=INT_DTYPES, doc="target class per position, in [0, V)"),
    ),
    params=_TUNING,
    outputs=(),
    output_avals=lambda call: [
        (name, (call.dims["N"],), output_dtype(call.avals["logits_hbm"].dtype, call.params["dtype"]))
        for name in ("loss_hbm", "lse_state_hbm")
    ],
    reference=reference_cross_entropy_forward,
    check=_check,
    neuron_limits=_neuron_limits,
    neuron_notes=_neuron_notes,
    fold_plans=(FoldPlan({"logits_hbm": "N", "targets_hbm": "N"}, outputs={"loss_hbm": 0, "lse_state_hbm": 0}),),
    mac_count=lambda call: 4 * call.dims["N"] * call.dims["V"],
    family="loss",
    catalog="1.22",
    support={
        "idiomatic": "cross_entropy",
        "vjp": "cross_entropy_backward kernel (reduction='sum', rows scaled by the cotangents)",
        "notes": "online log-sum-exp over vocabulary chunks; chunk_size <= min(V, 65535), positions_per_batch <= "
        "128, positions_per_batch*chunk_size*bytes <= 24 MiB; outputs in `dtype` (bfloat16 default)",
    },
)


# ----------------------------------------------------------------------------------------------- backward
def reference_cross_entropy_backward(
    logits_hbm, targets_hbm, lse_state_hbm, *, reduction, positions_per_batch, chunk_size, dtype, inplace
):
    """``s (exp(x - lse) - onehot)`` chunk by chunk, ``s = 1/N`` (mean) or ``1`` (sum); in the logits' dtype when
    ``inplace`` (the logits buffer), else in ``dtype``."""
    del positions_per_batch
    scale = 1.0 / logits_hbm.shape[0] if reduction == "mean" else 1.0
    out = logits_hbm.dtype if inplace else output_dtype(logits_hbm.dtype, dtype)
    return (chunked_softmax_gradient(logits_hbm, targets_hbm, lse_state_hbm, scale, chunk_size, out),)


def _backward_outputs(call: CallInfo):
    logits = call.avals["logits_hbm"]
    if call.params["inplace"]:
        return [("logits_hbm", logits.shape, logits.dtype)]
    return [("grad_logits_hbm", logits.shape, output_dtype(logits.dtype, call.params["dtype"]))]


CROSS_ENTROPY_BACKWARD_SPEC = KernelSpec(
    name="cross_entropy_backward",
    entry_point="nkilib.experimental.loss.cross_entropy:cross_entropy_backward",
    operands=(
        Operand.of("logits_hbm", "N, V", dtypes=LOGITS_DTYPES, doc="the forward's logits (overwritten if inplace)"),
        Operand.of("targets_hbm", "N", dtypes=INT_DTYPES, doc="the forward's targets"),
        Operand.of("lse_state_hbm", "N", dtypes=LOGITS_DTYPES, doc="the forward's lse_state_hbm"),
    ),
    params=(
        Param("reduction", "mean", ("mean", "sum"), "the implied cotangent: 1/N per row (mean) or 1 (sum)"),
        *_TUNING,
        Param("inplace", True, bool, "write the gradient over logits_hbm (aliased output, logits' dtype)"),
    ),
    outputs=(),
    output_avals=_backward_outputs,
    reference=reference_cross_entropy_backward,
    check=_check,
    neuron_limits=_neuron_limits,
    neuron_notes=_neuron_notes,
    # a vmapped axis merges into N only for reduction="sum": "mean"'s 1/N must stay per call
    fold_plans=(
        FoldPlan(
            {"logits_hbm": "N", "targets_hbm": "N", "lse_state_hbm": "N"},
            outputs={"logits_hbm": 0, "grad_logits_hbm": 0},
            when=lambda call: call.params["reduction"] == "sum",
        ),
    ),
    aliases={"logits_hbm": "logits_hbm"},
    mac_count=lambda call: 4 * call.dims["N"] * call.dims["V"],
    family="loss",
    catalog="1.22",
    support={
        "idiomatic": "cross_entropy",
        "vjp": "JAX (differentiates the chunked reference); it is itself the forward's backward kernel",
        "notes": "no upstream-gradient input (implied cotangent 1/N for mean, 1 for sum); inplace=True aliases "
        "the gradient to logits_hbm; 2*chunk_size*bytes(dtype) <= 229376",
    },
)

cross_entropy_backward = make_kernel(CROSS_ENTROPY_BACKWARD_SPEC, reference_vjp)
cross_entropy_forward = make_kernel(CROSS_ENTROPY_FORWARD_SPEC, _forward_vjp)
