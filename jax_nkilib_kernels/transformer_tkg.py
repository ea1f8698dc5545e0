"""Adapter for the NKI Library's ``transformer_tkg`` (``nkilib.experimental.transformer.transformer_tkg``).

The library function is not ``@nki.jit`` and takes Python lists of per-layer tensors. JAX hands this adapter one
stacked ``[L, ...]`` HBM tensor per list; the lists are built here, inside the traced kernel, as the library's own
test wrapper builds them from separate arguments. A list entry is the whole tensor reshaped when ``L == 1`` and the
view ``stacked[layer]`` otherwise (jax_nkilib lowers only ``num_layers == 1`` to this kernel: see
``jax_nkilib/_src/transformer/transformer_tkg.py``). The library updates the caches in place and returns the final
hidden states; the adapter also returns the cache tensors, so NKI reports them as outputs aliased to their inputs.
Not yet run on Trainium by this project.
"""

import nki

from jax_nkilib_kernels._library import load

_library_transformer_tkg = load("experimental.transformer.transformer_tkg", "transformer_tkg")


def _layers(stacked, count):
    """``count`` per-layer tensors of a stacked ``[L, ...]`` tensor (``None`` stays ``None``)."""
    if stacked is None:
        return None
    if stacked.shape[0] == 1:
        return [stacked.reshape(tuple(stacked.shape[1:]))]
    return [stacked[layer] for layer in range(count)]


@nki.jit
def transformer_tkg(
    X,
    W_qkvs,
    W_outs,
    W_gates,
    W_ups,
    W_downs,
    W_gamma_qkvs,
    W_gamma_mlps,
    K_caches,
    V_caches,
    RoPE_cos,
    RoPE_sin,
    mask_cache,
    mask_active=None,
    position_ids=None,
    W_gate_scales=None,
    W_up_scales=None,
    W_down_scales=None,
    num_layers=None,
    eps=1e-6,
    replica_groups=None,
    sbuf_residual_and_cc=False,
    clamp_bound=0.0,
):
    """``(out [B, S, H], K_caches, V_caches)``: the library's ``out`` and the caches it updated in place."""
    count = num_layers if num_layers is not None else W_qkvs.shape[0]
    out = _library_transformer_tkg(
        X=X,
        W_qkvs=_layers(W_qkvs, count),
        W_outs=_layers(W_outs, count),
        W_gates=_layers(W_gates, count),
        W_ups=_layers(W_ups, count),
        W_downs=_layers(W_downs, count),
        W_gamma_qkvs=_layers(W_gamma_qkvs, count),
        W_gamma_mlps=_layers(W_gamma_mlps, count),
        K_caches=_layers(K_caches, count),
        V_caches=_layers(V_caches, count),
        RoPE_cos=RoPE_cos,
        RoPE_sin=RoPE_sin,
        mask_cache=mask_cache,
        mask_active=mask_active,
        position_ids=position_ids,
        num_layers=count,
        eps=eps,
        replica_groups=replica_groups,
        sbuf_residual_and_cc=sbuf_residual_and_cc,
        clamp_bound=clamp_bound,
        W_gate_scales=_layers(W_gate_scales, count),
        W_up_scales=_layers(W_up_scales, count),
        W_down_scales=_layers(W_down_scales, count),
    )
    return out, K_caches, V_caches
