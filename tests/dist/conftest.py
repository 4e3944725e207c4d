"""Runs of the shipped DeepSpeed configs, shared by the dist tests that read them (one launch each)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from launch import CONFIGS, run_trainer

# The fast-path options as a user passes them (tests/dist/test_train.py reads them back).
SPEED_OPTIONS = ("--channels-last", "--attention", "math", "--sync-timing", "--no-tf32")
# Most shipped configs train 2 steps with the defaults. Two runs carry a second test's needs, so that one
# launch serves both: zero0_bf16 takes the speed options; zero2_fp16 runs 6 steps with checkpoints at 3
# and 6 for the training report of a real fp16 run (tests/dist/test_report_real_run.py).
RUN_SHAPES: dict[str, tuple[int, tuple[str, ...]]] = {
    "zero0_bf16.json": (2, SPEED_OPTIONS),
    "zero2_fp16.json": (6, ("--checkpoint-every", "3")),
}


def is_fp16(name: str) -> bool:
    return json.loads((CONFIGS / name).read_text()).get("fp16", {}).get("enabled", False)


@pytest.fixture(scope="session")
def shipped_run(
    tiny_model: Path, synth_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], tuple[subprocess.CompletedProcess, Path]]:
    """`shipped_run(name)`: the finished process and output folder of a 2-rank run of ds_configs/<name>."""
    runs: dict[str, tuple[subprocess.CompletedProcess, Path]] = {}

    def get(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        if name not in runs:
            steps, extra = RUN_SHAPES.get(name, (2, ()))
            out = tmp_path_factory.mktemp(name.removesuffix(".json")) / "run"
            proc = run_trainer(
                CONFIGS / name,
                tiny_model,
                synth_data,
                out,
                *extra,
                steps=steps,
                fp16_on_cpu=is_fp16(name),
                timeout=600,
            )
            runs[name] = (proc, out)
        return runs[name]

    return get
