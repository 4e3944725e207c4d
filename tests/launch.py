"""Helpers for tests that launch the trainer through DeepSpeed's launcher.

`run_trainer` starts one host's ranks with `sdzero.cluster.launch_command.one_host_command` (DeepSpeed's per-node
launcher, without the runner process in front of it: 2-3 s less per launch); the tests of `sdzero train`,
the hosts launch, Slurm and MPI go through the `deepspeed` runner as users do."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from sdzero.cluster.launch_command import REPO_ROOT, one_host_command
from sdzero.telemetry.metrics import read_metrics

SUPPORT = Path(__file__).resolve().parent / "support"
CONFIGS = REPO_ROOT / "ds_configs"


ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}}
SGD = {"type": "SGD", "params": {"lr": 0.05}}


def fp32_config(
    stage: int, micro: int = 4, accum: int = 1, optimizer: dict | None = None, **zero: Any
) -> dict:
    """A test config without mixed precision, for comparisons that must be exact or nearly so."""
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "optimizer": optimizer or ADAMW,
        "zero_optimization": {"stage": stage, **zero},
        "zero_allow_untested_optimizer": True,  # plain torch SGD under ZeRO
        "steps_per_print": 1000000,
    }


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config, indent=2))
    return path


def trainer_args(config: Path, model: Path, data: Path, out: Path, steps: int, *extra: str) -> list[str]:
    """The trainer's argv as every test writes it: one loader worker (2 cores), `extra` last (it wins)."""
    return [
        "--deepspeed_config",
        str(config),
        "--model",
        str(model),
        "--data",
        str(data),
        "--output-dir",
        str(out),
        "--max-steps",
        str(steps),
        "--num-workers",
        "1",
        *extra,
    ]


def run_trainer(
    config: Path,
    model: Path,
    data: Path,
    out: Path,
    *extra: str,
    steps: int = 2,
    ranks: int = 2,
    fp16_on_cpu: bool = False,
    timeout: float = 400,
) -> subprocess.CompletedProcess:
    args = trainer_args(config, model, data, out, steps, *extra)
    env = dict(os.environ)
    if fp16_on_cpu:
        env["SDZERO_TEST_FP16_ON_CPU"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SUPPORT), env.get("PYTHONPATH")]))
    return subprocess.run(
        one_host_command(args, ranks), capture_output=True, text=True, timeout=timeout, env=env
    )


def check_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, (
        f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )


def metrics(out: Path) -> list[dict[str, Any]]:
    return read_metrics(out / "metrics.jsonl")
