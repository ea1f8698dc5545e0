"""The Neuron platform target and the LNC degree: read once from the environment, following the platform, keyed.

Defaults are read when jax_nkilib is imported, so they are checked in fresh interpreters; the test process itself
pins trn2 at LNC 1 (conftest)."""

import json
import os
import subprocess
import sys

import jax
import pytest

import jax_nkilib
from jax_nkilib._src.framework import platform
from jax_nkilib.nki import RoPE, rmsnorm_quant_kernel
from tests.support.data import angles, random
from tests.support.hlo import kernel_configs

X = random((64, 2, 4, 16))
COS, SIN = angles((32, 2, 16))
REPORT = (
    "import json, jax_nkilib; from jax_nkilib._src.framework import config; "
    "print(json.dumps([config.current_target(), jax_nkilib.current_lnc()]))"
)


def fresh(environment: dict) -> subprocess.CompletedProcess:
    """``REPORT`` in a new interpreter whose Neuron variables are exactly ``environment``."""
    env = {k: v for k, v in os.environ.items() if k not in (platform.PLATFORM_TARGET_ENV_VAR, platform.LNC_ENV_VAR)}
    env.update(environment, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", REPORT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
    )


@pytest.mark.parametrize(
    "environment, expected",
    [
        ({}, ["trn2", 2]),  # unset: Trainium2, whose runtime default is LNC 2
        ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"}, ["trn1", 1]),
        ({"NEURON_PLATFORM_TARGET_OVERRIDE": "inf2"}, ["inf2", 1]),
        ({"NEURON_PLATFORM_TARGET_OVERRIDE": "TRN3"}, ["trn3", 2]),
        ({"NEURON_LOGICAL_NC_CONFIG": "1"}, ["trn2", 1]),
        ({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1", "NEURON_LOGICAL_NC_CONFIG": "2"}, ["trn1", 2]),
    ],
    ids=["unset", "trn1", "inf2", "trn3", "lnc1", "trn1-lnc2"],
)
def test_import_reads_the_platform_and_its_lnc_default(environment, expected):
    result = fresh(environment)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"NEURON_LOGICAL_NC_CONFIG": "4"}, "NEURON_LOGICAL_NC_CONFIG must be 1 or 2, got 4"),
        ({"NEURON_PLATFORM_TARGET_OVERRIDE": "tpu"}, "NEURON_PLATFORM_TARGET_OVERRIDE must be one of"),
    ],
)
def test_bad_environment_is_named_at_import(environment, message):
    result = fresh(environment)
    assert result.returncode != 0 and message in result.stderr


def test_instance_type_names_the_platform(tmp_path):
    product = tmp_path / "product_name"
    for instance, target in [
        ("trn2.48xlarge", "trn2"),
        ("trn1n.32xlarge", "trn1"),
        ("inf2.xlarge", "inf2"),
        ("trn3pre.48xlarge", "trn3pre"),
        ("m5.large", None),
    ]:
        product.write_text(instance + "\n")
        assert platform.instance_target(str(product)) == target
        assert platform.target_from_environment({}, str(product)) == (target or "trn2")
    assert platform.target_from_environment({"NEURON_PLATFORM_TARGET_OVERRIDE": "trn1"}, str(product)) == "trn1"
    assert platform.instance_target(str(tmp_path / "absent")) is None


def test_config_target_sets_the_lnc_default_and_is_validated():
    assert jax_nkilib.current_lnc() == 1  # pinned by conftest
    with jax_nkilib.config(target="trn1"):
        from jax_nkilib._src.framework import config

        assert config.current_target() == "trn1"
    with pytest.raises(ValueError, match="target must be one of trn1, inf2, trn2, trn3pre, trn3; got 'gpu'"):
        with jax_nkilib.config(target="gpu"):
            pass


def test_jit_cache_is_keyed_on_the_target():
    fn = jax.jit(lambda *a: RoPE(*a))
    targets = []
    with jax_nkilib.neuron.dry_run():
        for target in ("trn2", "trn1", "trn2"):
            with jax_nkilib.config(target=target):
                text = fn.trace(X, COS, SIN).lower(lowering_platforms=("neuron",)).as_text()
            targets.append(kernel_configs(text)[0]["platform_target"])
    assert targets == ["trn2", "trn1", "trn2"]


def test_target_dependent_semantics_follow_the_target():
    hidden = random((1, 4, 256))
    gamma = random((1, 256), seed=3)
    with jax_nkilib.config(target="trn3"):
        ocp = jax.jit(lambda h, g: rmsnorm_quant_kernel(h, g, dtype_mode="AUTO"))(hidden, gamma)
    nonocp = jax.jit(lambda h, g: rmsnorm_quant_kernel(h, g, dtype_mode="AUTO"))(hidden, gamma)
    assert str(ocp[0].dtype) == "float8_e4m3fn" and str(nonocp[0].dtype) == "float8_e4m3"
