"""jax_nkilib: the AWS NKI Library kernels as JAX primitives.

Idiomatic ops (JAX layouts, autodiff, vmap, shard_map) live here; the kernel-native layer is ``jax_nkilib.nki``;
remat policies that save kernel results are in ``jax_nkilib.checkpoint_policies``.
On CPU/GPU each op runs a faithful JAX reference of its kernel; lowered for ``neuron`` it becomes the NKI kernel.
"""

from jax_nkilib import checkpoint_policies, neuron, nki, optim
from jax_nkilib._src.framework.config import config, current_lnc
from jax_nkilib._src.ops.attention import attention, decode_attention
from jax_nkilib._src.ops.conv import conv
from jax_nkilib._src.ops.cumsum import cumsum
from jax_nkilib._src.ops.decode_block import decode_block
from jax_nkilib._src.ops.deformable_attention import deformable_attention
from jax_nkilib._src.ops.dot_product_attention import dot_product_attention
from jax_nkilib._src.ops.embedding import embedding_lookup
from jax_nkilib._src.ops.flax_attention import flax_attention_fn
from jax_nkilib._src.ops.loss import cross_entropy
from jax_nkilib._src.ops.mla import mla_attention
from jax_nkilib._src.ops.mlp import mlp
from jax_nkilib._src.ops.moe import moe, moe_block
from jax_nkilib._src.ops.norm import dequantize_fp8, layer_norm, quantize_fp8, rms_norm
from jax_nkilib._src.ops.pad import pad
from jax_nkilib._src.ops.projection import output_projection, qkv_projection
from jax_nkilib._src.ops.quant import dequantize_mx, mxfp8_matmul, quantize_mx
from jax_nkilib._src.ops.ring_attention import ring_attention
from jax_nkilib._src.ops.rope import rope
from jax_nkilib._src.ops.routing import Routing, argmax, router, topk
from jax_nkilib._src.ops.ssm import selective_scan, ssd
from jax_nkilib._src.quant.weights import QuantizedWeight, quantize_weight_fp8
from jax_nkilib._src.sharding.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_nkilib._src.sharding.sequence_layouts import from_ring_layout, to_ring_layout, token_positions
from jax_nkilib._src.tools.explain import Explanation, KernelCallReport, explain, neuron_hlo
from jax_nkilib._src.tools.support import KernelSupport, support_matrix

__version__ = "0.1.0"

__all__ = [
    "all_gather_matmul",
    "argmax",
    "attention",
    "checkpoint_policies",
    "config",
    "cross_entropy",
    "conv",
    "cumsum",
    "current_lnc",
    "decode_attention",
    "decode_block",
    "deformable_attention",
    "dequantize_fp8",
    "dequantize_mx",
    "dot_product_attention",
    "embedding_lookup",
    "explain",
    "Explanation",
    "flax_attention_fn",
    "from_ring_layout",
    "KernelCallReport",
    "KernelSupport",
    "layer_norm",
    "matmul_reduce_scatter",
    "mla_attention",
    "mlp",
    "moe",
    "moe_block",
    "mxfp8_matmul",
    "neuron",
    "neuron_hlo",
    "nki",
    "optim",
    "output_projection",
    "pad",
    "qkv_projection",
    "quantize_fp8",
    "quantize_mx",
    "quantize_weight_fp8",
    "QuantizedWeight",
    "ring_attention",
    "rms_norm",
    "rope",
    "router",
    "Routing",
    "selective_scan",
    "ssd",
    "support_matrix",
    "to_ring_layout",
    "token_positions",
    "topk",
]
