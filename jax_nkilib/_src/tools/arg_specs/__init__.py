"""Named argument specs for every bound kernel and idiomatic op (see :mod:`.spec`)."""

from jax_nkilib._src.tools.arg_specs.spec import ArgSpec, BadInput, Sharding, arg_spec, arg_specs, public_name, register

__all__ = ["ArgSpec", "BadInput", "Sharding", "arg_spec", "arg_specs", "public_name", "register"]
