"""Mixture-of-experts kernels: routing and top-k (``router_topk``, ``topk``, ``cascaded_max``, subkernels)."""
