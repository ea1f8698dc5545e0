"""``LlamaConfig``: the hyperparameters of a Llama-3-style decoder, and RoPE's frequencies with the llama3 scaling."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1's RoPE frequency scaling (HF ``rope_scaling = {"rope_type": "llama3", ...}``).

    With ``wavelength = 2 pi / f`` for each base frequency ``f``: wavelengths shorter than
    ``original_max_positions / high_freq_factor`` keep ``f``; longer than ``original_max_positions /
    low_freq_factor`` become ``f / factor``; in between, ``(1 - s) f / factor + s f`` with ``s =
    (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int = 8192

    def __post_init__(self):
        if not (self.factor > 0 and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(
                "Llama3RopeScaling: need factor > 0 and 0 < low_freq_factor < high_freq_factor; got "
                f"factor={self.factor}, low_freq_factor={self.low_freq_factor}, "
                f"high_freq_factor={self.high_freq_factor}"
            )
        if self.original_max_positions <= 0:
            raise ValueError(
                f"Llama3RopeScaling: original_max_positions must be > 0, got {self.original_max_positions!r}"
            )

    def scale(self, freqs: np.ndarray) -> np.ndarray:
        wavelength = 2 * math.pi / freqs
        smooth = (self.original_max_positions / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * freqs / self.factor + smooth * freqs
        long_waves = wavelength > self.original_max_positions / self.low_freq_factor
        short_waves = wavelength < self.original_max_positions / self.high_freq_factor
        return np.where(long_waves, freqs / self.factor, np.where(short_waves, freqs, blended))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-3-style decoder: GQA attention with RoPE (rotate-half convention), RMSNorm, SwiGLU MLP.

    ``head_dim`` defaults to ``hidden // heads``; ``kv_heads`` divides ``heads``. ``max_len`` is the length of a KV
    cache from ``llama.init_cache``, which holds ``max_len - 1`` tokens (a multiple of 128 for Neuron's decode
    attention kernel). ``dtype`` names the parameters' and activations' dtype
    (``"float32"``, ``"bfloat16"``, ...). Frozen and hashable: pass it to ``jax.jit`` as a static argument.
    """

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    head_dim: int | None = None
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_embeddings: bool = False
    max_len: int = 2048
    dtype: str = "float32"

    def __post_init__(self):
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden // self.heads if self.heads else 0)
        for name in ("vocab", "hidden", "layers", "heads", "kv_heads", "intermediate", "head_dim", "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"LlamaConfig: `{name}` must be a positive int; got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig: `heads` ({self.heads}) must be a multiple of `kv_heads` ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: `head_dim` must be even (RoPE rotates halves); got {self.head_dim}")
        if not (self.rms_eps >= 0 and self.rope_theta > 0):
            raise ValueError(
                f"LlamaConfig: need rms_eps >= 0 and rope_theta > 0; got {self.rms_eps}, {self.rope_theta}"
            )
        jnp.dtype(self.dtype)  # raises on an unknown dtype name

    @property
    def param_dtype(self):
        return jnp.dtype(self.dtype)

    @classmethod
    def from_hf_config(cls, hf: dict, *, max_len: int | None = None, dtype: str | None = None) -> LlamaConfig:
        """A config from a Hugging Face Llama ``config.json`` (as a dict).

        Reads ``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``num_key_value_heads`` (default: the heads), ``head_dim`` (default ``hidden_size / heads``),
        ``intermediate_size``, ``rms_norm_eps``, ``rope_theta``, ``rope_scaling`` (``rope_type`` ``"llama3"`` or
        none; newer files' ``rope_parameters`` too), ``tie_word_embeddings``, ``max_position_embeddings`` (the
        cache length unless ``max_len`` is given) and ``torch_dtype`` (unless ``dtype`` is given). Biases
        (``attention_bias``, ``mlp_bias``) and other RoPE scalings are refused with a ValueError.
        """
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"LlamaConfig.from_hf_config: `{flag}: true` is not supported (no biases here)")
        if hf.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"LlamaConfig.from_hf_config: hidden_act must be 'silu'; got {hf['hidden_act']!r}")
        heads = hf["num_attention_heads"]
        rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "llama3":
            scaling = Llama3RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_positions=int(rope["original_max_position_embeddings"]),
            )
        elif rope_type == "default":
            scaling = None
        else:
            raise ValueError(f"LlamaConfig.from_hf_config: rope_type {rope_type!r} is not supported (llama3 or none)")
        return cls(
            vocab=hf["vocab_size"],
            hidden=hf["hidden_size"],
            layers=hf["num_hidden_layers"],
            heads=heads,
            kv_heads=hf.get("num_key_value_heads") or heads,
            intermediate=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_len=max_len or hf.get("max_position_embeddings", 2048),
            dtype=dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32",
        )


def rope_frequencies(config: LlamaConfig) -> np.ndarray:
    """The ``head_dim/2`` rotation frequencies ``theta^(-2i/head_dim)``, llama3-scaled when configured (float64)."""
    freqs = config.rope_theta ** (-np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)
    return freqs if config.rope_scaling is None else config.rope_scaling.scale(freqs)


def rope_tables(config: LlamaConfig, positions):
    """``(cos, sin)`` of ``positions [...]`` (int) times the frequencies: ``[..., head_dim/2]`` tables in float32
    (float64 for a float64 model), :func:`jax_nkilib.rope`'s layout (``[seq, d/2]`` for a shared ``[seq]``,
    ``[batch, seq, d/2]`` per sequence)."""
    dtype = jnp.promote_types(config.param_dtype, jnp.float32)
    angles = jnp.asarray(positions, dtype)[..., None] * jnp.asarray(rope_frequencies(config), dtype)
    return jnp.cos(angles), jnp.sin(angles)
