"""Arg specs of the convolution kernels."""

from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, normal, register

_DATA = (("data", 8),)

register(
    ArgSpec(
        "conv1d",
        nki.conv1d,
        ("x_in", "filters", "bias"),
        lambda rng: (normal(rng, (8, 5, 19)), normal(rng, (3, 5, 6), scale=0.5), normal(rng, (6,))),
        kwargs={"stride": 2, "padding": (2, 1), "dilation": 2, "activation_fn": "GELU_Tanh_Approx"},
        kernels=("conv1d",),
        grad=("x_in", "filters", "bias"),
        sharding=Sharding(_DATA, (P("data"), P(), P()), P("data")),
        bad=BadInput("filters", lambda f: f[:, :4], "K, Cin, Cout"),
    ),
)

register(
    ArgSpec(
        "depthwise_conv1d_implicit_gemm",
        nki.depthwise_conv1d_implicit_gemm,
        ("img_ref", "filter_ref"),
        lambda rng: (normal(rng, (8, 6, 1, 23)), normal(rng, (6, 1, 1, 5), scale=0.5)),
        kwargs={"padding": ((0, 0), (2, 1)), "stride": (1, 2), "feature_group_count": 6},
        kernels=("depthwise_conv1d_implicit_gemm",),
        grad=("img_ref", "filter_ref"),
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        bad=BadInput("filter_ref", lambda f: f.reshape(6, 1, 5, 1), "C, 1, 1, S"),
        neuron_lnc=2,
    ),
)

register(
    ArgSpec(
        "jax_nkilib.conv",
        jax_nkilib.conv,
        ("lhs", "rhs"),
        lambda rng: (normal(rng, (8, 21, 5)), normal(rng, (3, 5, 4), scale=0.5)),
        kwargs={
            "window_strides": (2,),
            "padding": "SAME",
            "rhs_dilation": (2,),
            "dimension_numbers": ("NWC", "WIO", "NCW"),
        },
        kernels=("conv1d",),
        only_kernels=False,
        grad=("lhs", "rhs"),
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        bad=BadInput("rhs", lambda w: w[..., 0], "rhs"),
        notes="the conv1d route, layouts transposed around the kernel",
    ),
    ArgSpec(
        "jax_nkilib.conv(depthwise)",
        jax_nkilib.conv,
        ("lhs", "rhs"),
        lambda rng: (normal(rng, (8, 6, 19)), normal(rng, (6, 1, 4), scale=0.5)),
        kwargs={"window_strides": (1,), "padding": [(1, 2)], "feature_group_count": 6},
        kernels=("depthwise_conv1d_implicit_gemm",),
        only_kernels=False,
        grad=("lhs", "rhs"),
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        neuron_lnc=2,
        notes="the depthwise route (NCH/OIH/NCH, the kernel's own layouts up to a unit H axis)",
    ),
    ArgSpec(
        "jax_nkilib.conv(3d)",
        jax_nkilib.conv,
        ("lhs", "rhs"),
        lambda rng: (normal(rng, (8, 4, 5, 3, 2)), normal(rng, (2, 3, 2, 2, 3), scale=0.5)),
        kwargs={
            "window_strides": (1, 2, 1),
            "padding": "SAME",
            "dimension_numbers": ("NDHWC", "DHWIO", "NDHWC"),
        },
        kernels=("conv3d",),
        only_kernels=False,
        grad=("lhs", "rhs"),
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        notes="the conv3d route from channels-last layouts",
    ),
    ArgSpec(
        "jax_nkilib.conv(3d transpose)",
        jax_nkilib.conv,
        ("lhs", "rhs"),
        lambda rng: (normal(rng, (8, 2, 3, 4, 5)), normal(rng, (4, 2, 2, 2, 3), scale=0.5)),
        kwargs={"window_strides": (1, 1, 1), "padding": [(1, 1)] * 3, "lhs_dilation": (2, 1, 2)},
        kernels=(),
        only_kernels=False,
        grad=("lhs", "rhs"),
        sharding=Sharding(_DATA, (P("data"), P()), P("data")),
        neuron_fallback="lhs_dilation",
        notes="a 3-D transposed convolution (lhs_dilation): lax on every platform until conv3d_transpose is bound",
    ),
)

register(
    ArgSpec(
        "conv3d",
        nki.conv3d,
        ("x_in", "filters", "bias"),
        lambda rng: (normal(rng, (8, 3, 4, 5, 6)), normal(rng, (2, 3, 2, 3, 4), scale=0.3), normal(rng, (4,))),
        kwargs={"stride": (1, 2, 1), "padding": (1, 0, 0, 1, 2, 1), "dilation": (1, 1, 2), "activation_fn": "SiLU"},
        kernels=("conv3d",),
        grad=("x_in", "filters", "bias"),
        sharding=Sharding(_DATA, (P("data"), P(), P()), P("data")),
        bad=BadInput("filters", lambda f: f[..., :2, :], "Kd, Kh, Kw, Cin, Cout"),
    ),
    ArgSpec(
        "conv3d_temporal_unroll",
        nki.conv3d_temporal_unroll,
        ("x_in", "filters", "bias"),
        lambda rng: (normal(rng, (8, 5, 4, 3, 7)), normal(rng, (2, 2, 3, 5, 3), scale=0.3), normal(rng, (3,))),
        kwargs={"padding": (0, 0, 1, 1, 1, 1), "activation_fn": "GELU"},
        kernels=("conv3d_temporal_unroll",),
        grad=("x_in", "filters", "bias"),
        sharding=Sharding(_DATA, (P("data"), P(), P()), P("data")),
        bad=BadInput("bias", lambda b: b[:2], "Cout"),
    ),
)
