"""Launching the trainer on a namespace cluster from tests: `sdzero launch` in the background, logs to a file."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from sdzero.telemetry.metrics import read_metrics

SDZERO = str(Path(sys.executable).with_name("sdzero"))
REFERENCE_STEPS = 6
LOSS_RTOL = 1e-5
"""Multi-host vs 1 host x 2 slots, fp32: the same samples, noise and (for 2 ranks) the same reduction
order; only the transport differs. The margin covers a reordered sum in a reduction, nothing more."""
ROOT_MPI = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def start(
    command: list[str], log_path: Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.Popen:
    """Output goes to a file (a full pipe would block the ranks); its own session, to kill it whole."""
    log = log_path.open("w")
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, **ROOT_MPI, **(env or {})},
    )
    log.close()  # the child holds its own copy
    proc.log_path = log_path  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    """Exit code and output; a launch that overruns is killed (whole session) and reported as a hang."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise AssertionError(f"launch hung past {timeout} s:\n{proc.log_path.read_text()[-4000:]}") from None  # type: ignore[attr-defined]
    return code, proc.log_path.read_text()  # type: ignore[attr-defined]


def launch(hostfile: Path, args: list[str], log_path: Path, cwd: Path, *options: str) -> tuple[int, str]:
    command = [SDZERO, "launch", "--hostfile", str(hostfile), *options, "--", *args]
    return finish(start(command, log_path, cwd))


def ok(result: tuple[int, str]) -> str:
    code, output = result
    assert code == 0, f"launch failed ({code}):\n{output[-6000:]}"
    return output


def losses(out: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(out / "metrics.jsonl")]


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before step {step}")
        path = out / "metrics.jsonl"
        if path.exists() and any(r["step"] >= step for r in read_metrics(path)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s")


def assert_same_losses(got: list[float], want: list[float], rtol: float) -> None:
    assert len(got) == len(want), (got, want)
    for step, (a, b) in enumerate(zip(got, want, strict=True), start=1):
        assert abs(a - b) <= rtol * max(1.0, abs(b)), f"step {step}: {a!r} vs {b!r} (rtol {rtol})"
