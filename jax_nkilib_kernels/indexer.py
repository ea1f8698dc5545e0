"""Adapter for the NKI Library's ``sparse_attention_indexer_mx_bf16score``
(``nkilib.experimental.sparse_attention_indexer``) with the flat top-k output (``emit_flat_topk=True``).

The newer library source (public code index) adds ``compact_scales``, the ``precision``/``rope_layout`` enums
(``MlaPrecision``, ``RopeLayout`` of ``experimental.mla.deepseek.mla_common_cte``, passed here by member name) and the
plain bf16 ``qr_bf16_hbm`` to the 2.32 signature; the adapter passes them only when a call uses them, so the MX mode
with half-split RoPE and native scales also compiles against 2.32 (the newer modes need the newer library). The
shape-derived config (``n_heads``, ``head_dim``, ``rope_head_dim``, ``batch_size``) is computed here from the
tensors. With ``phase="all"`` the library updates ``k_cache`` in place and returns ``(index_score, topk)``; the
adapter also returns the cache, so NKI reports it as an output aliased to its input. With ``phase="kproj"`` it writes
K into ``k_seq_out_hbm``, which the adapter allocates and returns (the library's second result, its unwritten top-k
buffer, is dropped); ``"score"`` returns ``(index_score, topk)``. Not yet run on Trainium by this project.
"""

import nki
import nki.language as nl

from jax_nkilib_kernels._library import body, load

_library_indexer = load(
    "experimental.sparse_attention_indexer.sparse_attention_indexer_mx_bf16score",
    "sparse_attention_indexer_mx_bf16score",
)
# newer than 2.32: used only for the BF16 precision, the interleaved RoPE and the compact scales
MlaPrecision = load("experimental.mla.deepseek.mla_common_cte", "MlaPrecision", optional=True)
RopeLayout = load("experimental.mla.deepseek.mla_common_cte", "RopeLayout", optional=True)

_indexer_body = body(_library_indexer)


def _newer_arguments(compact_scales, precision, rope_layout, qr_bf16_hbm):
    """The arguments the 2.32 kernel lacks, only where they differ from its behaviour (MX, half-split RoPE, native
    scales), so that the MX mode also runs on 2.32."""
    newer = {}
    if compact_scales:
        newer["compact_scales"] = True
    if precision != "MX":
        newer["precision"] = MlaPrecision[precision]
        newer["qr_bf16_hbm"] = qr_bf16_hbm
    if rope_layout != "HALF_SPLIT":
        newer["rope_layout"] = RopeLayout[rope_layout]
    return newer


@nki.jit
def sparse_attention_indexer_mx_bf16score(
    x,
    wq_b,
    wk,
    k_norm_gamma,
    k_norm_beta,
    weights_proj,
    cos,
    sin,
    k_cache,
    mask,
    wq_b_scale=None,
    wk_scale=None,
    qr_qtz_hbm=None,
    qr_scale_hbm=None,
    qr_bf16_hbm=None,
    index_topk=None,
    start_pos=0,
    phase="all",
    end_pos_arg=None,
    compact_scales=False,
    precision="MX",
    rope_layout="HALF_SPLIT",
):
    """``(index_score [B*S, end] f32, topk [B*S, index_topk] int32, k_cache)`` from the library kernel; phase
    ``"kproj"``: ``(k_seq_out [B*S, head_dim],)``; ``"score"``: ``(index_score, topk)``."""
    k_seq_out = None
    if phase == "kproj":
        k_seq_out = nl.ndarray((x.shape[0], k_cache.shape[1]), dtype=k_cache.dtype, buffer=nl.shared_hbm)
    first, topk = _indexer_body(
        x,
        wq_b,
        wk,
        k_norm_gamma,
        k_norm_beta,
        weights_proj,
        cos,
        sin,
        k_cache,
        mask,
        weights_proj.shape[0],
        k_cache.shape[1],
        2 * cos.shape[1],
        index_topk,
        start_pos,
        batch_size=k_cache.shape[0],
        wq_b_scale=wq_b_scale,
        wk_scale=wk_scale,
        qr_qtz_hbm=qr_qtz_hbm,
        qr_scale_hbm=qr_scale_hbm,
        phase=phase,
        k_seq_out_hbm=k_seq_out,
        end_pos_arg=end_pos_arg,
        emit_flat_topk=True,
        **_newer_arguments(compact_scales, precision, rope_layout, qr_bf16_hbm),
    )
    if phase == "kproj":
        return (first,)
    if phase == "score":
        return first, topk
    return first, topk, k_cache
