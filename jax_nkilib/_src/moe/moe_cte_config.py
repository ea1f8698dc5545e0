"""``moe_cte``'s configuration objects, mirrored from ``nkilib.core.moe.moe_cte`` (``moe_cte.py``,
``moe_cte_utils.py``) as frozen dataclasses and enums with the library's class, field and member names.

``MoECTESpec`` selects the implementation and carries its options (``ShardOnBlockConfig`` for the block-sharded
kernels, ``ShardOnIConfig`` for the I-sharded ones); ``jax_nkilib.nki.moe_cte`` also takes those fields as keyword
arguments. ``SkipMode(skip_token, skip_weight)`` is the kernels' DMA-skipping mode: with ``skip_token`` a token id of
``-1`` is out of bounds and skipped (its slot reads zeros and writes nowhere); ``skip_weight`` only skips reloading
the weights of a block whose expert equals the previous block's (no numeric effect).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from ..framework.common_types import ExpertAffinityScaleMode
from ..framework.spec import INT_DTYPES, Operand, Param


class MoECTEImplementation(enum.Enum):
    """The kernel behind ``moe_cte``: ``shard_on_block`` (blocks split over the cores), ``shard_on_i`` (the
    intermediate dimension split, every block processed), ``shard_on_i_hybrid`` (a static loop over
    ``num_static_block`` blocks, then a dynamic loop while ``conditions`` says a block is used),
    ``shard_on_i_dropping`` (token-dropping layout, always returns the activation checkpoints), and the MX
    (MXFP4/MXFP8, Trainium3) variants."""

    shard_on_block = 0
    shard_on_i = 1
    shard_on_i_hybrid = 2
    shard_on_i_dropping = 3
    shard_on_block_mx = 4
    shard_on_i_mx = 5
    shard_on_i_mx_hybrid = 6


class BlockShardStrategy(enum.Enum):
    """How ``shard_on_block`` deals blocks to the cores: ``PING_PONG`` alternates, ``HI_LO`` halves (the kernel
    accepts only ``PING_PONG``)."""

    HI_LO = 0
    PING_PONG = 1


@dataclasses.dataclass(frozen=True)
class SkipMode:
    """Out-of-bounds DMA skipping: ``skip_token`` (token ids of ``-1`` skipped; ``hidden_states`` then has no
    padding row) and ``skip_weight`` (weight reloads skipped for repeated experts)."""

    skip_token: bool = False
    skip_weight: bool = False


@dataclasses.dataclass(frozen=True)
class ShardOnBlockConfig:
    """Options of the block-sharded implementations (``n_static_blocks``/``n_dynamic_blocks``: MX only)."""

    n_block_per_iter: int = 1
    block_sharding_strategy: BlockShardStrategy = BlockShardStrategy.PING_PONG
    n_static_blocks: int = -1
    n_dynamic_blocks: int = 55


@dataclasses.dataclass(frozen=True)
class ShardOnIConfig:
    """Options of the I-sharded implementations: ``checkpoint_activation`` (also return the gate/up and down
    activations for ``blockwise_mm_bwd``), ``expert_affinity_multiply_on_I`` (scale the activation ``act(g) * u`` by
    the affinity instead of the expert's output; no down checkpoint then), ``num_static_block`` (hybrid: blocks in
    the static loop, default ``N - E``)."""

    checkpoint_activation: bool = False
    expert_affinity_multiply_on_I: bool = False
    num_static_block: int | None = None


@dataclasses.dataclass(frozen=True)
class MoECTESpec:
    """The implementation and its config; the config not given takes its defaults."""

    implementation: MoECTEImplementation
    shard_on_block: ShardOnBlockConfig | None = None
    shard_on_I: ShardOnIConfig | None = None


BLOCK_FIELDS = tuple(field.name for field in dataclasses.fields(ShardOnBlockConfig))
I_FIELDS = tuple(field.name for field in dataclasses.fields(ShardOnIConfig))


def spec_fields(spec: MoECTESpec) -> dict[str, Any]:
    """The implementation and every config field of ``spec`` (defaults for the configs it leaves out)."""
    block = spec.shard_on_block or ShardOnBlockConfig()
    shard_i = spec.shard_on_I or ShardOnIConfig()
    fields = {"implementation": spec.implementation}
    fields.update((name, getattr(block, name)) for name in BLOCK_FIELDS)
    fields.update((name, getattr(shard_i, name)) for name in I_FIELDS)
    return fields


def skip_mode(value: Any, where: str) -> tuple[bool, bool]:
    """``value`` (``None``, a :class:`SkipMode`, an object with the same two flags, or a pair of bools) as the pair
    ``(skip_token, skip_weight)``."""
    if value is None:
        return (False, False)
    if isinstance(value, tuple) and len(value) == 2:
        flags = value
    else:
        flags = (getattr(value, "skip_token", None), getattr(value, "skip_weight", None))
    if all(isinstance(flag, bool) for flag in flags):
        return tuple(flags)
    raise TypeError(f"{where} must be a SkipMode(skip_token, skip_weight) or a pair of bools; got {value!r}")


def moe_cte_spec(value: Any, where: str) -> MoECTESpec | None:
    """``value`` as a :class:`MoECTESpec` (or ``None``)."""
    if value is None or isinstance(value, MoECTESpec):
        return value
    raise TypeError(f"{where} must be a jax_nkilib.nki.MoECTESpec or None; got {value!r}")


# The operands and loop parameters that moe_cte and blockwise_mm_baseline_shard_hidden share (in the kernels' order).
BLOCKWISE_OPERANDS = (
    Operand.of("hidden_states", "T, H", doc="[T+1, H]: the tokens and the padding row T"),
    Operand.of("expert_affinities_masked", "TE, 1", doc="[(T+1)*E, 1]: token t's weight for expert e at t*E+e"),
    Operand.of("gate_up_proj_weight", "E, H, 2, I"),
    Operand.of("down_proj_weight", "E, I, H"),
    Operand.of("token_position_to_id", "NB", dtypes=INT_DTYPES, doc="[N*B] token id per block slot"),
    Operand.of("block_to_expert", "N, 1", dtypes=INT_DTYPES),
)
BLOCK_SIZE = Param("block_size", None, int, "tokens per block", required=True)
BLOCKWISE_LOOP_PARAMS = (
    Param("skip_dma", None, tuple, "SkipMode(skip_token, skip_weight)", normalizer=skip_mode),
    Param("compute_dtype", "bfloat16", "dtype", "the kernel's on-chip dtype (no effect on the reference)"),
    Param("is_tensor_update_accumulating", True, bool, "accumulate blocks into the output (top_k > 1)"),
    Param("expert_affinities_scaling_mode", "POST_SCALE", ExpertAffinityScaleMode),
)


def check_blockwise_routing(call) -> None:
    """The shapes :data:`BLOCKWISE_OPERANDS` bind together: ``expert_affinities_masked [(T+1)*E, 1]`` and
    ``token_position_to_id [N*B]`` (``block_size`` B, ``N`` blocks)."""
    dims, p, function = call.dims, call.params, call.function
    if dims["TE"] != dims["T"] * dims["E"]:
        raise ValueError(
            f"{function}: expert_affinities_masked must be [(T+1)*E, 1] = [{dims['T'] * dims['E']}, 1] for "
            f"hidden_states [T+1={dims['T']}, H] and E={dims['E']}; got [{dims['TE']}, 1]"
        )
    if p["block_size"] < 1 or dims["NB"] != dims["N"] * p["block_size"]:
        raise ValueError(
            f"{function}: token_position_to_id must be [N*B] = [{dims['N'] * p['block_size']}] for N={dims['N']} "
            f"blocks (block_to_expert [N, 1]) of block_size={p['block_size']}; got [{dims['NB']}]"
        )
