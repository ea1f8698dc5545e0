"""examples/mamba2.py: a tiny Mamba-2 block trains (the loss falls) and its Neuron lowering runs the ssd kernel."""

import importlib.util
import pathlib

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "mamba2.py"


def test_mamba2_example_trains_and_lowers_to_the_ssd_kernel(capsys):
    spec = importlib.util.spec_from_file_location("mamba2_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    result = module.main(steps=6)
    losses = result["losses"]
    assert losses[-1] < 0.8 * losses[0], losses
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])), losses
    assert result["forward_kernels"] == ["ssd", "rmsnorm_tkg"]
    assert result["gradient_kernels"].count("ssd") == 1  # the forward's call; the scan's gradient is plain JAX
    assert "loss over 6 adam steps" in capsys.readouterr().out
