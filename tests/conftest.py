"""Test configuration: 8 CPU devices for shard_map tests and float64 for gradient checks.

Both must be set before JAX initialises its backends, hence here, before anything imports jax_nkilib.
"""

import jax
import jaxlib

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)


def pytest_report_header(config):
    return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"
