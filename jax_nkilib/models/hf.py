"""Hugging Face Llama checkpoints (safetensors) as :mod:`jax_nkilib.models.llama` parameters.

HF ``nn.Linear`` weights are ``[out, in]``; the model's projections are ``x @ w`` with ``w [in, out]``, so each is
transposed. HF's RoPE rotates the halves ``(x[i], x[i + head_dim/2])`` of each q/k head (``rotate_half``: its
checkpoints already carry the permutation from Meta's interleaved layout), the convention
:func:`jax_nkilib.rope` (``interleaved=False``) and ``qkv_projection(rope=)`` implement, so q/k columns are used in
HF's order without a permutation. Needs ``safetensors`` (``pip install 'jax-nkilib[models]'``).
"""

from __future__ import annotations

import os

import jax.numpy as jnp

from .config import LlamaConfig
from .qkv_layout import group_qkv

_LAYER_NAMES = {
    "attn_norm": ("input_layernorm.weight", False),
    "q": ("self_attn.q_proj.weight", True),
    "k": ("self_attn.k_proj.weight", True),
    "v": ("self_attn.v_proj.weight", True),
    "w_o": ("self_attn.o_proj.weight", True),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


def _grouped_layer(layer: dict, config: LlamaConfig) -> dict:
    """A layer's HF q, k, v projections as the model's grouped ``w_qkv``."""
    layer = dict(layer)
    layer["w_qkv"] = group_qkv(layer.pop("q"), layer.pop("k"), layer.pop("v"), config.kv_heads)
    return layer


def read_safetensors(path_or_dir) -> dict:
    """Every tensor of a ``.safetensors`` file, or of all ``*.safetensors`` files in a directory (sharded
    checkpoints), as NumPy arrays by name."""
    from safetensors.numpy import load_file

    if os.path.isdir(path_or_dir):
        files = sorted(os.path.join(path_or_dir, f) for f in os.listdir(path_or_dir) if f.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"jax_nkilib.models.load_hf_checkpoint: no *.safetensors file in {path_or_dir}")
    else:
        files = [path_or_dir]
    tensors = {}
    for file in files:
        tensors.update(load_file(file))
    return tensors


def load_hf_checkpoint(path_or_dir, config: LlamaConfig) -> dict:
    """The parameters of a HF Llama checkpoint (a safetensors file or a directory of them), in ``config.dtype``.

    Names: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
    ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, ``model.layers.{i}.input_layernorm.weight``,
    ``model.layers.{i}.post_attention_layernorm.weight``, ``model.norm.weight`` and, untied, ``lm_head.weight``.
    Every tensor's shape is checked against ``config``; a missing tensor is a KeyError naming it.
    """
    tensors = read_safetensors(path_or_dir)
    dtype = config.param_dtype
    q_dim, kv_dim = config.heads * config.head_dim, config.kv_heads * config.head_dim
    expected = {
        "attn_norm": (config.hidden,),
        "q": (config.hidden, q_dim),
        "k": (config.hidden, kv_dim),
        "v": (config.hidden, kv_dim),
        "w_o": (q_dim, config.hidden),
        "mlp_norm": (config.hidden,),
        "w_gate": (config.hidden, config.intermediate),
        "w_up": (config.hidden, config.intermediate),
        "w_down": (config.intermediate, config.hidden),
    }

    def take(name, transpose, shape):
        if name not in tensors:
            raise KeyError(f"jax_nkilib.models.load_hf_checkpoint: the checkpoint has no tensor {name!r}")
        value = tensors[name].T if transpose else tensors[name]
        if value.shape != shape:
            raise ValueError(
                f"jax_nkilib.models.load_hf_checkpoint: {name} has shape {tensors[name].shape}; the config needs "
                f"{shape[::-1] if transpose else shape}"
            )
        return jnp.asarray(value, dtype)

    params = {
        "embed": take("model.embed_tokens.weight", False, (config.vocab, config.hidden)),
        "final_norm": take("model.norm.weight", False, (config.hidden,)),
        "layers": [
            _grouped_layer(
                {
                    ours: take(f"model.layers.{i}.{theirs}", transpose, expected[ours])
                    for ours, (theirs, transpose) in _LAYER_NAMES.items()
                },
                config,
            )
            for i in range(config.layers)
        ],
    }
    if not config.tie_embeddings:
        params["lm_head"] = take("lm_head.weight", True, (config.hidden, config.vocab))
    return params
