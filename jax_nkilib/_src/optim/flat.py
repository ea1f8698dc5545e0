"""What the foreach and optimizer kernels share: a flat ``[N]`` operand whose element count the kernel also takes as
the static ``numel``, and scalars passed as ``[128, 1]`` HBM tensors (one value per partition, all equal).

``numel`` is the kernel's own required argument: it must equal ``N``. A scalar tensor's value is its element
``[0, 0]``; the kernels broadcast one value, so the 128 entries must be equal (the layer-2 ops build them with
:func:`scalar_tensor`).
"""

from __future__ import annotations

import jax.numpy as jnp

from ..framework.hardware import PARTITIONS
from ..framework.spec import CallInfo, Param

NUMEL = Param("numel", None, int, "number of elements of the flat operand(s) (must equal N)", required=True)
SCALAR_LAYOUT = f"{PARTITIONS}, 1"


def scalar_tensor(value, dtype=jnp.float32):
    """``value`` (a Python or traced scalar) broadcast to the kernels' ``[128, 1]`` scalar layout."""
    return jnp.broadcast_to(jnp.asarray(value, dtype).reshape(1, 1), (PARTITIONS, 1))


def scalar_value(tensor):
    """The scalar a ``[128, 1]`` scalar tensor carries (its element ``[0, 0]``)."""
    return tensor[0, 0]


def check_numel(call: CallInfo, flat: tuple[str, ...]) -> None:
    """``numel == N`` and every flat operand in ``flat`` that is present has one dtype."""
    n, function = call.dims["N"], call.function
    if call.params["numel"] != n:
        raise ValueError(
            f"{function}: parameter `numel` must equal the number of elements N={n} of the flat [N] operand(s); "
            f"got numel={call.params['numel']}"
        )
    dtypes = {name: call.avals[name].dtype for name in flat if call.avals.get(name) is not None}
    if len(set(dtypes.values())) > 1:
        given = ", ".join(f"{name}: {dtype}" for name, dtype in dtypes.items())
        raise TypeError(f"{function}: the flat [N] operands must share one dtype; got {given}")
