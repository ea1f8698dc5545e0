"""The idiomatic layer's one layout per concept (the README's "Layouts" table).

Activations and new q/k/v heads are JAX's ``[batch, seq, heads, head_dim]``; KV caches are
``[batch, kv_heads, max_len, head_dim]`` everywhere (``attention(prefix=)``, ``qkv_projection(kv_cache=)``,
``decode_attention``), the layout the attention kernels read as ``batch * kv_heads`` rows with a reshape, so a
decode step never transposes its cache; a paged cache is ``[num_blocks, kv_heads, block_len, head_dim]``. RoPE
tables are ``[seq, head_dim/2]`` or ``[batch, seq, head_dim/2]``.
"""

from __future__ import annotations

KV_CACHE_LAYOUT = "batch, kv_heads, max_len, head_dim"
PAGED_KV_CACHE_LAYOUT = "num_blocks, kv_heads, block_len, head_dim"
