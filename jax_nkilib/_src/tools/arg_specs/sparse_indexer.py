"""Arg specs of ``sparse_attention_indexer_mx_bf16score`` (DeepSeek-V3.2's sparse attention indexer, BF16 mode)."""

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jax_nkilib import nki
from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, angles, normal, register

OPERANDS = ("x", "wq_b", "wk", "k_norm_gamma", "k_norm_beta", "weights_proj", "cos", "sin", "k_cache", "mask")
OPERANDS += ("qr_bf16_hbm",)
_DEVICE = {"wq_b", "wk", "weights_proj", "k_cache", "qr_bf16_hbm"}  # bfloat16 on Neuron; the others float32


def indexer_operands(b, s, dim, q, h, d, r, t, start_pos, device=False, end=None):
    """The indexer's operands (``device``: the kernel's dtypes; ``end``: the mask's key range, default
    ``start_pos + s``), weights scaled so the scores stay O(1)."""

    def build(rng):
        dtype = lambda name: jnp.bfloat16 if device and name in _DEVICE else jnp.float32  # noqa: E731
        shapes = {
            "x": ((b * s, dim), 1.0),
            "wq_b": ((q, h * d), q**-0.5),
            "wk": ((dim, d), dim**-0.5),
            "k_norm_gamma": ((d,), 0.1),
            "k_norm_beta": ((d,), 0.1),
            "weights_proj": ((h, dim), dim**-0.5),
        }
        built = [normal(rng, shape, dtype(name), scale) for name, (shape, scale) in shapes.items()]
        built[3] = built[3] + 1.0
        built += angles(rng, (s, r // 2))
        built += [normal(rng, (b, d, t), dtype("k_cache")), normal(rng, (b * s, end or start_pos + s), scale=0.1)]
        built += [normal(rng, (b * s, q), dtype("qr_bf16_hbm"))]
        return tuple(built)

    return build


MX_OPERANDS = OPERANDS[:10] + ("wq_b_scale", "wk_scale", "qr_qtz_hbm", "qr_scale_hbm")


def _x4_words(rng, shape):
    """uint32 float8_e4m3fn_x4 words of random codes with magnitudes in [0.5, 2) (no NaN codes)."""
    codes = rng.integers(0x30, 0x40, (*shape, 4)) | (rng.integers(0, 2, (*shape, 4)) << 7)
    return jnp.asarray(np.sum(codes.astype(np.uint32) << (8 * np.arange(4, dtype=np.uint32)), axis=-1), jnp.uint32)


def _scales(rng, shape, exponent):
    """uint8 e8m0 scales near ``2**exponent``."""
    return jnp.asarray(127 + exponent + rng.integers(-1, 2, shape), jnp.uint8)


def mx_indexer_operands(b, s, dim, q, h, d, r, t, start_pos, device=False):
    """The MX mode's operands: x4 words with native scales for the weights and the swizzled ``qr_qtz_hbm``."""

    def build(rng):
        base = indexer_operands(b, s, dim, q, h, d, r, t, start_pos, device)(rng)
        tiles = -(-(b * s) // 128)
        wq, wk = _x4_words(rng, (q // 4, h * d)), _x4_words(rng, (dim // 4, d))
        extra = (_scales(rng, (q // 32, h * d), -4), _scales(rng, (dim // 32, d), -4))
        extra += (_x4_words(rng, (tiles, 128, q // 512, 128)), _scales(rng, (tiles, 128, q // 512, 128), -1))
        return (base[0], wq, wk, *base[3:10], *extra)

    return build


register(
    ArgSpec(
        "sparse_attention_indexer_mx_bf16score",
        nki.sparse_attention_indexer_mx_bf16score,
        OPERANDS,
        indexer_operands(8, 3, 12, 8, 2, 8, 4, 6, 1),
        kernels=("sparse_attention_indexer_mx_bf16score",),
        kwargs={"index_topk": 2, "start_pos": 1, "precision": "BF16"},
        positional=10,
        batch=("x", "k_cache", "mask", "qr_bf16_hbm"),
        sharding=Sharding(
            mesh=(("data", 8),),
            in_specs=(P("data"),) + (P(),) * 7 + (P("data"),) * 3,
            out_specs=(P("data"), P("data"), P("data")),
        ),
        neuron=indexer_operands(1, 128, 1024, 256, 2, 128, 64, 256, 0, device=True),
        neuron_kwargs={"index_topk": 32, "precision": "BF16"},
        bad=BadInput("index_topk", lambda _: 0, "index_topk"),
        notes="not differentiable (a selection kernel): no gradient check",
    ),
    ArgSpec(
        "sparse_attention_indexer_mx_bf16score.kproj",
        nki.sparse_attention_indexer_mx_bf16score,
        OPERANDS,
        indexer_operands(8, 3, 12, 8, 2, 8, 4, 6, 1),
        kernels=("sparse_attention_indexer_mx_bf16score",),
        kwargs={"index_topk": 2, "start_pos": 1, "phase": "kproj", "precision": "BF16"},
        positional=10,
        batch=("x", "k_cache", "mask", "qr_bf16_hbm"),
        sharding=Sharding(
            mesh=(("data", 8),), in_specs=(P("data"),) + (P(),) * 7 + (P("data"),) * 3, out_specs=P("data")
        ),
        neuron=indexer_operands(1, 128, 1024, 256, 2, 128, 64, 256, 0, device=True),
        neuron_kwargs={"index_topk": 32, "phase": "kproj", "precision": "BF16"},
        bad=BadInput("end_pos_arg", lambda _: 4, "end_pos_arg"),
        notes="context-parallel K projection: returns k_seq_out only",
    ),
    ArgSpec(
        "sparse_attention_indexer_mx_bf16score.score",
        nki.sparse_attention_indexer_mx_bf16score,
        OPERANDS,
        indexer_operands(8, 3, 12, 8, 2, 8, 4, 6, 1, end=5),
        kernels=("sparse_attention_indexer_mx_bf16score",),
        kwargs={"index_topk": 2, "start_pos": 1, "phase": "score", "end_pos_arg": 5, "precision": "BF16"},
        positional=10,
        batch=("x", "k_cache", "mask", "qr_bf16_hbm"),
        sharding=Sharding(
            mesh=(("data", 8),),
            in_specs=(P("data"),) + (P(),) * 7 + (P("data"),) * 3,
            out_specs=(P("data"), P("data")),
        ),
        neuron=indexer_operands(1, 128, 1024, 256, 2, 128, 64, 512, 128, device=True, end=512),
        neuron_kwargs={"index_topk": 32, "start_pos": 128, "phase": "score", "end_pos_arg": 512, "precision": "BF16"},
        bad=BadInput("end_pos_arg", lambda _: 9, "end_pos_arg"),
        notes="context-parallel score phase: this rank's queries against the gathered cache",
    ),
    ArgSpec(
        "sparse_attention_indexer_mx_bf16score.mx",
        nki.sparse_attention_indexer_mx_bf16score,
        MX_OPERANDS,
        mx_indexer_operands(2, 3, 64, 512, 2, 8, 4, 6, 1),
        kernels=("sparse_attention_indexer_mx_bf16score",),
        kwargs={"index_topk": 2, "start_pos": 1},
        positional=10,
        batch=("x", "k_cache", "mask"),
        neuron=mx_indexer_operands(1, 128, 1024, 512, 2, 128, 64, 256, 0, device=True),
        neuron_kwargs={"index_topk": 32},
        bad=BadInput("wq_b_scale", lambda a: a[:-1], "wq_b_scale"),
        notes="MX projections (the kernel's default precision): random x4 words and scales",
    ),
)
