"""Helpers for the checkpoint tests: background launches, rank processes, and deep state comparison."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import torch
from launch import fp32_config, metrics, trainer_args

from sdzero.cluster.launch_command import one_host_command

TORCH_ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}
"""torch's AdamW, not DeepSpeed's CPU "FusedAdam": that C++ op (like DeepSpeedCPUAdam) updates beta**t
incrementally inside a process-wide object, so a fresh process computes beta**t with pow() and the bias
correction differs by an ulp after a resume. CUDA's FusedAdam and torch's AdamW compute it from the saved
step count, so resumes are bitwise exact with them."""


def exact_config(stage: int) -> dict:
    return fp32_config(stage, optimizer=TORCH_ADAMW)


def start_trainer(
    config: Path,
    model: Path,
    data: Path,
    out: Path,
    *extra: str,
    steps: int,
    env: dict[str, str] | None = None,
    ranks: int = 2,
) -> subprocess.Popen:
    """Launch `ranks` ranks in the background; output goes to <out>.N.log (a pipe could fill and block
    them)."""
    args = trainer_args(config, model, data, out, steps, *extra)
    n = 1
    while Path(f"{out}.{n}.log").exists():
        n += 1
    log = open(f"{out}.{n}.log", "w")  # noqa: SIM115 (handed to the child, closed by `finish`)
    proc = subprocess.Popen(
        one_host_command(args, ranks),
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    proc.log_path = Path(log.name)  # type: ignore[attr-defined]
    proc.log_file = log  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = 400) -> tuple[int, str]:
    """Wait for the launch; kill its whole session if it overruns. Returns (exit code, output)."""
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait()
        raise
    finally:
        proc.log_file.close()  # type: ignore[attr-defined]
    return code, proc.log_path.read_text()  # type: ignore[attr-defined]


def run(
    config: Path, model: Path, data: Path, out: Path, *extra: str, steps: int, env=None, ranks: int = 2
) -> tuple[int, str]:
    return finish(start_trainer(config, model, data, out, *extra, steps=steps, env=env, ranks=ranks))


def ok(result: tuple[int, str]) -> str:
    code, output = result
    assert code == 0, f"trainer failed ({code}):\n{output[-6000:]}"
    return output


def rank_process(proc: subprocess.Popen, rank: int, timeout: float = 120) -> psutil.Process:
    """The trainer process of `rank` under a deepspeed launcher."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(proc.pid).children(recursive=True):
            try:
                cmd = child.cmdline()
            except psutil.Error:
                continue
            if any(a.endswith("train.py") for a in cmd) and f"--local_rank={rank}" in cmd:
                return child
        time.sleep(0.2)
    raise TimeoutError(f"rank {rank} never started")


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"trainer exited ({proc.returncode}) before step {step}")
        path = out / "metrics.jsonl"
        if path.exists() and any(r["step"] >= step for r in metrics(out)):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no step {step} within {timeout} s")


def zero_optimizer_states(checkpoint: Path) -> dict[str, Any]:
    """Every rank's ZeRO optimizer state (fp32 master partitions, Adam moments, step counts).

    weights_only=False: DeepSpeed pickles its LossScaler object into these files; they are this test's own.
    """
    return {
        p.name: torch.load(p, map_location="cpu", weights_only=False)["optimizer_state_dict"]
        for p in sorted(checkpoint.glob("*optim_states.pt"))
    }


def assert_same_state(a: Any, b: Any, where: str = "") -> None:
    """Recursive equality; tensors must be torch.equal (same dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for key in a:
            assert_same_state(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b), where
        assert_same_state(vars(a), vars(b), f"{where}.{type(a).__name__}")
    else:
        assert a == b, (where, a, b)


def tensors_in(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return 1
    if isinstance(state, dict):
        return sum(tensors_in(v) for v in state.values())
    if isinstance(state, list | tuple):
        return sum(tensors_in(v) for v in state)
    return 0
