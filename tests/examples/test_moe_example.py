"""examples/moe.py: a Mixtral-style block trains, runs expert-parallel on 2x4 devices like one device, and explains."""

import importlib.util
import pathlib

from tests.support.numerics import tolerance

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "moe.py"


def test_moe_example_trains_and_runs_expert_parallel(capsys):
    spec = importlib.util.spec_from_file_location("moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main()
    assert result["losses"][-1] < result["losses"][0]
    assert result["error"] <= tolerance("float32", reduction=module.MODEL + module.INTERMEDIATE, ops=4)
    assert result["grad_error"] <= 1e-6
    assert result["collectives"] == {"all-to-all": 3}  # dispatch (rows, expert ids) and combine
    printed = capsys.readouterr().out
    assert "router_topk(" in printed and "moe_cte(" in printed
