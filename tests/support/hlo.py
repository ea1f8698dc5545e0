"""Reading lowered StableHLO: which operations a module contains and the Neuron custom calls in it."""

import re

import jax

from jax_nkilib.neuron import CUSTOM_CALL_TARGET, decode_backend_config

_OP = re.compile(r"=\s*(?:\"?)([a-z_]+\.[a-z_.]+)")
_BACKEND_CONFIG = re.compile(r"@" + CUSTOM_CALL_TARGET + r'\(.*?backend_config = "([A-Za-z0-9+/=]*)"')
STRUCTURAL = {"func.return", "func.call", "stablehlo.return"}


def neuron_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("neuron",)).as_text()


def operations(text: str) -> list[str]:
    """Operation names (``stablehlo.custom_call``, ``stablehlo.transpose``, ...) in program order."""
    return [match.group(1) for match in _OP.finditer(text) if match.group(1) not in STRUCTURAL]


def kernel_configs(text: str) -> list[dict]:
    """Decoded backend configs of the Neuron kernel calls, in program order."""
    return [decode_backend_config(encoded) for encoded in _BACKEND_CONFIG.findall(text)]


def compute_operations(text: str) -> list[str]:
    """Operations other than the kernel calls and constants."""
    return [op for op in operations(text) if op not in ("stablehlo.custom_call", "stablehlo.constant")]


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all", "collective-broadcast")


def compiled_collectives(compiled_text: str) -> dict[str, int]:
    """Counts of the collective instructions (asynchronous ones by their ``-start``) in compiled HLO text; kinds
    that do not occur are absent."""
    found = re.findall(r"\s(" + "|".join(COLLECTIVES) + r")(?:-start)?\(", compiled_text)
    return {name: found.count(name) for name in sorted(set(found))}


def manual_computations(text: str) -> int:
    """The number of ``sdy.manual_computation`` ops with operands in lowered StableHLO text: the ``shard_map`` calls.

    Not counted: the operand-less ones JAX's lowering of ``jax.lax.axis_index`` adds in a partly manual computation,
    which compute the partition id over the mesh axes left automatic (as ring attention's does)."""
    return len(re.findall(r"sdy\.manual_computation\(%", text))
