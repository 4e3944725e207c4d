"""How a trial's end is classified, and the profile driver's bookkeeping with a stand-in trial runner.

The real trials (2 ranks through the deepspeed launcher) are in tests/dist/test_profile.py; here the
runner is replaced so that resuming, ladders and trials.csv are checked in milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import typer
from typer.testing import CliRunner

import advisor.commands.profile as profile_command_module
import advisor.measure.profile as profile_module
from advisor.commands.profile import profile_command
from advisor.measure.grid import GridRequest, TrialSpec
from advisor.measure.profile import run_profile
from advisor.measure.trial_table import TRIAL_COLUMNS, read_trials
from advisor.measure.trials import GIB, TrialOutcome, TrialSettings, classify_trial, error_line, trainer_args
from sdzero.errors import UserError

SETTINGS = TrialSettings(
    model="/m", data=Path("/d"), steps=3, warmup_steps=1, trial_timeout_s=60, stall_timeout_s=20
)


def profile_json(peak: int) -> dict:
    rank = {"rank": 0, "device_peak_bytes": peak, "model_state_bytes": {}, "model_state_total_bytes": 0}
    return {"ranks": [rank, {**rank, "rank": 1, "device_peak_bytes": peak // 2}], "device_peak_bytes": peak}


def classify(
    tmp_path: Path,
    log: str,
    returncode: int | None = 1,
    killed_for: str | None = None,
    profile: dict | None = None,
    cap: int | None = None,
) -> TrialOutcome:
    (tmp_path / "log.txt").write_text(log)
    if profile is not None:
        (tmp_path / "profile.json").write_text(json.dumps(profile))
    settings = TrialSettings(**{**SETTINGS.__dict__, "mem_cap_bytes": cap})
    return classify_trial(
        returncode, killed_for, tmp_path / "log.txt", tmp_path / "profile.json", settings, 1.0
    )


CRASH_LOG = """$ deepspeed ...
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/tests/support/fault_callbacks.py", line 1, in on_step_begin
[rank0]: fault_callbacks.InjectedCrash: injected crash at step 2 (SDZERO_TEST_CRASH_AT_STEP)
[2026-01-01 00:00:00,000] [INFO] [launch.py:253:sigkill_handler] Killing subprocess 123
"""


def test_crash_reason_is_the_exception_line(tmp_path):
    out = classify(tmp_path, CRASH_LOG)
    assert out.status == "crash"
    assert out.reason.startswith("fault_callbacks.InjectedCrash: injected crash at step 2")
    assert out.reason.endswith("(exit code 1)")
    assert "Killing subprocess" in out.log_tail and out.log_tail.count("\n") < 20


@pytest.mark.parametrize(
    "line",
    [
        "[rank1]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "RuntimeError: [enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory",
        "[INFO] [launch.py:316:sigkill_handler] ['python', 'train.py'] exits with return code = -9",
    ],
)
def test_out_of_memory_in_the_log_is_oom(tmp_path, line):
    out = classify(tmp_path, f"$ deepspeed\nsome output\n{line}\nmore\n")
    assert out.status == "oom"
    assert line.split("]: ")[-1][:40] in out.reason


def test_profile_under_the_cap_is_ok_and_over_it_is_oom(tmp_path):
    assert classify(tmp_path, "fine\n", 0, profile=profile_json(GIB), cap=2 * GIB).status == "ok"
    out = classify(tmp_path, "fine\n", 0, profile=profile_json(3 * GIB), cap=2 * GIB)
    assert (out.status, out.reason) == ("oom", "memory cap: peak 3.000 GiB on rank 0 > --mem-cap-gib 2")
    assert out.profile is not None  # the measurements of an over-cap trial are kept


def test_killed_after_its_profile_is_ok_with_a_note(tmp_path):
    why = "teardown: the profile was written but the launcher had not exited 30 s later"
    out = classify(tmp_path, "fine\n", -15, killed_for=why, profile=profile_json(GIB))
    assert out.status == "ok" and out.notes == [why]


def test_hang_is_timeout_and_a_stuck_crash_is_crash(tmp_path):
    hung = classify(tmp_path, "step 1\n", -9, killed_for="timeout: hung, no new step for 20 s after step 1")
    assert (hung.status, hung.reason) == ("timeout", "hung, no new step for 20 s after step 1")
    stuck = classify(
        tmp_path, CRASH_LOG, -9, killed_for="crash: a rank failed and the launcher had not exited"
    )
    assert stuck.status == "crash" and "InjectedCrash" in stuck.reason


def test_error_line_falls_back_to_the_last_line():
    assert error_line("a\n[rank0]: something odd happened") == "something odd happened"
    assert (
        error_line("x\nsdzero: error: --data /x: no such folder\n")
        == "sdzero: error: --data /x: no such folder"
    )


def test_trainer_args_profile_the_requested_steps(tmp_path):
    settings = TrialSettings(**{**SETTINGS.__dict__, "train_args": ("--num-workers", "0")})
    args = trainer_args(settings, tmp_path / "ds.json", tmp_path)
    assert args[args.index("--max-steps") + 1] == "4"  # warm-up + measured
    assert args[args.index("--profile-warmup-steps") + 1] == "1"
    assert args[args.index("--profile-out") + 1] == str(tmp_path / "profile.json")
    assert args[-2:] == ["--num-workers", "0"]


# --------------------------------------------------------------------------------------------------
# The driver with a stand-in runner


class FakeRunner:
    """Stands in for a launch (advisor.measure.trials.run_trial under advisor.measure.launch): its configs
    out of memory from `oom_from` upwards, as the config sweep reports them; may interrupt a launch."""

    def __init__(self, oom_from: int = 4, interrupt_at: int | None = None) -> None:
        self.oom_from, self.interrupt_at = oom_from, interrupt_at
        self.calls: list[tuple[str, dict | None]] = []

    def __call__(self, spec: TrialSpec, settings, ds_config: Path, trial_dir: Path, env=None) -> TrialOutcome:
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        self.calls.append((spec.trial_id, env))
        assert json.loads(ds_config.read_text())["train_micro_batch_size_per_gpu"] == spec.micro_batch
        configs, oom = {}, {}
        for part in settings.sweep.split(","):
            mb = int(part.split(":")[0])
            key = f"mb{mb}-ga1"
            if mb >= self.oom_from:
                oom[key] = "out of memory" if mb == self.oom_from else f"above mb{self.oom_from}-ga1"
            else:
                configs[key] = profile(mb)
        launch = {"rounds": 3, "round_steps": 2, "oom": oom, "seconds": {"timed": 1.0}, "tie_s": [0.01]}
        result = {"launch": launch, "configs": configs}
        return TrialOutcome("ok", "", result, 2.0, 0, trial_dir / "log.txt")


def profile(mb: int) -> dict:
    """A config's profile as the sweep writes it (the figures trials.csv reads)."""
    rank = {
        "rank": 0,
        "device_peak_bytes": mb,
        "model_state_bytes": {k: 1 for k in ("params", "grads", "master", "optimizer")},
        "model_state_total_bytes": 4,
        "bucket_bytes": 0,
        "offloaded_bytes": 0,
        "frozen_bytes": 0,
        "activation_bytes": mb,
        "cuda_peak_bytes": None,
    }
    steps = [0.1 * mb] * 5
    return {
        "grad_accum": 1,
        "world_size": 2,
        "global_batch": 2 * mb,
        "samples_per_s": 20.0,
        "step_time_s": 0.1 * mb,
        "ranks": [rank],
        "trained_params": 1,
        "device_peak_bytes": mb,
        "peak_rss_bytes": 1,
        "measured_steps": 5,
        "step_times_s": steps,
    }


@pytest.fixture
def fake(monkeypatch, tmp_path):
    monkeypatch.setattr(
        profile_module,
        "device_support",
        lambda env=None: {"device": "cpu", "count": 1, "bf16": True, "fp16": False},
    )
    monkeypatch.setattr("sdzero.models.loading.detect_family", lambda model: "sd")
    (tmp_path / "data").mkdir()

    def run(runner: FakeRunner, **kwargs) -> profile_module.ProfileResult:
        monkeypatch.setattr(profile_module, "run_trial", runner)
        grid = GridRequest(stages=(1, 2), precisions=("bf16", "fp16"), max_micro_batch=8)
        return run_profile("/m", tmp_path / "data", tmp_path / "out", grid=grid, **kwargs)

    return run


def test_ladders_stop_at_oom_and_rows_have_the_columns(fake, tmp_path):
    runner = FakeRunner(oom_from=4)
    result = fake(runner)
    assert [c[0][:2] for c in runner.calls] == ["z1", "z2"]  # one launch per ladder
    assert [r.split("-")[2] for r in result.ran] == ["mb1", "mb2", "mb4", "mb8"] * 2
    assert result.notes and result.notes[0].startswith("fp16: skipped")
    on_disk = pd.read_csv(tmp_path / "out" / "trials.csv")
    assert tuple(on_disk.columns) == TRIAL_COLUMNS and len(on_disk) == 8
    # mb8 never ran after mb4 ran out of memory in the launch: it is an oom row that says why
    assert list(on_disk["status"]) == ["ok", "ok", "oom", "oom"] * 2
    assert on_disk["reason"].iloc[3] == "above mb4-ga1"
    assert (on_disk["ranks_per_node"] == 2).all()  # the CPU default


def test_rerun_skips_finished_trials_and_resumes_after_an_interrupt(fake, tmp_path):
    with pytest.raises(KeyboardInterrupt):
        fake(FakeRunner(interrupt_at=1))
    assert len(read_trials(tmp_path / "out" / "trials.csv")) == 4  # the first launch's rows, whole
    second = FakeRunner()
    result = fake(second)
    assert result.skipped[:2] == ["z1-bf16-mb1-off-none-r2", "z1-bf16-mb2-off-none-r2"]
    assert [c[0][:2] for c in second.calls] == ["z2"] and len(result.ran) == 4
    assert fake(FakeRunner()).ran == []  # all done: nothing runs a third time
    assert len(result.table) == 8


def test_a_changed_setup_runs_again(fake):
    fake(FakeRunner())
    assert len(fake(FakeRunner(), steps=7).ran) == 8


@pytest.mark.parametrize("setup", ["5e1234567890", "123456789012", "00000000007a"])
def test_a_number_like_setup_hash_still_resumes(fake, monkeypatch, setup):
    # CI once drew a data path whose hash read as a float (5e...: inf): the resume then ran nothing
    monkeypatch.setattr(profile_module, "setup_id", lambda parts: setup)
    with pytest.raises(KeyboardInterrupt):
        fake(FakeRunner(interrupt_at=1))
    result = fake(FakeRunner())
    assert len(result.skipped) == 4 and len(result.ran) == 4 and len(result.table) == 8
    assert set(result.table["setup_id"]) == {setup}


def test_trial_env_reaches_each_trial(fake):
    runner = FakeRunner()
    fake(runner, trial_env=lambda spec: {"X_STAGE": str(spec.zero_stage)})
    assert {(c[0][:2], c[1]["X_STAGE"]) for c in runner.calls} == {("z1", "1"), ("z2", "2")}


def test_a_foreign_trials_csv_is_refused(fake, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "trials.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="trials.csv: its columns"):
        fake(FakeRunner())


def test_command_parses_and_delegates(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(
        profile_command_module, "run_profile", lambda **kw: seen.update(kw) or _empty(tmp_path)
    )
    app = typer.Typer()
    app.command()(profile_command)
    args = [
        "--model",
        "/m",
        "--data",
        str(tmp_path),
        "--stage",
        "3",
        "--precision",
        "bf16",
        "--micro-batch",
        "2",
        "--overlap-comm",
        "off",
        "--train-args",
        "--num-workers 1",
        # its own folder: the command takes the output lock there (never the checkout's reports/)
        "--out",
        str(tmp_path / "profile"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    grid = seen["grid"]
    assert (grid.stages, grid.precisions, grid.micro_batches, grid.overlap_comm) == (
        (3,),
        ("bf16",),
        (2,),
        (False,),
    )
    assert seen["train_args"] == ["--num-workers", "1"] and seen["progress"] is True
    bad = CliRunner().invoke(app, ["--model", "/m", "--data", str(tmp_path), "--stage", "4"])
    assert isinstance(bad.exception, UserError) and "--stage" in str(bad.exception)


def _empty(tmp_path: Path) -> profile_module.ProfileResult:
    return profile_module.ProfileResult(tmp_path / "trials.csv", pd.DataFrame(columns=list(TRIAL_COLUMNS)))
