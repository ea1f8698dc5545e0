"""The idiomatic layer (layer 2): ``jax_nkilib.<op>`` in JAX layouts, each built on the layer-1 kernels, with
automatic sharding: attention and decode attention, ring attention, RoPE, norms, quantization, projections, MLP."""
