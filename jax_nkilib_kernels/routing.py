"""Adapters for the NKI Library's routing and top-k kernels (``nkilib.core.router_topk``, ``nkilib.core.topk``).

``router_topk`` is a destination-passing subkernel: the adapter allocates ``router_logits`` and
``expert_affinities`` (the input's dtype) and ``expert_index`` (uint32) in shared HBM, calls it, and returns them;
with ``return_eager_affi`` it also stores the kernel's SBUF ``[T, K]`` float32 top-K affinities to HBM.

``topk`` in the library is a host-side launcher (``topk[lnc](inp, k, ...)``) that builds a ``RotationalTopkConfig``
for the input shape and the LNC degree, writes the algorithm's constants to files and launches
``rotational_topk[lnc]``. The adapters do the same inside one ``@nki.jit`` kernel (launched with the call's LNC
grid): the library's config factories run on the traced shape, and the undecorated ``rotational_topk`` is traced
inline. ``gpsimd_topk`` (2.32) likewise builds its config with the library's ``create_gpsimd_topk_config``.
The constants' temporary files are left in place (the compiler reads them after tracing). Not yet run on
Trainium by this project.
"""

import math

import nki
import nki.isa as nisa
import nki.language as nl

from jax_nkilib_kernels._library import body, load

_library_router_topk = load("core.router_topk.router_topk", "router_topk")
RouterActFnType = load("core.utils.common_types", "RouterActFnType")
_library_rotational_topk = load("core.topk.rotational_topk", "rotational_topk")
prepare_rotational_constants = load("core.topk.rotational_topk", "prepare_rotational_constants")
create_topk_config = load("core.topk.rotational_topk_utils", "create_topk_config")
create_rotational_topk_config = load("core.topk.rotational_topk_utils", "create_rotational_topk_config")
_library_gpsimd_topk = load("experimental.topk.gpsimd_topk", "gpsimd_topk")  # 2.32
create_gpsimd_topk_config = load("experimental.topk.gpsimd_topk", "create_gpsimd_topk_config")

_rotational_topk_body = body(_library_rotational_topk)
_gpsimd_topk_body = body(_library_gpsimd_topk)


@nki.jit
def router_topk(
    x,
    w,
    w_bias=None,
    act_fn=None,
    k=None,
    x_hbm_layout=None,
    x_sb_layout=None,
    router_pre_norm=True,
    norm_topk_prob=False,
    use_column_tiling=False,
    use_indirect_dma_scatter=False,
    return_eager_affi=False,
    use_PE_broadcast_w_bias=False,
    shard_on_tokens=False,
    skip_store_expert_index=False,
    skip_store_router_logits=False,
):
    """``(router_logits [T, E], expert_index [T, K] uint32, expert_affinities [T, E][, topk affinities [T, K]])``."""
    tokens = x.shape[1] if x_hbm_layout == 0 else x.shape[0]
    experts = w.shape[1]
    router_logits = nl.ndarray((tokens, experts), dtype=x.dtype, buffer=nl.shared_hbm)
    expert_affinities = nl.ndarray((tokens, experts), dtype=x.dtype, buffer=nl.shared_hbm)
    expert_index = nl.ndarray((tokens, k), dtype=nl.uint32, buffer=nl.shared_hbm)
    outputs = _library_router_topk(
        x,
        w,
        w_bias,
        router_logits,
        expert_affinities,
        expert_index,
        act_fn=RouterActFnType[getattr(act_fn, "name", act_fn)],
        k=k,
        x_hbm_layout=x_hbm_layout,
        x_sb_layout=x_sb_layout,
        router_pre_norm=router_pre_norm,
        norm_topk_prob=norm_topk_prob,
        use_column_tiling=use_column_tiling,
        use_indirect_dma_scatter=use_indirect_dma_scatter,
        return_eager_affi=return_eager_affi,
        use_PE_broadcast_w_bias=use_PE_broadcast_w_bias,
        shard_on_tokens=shard_on_tokens,
        skip_store_expert_index=skip_store_expert_index,
        skip_store_router_logits=skip_store_router_logits,
    )
    if not return_eager_affi:
        return router_logits, expert_index, expert_affinities
    topk_affinities = nl.ndarray((tokens, k), dtype=nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=topk_affinities, src=outputs[3])
    return router_logits, expert_index, expert_affinities, topk_affinities


def _rotational(inp, k, sorted_flag):
    """The library's rotational top-k of ``inp`` (any rank >= 2) over its last axis, outputs ``[..., k]``."""
    rows, vocab = math.prod(inp.shape[:-1]), inp.shape[-1]
    topk_config = create_topk_config(
        inp_shape=tuple(inp.shape),
        inp_dtype=getattr(nl, str(inp.dtype).rsplit(".", 1)[-1]),
        k=k,
        sorted=sorted_flag,
        num_programs=nl.num_programs(0),
    )
    config = prepare_rotational_constants(
        create_rotational_topk_config(inp_shape=(rows, vocab), topk_config=topk_config)
    )
    values, indices = _rotational_topk_body(inp.reshape((rows, vocab)), config)
    out_shape = tuple(inp.shape[:-1]) + (k,)
    return values.reshape(out_shape), indices.reshape(out_shape)


@nki.jit
def topk(inp, k=None, sorted_flag=True, method="ROTATIONAL"):
    """``(topk_values, topk_indices uint32)`` ``[..., k]``; only the ROTATIONAL method (checked by the spec)."""
    return _rotational(inp, k, sorted_flag)


@nki.jit
def rotational_topk(inp, config=None):
    """``(topk_values [R, k], topk_indices [R, k] uint32)``; ``config`` is jax_nkilib's ``RotationalTopkConfig`` as
    the tuple ``(orig_k, sorted)``."""
    orig_k, sorted_flag = config
    return _rotational(inp, orig_k, sorted_flag)


@nki.jit
def gpsimd_topk(inp, config=None):
    """``(topk_values [R, k] bf16, topk_indices [R, k] uint32)``; ``config`` is jax_nkilib's ``GpsimdTopkConfig`` as
    the tuple ``(k, sorted)``."""
    k, sorted_flag = config
    library_config = create_gpsimd_topk_config(
        inp_shape=tuple(inp.shape),
        inp_dtype=nl.bfloat16,
        k=k,
        sorted=sorted_flag,
        num_programs=nl.num_programs(0),
    )
    return _gpsimd_topk_body(inp, library_config)
