"""The Neuron platform the kernels are built for: its target name and its default LNC degree, from the environment.

This is the one place that reads the Neuron environment variables. ``config`` reads it once, when jax_nkilib is
imported, into settings that are part of JAX's jit cache key (so a traced function is never reused for another
target or LNC degree); ``jax_nkilib.config(target=..., lnc=...)`` overrides them for a block of code.

* ``NEURON_PLATFORM_TARGET_OVERRIDE`` (the variable neuronx-cc and NKI read): ``trn1``, ``inf2``, ``trn2``,
  ``trn3``...; unset, the instance type the machine reports (``/sys/devices/virtual/dmi/id/product_name``, e.g.
  ``trn2.48xlarge``, as nkipy detects it), and elsewhere (a development machine) Trainium2.
* ``NEURON_LOGICAL_NC_CONFIG``: the logical NeuronCore degree, 1 or 2. Unset, it follows the platform as the Neuron
  runtime does: 2 on Trainium2 and later, 1 on Trainium1 and Inferentia2.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PLATFORM_TARGET_ENV_VAR = "NEURON_PLATFORM_TARGET_OVERRIDE"
LNC_ENV_VAR = "NEURON_LOGICAL_NC_CONFIG"
DEFAULT_PLATFORM_TARGET = "trn2"
PLATFORM_TARGETS = ("trn1", "inf2", "trn2", "trn3pre", "trn3")  # the generations NKI compiles for
LNC_DEGREES = (1, 2)
PRODUCT_NAME_FILE = "/sys/devices/virtual/dmi/id/product_name"
_ONE_CORE_FAMILIES = ("trn1", "inf2")  # platforms whose runtime default is LNC=1


def normalize_target(target: str, source: str = "target") -> str:
    """``target`` lower-cased and checked to be one of :data:`PLATFORM_TARGETS`."""
    name = str(target).strip().lower()
    if name not in PLATFORM_TARGETS:
        raise ValueError(f"{source} must be one of {', '.join(PLATFORM_TARGETS)}; got {target!r}")
    return name


def instance_target(product_name_file: str = PRODUCT_NAME_FILE) -> str | None:
    """The platform of the Neuron instance this runs on, from its instance type (``trn2.48xlarge`` -> ``trn2``), or
    ``None`` elsewhere."""
    try:
        with open(product_name_file, encoding="utf-8") as file:
            product = file.read().strip().lower()
    except OSError:
        return None
    family = product.split(".", 1)[0]
    return next((target for target in PLATFORM_TARGETS if family.startswith(target)), None)


def target_from_environment(environ: Mapping[str, str] = os.environ, product_name_file: str = PRODUCT_NAME_FILE) -> str:
    """``$NEURON_PLATFORM_TARGET_OVERRIDE``, else the instance's platform, else ``trn2``."""
    raw = environ.get(PLATFORM_TARGET_ENV_VAR, "").strip()
    if raw:
        return normalize_target(raw, f"${PLATFORM_TARGET_ENV_VAR}")
    return instance_target(product_name_file) or DEFAULT_PLATFORM_TARGET


def platform_default_lnc(target: str) -> int:
    """The Neuron runtime's default LNC degree on ``target``: 1 on Trainium1/Inferentia2, 2 on Trainium2 and later."""
    return 1 if target.startswith(_ONE_CORE_FAMILIES) else 2


def lnc_from_environment(environ: Mapping[str, str] = os.environ) -> int | None:
    """``$NEURON_LOGICAL_NC_CONFIG`` (1 or 2), or ``None`` when it is unset (the platform's default then applies)."""
    raw = environ.get(LNC_ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{LNC_ENV_VAR} must be 1 or 2, got {raw!r}") from None
    if value not in LNC_DEGREES:
        raise ValueError(f"{LNC_ENV_VAR} must be 1 or 2, got {value}")
    return value


def is_trn3(target: str) -> bool:
    """Whether ``target`` is a Trainium3 generation (``trn3``, ``trn3pre``), whose FP8 is the OCP format."""
    return target.startswith("trn3")


def before_trn2(target: str) -> bool:
    """Whether ``target`` is older than Trainium2 (Trainium1, Inferentia2)."""
    return target.startswith(_ONE_CORE_FAMILIES)
