"""``ssd`` (catalog row 41, sections 1.27 and 6): Mamba-2's state space duality scan, chunk by chunk.

Source: docs only, the 2.32 NKI Library API reference ``nki/library/api/ssd.rst`` (module
``nkilib.experimental.scan``, ``ssd(x, dt, A, B, C, chunk_size=128, D=None, initial_state=None, causal_mask=None)``);
the kernel's source (``experimental/scan/ssd.py``) is in neither the nki-library snapshot nor the public code index.

``ssd(x [b, h, L, p], dt [b, h, L], A [h], B [b, L, n], C [b, L, n], chunk_size=Q, D [h] = None,
initial_state [b, h, n, p] = None, causal_mask [Q, Q]) -> (y [b, h, L, p], final_state [b, h, n, p])`` computes the
recurrence (one group: B and C are shared by the heads)::

    state[t] = exp(dt[t] * A[h]) * state[t - 1] + dt[t] * outer(B[t], x[t])      # [n, p] per (b, h)
    y[t] = C[t] @ state[t] + D[h] * x[t]

chunk by chunk as the reference documents it: with ``cs = cumsum(dt * A)`` inside a chunk,
``y_intra = exp(cs) * ((C B^T * causal_mask) @ (exp(-cs) * dt * x))``, ``y_off = exp(cs) * (C @ state)`` and
``state <- exp(cs[-1]) * state + B^T @ (dt * x * exp(cs[-1] - cs))``. The JAX reference computes the same products
with ``exp(cs[i] - cs[j])`` per pair (equal in exact arithmetic, and no overflow of ``exp(-cs)`` on long chunks), in
float32 (float64 for float64 inputs); the chunk-to-chunk state recurrence is a ``jax.lax.scan`` over chunks (a
loop, not unrolled; memory linear in L). ``causal_mask`` multiplies ``C B^T`` as in the kernel: when it is not
given, :func:`ssd` passes ``tril(ones((Q, Q)))`` (the kernel requires the mask). ``y`` is rounded to x's dtype,
``final_state`` is float32 (float64 off Neuron for float64 inputs). Off Neuron a length that is not a multiple of
``chunk_size`` is padded with ``dt = 0`` steps (they leave the state unchanged).

Reverse mode: the reference's VJP (the library has no backward kernel).

:func:`packed_ssd` is the same chunked scan with Mamba-2's ``seq_idx`` (packed sequences: the state is reset where
the sequence index changes), in plain JAX for ``jax_nkilib.ssd``: the kernel has no sequence index.

Neuron limits (the API reference's notes): chunk_size <= 128, dstate n <= 128, headdim p <= 512,
L % chunk_size == 0; one core (no LNC sharding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.compat import varying_like
from ..framework.primitive import make_kernel, reference_vjp
from ..framework.spec import CallInfo, FoldPlan, KernelSpec, Operand, Param, accumulation_dtype

MAX_CHUNK, MAX_DSTATE, MAX_HEADDIM = 128, 128, 512  # the API reference's notes


def causal_mask(chunk_size: int) -> np.ndarray:
    """The mask the kernel requires: ``tril(ones((Q, Q)))`` in float32 (a NumPy constant: no ops in the program)."""
    return np.tril(np.ones((chunk_size, chunk_size), np.float32))


def reference_ssd(x, dt, A, B, C, D=None, initial_state=None, causal_mask=None, *, chunk_size=128):
    """JAX reference of ``ssd`` (see the module docstring)."""
    return _chunked_scan(x, dt, A, B, C, D, initial_state, causal_mask, chunk_size, segments=None)


def packed_ssd(x, dt, A, B, C, seq_idx, D=None, initial_state=None, *, chunk_size=128):
    """``ssd`` of packed sequences (plain JAX: the kernel has no sequence index): as :func:`reference_ssd` with
    the state reset (decay 0) before every ``t`` where ``seq_idx[:, t] != seq_idx[:, t - 1]``, so tokens of
    different sequences never interact. ``seq_idx [b, L]`` (integers); ``initial_state`` is the state before the
    first sequence of each row only; ``final_state`` is the state after the last token (of the last sequence).

    Same chunked computation, masked: a pair ``(i, j)`` of a chunk counts only inside one sequence, a token adds to
    its chunk's state only if the chunk ends in its sequence, a chunk's decay is 0 when it ends in another sequence
    than the previous chunk, and the state entering a chunk reaches only the tokens of the sequence it belongs to.
    Differentiable (JAX's VJP of the same chunked scan: no unrolling over the sequence)."""
    starts = jnp.concatenate(
        [jnp.zeros_like(seq_idx[:, :1], dtype=jnp.int32), (seq_idx[:, 1:] != seq_idx[:, :-1]).astype(jnp.int32)],
        axis=1,
    )
    segments = jnp.cumsum(starts, axis=1)  # [b, L]: 0 for the first sequence of a row, +1 at every change
    mask = jnp.asarray(causal_mask(chunk_size))
    return _chunked_scan(x, dt, A, B, C, D, initial_state, mask, chunk_size, segments=segments)


def _chunked_scan(x, dt, A, B, C, D, initial_state, causal_mask, chunk_size, *, segments):
    """The chunked scan of the module docstring; ``segments [b, L]`` (non-decreasing ints, or ``None``) masks every
    interaction between tokens of different segments (see :func:`packed_ssd`)."""
    wide = accumulation_dtype(x.dtype)
    batch, heads, length, headdim = x.shape
    q = chunk_size
    chunks = -(-length // q)
    pad = chunks * q - length
    x_w = jnp.pad(x.astype(wide), ((0, 0), (0, 0), (0, pad), (0, 0)))
    dt_w = jnp.pad(dt.astype(wide), ((0, 0), (0, 0), (0, pad)))  # dt = 0: decay 1, no input
    B_w = jnp.pad(B.astype(wide), ((0, 0), (0, pad), (0, 0))).reshape(batch, chunks, q, -1)
    C_w = jnp.pad(C.astype(wide), ((0, 0), (0, pad), (0, 0))).reshape(batch, chunks, q, -1)
    x_w = x_w.reshape(batch, heads, chunks, q, headdim)
    dt_w = dt_w.reshape(batch, heads, chunks, q)
    cs = jnp.cumsum(dt_w * A.astype(wide)[None, :, None, None], axis=-1)  # [b, h, c, Q]
    mask = causal_mask.astype(wide)
    keep = mask != 0  # [Q, Q]
    if segments is not None:
        seg = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge").reshape(batch, 1, chunks, q)  # [b, 1, c, Q]
        same = seg[..., :, None] == seg[..., None, :]  # [b, 1, c, Q, Q]
        keep = keep & same
        mask = mask * same
    scores = jnp.einsum("bcin,bcjn->bcij", C_w, B_w)[:, None] * mask  # [b, 1, c, Q, Q]
    # exp(cs_i - cs_j), only where the mask keeps the pair (elsewhere the product is zero: exp(0) avoids overflow)
    decay_pairs = jnp.exp(jnp.where(keep, cs[..., :, None] - cs[..., None, :], 0.0))
    inputs = dt_w[..., None] * x_w  # dt * x  [b, h, c, Q, p]
    y = jnp.einsum("bhcij,bhcjp->bhcip", scores * decay_pairs, inputs)
    # the state each chunk adds on its own, then the chunk-to-chunk recurrence
    to_end = jnp.exp(cs[..., -1:] - cs)  # [b, h, c, Q]
    chunk_decay = jnp.exp(cs[..., -1])  # [b, h, c]
    from_previous = jnp.exp(cs)  # [b, h, c, Q]: the decay of the state entering the chunk up to each token
    if segments is not None:
        last = seg[..., -1]  # [b, 1, c]: the segment each chunk ends in
        before = jnp.concatenate([jnp.zeros_like(last[..., :1]), last[..., :-1]], axis=-1)  # the previous chunk's
        to_end = jnp.where(seg == last[..., None], to_end, 0.0)
        chunk_decay = jnp.where(last == before, chunk_decay, 0.0)
        from_previous = jnp.where(seg == before[..., None], from_previous, 0.0)
    chunk_states = jnp.einsum("bcjn,bhcjp->bhcnp", B_w, inputs * to_end[..., None])
    start = jnp.zeros(chunk_states.shape[:2] + chunk_states.shape[3:], wide)
    if initial_state is not None:
        start = initial_state.astype(wide)

    def chunk_step(state, chunk):  # the state entering the chunk -> the state leaving it
        decay, added = chunk
        return decay[..., None, None] * state + added, state

    final, entering = jax.lax.scan(
        chunk_step,
        varying_like(start, chunk_states),
        (jnp.moveaxis(chunk_decay, 2, 0), jnp.moveaxis(chunk_states, 2, 0)),
    )
    previous = jnp.moveaxis(entering, 0, 2)  # [b, h, c, n, p]: the state entering each chunk
    y = y + from_previous[..., None] * jnp.einsum("bcin,bhcnp->bhcip", C_w, previous)
    y = y.reshape(batch, heads, chunks * q, headdim)[:, :, :length]
    if D is not None:
        y = y + D.astype(wide)[None, :, None, None] * x.astype(wide)
    return y.astype(x.dtype), final


def _prepare(function, operands, params):
    """Pass the kernel's required ``causal_mask`` (``tril(ones((Q, Q)))``) when the caller gives none."""
    if operands.get("causal_mask") is None and isinstance(params.get("chunk_size"), int) and params["chunk_size"] > 0:
        operands["causal_mask"] = jnp.asarray(causal_mask(params["chunk_size"]))
    return operands, params


def _check_ssd(call: CallInfo) -> None:
    q = call.params["chunk_size"]
    if q <= 0:
        raise ValueError(f"{call.function}: parameter `chunk_size` must be positive; got {q}")
    mask = call.avals.get("causal_mask")
    if mask is not None and mask.shape != (q, q):
        raise ValueError(
            f"{call.function}: `causal_mask` must have layout [Q, Q] with Q = chunk_size = {q}; got {mask.shape}"
        )


def _neuron_limits(call: CallInfo) -> list[str]:
    dims, q, unmet = call.dims, call.params["chunk_size"], []
    if q > MAX_CHUNK:
        unmet.append(f"chunk_size={q} exceeds the kernel's limit {MAX_CHUNK} (the partition dimension)")
    if dims["n"] > MAX_DSTATE:
        unmet.append(f"dstate n={dims['n']} exceeds the kernel's limit {MAX_DSTATE}")
    if dims["p"] > MAX_HEADDIM:
        unmet.append(f"headdim p={dims['p']} exceeds the kernel's limit {MAX_HEADDIM}")
    if dims["L"] % q:
        unmet.append(f"seqlen L={dims['L']} is not a multiple of chunk_size={q}")
    return unmet


def _outputs(call: CallInfo):
    """``y`` of x's shape and dtype, ``final_state [b, h, n, p]`` in float32 (float64 for float64 inputs)."""
    x, dims = call.avals["x"], call.dims
    state = (dims["b"], dims["h"], dims["n"], dims["p"])
    return [("y", x.shape, x.dtype), ("final_state", state, accumulation_dtype(x.dtype))]


SSD_SPEC = KernelSpec(
    name="ssd",
    entry_point="nkilib.experimental.scan.ssd:ssd",
    operands=(
        Operand.of("x", "b, h, L, p", doc="input, per head"),
        Operand.of("dt", "b, h, L", doc="positive time steps"),
        Operand.of("A", "h", doc="negative decay rate per head"),
        Operand.of("B", "b, L, n", doc="input projection, shared by the heads (one group)"),
        Operand.of("C", "b, L, n", doc="output projection, shared by the heads (one group)"),
        Operand.of("D", "h", optional=True, doc="skip connection weights"),
        Operand.of("initial_state", "b, h, n, p", optional=True, doc="the state before t = 0 (zero)"),
        Operand.of("causal_mask", "Q, Q", optional=True, doc="multiplies C B^T inside a chunk (lower triangular)"),
    ),
    params=(Param("chunk_size", 128, int, "Q: the chunk length"),),
    outputs=(),
    output_avals=_outputs,
    prepare=_prepare,
    reference=reference_ssd,
    check=_check_ssd,
    neuron_limits=_neuron_limits,
    neuron_split_dims=("b",),
    fold_plans=(
        FoldPlan(
            axes={
                "x": "b",
                "dt": "b",
                "A": None,
                "B": "b",
                "C": "b",
                "D": None,
                "initial_state": "b",
                "causal_mask": None,
            },
            outputs={"y": 0, "final_state": 0},
        ),
    ),
    family="scan",
    catalog="1.27",
    support={
        "idiomatic": "ssd",
        "vjp": "reference (chunked: lax.scan over chunks; no backward kernel)",
        "notes": f"docs only (2.32 API reference); one group (B, C shared by the heads); float32 inside; Neuron: "
        f"chunk_size <= {MAX_CHUNK}, dstate <= {MAX_DSTATE}, headdim <= {MAX_HEADDIM}, L % chunk_size == 0; "
        "one core",
    },
)


ssd = make_kernel(SSD_SPEC, reference_vjp)
