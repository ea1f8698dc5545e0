"""The training-step kernels of the NKI Library's ``experimental/foreach`` and ``experimental/optimizer`` (layer 1):
the foreach elementwise family and the L1/L2/Linf norms over a flat ``[N]`` tensor (:mod:`.foreach`), and the fused
Adam/AdamW update (:mod:`.fused_adam`). All are docs-only kernels (NKI Library 2.32 API reference)."""
