"""Checks the attention kernels share: the NKI head-size limit, one dtype across tensors, cache dtypes, required int
params."""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.arguments import is_array
from ..framework.spec import FLOAT_DTYPES, FP8_DTYPES, CallInfo

QKV_LAYOUT = "[batch, seq, heads, head_dim]"

MAX_HEAD_DIM = 128  # every NKI attention kernel tiles the head dimension on at most 128 partitions


def head_dim_limit(call: CallInfo) -> list[str]:
    """The Neuron limit on the head dimension ``d`` (empty when met)."""
    d = call.dims["d"]
    return [f"head dim d={d} exceeds {MAX_HEAD_DIM}"] if d > MAX_HEAD_DIM else []


def require_same_dtype(call: CallInfo, names: tuple[str, ...], what: str) -> None:
    """``TypeError`` unless the present operands ``names`` (described as ``what``) share one dtype."""
    dtypes = {name: call.avals[name].dtype for name in names if call.avals.get(name) is not None}
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"{call.function}: {what} must share one dtype; got {dtypes}")


def require_params(call: CallInfo, names: tuple[str, ...], *, positive: bool) -> None:
    """``ValueError`` for a required int param left ``None`` (or, with ``positive``, not above 0)."""
    for name in names:
        value = call.params[name]
        if value is None or (positive and value <= 0):
            needs = " and must be positive" if positive else ""
            raise ValueError(f"{call.function}: `{name}` is required{needs}; got {value!r}")


def require_cache_dtypes(call: CallInfo, caches: tuple[str, ...] = ("k_cache", "v_cache"), like: str = "q") -> None:
    """``TypeError`` unless each present cache has ``like``'s dtype or an FP8 dtype (a quantized cache)."""
    dtype = call.avals[like].dtype
    for name in caches:
        aval = call.avals.get(name)
        if aval is not None and aval.dtype != dtype and aval.dtype not in FP8_DTYPES:
            raise TypeError(
                f"{call.function}: `{name}` must have {like}'s dtype {dtype} or an FP8 dtype "
                f"{tuple(str(d) for d in FP8_DTYPES)}; got {aval.dtype}"
            )


def check_qkv_layout(where: str, q, k, v, *, same_seq: bool = False, kind: str = "an array") -> None:
    """``ValueError`` unless ``q [batch, seq, heads, head_dim]`` and ``k, v [batch, seq_kv, kv_heads, head_dim]``
    agree (batch, head_dim, and ``heads % kv_heads == 0``; with ``same_seq`` also the sequence length) and no axis
    is empty; ``TypeError`` unless they share one floating dtype."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not is_array(x) or x.ndim != 4:
            raise ValueError(
                f"{where}: `{name}` must be {kind} {QKV_LAYOUT}; got {getattr(x, 'shape', type(x).__name__)}"
            )
    for name, x, axes in (
        ("q", q, ("batch", "seq", "heads", "head_dim")),
        ("k", k, ("batch", "seq_kv", "kv_heads", "head_dim")),
        ("v", v, ("batch", "seq_kv", "kv_heads", "head_dim")),
    ):
        require_nonempty(where, name, x, axes)
    if k.shape != v.shape:
        raise ValueError(
            f"{where}: `k` and `v` must have the same shape [batch, seq_kv, kv_heads, head_dim]; got "
            f"{k.shape} and {v.shape}"
        )
    agree = (0, 1, 3) if same_seq else (0, 3)
    if any(q.shape[axis] != k.shape[axis] for axis in agree):
        what = "batch, seq and head_dim" if same_seq else "batch and head_dim"
        raise ValueError(f"{where}: `q` {q.shape} and `k` {k.shape} must agree on {what}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{where}: query heads ({q.shape[2]}) must be a multiple of kv heads ({k.shape[2]})")
    require_float_dtypes(where, {"q": q, "k": k, "v": v}, same=True)


def require_nonempty(where: str, name: str, x, axes: tuple[str, ...]) -> None:
    """``ValueError`` naming the first empty axis of ``x`` (``axes`` names its axes)."""
    for axis, size in zip(axes, x.shape):
        if size == 0:
            raise ValueError(
                f"{where}: `{name}` has {axis} = 0 (shape {tuple(x.shape)}, axes [{', '.join(axes)}]); "
                "every axis must be non-empty"
            )


def require_float_dtypes(where: str, arrays: dict, *, same: bool) -> None:
    """``TypeError`` unless every array of ``arrays`` (by argument name) has a dtype the attention kernels take
    (float32, bfloat16, float16, float64) and, with ``same``, they share one."""
    for name, x in arrays.items():
        if jnp.dtype(x.dtype) not in FLOAT_DTYPES:
            raise TypeError(
                f"{where}: `{name}` must have a floating dtype in ({', '.join(map(str, FLOAT_DTYPES))}); got {x.dtype}"
            )
    if same and len({jnp.dtype(x.dtype) for x in arrays.values()}) > 1:
        raise TypeError(
            f"{where}: {', '.join(f'`{name}`' for name in arrays)} must share one floating dtype; got "
            + ", ".join(f"{name} {x.dtype}" for name, x in arrays.items())
        )
