"""examples/sharded_inference.py: the quickstart block on a 4x2 data x tensor-parallel mesh."""

import importlib.util
import pathlib
import sys

from tests.examples.test_quickstart import KERNELS
from tests.support.numerics import tolerance

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def test_sharded_block_matches_with_two_all_reduces_and_kernels_inside_manual_computations(capsys):
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("sharded_inference", EXAMPLES / "sharded_inference.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        result = module.main()
    finally:
        sys.path.remove(str(EXAMPLES))
    # the CTE kernels compute float32 in bfloat16, and the row-parallel sums add bfloat16-rounded partials
    assert result["error"] <= tolerance("bfloat16", reduction=1, ops=1)
    assert result["collectives"] == {"all-reduce": 2}  # Megatron: after the output projection and the MLP
    assert result["kernels"] == KERNELS and result["manual"]
    assert "8 NKI kernel calls inside" in capsys.readouterr().out
