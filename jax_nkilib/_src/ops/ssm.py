"""State-space scans with Mamba's calls: ``jax_nkilib.selective_scan`` (Mamba's ``selective_scan_fn``) and
``jax_nkilib.ssd`` (Mamba-2's ``mamba_chunk_scan_combined``), through the ``selective_scan`` and ``ssd`` kernels.

Both compute in float32 (float64 for float64 inputs) and return the output in the input's dtype, the last state in
float32. Time-step preprocessing (bias, softplus, clamping) and the ``z`` gate (``y * silu(z)``) run in JAX around
the kernel, in float32. Groups (B, C shared by a group of channels or heads) run one kernel call per group. Reverse
mode is the kernels' reference VJP: an associative scan, so memory grows linearly with the sequence length.
Under explicit shardings the batch and channel/head axes split freely; the sequence axis does not split.
``ssd``'s ``seq_idx`` (packed sequences) has no kernel: that call runs as JAX, and lowering it for Neuron warns with
a ``NeuronFallbackWarning`` (an error under ``config(on_unsupported="error")``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..framework.arguments import array_argument
from ..framework.spec import accumulation_dtype
from ..framework.validation import require_static, static_bool, static_int
from ..neuron.reference_only import reference_only
from ..scan.selective_scan import selective_scan as selective_scan_kernel
from ..scan.ssd import MAX_CHUNK, packed_ssd
from ..scan.ssd import ssd as ssd_kernel
from ..sharding import auto

SELECTIVE_SCAN = "jax_nkilib.selective_scan"
SSD = "jax_nkilib.ssd"

SELECTIVE_SCAN_SHARDING = auto.register_rule(
    auto.ShardingRule(
        SELECTIVE_SCAN,
        free={"b": "batch", "d": "channels"},
        note="channels split only with one group (B and C shared by every channel)",
    )
)
SSD_SHARDING = auto.register_rule(
    auto.ShardingRule(SSD, free={"b": "batch", "h": "heads"}, note="heads split only with one group (ngroups=1)")
)
SEQ_IDX_FALLBACK = "`seq_idx` (packed sequences) is given: the NKI ssd kernel has no sequence index"


def _shape_error(where, name, layout, value, expected):
    return ValueError(f"{where}: `{name}` must have layout {layout} = {expected}; got shape {tuple(value.shape)}")


def _require_shape(where, name, layout, value, expected):
    if value is not None and tuple(value.shape) != tuple(expected):
        raise _shape_error(where, name, layout, value, expected)


def _optional_arrays(where, checks: dict, values: dict) -> dict:
    """``values`` by name, each ``None`` or an array of ``checks[name] = (layout, expected shape)``."""
    checked = dict(values)
    for name, (layout, expected) in checks.items():
        if values[name] is not None:
            checked[name] = array_argument(where, name, values[name], layout=layout)
            _require_shape(where, name, layout, checked[name], expected)
    return checked


def _time_steps(delta, bias, softplus, limit=None):
    """``delta`` (+ ``bias`` along its channel axis 1), softplus'd and clamped, in float32 (float64)."""
    wide = accumulation_dtype(delta.dtype)
    delta = delta.astype(wide)
    if bias is not None:
        delta = delta + bias.astype(wide).reshape((1, -1) + (1,) * (delta.ndim - 2))
    if softplus:
        delta = jax.nn.softplus(delta)
    if limit is not None and tuple(limit) != (0.0, float("inf")):
        delta = jnp.clip(delta, limit[0], limit[1])
    return delta


def _gate(y, z):
    """``y * silu(z)`` in float32 (float64), rounded to y's dtype; ``y`` unchanged without ``z``."""
    if z is None:
        return y
    wide = accumulation_dtype(y.dtype)
    return (y.astype(wide) * jax.nn.silu(z.astype(wide))).astype(y.dtype)


# ------------------------------------------------------------------------------------------------ selective_scan
def selective_scan(
    u,
    delta,
    A,
    B,
    C,
    D=None,
    z=None,
    delta_bias=None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
):
    """Mamba's selective scan, as ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (real inputs)::

        delta = softplus(delta + delta_bias) (softplus only with delta_softplus)
        state[t] = exp(delta[t] * A) * state[t - 1] + delta[t] * u[t] * B[t]        # [dstate] per (batch, channel)
        y[t] = C[t] . state[t] + D * u[t];   out = y * silu(z)  (with z)

    Args:
      u, delta: ``[batch, dim, L]``.
      A: ``[dim, dstate]`` (negative for a stable scan).
      B, C: ``[batch, dstate, L]``, or grouped ``[batch, groups, dstate, L]`` (``dim % groups == 0``: channel
        ``c`` uses group ``c // (dim // groups)``). Mamba's time-invariant ``[dim, dstate]`` B/C is not supported
        (the kernel shares B and C across channels).
      D: ``[dim]`` skip weights; z: ``[batch, dim, L]`` gate; delta_bias: ``[dim]``.
      delta_softplus: apply softplus to ``delta + delta_bias``.
      return_last_state: also return the last state ``[batch, dim, dstate]`` (float32).

    Returns ``out`` in u's dtype, or ``(out, last_state)``. On Neuron: the ``selective_scan`` kernel, one call per
    group; the time-step preprocessing and the gate are plain JAX.
    """
    where = SELECTIVE_SCAN
    u = array_argument(where, "u", u, layout="[batch, dim, L]", rank=3)
    batch, dim, length = u.shape
    delta = array_argument(where, "delta", delta, layout="[batch, dim, L]", rank=3)
    _require_shape(where, "delta", "[batch, dim, L]", delta, u.shape)
    A = array_argument(where, "A", A, layout="[dim, dstate]", rank=2)
    if A.shape[0] != dim:
        raise _shape_error(where, "A", "[dim, dstate]", A, (dim, "dstate"))
    dstate = A.shape[1]
    B = array_argument(where, "B", B, layout="[batch, dstate, L] or [batch, groups, dstate, L]")
    C = array_argument(where, "C", C, layout="[batch, dstate, L] or [batch, groups, dstate, L]")
    groups = _groups(where, B, C, batch, dim, dstate, length)
    optional = {"D": ("[dim]", (dim,)), "z": ("[batch, dim, L]", u.shape), "delta_bias": ("[dim]", (dim,))}
    values = _optional_arrays(where, optional, {"D": D, "z": z, "delta_bias": delta_bias})
    D, z, delta_bias = values["D"], values["z"], values["delta_bias"]
    static_bool(where, "delta_softplus", delta_softplus)
    static_bool(where, "return_last_state", return_last_state)

    # channels split only with one group; the sequence axis (l) and dstate (n) never split
    letters = ("bdl", "bdl", "dn", "bnl", "bnl") if groups == 1 else ("b_l", "b_l", "__", "b_nl", "b_nl")
    arguments = [
        auto.ShardedArgument(n, v, d) for n, v, d in zip(("u", "delta", "A", "B", "C"), (u, delta, A, B, C), letters)
    ]
    channel = "d" if groups == 1 else "_"
    arguments += [
        auto.ShardedArgument("D", D, channel),
        auto.ShardedArgument("z", z, letters[0]),
        auto.ShardedArgument("delta_bias", delta_bias, channel),
    ]
    sharded = auto.plan(SELECTIVE_SCAN_SHARDING, arguments)
    flags = dict(delta_softplus=delta_softplus, return_last_state=return_last_state)
    if sharded:
        out_dims = letters[0] if not return_last_state else (letters[0], "bdn" if groups == 1 else "b_n")
        return sharded.run(
            lambda u, delta, A, B, C, D, z, delta_bias, axes: selective_scan(
                u, delta, A, B, C, D, z, delta_bias, **flags
            ),
            out_dims,
        )

    delta = _time_steps(delta, delta_bias, delta_softplus)
    if groups == 1:
        y, last = selective_scan_kernel(u, delta, A, B, C, D)
    else:
        per = dim // groups
        parts = [
            selective_scan_kernel(
                u[:, g * per : (g + 1) * per],
                delta[:, g * per : (g + 1) * per],
                A[g * per : (g + 1) * per],
                B[:, g],
                C[:, g],
                None if D is None else D[g * per : (g + 1) * per],
            )
            for g in range(groups)
        ]
        y = jnp.concatenate([p[0] for p in parts], axis=1)
        last = jnp.concatenate([p[1] for p in parts], axis=1)
    out = _gate(y, z)
    return (out, last) if return_last_state else out


def _groups(where, B, C, batch, dim, dstate, length) -> int:
    """The number of groups of ``B``/``C`` (1 for ``[batch, dstate, L]``), checked against ``u`` and ``A``."""
    if B.shape != C.shape:
        raise ValueError(f"{where}: `C` must have B's shape {tuple(B.shape)}; got {tuple(C.shape)}")
    if B.ndim == 3 and B.shape == (batch, dstate, length):
        return 1
    if B.ndim == 4 and B.shape[0] == batch and B.shape[2:] == (dstate, length) and dim % B.shape[1] == 0:
        return B.shape[1]
    raise ValueError(
        f"{where}: `B` must have layout [batch, dstate, L] = {(batch, dstate, length)} or [batch, groups, dstate, L] "
        f"with groups dividing dim={dim}; got shape {tuple(B.shape)} (time-invariant [dim, dstate] B/C are not "
        "supported: the kernel shares B and C across channels)"
    )


# ---------------------------------------------------------------------------------------------------------- ssd
def ssd(
    x,
    dt,
    A,
    B,
    C,
    chunk_size: int,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    seq_idx=None,
):
    """Mamba-2's chunked scan, as ``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`` (with
    ``seq_idx``; no ``cu_seqlens``)::

        dt = clamp(softplus(dt + dt_bias), *dt_limit) (softplus only with dt_softplus)
        keep[t] = 0 if seq_idx[t] != seq_idx[t - 1] else 1                          # 1 without seq_idx
        state[t] = keep[t] * exp(dt[t] * A) * state[t - 1] + dt[t] * outer(x[t], B[t])  # [headdim, dstate] per head
        y[t] = state[t] @ C[t] + D * x[t];   out = y * silu(z)  (with z)

    Args:
      x: ``[batch, L, nheads, headdim]``; dt: ``[batch, L, nheads]``; A: ``[nheads]``.
      B, C: ``[batch, L, ngroups, dstate]`` (``nheads % ngroups == 0``: head ``h`` uses group
        ``h // (nheads // ngroups)``).
      chunk_size: the chunk length (the kernel's Q, at most 128 on Neuron). The result does not depend on it.
      D: ``[nheads]`` or ``[nheads, headdim]``; z: ``[batch, L, nheads, headdim]``; dt_bias: ``[nheads]``;
      initial_states: ``[batch, nheads, headdim, dstate]``.
      dt_softplus, dt_limit: time-step preprocessing, as Mamba-2's.
      return_final_states: also return the final states ``[batch, nheads, headdim, dstate]`` (float32): the state
        after the last token.
      seq_idx: ``[batch, L]`` integers, non-decreasing along each row (Mamba-2's): the sequence each token belongs
        to, for packed sequences. Tokens of different sequences do not interact: every change of the index resets
        the state (so a row ``0, 1, 0`` holds three sequences). ``initial_states`` is the state before the first
        sequence of each row, whatever its index (Mamba-2's kernels apply it only where ``seq_idx == 0``: the same
        for rows numbered from 0).

    Returns ``out [batch, L, nheads, headdim]`` in x's dtype, or ``(out, final_states)``. On Neuron: the ``ssd``
    kernel on ``[batch, nheads, L, headdim]`` (one call per group); a length that is not a multiple of
    ``chunk_size`` is padded with ``dt = 0`` steps (which leave the state unchanged). With ``seq_idx`` the same
    chunked scan runs as JAX (masked), with a ``NeuronFallbackWarning`` when lowered for Neuron.
    """
    where = SSD
    x = array_argument(where, "x", x, layout="[batch, L, nheads, headdim]", rank=4)
    batch, length, heads, headdim = x.shape
    dt = array_argument(where, "dt", dt, layout="[batch, L, nheads]", rank=3)
    _require_shape(where, "dt", "[batch, L, nheads]", dt, (batch, length, heads))
    A = array_argument(where, "A", A, layout="[nheads]", rank=1)
    _require_shape(where, "A", "[nheads]", A, (heads,))
    B = array_argument(where, "B", B, layout="[batch, L, ngroups, dstate]", rank=4)
    groups, dstate = B.shape[2], B.shape[3]
    if B.shape[:2] != (batch, length) or heads % groups:
        raise _shape_error(where, "B", "[batch, L, ngroups, dstate] (ngroups dividing nheads)", B, (batch, length))
    C = array_argument(where, "C", C, layout="[batch, L, ngroups, dstate]", rank=4)
    _require_shape(where, "C", "[batch, L, ngroups, dstate]", C, B.shape)
    require_static(where, "chunk_size", chunk_size, "an int")
    chunk_size = static_int(where, "chunk_size", chunk_size, minimum=1)
    if D is not None:
        D = array_argument(where, "D", D, layout="[nheads] or [nheads, headdim]")
        if tuple(D.shape) not in ((heads,), (heads, headdim)):
            raise _shape_error(where, "D", "[nheads] or [nheads, headdim]", D, (heads,))
    checks = {
        "z": ("[batch, L, nheads, headdim]", x.shape),
        "dt_bias": ("[nheads]", (heads,)),
        "initial_states": ("[batch, nheads, headdim, dstate]", (batch, heads, headdim, dstate)),
    }
    values = _optional_arrays(where, checks, {"z": z, "dt_bias": dt_bias, "initial_states": initial_states})
    z, dt_bias, initial_states = values["z"], values["dt_bias"], values["initial_states"]
    static_bool(where, "dt_softplus", dt_softplus)
    static_bool(where, "return_final_states", return_final_states)
    limit = tuple(float(v) for v in dt_limit)
    seq_idx = _sequence_index(where, seq_idx, batch, length)

    head = "h" if groups == 1 else "_"
    arguments = [
        auto.ShardedArgument("x", x, "bl" + head + "p"),
        auto.ShardedArgument("dt", dt, "bl" + head),
        auto.ShardedArgument("A", A, head),
        auto.ShardedArgument("B", B, "bl_n"),
        auto.ShardedArgument("C", C, "bl_n"),
        auto.ShardedArgument("D", D, None if D is None else head + "p"[: D.ndim - 1]),
        auto.ShardedArgument("z", z, "bl" + head + "p"),
        auto.ShardedArgument("dt_bias", dt_bias, head),
        auto.ShardedArgument("initial_states", initial_states, "b" + head + "pn"),
        auto.ShardedArgument("seq_idx", seq_idx, "bl"),
    ]
    sharded = auto.plan(SSD_SHARDING, arguments)
    flags = dict(dt_softplus=dt_softplus, dt_limit=limit, return_final_states=return_final_states)
    if sharded:
        out_dims = "bl" + head + "p"
        return sharded.run(
            lambda x, dt, A, B, C, D, z, dt_bias, h0, seq_idx, axes: ssd(
                x, dt, A, B, C, chunk_size, D, z, dt_bias, h0, **flags, seq_idx=seq_idx
            ),
            (out_dims, "b" + head + "pn") if return_final_states else out_dims,
        )

    steps = _time_steps(jnp.swapaxes(dt, 1, 2), dt_bias, dt_softplus, limit)  # [b, h, L], float32
    x_k = jnp.swapaxes(x, 1, 2)  # [b, h, L, p]
    # pad to whole chunks for the kernel: dt = 0 steps change nothing (the JAX scan of seq_idx pads itself)
    pad = -length % chunk_size if chunk_size <= MAX_CHUNK and seq_idx is None else 0
    if pad:
        x_k = jnp.pad(x_k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        steps = jnp.pad(steps, ((0, 0), (0, 0), (0, pad)))
        B = jnp.pad(B, ((0, 0), (0, pad), (0, 0), (0, 0)))
        C = jnp.pad(C, ((0, 0), (0, pad), (0, 0), (0, 0)))
    h0 = None if initial_states is None else jnp.swapaxes(initial_states, 2, 3)  # [b, h, n, p]
    kernel_D = D if D is not None and D.ndim == 1 else None
    per = heads // groups
    parts = []
    for g in range(groups):
        heads_g = slice(g * per, (g + 1) * per)
        operands = (x_k[:, heads_g], steps[:, heads_g], A[heads_g], B[:, :, g], C[:, :, g])
        optional = dict(
            D=None if kernel_D is None else kernel_D[heads_g], initial_state=None if h0 is None else h0[:, heads_g]
        )
        if seq_idx is None:
            parts.append(ssd_kernel(*operands, chunk_size=chunk_size, **optional))
        else:
            parts.append(packed_ssd(*operands, seq_idx, chunk_size=chunk_size, **optional))
    y = jnp.concatenate([p[0] for p in parts], axis=1)[:, :, :length]
    final = jnp.concatenate([p[1] for p in parts], axis=1)
    if seq_idx is not None:
        y = reference_only(y, op=where, reasons=(SEQ_IDX_FALLBACK,))
        final = reference_only(final, op=where, reasons=(SEQ_IDX_FALLBACK,))
    y = jnp.swapaxes(y, 1, 2)  # [b, L, h, p]
    if D is not None and D.ndim == 2:
        wide = accumulation_dtype(x.dtype)
        y = (y.astype(wide) + D.astype(wide) * x.astype(wide)).astype(x.dtype)
    out = _gate(y, z)
    return (out, jnp.swapaxes(final, 2, 3)) if return_final_states else out


def _sequence_index(where, seq_idx, batch: int, length: int):
    """``seq_idx`` checked: ``None`` or an integer array ``[batch, L]``, returned as int32."""
    if seq_idx is None:
        return None
    layout = "[batch, L] (the sequence of each token, non-decreasing along L)"
    seq_idx = array_argument(where, "seq_idx", seq_idx, layout=layout, dtypes="integer")
    _require_shape(where, "seq_idx", layout, seq_idx, (batch, length))
    return seq_idx.astype(jnp.int32)
