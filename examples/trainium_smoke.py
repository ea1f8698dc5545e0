"""First run on Trainium: compile a handful of jax_nkilib kernels for the Neuron device, run them, and compare each
with its JAX reference on the CPU.

Run on a Trainium instance with the Neuron SDK installed (README, "Running on Trainium"):

    python examples/trainium_smoke.py            # LNC 1 and LNC 2, each in a fresh process
    python examples/trainium_smoke.py --lnc 2    # one LNC degree, in this process

The cases: RoPE, rmsnorm_quant_kernel (FP8 row quantization), attention forward and backward (attention_cte and
attention_bwd), the SwiGLU mlp, and all_reduce_hbm_kernel inside ``jax.shard_map`` over the instance's devices.
Each is lowered with ``on_unsupported="error"``, so a kernel limit that would make Neuron fall back to the reference
is reported as a failure, not hidden. The table gives, per case and LNC degree: the NKI kernel calls, the compile
time, the largest difference from the CPU reference against its tolerance, and PASS/FAIL. The LNC degree is a
global property of a Neuron compilation (neuronx-cc's ``--lnc`` must match), hence one process per degree.

Without a Neuron device the script says so and exits with status 2; CI lowers every case for Neuron against a
stand-in of the SDK (tests/examples/test_trainium_smoke.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_nkilib
from jax_nkilib import nki


@dataclasses.dataclass(frozen=True)
class Case:
    """A function, its arguments (built for the given devices), and how to measure its difference from the
    reference: ``error(device_out, reference_out) -> float`` (default: the relative error) against ``tolerance``."""

    name: str
    build: Callable[[list], tuple[Callable, tuple]]
    tolerance: float
    error: Callable = None


def relative_error(device_out, reference_out) -> float:
    """The largest ``max |device - reference| / max |reference|`` over the outputs."""
    errors = []
    for a, b in zip(jax.tree.leaves(device_out), jax.tree.leaves(reference_out)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        errors.append(float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(b))), 1e-30)))
    return max(errors)


def fp8_mismatch(device_out, reference_out) -> float:
    """The fraction of FP8 bytes that differ (rounding may flip a few at ties)."""
    a, b = (np.asarray(x).view(np.uint8) for x in (device_out, reference_out))
    return float(np.mean(a != b))


def normal(key, shape, dtype=jnp.bfloat16, scale=1.0):
    return (jax.random.normal(jax.random.key(key), shape, jnp.float32) * scale).astype(dtype)


def rope_case(devices):
    x = normal(0, (2, 128, 4, 128))
    angle = jnp.arange(128)[:, None] * (10000.0 ** (-jnp.arange(64) / 64))[None, :]
    return (lambda x, c, s: jax_nkilib.rope(x, c, s)), (
        x,
        jnp.cos(angle).astype(jnp.bfloat16),
        jnp.sin(angle).astype(jnp.bfloat16),
    )


def rmsnorm_quant_case(devices):
    return (lambda h, w: nki.rmsnorm_quant_kernel(h, w, quantization_type="ROW")), (
        normal(1, (1, 128, 512)),
        normal(2, (1, 512)),
    )


def attention_case(devices):
    q, k, v = normal(3, (1, 256, 4, 128)), normal(4, (1, 256, 2, 128)), normal(5, (1, 256, 2, 128))

    def forward_backward(q, k, v):
        loss = lambda q, k, v: jnp.sum(jax_nkilib.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

    return forward_backward, (q, k, v)


def mlp_case(devices):
    x = normal(6, (1, 128, 512))
    gate, up, down = (
        normal(7, (512, 1024), scale=0.05),
        normal(8, (512, 1024), scale=0.05),
        normal(9, (1024, 512), scale=0.05),
    )
    return (lambda x, g, u, d: jax_nkilib.mlp(x, g, u, d, activation="silu")), (x, gate, up, down)


def all_reduce_case(devices):
    mesh = jax.sharding.Mesh(np.array(devices), ("ranks",))
    body = jax.shard_map(
        lambda v: nki.all_reduce_hbm_kernel(v, replica_group="ranks"),
        mesh=mesh,
        in_specs=P("ranks"),
        out_specs=P("ranks"),
    )
    x = jax.device_put(normal(10, (len(devices) * 128, 512)), NamedSharding(mesh, P("ranks")))
    return body, (x,)


CASES = (
    Case("RoPE", rope_case, 0.02),
    Case("rmsnorm_quant_kernel (ROW FP8)", rmsnorm_quant_case, 0.01, fp8_mismatch),
    Case("attention fwd+bwd (attention_cte, attention_bwd)", attention_case, 0.05),
    Case("mlp (SwiGLU)", mlp_case, 0.05),
    Case("all_reduce_hbm_kernel (shard_map)", all_reduce_case, 0.05),
)


def lower(case: Case, devices, lnc: int):
    """The case's function and arguments, and its Neuron lowering (errors on any kernel fallback)."""
    fn, args = case.build(devices)
    with jax_nkilib.config(lnc=lnc, on_unsupported="error"):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("neuron",))
        calls = jax_nkilib.explain(fn, *args)
    return fn, args, lowered, calls


def run(case: Case, lnc: int) -> dict:
    """Compile and run one case on the Neuron devices and on the CPU; one row of the table."""
    devices = jax.devices("neuron")
    row = {"case": case.name, "lnc": lnc}
    try:
        fn, args, lowered, calls = lower(case, devices if "shard_map" in case.name else devices[:1], lnc)
        row["kernels"] = " ".join(report.kernel for report in calls)
        start = time.perf_counter()
        compiled = lowered.compile()
        row["compile_s"] = round(time.perf_counter() - start, 1)
        on_device = jax.block_until_ready(compiled(*args))
        cpu = jax.devices("cpu")[0]
        with jax_nkilib.config(lnc=lnc):
            reference = jax.jit(fn)(*jax.device_put(args, cpu)) if "shard_map" not in case.name else None
        if reference is None:  # the collective: the reference is the sum over ranks, computed here
            shards = np.asarray(args[0], np.float64).reshape(len(devices), -1, args[0].shape[-1])
            reference = np.tile(shards.sum(0), (len(devices), 1))
        error = (case.error or relative_error)(jax.device_get(on_device), jax.device_get(reference))
        row.update(error=error, tolerance=case.tolerance, status="PASS" if error <= case.tolerance else "FAIL")
    except Exception as err:  # a failure is a row of the table, not the end of the run
        row.update(status="FAIL", detail=f"{type(err).__name__}: {err}"[:300])
    return row


def table(rows: list[dict]) -> str:
    lines = [f"{'case':<52} {'LNC':>3} {'compile s':>9} {'error':>10} {'tolerance':>9}  status  kernels"]
    for row in rows:
        error = f"{row['error']:.3g}" if "error" in row else "-"
        lines.append(
            f"{row['case']:<52} {row['lnc']:>3} {row.get('compile_s', '-'):>9} {error:>10} "
            f"{row.get('tolerance', '-'):>9}  {row['status']:<6}  {row.get('kernels', '')}"
        )
        if "detail" in row:
            lines.append(f"    {row['detail']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lnc", type=int, choices=(1, 2), help="one LNC degree, in this process")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON (used between processes)")
    options = parser.parse_args(argv)
    try:
        jax.devices("neuron")
    except RuntimeError as err:
        print(
            f"no Neuron device here ({err}); run this on a Trainium instance with the Neuron SDK installed "
            "(see the README, 'Running on Trainium')"
        )
        return 2
    print("Neuron SDK:", jax_nkilib.neuron.installed_versions(), "| jax", jax.__version__, file=sys.stderr)
    if options.lnc is not None:
        rows = [run(case, options.lnc) for case in CASES]
    else:
        rows = []
        for lnc in (1, 2):  # one process per degree: neuronx-cc compiles a whole program at one LNC degree
            env = dict(os.environ, NEURON_LOGICAL_NC_CONFIG=str(lnc))
            done = subprocess.run(
                [sys.executable, __file__, "--lnc", str(lnc), "--json"], env=env, capture_output=True, text=True
            )
            try:
                rows += json.loads(done.stdout.strip().splitlines()[-1])
            except (IndexError, json.JSONDecodeError):
                rows.append({"case": "(all cases)", "lnc": lnc, "status": "FAIL", "detail": done.stderr[-300:]})
    print(json.dumps(rows) if options.json else table(rows))
    return 0 if all(row["status"] == "PASS" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
