"""The README's main example runs, trains, and explains its kernel calls."""

import importlib.util
import pathlib

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "quickstart.py"


def test_quickstart_trains_and_explains(capsys):
    spec = importlib.util.spec_from_file_location("quickstart", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    losses = module.main()
    assert losses[-1] < losses[0]
    printed = capsys.readouterr().out
    assert "6 jax_nkilib kernel call(s); 6 would run as NKI kernels on Neuron" in printed
    assert printed.count("RoPE(") == 4 and printed.count("attention_cte(") == 1
    assert printed.count("attention_bwd(") == 1
