"""``jax_nkilib.deformable_attention``: multi-scale deformable attention with the semantics and layouts of Deformable
DETR's ``ms_deform_attn_core_pytorch`` (bilinear ``grid_sample``, ``align_corners=False``, zero padding), through the
``ms_deformable_attention`` kernel, whose VJP is the ``ms_deformable_attention_bwd`` kernel (see
:mod:`jax_nkilib._src.attention.ms_deformable_attention` for the math and dtype policy).

Under explicit shardings the batch splits freely; the other axes must be replicated.
"""

from __future__ import annotations

from ..attention.deformable_math import level_starts
from ..attention.ms_deformable_attention import ms_deformable_attention, normalize_spatial_shapes
from ..framework.validation import check_operand_layouts, require_static
from ..sharding import auto

WHERE = "jax_nkilib.deformable_attention"
LAYOUTS = {
    "value": "B, L, N_h, C_h",
    "sampling_locations": "B, N_q, N_h, N_l, N_p, 2",
    "attention_weights": "B, N_q, N_h, N_l, N_p",
}

DEFORMABLE_ATTENTION_SHARDING = auto.register_rule(
    auto.ShardingRule(WHERE, free={"b": "batch"}, note="queries, heads, levels and the value's pixels are replicated")
)


def _spatial_shapes(spatial_shapes) -> tuple[tuple[int, int], ...]:
    require_static(WHERE, "spatial_shapes", spatial_shapes, "a tuple of (H_l, W_l) int pairs")
    return normalize_spatial_shapes(spatial_shapes, f"{WHERE}: `spatial_shapes`")


def deformable_attention(value, spatial_shapes, sampling_locations, attention_weights):
    """Multi-scale deformable attention: ``[B, N_q, N_h * C_h]`` in ``value``'s dtype.

    ``value [B, sum(H_l * W_l), N_h, C_h]`` holds the levels' feature maps flattened row-major, one after the other;
    ``spatial_shapes`` is the static ``((H_0, W_0), ...)``; ``sampling_locations [B, N_q, N_h, N_l, N_p, 2]`` gives
    each point's ``(x, y)`` in ``[0, 1]`` of its level (x along the width); ``attention_weights [B, N_q, N_h, N_l,
    N_p]``. Each head's output is ``sum_{l, p} attention_weights * bilinear(value_l, x W_l - 0.5, y H_l - 0.5)`` with
    corners outside the map counting zero (``grid_sample(..., align_corners=False, padding_mode="zeros")``).
    Differentiable in all three arrays.
    """
    shapes = _spatial_shapes(spatial_shapes)
    dims = check_operand_layouts(
        WHERE,
        LAYOUTS,
        dtypes="floating",
        value=value,
        sampling_locations=sampling_locations,
        attention_weights=attention_weights,
    )
    if len(shapes) != dims["N_l"]:
        raise ValueError(
            f"{WHERE}: `spatial_shapes` has {len(shapes)} levels but `sampling_locations` and `attention_weights` "
            f"have N_l={dims['N_l']}"
        )
    pixels = sum(height * width for height, width in shapes)
    if pixels != dims["L"]:
        raise ValueError(
            f"{WHERE}: `value` must be [B, sum(H_l * W_l)={pixels}, N_h, C_h] for spatial_shapes {shapes}; got "
            f"L={dims['L']}"
        )
    sharded = auto.plan(
        DEFORMABLE_ATTENTION_SHARDING,
        [
            auto.ShardedArgument("value", value, "b___"),
            auto.ShardedArgument("sampling_locations", sampling_locations, "b_____"),
            auto.ShardedArgument("attention_weights", attention_weights, "b____"),
        ],
    )
    if sharded:
        return sharded.run(lambda v, s, a, axes: deformable_attention(v, shapes, s, a), "b__")
    return ms_deformable_attention(
        value, sampling_locations, attention_weights, spatial_shapes=shapes, level_start_index=level_starts(shapes)
    )
