"""Megatron tensor parallelism for :mod:`jax_nkilib.models.llama`'s parameters: the ``PartitionSpec`` of each.

Column-parallel ``w_qkv`` (over its kv-head axis: whole kv-head groups per device), ``w_gate`` and ``w_up``;
row-parallel ``w_o`` and ``w_down``; norms, embeddings and the LM head replicated. Placed with these specs on a
mesh with explicit axes, the ops plan their own ``shard_map``: attention runs on local heads and the output
projection and the MLP each end with one all-reduce over ``model_axis``. The batch goes over the data axis
(``P(data_axis)`` on tokens).
"""

from __future__ import annotations

from jax.sharding import PartitionSpec as P

_COLUMNS = ("w_gate", "w_up")
_ROWS = ("w_o", "w_down")


def param_specs(params, model_axis: str = "model"):
    """A pytree of ``PartitionSpec`` shaped like ``params`` (a ``{"params": ...}`` wrapper is kept)."""
    if set(params) == {"params"}:
        return {"params": param_specs(params["params"], model_axis)}

    def layer_spec(name):
        if name == "w_qkv":  # [hidden, kv_heads, heads / kv_heads + 2, head_dim]
            return P(None, model_axis)
        return P(None, model_axis) if name in _COLUMNS else P(model_axis) if name in _ROWS else P()

    specs = {name: P() for name in params if name != "layers"}
    specs["layers"] = [{name: layer_spec(name) for name in layer} for layer in params["layers"]]
    return specs
