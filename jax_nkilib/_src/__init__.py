"""The implementation, in layers that only import downwards (enforced by import-linter, see ``pyproject.toml``):

1. ``framework``: kernel specs, the primitive factory, batching, validation, config, JAX compat, shared enums;
2. ``neuron``: the Neuron custom-call lowering and the kernel compilers (it registers itself with the factory);
3. the kernel families, one folder each (``quant`` and ``collectives`` at the bottom, then ``norm`` and ``rope``,
   then ``attention``, ``mlp`` and ``projection``, then ``moe`` and ``transformer``, the fused blocks built on them):
   each binds NKI Library kernels (layer 1) with their references;
4. ``sharding``: automatic sharding of the idiomatic ops, sequence layouts, collective matmuls;
5. ``ops``: the idiomatic layer-2 functions (``jax_nkilib.attention``, ``rms_norm``...);
6. ``tools``: ``explain``, ``neuron_hlo``, the support matrix.
"""

from . import neuron  # noqa: E402,F401  (registers the Neuron lowering before any kernel is made)
