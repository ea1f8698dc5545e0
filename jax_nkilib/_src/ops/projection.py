"""Projections in JAX layouts: ``jax_nkilib.qkv_projection`` (on ``qkv``) and ``jax_nkilib.output_projection`` (on
``output_projection_cte`` / ``output_projection_tkg``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..framework.arguments import array_argument, is_array
from ..framework.common_types import NormType, QKVOutputLayout, QuantizationType
from ..framework.validation import check_operand_layouts, check_positive_finite, static_float, static_int
from ..norm.fused_norm import norm_type_of
from ..projection.output_projection_cte import output_projection_cte
from ..projection.output_projection_tkg import output_projection_tkg
from ..projection.qkv import NBSD_HEAD_DIM, qkv
from ..projection.qkv_reference import kv_bounds, quantize_kv, uses_tkg
from ..quant.weights import QuantizedWeight, check_weight, fp8_data, input_scale_tile, scale_tile
from ..sharding import auto
from .layouts import KV_CACHE_LAYOUT
from .precision import float32_compute
from .rope import TABLE_LAYOUTS


def _array(where: str, name: str, value, layout: str, rank: int | None = None, activation: bool = False):
    """A float array (``activation``: in a dtype the kernels compute in, not FP8) of rank ``rank``."""
    return array_argument(where, name, value, layout=layout, rank=rank, dtypes="kernel" if activation else "floating")


def _row(where: str, name: str, value, dim: str, size: int, dtype):
    """A ``[dim]`` (or ``[1, dim]``) vector, ``dim`` of ``size``, as the kernels' ``[1, size]`` row in ``dtype``."""
    if value is None:
        return None
    check_operand_layouts(where, {name: (dim, f"1, {dim}")}, dtypes="floating", known={dim: size}, **{name: value})
    return jnp.asarray(value).reshape(1, size).astype(dtype)


def _weight(where: str, w, layout: str):
    """A float weight ``[in, out]`` or a validated :class:`QuantizedWeight`; raw FP8 arrays are refused."""
    if isinstance(w, QuantizedWeight):
        check_weight(where, "w", w)
        return w
    w = _array(where, "w", w, layout, 2)
    if w.dtype.itemsize == 1:
        raise TypeError(
            f"{where}: `w` is a raw FP8 array; pass FP8 weights with their scales as "
            "jax_nkilib.quantize_weight_fp8(w, mode=...) (a QuantizedWeight)"
        )
    return w


def _quantization(where: str, w, tkg: bool, path: str) -> QuantizationType:
    """The kernel's quantization type for ``w``: ROW needs the TKG path (``path`` names the dispatch rule)."""
    if not isinstance(w, QuantizedWeight):
        return QuantizationType.NONE
    if w.mode == "row" and not tkg:
        raise ValueError(
            f"{where}: mode='row' weights run only on the kernel's TKG path ({path}); this call takes "
            "the CTE path, which supports mode='static' only"
        )
    return QuantizationType.ROW if w.mode == "row" else QuantizationType.STATIC


# ------------------------------------------------------------------------------------------- output projection
OUTPUT_PROJECTION_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.output_projection",
        free={"b": "batch", "s": "sequence", "h": "hidden (w's columns)"},
        collective={
            "n": ("heads (the contraction)", "row-parallel: local projections + one all-reduce (psum), then the bias")
        },
        note="a QuantizedWeight must be replicated",
    )
)


def output_projection(attn, w, bias=None):
    """``attn [batch, seq, heads, head_dim] · w [heads * head_dim, hidden] (+ bias [hidden])`` -> ``[batch, seq,
    hidden]``, in ``attn``'s dtype (``w`` and ``bias`` are cast to it; accumulation in float32).

    Row ``h * head_dim + d`` of ``w`` multiplies head ``h``, component ``d``. Differentiable in ``attn``, ``w`` and
    ``bias``. ``w`` may be a ``jax_nkilib.QuantizedWeight`` (``W ~= data * scale``, see
    ``jax_nkilib.quantize_weight_fp8``; no gradient): ``mode="static"`` (both paths) quantizes the attention as
    ``fp8(clip(attn / input_scale, +-bound))`` and computes ``(q @ data) * (scale * input_scale)``; ``mode="row"``
    (TKG path only, else ``ValueError``) computes ``(attn @ data) * scale[col]`` with unquantized attention.
    On Neuron it is ``output_projection_tkg`` when ``seq <= 96`` and ``batch * seq <= 128`` (the decode threshold
    ``qkv`` uses), else ``output_projection_cte``; the attention reaches the kernel's layout by one transpose in the
    Neuron lowering (none on CPU/GPU).
    """
    where = "jax_nkilib.output_projection"
    check_operand_layouts(where, {"attn": "batch, seq, heads, head_dim"}, positive=("heads", "head_dim"), attn=attn)
    attn = jnp.asarray(attn)
    batch, seq, heads, d = attn.shape
    w = _weight(where, w, "[heads * head_dim, hidden]")
    if w.shape[0] != heads * d:
        raise ValueError(
            f"{where}: `w` must be [heads * head_dim, hidden] = [{heads * d}, hidden] for attn "
            f"{tuple(attn.shape)}; got {tuple(w.shape)}"
        )
    hidden = w.shape[1]
    sharded = auto.plan(
        OUTPUT_PROJECTION_SHARDING,
        [
            auto.ShardedArgument("attn", attn, "bsnd"),
            auto.ShardedArgument("w", w, None if isinstance(w, QuantizedWeight) else "nh"),
            auto.ShardedArgument("bias", bias, None if bias is None else "h"),
        ],
    )
    if sharded:

        def local(attn, w, bias, axes):
            if "n" not in axes:
                return output_projection(attn, w, bias)
            out = jax.lax.psum(output_projection(attn, w), axes["n"])  # row-parallel: partial sums over heads
            return out if bias is None else out + jnp.asarray(bias).astype(out.dtype)

        return sharded.run(local, "bsh")
    if batch * seq * hidden == 0:  # no tokens or no outputs: nothing for a kernel to compute
        _row(where, "bias", bias, "hidden", hidden, attn.dtype)
        return jnp.zeros((batch, seq, hidden), attn.dtype)
    tkg = uses_tkg(batch, seq, False)
    quant = _quantization(where, w, tkg, "seq <= 96 and batch * seq <= 128")
    weight = fp8_data(w) if quant != QuantizationType.NONE else w.astype(attn.dtype)
    w_scale = None if quant == QuantizationType.NONE else scale_tile(w)
    in_scale = input_scale_tile(w) if quant == QuantizationType.STATIC else None
    operands = {"weight": weight, "bias": _row(where, "bias", bias, "hidden", hidden, attn.dtype)}
    if tkg:  # attention [head_dim, batch, heads, seq]
        kernel = output_projection_tkg
        operands.update(attention=jnp.transpose(attn, (3, 0, 2, 1)), weight_scale=w_scale, input_scale=in_scale)
    else:  # attention [batch, heads, head_dim, seq]
        kernel = output_projection_cte
        operands.update(attention=jnp.transpose(attn, (0, 2, 3, 1)), input_scales=in_scale, weight_scales=w_scale)
    (out,) = kernel.call(operands, kernel.params(quantization_type=quant))
    return out.reshape(batch, seq, hidden)


# ---------------------------------------------------------------------------------------------- qkv projection
def _cache_arrays(where, kv_cache, batch, seq, kv_heads, d, positions):
    """The checked caches and write positions ``[batch, seq]`` int32 (``None``: ``0 .. seq-1``; a position outside
    ``[0, max_len)`` becomes ``max_len``, which every write skips)."""
    if not (isinstance(kv_cache, (tuple, list)) and len(kv_cache) == 2):
        raise TypeError(f"{where}: `kv_cache` must be (k_cache, v_cache), each [{KV_CACHE_LAYOUT}]")
    positions = None if positions is None else jnp.asarray(positions)  # a nested list of ints is fine too
    dims = check_operand_layouts(
        where,
        {"k_cache": KV_CACHE_LAYOUT, "v_cache": KV_CACHE_LAYOUT, "cache_positions": "batch, seq"},
        dtypes={"k_cache": "floating", "v_cache": "floating", "cache_positions": None},
        known={"batch": batch, "seq": seq, "kv_heads": kv_heads, "head_dim": d},
        k_cache=kv_cache[0],
        v_cache=kv_cache[1],
        cache_positions=positions,
    )
    k_cache, v_cache = jnp.asarray(kv_cache[0]), jnp.asarray(kv_cache[1])
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"{where}: k_cache and v_cache must have one dtype; got {k_cache.dtype} and {v_cache.dtype}")
    max_len = dims["max_len"]
    if positions is None:
        if max_len < seq:
            raise ValueError(f"{where}: the caches hold {max_len} positions, fewer than the {seq} tokens")
        return k_cache, v_cache, None
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"{where}: `cache_positions` must be an integer array [batch, seq]; got {positions.dtype}")
    inside = (positions >= 0) & (positions < max_len)
    return k_cache, v_cache, jnp.where(inside, positions, max_len).astype(jnp.int32)


def _write_new_tokens(cache, new, positions):
    """``cache [batch, kv_heads, max_len, d]`` with ``new [batch, seq, kv_heads, d]`` at positions ``0 .. seq-1``
    or ``positions [batch, seq]`` (``max_len`` skips): only the new tokens move, never the cache."""
    if positions is None:
        return jax.lax.dynamic_update_slice(cache, jnp.swapaxes(new, 1, 2), (0, 0, 0, 0))
    rows = jnp.arange(cache.shape[0])[:, None]
    return cache.at[rows, :, positions].set(new, mode="drop")  # indexed dims first: [batch, seq, kv_heads, d]


def _kernel_cache_write(operands, flags, k_cache, v_cache, positions, k_scale, v_scale):
    """The qkv kernel's fused write into caches of one kv head: ``[batch, 1, max_len, d]`` is the kernel's flat
    ``[batch, max_len, d]`` cache, and with ``positions`` its block cache of ``batch`` blocks of ``max_len``
    slots. Returns ``(q [batch, seq, q_dim], k_cache, v_cache)``."""
    batch, _, max_len, d = k_cache.shape
    cache_flags = dict(kv_dtype=k_cache.dtype)
    slots = None
    if positions is not None:
        rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
        slots = jnp.where(positions < max_len, rows * max_len + positions, -1)
        cache_flags.update(use_block_kv=True, block_size=max_len)
    operands = dict(
        operands,
        k_cache=k_cache.reshape(batch, max_len, d),
        v_cache=v_cache.reshape(batch, max_len, d),
        k_scale=k_scale,
        v_scale=v_scale,
        slot_mapping=slots,
    )
    q, k_new, v_new = qkv.call(operands, qkv.params(**flags, **cache_flags))
    return q, k_new.reshape(k_cache.shape), v_new.reshape(v_cache.shape)


def _scales(where, kv_scale):
    if kv_scale is None:
        return jnp.ones((128, 1), jnp.float32), jnp.ones((128, 1), jnp.float32)
    if not (isinstance(kv_scale, (tuple, list)) and len(kv_scale) == 2):
        raise TypeError(f"{where}: `kv_scale` must be (k_scale, v_scale), two scalars")
    scales = []
    for name, scale in zip(("k_scale", "v_scale"), kv_scale):
        if not (
            isinstance(scale, (int, float, np.integer, np.floating))
            and not isinstance(scale, bool)
            or hasattr(scale, "dtype")
            and (jnp.issubdtype(scale.dtype, jnp.floating) or jnp.issubdtype(scale.dtype, jnp.integer))
        ):
            raise TypeError(f"{where}: `kv_scale` entries must be float scalars; {name} is {type(scale).__name__}")
        check_positive_finite(
            where, "kv_scale", scale, f"{name}, a cache dequantization scale: the cache stores {name[0]} / {name}"
        )
        scale = jnp.asarray(scale, jnp.float32)
        if scale.size != 1:
            raise ValueError(f"{where}: `kv_scale` entries must be scalars; {name} has shape {scale.shape}")
        scales.append(jnp.broadcast_to(scale.reshape(1, 1), (128, 1)))
    return tuple(scales)


QKV_PROJECTION_SHARDING = auto.register_rule(
    auto.ShardingRule(
        "jax_nkilib.qkv_projection",
        free={"b": "batch", "s": "sequence", "n": "heads"},
        note="heads shard when w is given as (w_q, w_k, w_v) (column-parallel; num_q_heads and num_kv_heads divisible "
        "by the mesh axis size); not the sequence with kv_cache",
    )
)


def head_counts(where: str, num_q_heads, num_kv_heads) -> tuple[int, int]:
    """``(num_q_heads, num_kv_heads)`` as static positive Python ints (``TypeError`` for a traced or non-int value,
    ``ValueError`` for one below 1)."""
    return static_int(where, "num_q_heads", num_q_heads, minimum=1), static_int(
        where, "num_kv_heads", num_kv_heads, minimum=1
    )


def _split_weights(where: str, w, bias, hidden: int, num_q_heads: int, num_kv_heads: int):
    """Validate ``w = (w_q, w_k, w_v)`` (and a matching ``bias`` triple) against the head counts: ``w_q [hidden,
    num_q_heads * head_dim]``, ``w_k`` and ``w_v [hidden, num_kv_heads * head_dim]`` with one head_dim."""
    if len(w) != 3 or not all(is_array(part) and jnp.ndim(part) == 2 for part in w):
        raise TypeError(f"{where}: a split `w` must be (w_q, w_k, w_v), float arrays [hidden, heads * head_dim]")
    if bias is not None and not (isinstance(bias, (tuple, list)) and len(bias) == 3):
        raise TypeError(f"{where}: with a split `w`, `bias` must be (b_q, b_k, b_v) or None")
    w_q, w_k, w_v = w
    d = w_q.shape[1] // num_q_heads
    expected = {"w_q": (hidden, num_q_heads * d), "w_k": (hidden, num_kv_heads * d), "w_v": (hidden, num_kv_heads * d)}
    if (
        w_q.shape[1] % num_q_heads
        or d == 0
        or any(tuple(part.shape) != expected[name] for name, part in zip(expected, w))
    ):
        got = ", ".join(f"{name} {tuple(part.shape)}" for name, part in zip(expected, w))
        raise ValueError(
            f"{where}: a split `w` must be w_q [hidden, num_q_heads * head_dim] and w_k, w_v [hidden, "
            f"num_kv_heads * head_dim] with one head_dim >= 1 (hidden={hidden}, num_q_heads={num_q_heads}, "
            f"num_kv_heads={num_kv_heads}); got {got}"
        )
    if bias is not None:
        for name, part, size in zip(("b_q", "b_k", "b_v"), bias, (num_q_heads * d, num_kv_heads * d, num_kv_heads * d)):
            if part is not None and jnp.shape(part) not in ((size,), (1, size)):
                raise ValueError(
                    f"{where}: `bias` {name} must be [{size}] (heads * head_dim with head_dim={d}); got "
                    f"shape {jnp.shape(part)}"
                )
        if any(part is None for part in bias):
            bias = tuple(
                jnp.zeros((size,), w_q.dtype) if part is None else part
                for part, size in zip(bias, (num_q_heads * d, num_kv_heads * d, num_kv_heads * d))
            )
    return tuple(jnp.asarray(part) for part in w), None if bias is None else tuple(jnp.asarray(b) for b in bias)


def _rope_table_dims(rope):
    """The planner's dims of ``rope``'s tables, as :func:`jax_nkilib.rope` plans them: ``[seq, head_dim/2]`` is
    ``"s_"``, ``[batch, seq, head_dim/2]`` ``"bs_"`` (``"_s_"`` for a batch of 1, broadcast); anything else is left
    replicated (the shape check refuses it)."""
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2):
        return None
    dims = {2: lambda t: "s_", 3: lambda t: "_s_" if t.shape[0] == 1 else "bs_"}
    return tuple(dims[t.ndim](t) if getattr(t, "ndim", None) in dims else None for t in rope)


def _rope_tables(where: str, rope, batch: int, seq: int, d: int, dtype):
    """``rope = (cos, sin)``, :func:`jax_nkilib.rope`'s tables (``[seq, head_dim/2]`` or ``[batch, seq,
    head_dim/2]``, the batch 1 or ``batch``), as the kernel's ``cos_cache``, ``sin_cache [batch, seq, head_dim]``
    in ``dtype``: each half-width table repeated (``[t | t]``; the kernel reads ``cos`` in full and the first half of
    ``sin``) and broadcast over the batch."""
    expected = "each [seq, head_dim/2] or [batch, seq, head_dim/2] (jax_nkilib.rope's tables)"
    if not (isinstance(rope, (tuple, list)) and len(rope) == 2):
        raise TypeError(f"{where}: `rope` must be (cos, sin), {expected}")
    if d % 2:
        raise ValueError(f"{where}: `rope` rotates halves of each head: head_dim must be even; got head_dim={d}")
    tables = dict(zip(("cos", "sin"), rope))
    try:
        check_operand_layouts(
            where,
            dict.fromkeys(tables, TABLE_LAYOUTS),
            dtypes="floating",
            known={"seq": seq, "head_dim": d},
            **tables,
        )
    except ValueError as err:
        detail = str(err).removeprefix(f"{where}: ")
        raise ValueError(f"{where}: `rope` must be (cos, sin), {expected}: {detail}") from None
    cos, sin = (jnp.asarray(table) for table in tables.values())
    if cos.shape != sin.shape:
        raise ValueError(
            f"{where}: `rope`'s `cos` and `sin` must have the same shape; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.ndim == 3 and cos.shape[0] not in (1, batch):
        raise ValueError(
            f"{where}: the batch axis of `rope`'s tables ({cos.shape[0]}) must be 1 or the batch of `x` ({batch})"
        )
    return tuple(jnp.broadcast_to(jnp.concatenate([t, t], -1), (batch, seq, d)).astype(dtype) for t in (cos, sin))


def _sharded_qkv(
    sharded,
    x,
    w,
    bias,
    norm_weight,
    norm_bias,
    rope,
    kv_cache,
    cache_positions,
    kv_scale,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    **flags,
):
    """Run :func:`qkv_projection` on local shards: batch and tokens split freely; heads split with ``w``'s
    columns (each shard projects its own query and kv heads)."""
    where = "jax_nkilib.qkv_projection"
    parts = sharded.axis_size("n")
    if num_q_heads % parts or num_kv_heads % parts:
        raise ValueError(
            f"{where}: {num_q_heads} query and {num_kv_heads} kv heads cannot be split evenly over mesh "
            f"axis {sharded.axes['n']} of size {parts}"
        )
    if kv_cache is not None and "s" in sharded.axes:
        raise ValueError(
            f"{where}: the sequence is split over mesh axis {sharded.axes['s']}, but the kv_cache write "
            "needs every token of a sequence on one device; replicate the sequence axis"
        )

    def local(x, w, bias, norm_weight, norm_bias, rope, kv_cache, cache_positions, kv_scale, axes):
        return qkv_projection(
            x,
            w,
            num_q_heads=num_q_heads // parts,
            num_kv_heads=num_kv_heads // parts,
            bias=bias,
            norm_weight=norm_weight,
            norm_bias=norm_bias,
            rope=rope,
            kv_cache=kv_cache,
            cache_positions=cache_positions,
            kv_scale=kv_scale,
            **flags,
        )

    cache_dims = "bsnd" if kv_cache is None else "bn_d"
    return sharded.run(local, ("bsnd", cache_dims, cache_dims))


def qkv_projection(
    x,
    w,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    bias=None,
    norm: str | None = None,
    norm_weight=None,
    norm_bias=None,
    eps: float = 1e-6,
    rope=None,
    kv_cache=None,
    cache_positions=None,
    kv_scale=None,
    precision=None,
):
    """Query, key and value heads of ``x [batch, seq, hidden]``: ``norm(x) @ w (+ bias)``, split into heads, with
    RoPE on the query and key heads.

    Args:
      w: ``[hidden, (num_q_heads + 2 * num_kv_heads) * head_dim]``, columns ``[Q heads | K heads | V heads]``, or
        ``(w_q, w_k, w_v)`` (``[hidden, num_q_heads * head_dim]``, ``[hidden, num_kv_heads * head_dim]`` twice, one
        head_dim, checked), the same projection, concatenated for the kernel; split weights let the heads shard
        (column parallelism).
      num_q_heads, num_kv_heads: static positive ints.
      bias: ``[(num_q_heads + 2 * num_kv_heads) * head_dim]`` (``(b_q, b_k, b_v)`` with a split ``w``).
      norm: ``None``, ``"rms"`` (``x / sqrt(mean(x^2) + eps) * norm_weight``; no scale when ``norm_weight`` is
        None) or ``"layer"`` (``(x - mean) / sqrt(var + eps) * norm_weight + norm_bias``), over ``hidden``; ``eps``
        a static finite float >= 0.
      rope: ``(cos, sin)``, :func:`jax_nkilib.rope`'s tables: each ``[seq, head_dim/2]`` (shared by every batch
        element) or ``[batch, seq, head_dim/2]`` (a batch of 1 broadcasts); halves ``[x1 | x2]`` of the query and key
        heads become ``[x1 cos - x2 sin, x2 cos + x1 sin]``, as ``jax_nkilib.rope(q, cos, sin)`` on the projected
        heads. (The kernel's ``[batch, seq, head_dim]`` tables, each half-width table repeated, are built here.)
      kv_cache: ``(k_cache, v_cache)``, each ``[batch, num_kv_heads, max_len, head_dim]`` (the KV-cache layout of
        :func:`jax_nkilib.attention`'s ``prefix`` and :func:`jax_nkilib.decode_attention`): the new keys (after
        RoPE) and values are stored at positions ``0 .. seq-1``, or at ``cache_positions [batch, seq]`` (int;
        positions outside ``[0, max_len)`` are skipped, except by the kernel's own write on Neuron, which does not
        check them), as
        ``clip(k / k_scale, ±max)`` in the caches' dtype (``max`` its largest finite value; ``kv_scale = (k_scale,
        v_scale)``, default 1, each finite and > 0: checked when concrete, a traced 0 fills the cache with +-max)
        — FP8 caches quantize.
      precision: float32 inputs compute in float32 off Neuron (JAX's convention, as ``x @ w``), unless bfloat16
        compute, the kernel's, is asked for: ``precision="bfloat16"`` (or ``jax.lax.DotAlgorithmPreset.BF16_BF16_F32``
        / ``BF16_BF16_BF16``), or, with ``None`` (the default), ``jax.default_matmul_precision("bfloat16")`` (read at
        trace time). Other values (``"default"``, ``"highest"``, ``"float32"``, a ``jax.lax.Precision``...) keep
        float32. No effect on bfloat16, float16 or float64 inputs, nor on the TKG path.

    Returns ``(q [batch, seq, num_q_heads, head_dim], k, v [batch, seq, num_kv_heads, head_dim])`` in ``x``'s dtype,
    or with ``kv_cache`` ``(q, k_cache, v_cache)`` (a functional update; the caches carry no gradient; with no
    tokens, ``batch * seq == 0``, empty heads and unchanged caches, without a kernel call). ``w``,
    ``bias``, ``norm_weight``, ``norm_bias`` and the RoPE tables are cast to ``x``'s dtype. ``w`` may be a
    ``jax_nkilib.QuantizedWeight`` (``W ~= data * scale``, see ``jax_nkilib.quantize_weight_fp8``; no gradient):
    ``mode="static"`` (both paths) computes ``fp8(clip(x' / input_scale, +-max)) @ data * (scale * input_scale)``
    (``x'`` the normed input, ``max`` the data format's largest value); ``mode="row"`` (TKG path only, else
    ``ValueError``: the CTE kernel applies no row scales) computes ``(x' @ data) * scale[col]``. Differentiable in
    ``x``, ``w``, ``bias``, the norm parameters and the tables. On Neuron this is the NKI ``qkv`` kernel (its CTE
    path for ``seq > 96``, ``batch * seq > 128`` or RoPE, there with ``head_dim == 128`` in its heads-first ``NBSd``
    layout, which :func:`jax_nkilib.attention` reads at batch 1 with no data-moving transpose; else its TKG
    path). The kernel's fused cache write takes
    ``[batch, max_len, kv_heads * head_dim]`` caches, which are this layout only for one kv head (a
    tensor-parallel shard's usual count): then the CTE path writes the cache in the kernel; otherwise XLA writes
    the new tokens (a transpose of the new ``[batch, seq, kv_heads, head_dim]`` only, never of the cache). The
    kernel computes float32 inputs in bfloat16 on its CTE path whatever ``precision`` says
    (``jax_nkilib.explain`` notes it for such calls); ``jax_nkilib.nki.qkv`` is the kernel's numerics everywhere.
    """
    where = "jax_nkilib.qkv_projection"
    check_operand_layouts(where, {"x": "batch, seq, hidden"}, positive=("hidden",), x=x)
    x = jnp.asarray(x)
    batch, seq, hidden = x.shape
    num_q_heads, num_kv_heads = head_counts(where, num_q_heads, num_kv_heads)
    eps = static_float(where, "eps", eps, minimum=0.0)
    compute = float32_compute(where, precision)
    split = isinstance(w, (tuple, list))
    if split:
        w, bias = _split_weights(where, w, bias, hidden, num_q_heads, num_kv_heads)
    sharded = auto.plan(
        QKV_PROJECTION_SHARDING,
        [
            auto.ShardedArgument("x", x, "bsh"),
            auto.ShardedArgument("w", w, ("hn",) * 3 if split else None if isinstance(w, QuantizedWeight) else "hf"),
            auto.ShardedArgument("bias", bias, ("n",) * 3 if split else "f"),
            auto.ShardedArgument("norm_weight", norm_weight, "h"),
            auto.ShardedArgument("norm_bias", norm_bias, "h"),
            auto.ShardedArgument("rope", rope, _rope_table_dims(rope)),
            auto.ShardedArgument("kv_cache", kv_cache, ("bn_d", "bn_d")),
            auto.ShardedArgument("cache_positions", cache_positions, "bs"),
            auto.ShardedArgument("kv_scale", kv_scale),
        ],
    )
    if sharded:
        return _sharded_qkv(
            sharded,
            x,
            w,
            bias,
            norm_weight,
            norm_bias,
            rope,
            kv_cache,
            cache_positions,
            kv_scale,
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            norm=norm,
            eps=eps,
            precision=compute,
        )
    if split:
        w = jnp.concatenate(w, axis=1)
        bias = None if bias is None else jnp.concatenate(bias)
    w = _weight(where, w, "[hidden, (num_q_heads + 2 * num_kv_heads) * head_dim]")
    heads = num_q_heads + 2 * num_kv_heads
    if w.shape[0] != hidden or w.shape[1] % heads or w.shape[1] == 0:
        raise ValueError(
            f"{where}: `w` must be [hidden={hidden}, (num_q_heads + 2 * num_kv_heads) * head_dim] with "
            f"{heads} heads and head_dim >= 1; got {tuple(w.shape)}"
        )
    d = w.shape[1] // heads
    norm_type = norm_type_of(where, norm)
    gamma = _row(where, "norm_weight", norm_weight, "hidden", hidden, x.dtype)
    beta = _row(where, "norm_bias", norm_bias, "hidden", hidden, x.dtype)
    if norm is None and (gamma is not None or beta is not None):
        raise ValueError(f"{where}: norm_weight/norm_bias need norm='rms' or 'layer'")
    if beta is not None and norm != "layer":
        raise ValueError(f"{where}: norm_bias needs norm='layer'")
    if norm == "rms" and gamma is None:
        norm_type = NormType.RMS_NORM_SKIP_GAMMA
    if norm == "layer" and gamma is None:
        gamma = jnp.ones((1, hidden), x.dtype)
    quant = _quantization(where, w, uses_tkg(batch, seq, rope is not None), "seq <= 96, batch * seq <= 128, no rope")
    operands = {
        "input": x,
        "bias": _row(where, "bias", bias, "qkv_dim", w.shape[1], x.dtype),
        "gamma_norm_weights": gamma,
        "layer_norm_bias": beta,
    }
    if quant == QuantizationType.NONE:
        operands["fused_qkv_weights"] = w.astype(x.dtype)
    else:  # FP8: STATIC takes one weight scale per Q/K/V segment (all equal here), ROW one per column
        tile = scale_tile(w)
        operands.update(
            fused_qkv_weights=fp8_data(w),
            qkv_w_scale=jnp.broadcast_to(tile, (128, 3)) if quant == QuantizationType.STATIC else tile,
            qkv_in_scale=input_scale_tile(w) if quant == QuantizationType.STATIC else None,
        )
    flags = dict(
        fused_norm_type=norm_type,
        norm_eps=float(eps),
        d_head=d,
        num_q_heads=num_q_heads,
        num_kv_heads=num_kv_heads,
        quantization_type=quant,
        float32_compute=compute,
    )
    if rope is not None:
        cos, sin = _rope_tables(where, rope, batch, seq, d, x.dtype)
        operands.update(cos_cache=cos, sin_cache=sin)
        flags["fused_rope"] = True
    if kv_cache is None:
        if cache_positions is not None or kv_scale is not None:
            raise ValueError(f"{where}: cache_positions and kv_scale need kv_cache")
        return _project_heads(operands, flags, x.dtype, batch, seq)
    k_cache, v_cache, positions = _cache_arrays(where, kv_cache, batch, seq, num_kv_heads, d, cache_positions)
    k_scale, v_scale = _scales(where, kv_scale)
    if batch * seq == 0:  # no tokens: the caches are unchanged
        return jnp.zeros((batch, seq, num_q_heads, d), x.dtype), k_cache, v_cache
    if num_kv_heads == 1 and not uses_tkg(batch, seq, rope is not None):  # the kernel's own cache write
        q, k_cache, v_cache = _kernel_cache_write(operands, flags, k_cache, v_cache, positions, k_scale, v_scale)
        return q.astype(x.dtype).reshape(batch, seq, num_q_heads, d), k_cache, v_cache
    # The kernel writes [batch, max_len, kv_heads * head_dim] caches only (and its TKG path none): project, then
    # write the new tokens by XLA.
    q, k, v = _project_heads(operands, flags, x.dtype, batch, seq)
    bounds = kv_bounds(k_cache.dtype, None, None)
    acc = jnp.promote_types(x.dtype, jnp.float32)
    k_cache, v_cache = (
        jax.lax.stop_gradient(
            _write_new_tokens(cache, quantize_kv(new.astype(acc), scale, cache.dtype, bounds, acc), positions)
        )
        for cache, new, scale in ((k_cache, k, k_scale), (v_cache, v, v_scale))
    )
    return q, k_cache, v_cache


def _project_heads(operands, flags, dtype, batch, seq):
    """The qkv kernel without caches: ``(q, k, v)``, each ``[batch, seq, heads, head_dim]`` in ``dtype``.

    With ``head_dim == 128`` on the kernel's CTE path the kernel writes its ``NBSd`` layout ``[heads, batch, seq,
    head_dim]``: q, k and v are then contiguous ranges of heads, and at batch 1 ``attention``'s rows ``[heads, seq,
    head_dim]`` are a transpose of only the unit batch axis away (no data moves between the two kernels).
    Otherwise ``BSD`` ``[batch, seq, heads * head_dim]``, split along its last axis."""
    d, num_q_heads, num_kv_heads = flags["d_head"], flags["num_q_heads"], flags["num_kv_heads"]
    heads_first = d == NBSD_HEAD_DIM and not uses_tkg(batch, seq, flags.get("fused_rope", False))
    if heads_first:
        flags = dict(flags, output_layout=QKVOutputLayout.NBSd)
    widths = (num_q_heads * d, num_kv_heads * d, num_kv_heads * d)
    if batch * seq == 0:  # no tokens: nothing for a kernel to compute
        return tuple(jnp.zeros((batch, seq, width // d, d), dtype) for width in widths)
    (out,) = qkv.call(operands, qkv.params(**flags))
    out = out.astype(dtype)  # STATIC on the CTE path returns bfloat16
    ends = np.cumsum(widths)
    if heads_first:  # [heads, batch, seq, d]
        return tuple(
            jnp.transpose(out[(end - width) // d : end // d], (1, 2, 0, 3)) for end, width in zip(ends, widths)
        )
    return tuple(out[..., end - width : end].reshape(batch, seq, width // d, d) for end, width in zip(ends, widths))
