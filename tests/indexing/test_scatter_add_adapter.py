"""jax_nkilib_kernels.misc.scatter_add, compiled through the stand-in of NKI's framework API
(tests/support/nki_standin.py) against two library versions: the newer one with ``unique_indices`` and the 2.32 one
without. The stand-in runs the adapter's Python body with NumPy placeholders and a recording library kernel."""

import jax.numpy as jnp
import pytest

from jax_nkilib.nki import scatter_add
from tests.support import nki_standin
from tests.support.hlo import kernel_configs, neuron_text

ENTRY = "nkilib.experimental.misc.scatter_add:scatter_add"
ARGS = (jnp.zeros((64, 32), jnp.float32), jnp.zeros((16,), jnp.int32), jnp.zeros((16, 32), jnp.float32))


def _install(monkeypatch, newer: bool) -> list[dict]:
    calls = []
    if newer:

        def library(input, dim, index, src, unique_indices=True):
            calls.append(dict(dim=dim, unique_indices=unique_indices, shapes=(input.shape, index.shape, src.shape)))
            return input
    else:

        def library(input, dim, index, src):
            calls.append(dict(dim=dim, shapes=(input.shape, index.shape, src.shape)))
            return input

    library.__name__ = library.__qualname__ = "scatter_add"
    standin = nki_standin.StandIn()
    nki_standin.install(monkeypatch, standin, {ENTRY: nki_standin.jit(library)})

    def run_adapter(**inputs):
        from jax_nkilib_kernels import misc

        return misc.scatter_add.func(**inputs)

    standin.rule("scatter_add", run_adapter)
    return calls


@pytest.mark.parametrize("unique", [True, False])
def test_a_newer_library_gets_unique_indices_only_when_false(monkeypatch, unique):
    calls = _install(monkeypatch, newer=True)
    text = neuron_text(lambda *a: scatter_add(*a, unique_indices=unique), *ARGS)
    (cfg,) = kernel_configs(text)
    assert cfg["func_name"] == "scatter_add" and "output_operand_aliases" in text
    (call,) = calls
    assert call == dict(dim=0, unique_indices=unique, shapes=((64, 32), (16,), (16, 32)))


def test_the_2_32_library_runs_the_default_and_refuses_unique_indices_false(monkeypatch):
    calls = _install(monkeypatch, newer=False)
    text = neuron_text(scatter_add, *ARGS)
    assert [cfg["func_name"] for cfg in kernel_configs(text)] == ["scatter_add"] and len(calls) == 1
    with pytest.raises(TypeError, match="has no unique_indices parameter"):
        neuron_text(lambda *a: scatter_add(*a, unique_indices=False), *ARGS)
