"""Arg specs of ``ms_deformable_attention``, ``ms_deformable_attention_bwd`` (kernel-native) and
``jax_nkilib.deformable_attention``.

Sampling locations keep every pixel coordinate's fraction in [0.25, 0.75] (away from bilinear sampling's kinks at
integer coordinates, so finite differences see one linear piece); some fall in the half pixel outside the map,
whose corners count zero.
"""

import numpy as np
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register, uniform

SPATIAL_SHAPES = ((3, 5), (2, 3))
LEVEL_STARTS = (0, 15)
PIXELS = 21
BATCH, QUERIES, HEADS, CHANNELS, POINTS = 8, 3, 2, 3, 2
LEVELS = len(SPATIAL_SHAPES)
_DATA = (("data", 8),)


def kink_free_locations(rng, shape, spatial_shapes, dtype=np.float32):
    """Normalized ``[..., N_l, N_p, 2]`` (x, y) locations whose pixel coordinates ``x W - 0.5`` (``y H - 0.5``) lie
    in ``[-1, size - 1] + [0.25, 0.75]``: one cell in, or half outside, the map, never on a cell boundary."""
    *lead, levels, points, _ = shape
    out = np.empty(shape, np.float64)
    for level, (height, width) in enumerate(spatial_shapes):
        for axis, size in ((0, width), (1, height)):
            cell = rng.integers(-1, size, (*lead, points))
            pixel = cell + rng.uniform(0.25, 0.75, (*lead, points))
            out[..., level, :, axis] = (pixel + 0.5) / size
    return np.asarray(out, dtype)


def forward_operands(rng, dtype=np.float32):
    value = normal(rng, (BATCH, PIXELS, HEADS, CHANNELS), dtype)
    shape = (BATCH, QUERIES, HEADS, LEVELS, POINTS, 2)
    locations = kink_free_locations(rng, shape, SPATIAL_SHAPES)
    weights = uniform(rng, (BATCH, QUERIES, HEADS, LEVELS, POINTS), 0.0, 1.0, dtype)
    return value, locations, weights


def _backward_operands(rng):
    value, locations, weights = forward_operands(rng)
    return normal(rng, (BATCH, QUERIES, HEADS * CHANNELS)), value, locations, weights


_STATIC = {"spatial_shapes": SPATIAL_SHAPES, "level_start_index": LEVEL_STARTS}
_FORWARD_SPECS = (P("data"), P("data"), P("data"))

register(
    ArgSpec(
        "ms_deformable_attention",
        nki.ms_deformable_attention,
        ("value", "sampling_locations", "attention_weights"),
        forward_operands,
        kwargs=_STATIC,
        kernels=("ms_deformable_attention",),
        grad=("value", "sampling_locations", "attention_weights"),
        sharding=Sharding(_DATA, _FORWARD_SPECS, P("data")),
        bad=BadInput("level_start_index", lambda starts: starts[:1], "level_start_index"),
    ),
    ArgSpec(
        "ms_deformable_attention_bwd",
        nki.ms_deformable_attention_bwd,
        ("grad_output", "value", "sampling_locations", "attention_weights"),
        _backward_operands,
        kwargs=_STATIC,
        kernels=("ms_deformable_attention_bwd",),
        grad=("grad_output", "value", "attention_weights"),
        sharding=Sharding(_DATA, (P("data"), *_FORWARD_SPECS), (P("data"), P("data"), P("data"))),
        bad=BadInput("spatial_shapes", lambda shapes: ((5, 0), (3, 4)), "spatial_shapes"),
        notes="second order: the locations' cotangent is left out (the derivative in the locations is piecewise "
        "constant in them, kinks included at the border)",
    ),
    ArgSpec(
        "jax_nkilib.deformable_attention",
        jax_nkilib.deformable_attention,
        ("value", "sampling_locations", "attention_weights"),
        forward_operands,
        kwargs={"spatial_shapes": SPATIAL_SHAPES},
        positional=1,
        kernels=("ms_deformable_attention",),
        grad=("value", "sampling_locations", "attention_weights"),
        sharding=Sharding(_DATA, _FORWARD_SPECS, P("data")),
        bad=BadInput("spatial_shapes", lambda shapes: ((5, 7), (3, 3)), "spatial_shapes"),
    ),
)
