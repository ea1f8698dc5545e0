"""What a kernel compiler hands the custom-call emitter, and how NKI's output specs compare with abstract evaluation.

NKI reports each output as a spec with a shape and an NKI dtype *name* (``"bfloat16"``, ``"float8_e4m3"``,
``"float8_e4m3fn_x4"``; see ``nki/compiler/ncc_driver.py``'s ``KernelDescriptor`` and vllm-neuron's
``nki_dtype_to_torch``). JAX has no packed types: jax_nkilib models an ``<fp>_x4`` element (four ``<fp>`` values in
one word) as the unsigned word of the same size, ``uint32`` for FP8 and ``uint16`` for FP4, with the same shape.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np

# NKI names Trainium's 1-byte E4M3 ``float8_e4m3``; frameworks hold the same bytes as either E4M3 flavour
# (vllm-neuron maps NKI's float8_e4m3 to torch.float8_e4m3fn on trn2), so the two names match each other.
_SAME_STORAGE = {"float8_e4m3": "float8_e4m3fn"}
_PACKED = re.compile(r"^(?P<element>[a-z0-9_]+?)_x(?P<count>\d+)$")


class NeuronOutputMismatchError(RuntimeError):
    """The compiled kernel's outputs differ from the shapes/dtypes that abstract evaluation promised."""


def jax_dtype_name(nki_dtype: Any) -> str:
    """The dtype name jax_nkilib holds an NKI output dtype as: packed ``<fp>_xN`` as the unsigned word of its size,
    Trainium's E4M3 under its framework name, anything else by its own name."""
    name = str(getattr(nki_dtype, "name", nki_dtype)).rsplit(".", 1)[-1]
    packed = _PACKED.match(name)
    if packed:
        element_bits = jnp.finfo(np.dtype(packed["element"])).bits
        return f"uint{element_bits * int(packed['count'])}"
    return _SAME_STORAGE.get(name, name)


def _storage_name(dtype: Any) -> str:
    name = np.dtype(dtype).name
    return _SAME_STORAGE.get(name, name)


def mismatched_outputs(output_specs: Sequence[tuple[tuple[int, ...], Any]], avals: Sequence[Any]) -> list[str]:
    """How the compiled kernel's outputs ``(shape, NKI dtype)`` differ from the avals of abstract evaluation."""
    if len(output_specs) != len(avals):
        return [f"{len(output_specs)} outputs where abstract evaluation expects {len(avals)}"]
    found = []
    for index, ((shape, dtype), aval) in enumerate(zip(output_specs, avals)):
        expected = (tuple(aval.shape), _storage_name(aval.dtype))
        if (tuple(shape), jax_dtype_name(dtype)) != expected:
            found.append(
                f"output {index} is {tuple(shape)} {dtype} where abstract evaluation expects "
                f"{expected[0]} {np.dtype(aval.dtype).name}"
            )
    return found


@dataclasses.dataclass(frozen=True)
class CompiledKernel:
    """What the custom-call emitter needs from a compiler.

    ``backend_config``: the ASCII base64 of the JSON config. ``output_specs``: ``(shape, dtype name)`` per output as
    the compiler reports them. ``aliases``: ``{input index: output index}`` over the kernel's tensor inputs in
    ``operand_order``. ``operand_order``: the call's operands (by their position among the present operands) in the
    order the kernel takes them. ``tuple_result``: the kernel returns a sequence, so the call's result is a tuple
    even with one output (as nkipy emits it).
    """

    backend_config: str
    output_specs: tuple[tuple[tuple[int, ...], str], ...]
    aliases: Mapping[int, int]
    has_collectives: bool
    operand_order: tuple[int, ...]
    tuple_result: bool = False

    @property
    def config(self) -> dict:
        return decode_backend_config(self.backend_config)


def encode_backend_config(config: Mapping[str, Any]) -> str:
    """The ``backend_config`` string of a config: ASCII base64 of its JSON."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"))
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def decode_backend_config(backend_config: str | bytes) -> dict:
    """Inverse of the base64-JSON encoding used in the ``backend_config`` string."""
    raw = backend_config if isinstance(backend_config, bytes) else backend_config.encode("ascii")
    return json.loads(base64.b64decode(raw).decode("utf-8"))
