"""Checks the attention kernels share: the NKI head-size limit, one dtype across tensors, cache dtypes, required int
params."""

from __future__ import annotations

from ..framework.spec import FP8_DTYPES, CallInfo

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
            raise TypeError(f"{call.function}: `{name}` must have {like}'s dtype {dtype} or an FP8 dtype "
                            f"{tuple(str(d) for d in FP8_DTYPES)}; got {aval.dtype}")
