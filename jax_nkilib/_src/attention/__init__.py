"""The attention kernels (layer 1): prefill (``attention_cte``, ``attention_segmented_cte``,
``attention_kv_parallel_segmented_cte``, ``swa_fused_cte``), decode (``attention_tkg``, ``attention_mxfp8_tkg``,
``gen_mask_tkg*``), the backward (``attention_bwd``), the ring attention kernels (``ring_attention_*``), and the
blockwise online-softmax engine their references share."""
