"""The XLA:CPU flags the suite compiles with (set by tests/conftest.py before JAX starts; no JAX import here).

The classic emitters flag exists in the XLA of jaxlib 0.7 to 0.10 and no longer in jaxlib 0.11's (an unknown XLA flag
aborts the process), so it is set only below 0.11.
"""

import importlib.metadata

CLASSIC_EMITTERS = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2]) < (0, 11)

FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_llvm_disable_expensive_passes=true",
    *(("--xla_cpu_use_fusion_emitters=false",) if CLASSIC_EMITTERS else ()),
)

# compiler_options for a program whose accuracy bound depends on XLA:CPU's summation order: XLA's default
# emitters, as users' programs are compiled, rather than the suite's cheaper ones
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if CLASSIC_EMITTERS else {}
