"""Run from outside the checkout: every module of the installed distribution imports from site-packages.

A subpackage left out of the wheel passes the test suite (which imports from the checkout) but fails here.
"""

import importlib
import pkgutil
import sys

import jax_nkilib
import jax_nkilib_kernels

for package in (jax_nkilib, jax_nkilib_kernels):
    if "site-packages" not in package.__file__:
        sys.exit(f"{package.__name__} imported from {package.__file__}, not from the installed wheel")

names = [jax_nkilib.__name__]
names += [info.name for info in pkgutil.walk_packages(jax_nkilib.__path__, "jax_nkilib.")]
for name in names:
    if name.endswith(".readme"):  # a script (it rewrites the README when run)
        continue
    importlib.import_module(name)
# the device adapters import nki, present only on a Neuron host: check that each one is shipped
adapters = [info.name for info in pkgutil.iter_modules(jax_nkilib_kernels.__path__)]
expected = {"_library", "allgather", "attention", "collectives", "mxfp8", "norm", "quant", "rope"}
if missing := expected - set(adapters):
    sys.exit(f"jax_nkilib_kernels is missing {sorted(missing)}")
print(f"installed wheel: {len(names)} jax_nkilib modules import; {len(adapters)} device adapter modules shipped")
