"""The rotary embedding kernels (layer 1): ``RoPE`` (halves or interleaved pairs, kernel layout) and ``rope_hf``
(Hugging Face rotate-half)."""
