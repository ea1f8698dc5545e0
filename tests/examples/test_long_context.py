"""examples/long_context.py: ring attention over 8 devices matches one device and uses a fraction of its memory."""

import importlib.util
import pathlib

from tests.support.numerics import tolerance

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "long_context.py"


def test_ring_matches_single_device_in_less_memory(capsys):
    spec = importlib.util.spec_from_file_location("long_context", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(seq=1024)
    assert all(error <= tolerance("float32", reduction=1024, ops=16) for error in result["errors"].values())
    assert result["memory_ratio"] < 0.25  # each device holds 1/8 of the sequence
    assert "ring over 8 devices vs one device" in capsys.readouterr().out
