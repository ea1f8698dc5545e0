"""A per-test time limit that a hang inside JAX's C++ (MLIR verification, XLA compilation) cannot defeat.

``signal.alarm`` cannot interrupt a hang there (the handler runs only when control returns to Python, which it never
does; issue 11's nested ``shard_map`` hung in ``ctx.module.operation.verify()``), so a test decorated with
:func:`time_limit` runs in a fresh ``pytest`` process for that one test, killed when the limit passes; the test then
fails with a message naming it and the limit, and the output the child printed so far.
"""

import functools
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_CHILD = "JAX_NKILIB_TEST_CHILD"


def _tail(output, lines: int = 60) -> str:
    if isinstance(output, bytes):
        output = output.decode(errors="replace")
    return "\n".join((output or "").splitlines()[-lines:])


def time_limit(seconds: int):
    """Run the decorated test in its own ``pytest`` process and fail it if it runs longer than ``seconds``."""

    def decorate(test):
        @functools.wraps(test)
        def run(*args, **kwargs):
            nodeid = os.environ["PYTEST_CURRENT_TEST"].rsplit(" (", 1)[0]
            if os.environ.get(_CHILD) == nodeid:
                return test(*args, **kwargs)
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", nodeid]
            try:
                result = subprocess.run(
                    command,
                    cwd=ROOT,
                    env={**os.environ, _CHILD: nodeid},
                    capture_output=True,
                    text=True,
                    timeout=seconds,
                )
            except subprocess.TimeoutExpired as expired:
                result = expired
            if isinstance(result, subprocess.TimeoutExpired):
                pytest.fail(
                    f"{nodeid} did not finish within its time limit of {seconds} s (it runs in a subprocess "
                    "so that a hang, e.g. in JAX's lowering, fails the test instead of stalling the suite). "
                    f"Output so far:\n{_tail(result.stdout)}\n{_tail(result.stderr)}",
                    pytrace=False,
                )
            if result.returncode != 0:
                pytest.fail(
                    f"{nodeid} failed in its subprocess:\n{_tail(result.stdout)}\n{_tail(result.stderr)}", pytrace=False
                )

        return run

    return decorate
