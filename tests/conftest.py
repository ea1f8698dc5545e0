"""Test configuration: 8 CPU devices for shard_map tests, float64 for gradient checks, and a pinned Neuron platform.

The devices and x64 must be set before JAX initialises its backends, hence here. The suite runs for Trainium2 at
LNC 1 whatever the machine's environment says (jax_nkilib's settings are JAX config options, set globally here);
tests of LNC 2 say so with ``jax_nkilib.config(lnc=2)``, and ``tests/neuron/test_platform.py`` checks the platform
defaults (LNC 2 on Trainium2 when ``NEURON_LOGICAL_NC_CONFIG`` is unset) in fresh processes.

XLA:CPU compiles the suite's thousands of tiny programs, and compiling, not running, is what the suite spends its
time on (about three quarters of its CPU time, measured on tests/norm), so it compiles them cheaply: LLVM's
optimizer off (about a third less CPU time on compile-bound tests such as attention_cte and norm) and XLA's
classic elemental emitters instead of its newer MLIR fusion emitters (compile time halved again: tests/rope and
tests/norm/test_norm_tkg.py 38-42 s -> 23 s of CPU). Both are long-standing XLA:CPU code paths with the same
numerics contract; fast math stays off either way, so results can differ from an optimised build at most in the
last bit of a fused multiply-add, far inside every tolerance. One exception is known: with both flags, a row
reduction in a backward pass can be summed in a less accurate order (tests/norm/test_norm_ops.py's large-mean
LayerNorm gradient, 4e-5 instead of 1e-7); such a test compiles its program with
``tests.support.xla_flags.DEFAULT_EMITTERS`` as ``compiler_options``. A user's own ``XLA_FLAGS`` come after these,
so they win.
"""

import os

from tests.support.xla_flags import FLAGS

os.environ["XLA_FLAGS"] = " ".join((*FLAGS, os.environ.get("XLA_FLAGS", ""))).strip()

import jax  # noqa: E402
import jaxlib  # noqa: E402

import jax_nkilib  # noqa: E402, F401  (defines the jax_nkilib_* config options)

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_x64", True)
jax.config.update("jax_nkilib_platform_target", "trn2")
jax.config.update("jax_nkilib_lnc", 1)


def pytest_report_header(config):
    return f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"
