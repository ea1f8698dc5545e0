"""KernelSpec, the primitive factory, lowering registration, batching helpers, config and JAX compat."""
