"""Models built from jax_nkilib's ops (``import jax_nkilib.models``; ``import jax_nkilib`` does not load them).

:mod:`jax_nkilib.models.llama`: a Llama-3-style decoder (prefill, cached decode, generation, optax training) that
loads Hugging Face checkpoints. Training needs ``optax`` and checkpoints ``safetensors``: ``pip install
'jax-nkilib[models]'``.
"""

from jax_nkilib.models import llama

__all__ = ["llama"]
