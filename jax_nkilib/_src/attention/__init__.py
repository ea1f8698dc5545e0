"""Attention kernels: attention_cte (prefill), attention_bwd (its backward) and the idiomatic attention op."""
