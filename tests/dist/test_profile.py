"""`sdzero profile` for real: trials of the tiny model with 2 ranks through the deepspeed launcher.

Two profiles, each shared by the tests of its part (a trial costs ~30 s on 2 busy cores):
- `profiled`: ZeRO 1, 2 and 3 in bf16 at micro-batch 1, a launch each. The first attempt is stopped by
  SIGTERM while its second launch runs, and a second call resumes it: together one interrupted-and-resumed profile.
- `failures`: a crashing trial, a trial over the memory cap and a hanging trial, in that order.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import psutil
import pytest
from support.fault_callbacks import CRASH_AT, HANG_AT, fault_env

from advisor.measure.grid import GridRequest, TrialSpec
from advisor.measure.profile import ProfileResult, run_profile
from advisor.measure.trial_table import TRIAL_COLUMNS
from sdzero.cluster.launch_command import REPO_ROOT

pytestmark = pytest.mark.dist

RANKS = 2
STEPS, WARMUP = 3, 1
TRIAL_TIMEOUT_S = 400.0  # generous: neighbours share these 2 cores
IDS = [f"z{s}-bf16-mb1-off-none-r2" for s in (1, 2, 3)]


def base_config(path: Path) -> Path:
    """The shipped ZeRO-1 bf16 JSON (overlap_comm off), with every parameter partitioned at ZeRO-3.

    DeepSpeed keeps parameters below stage3_param_persistence_threshold whole on every rank; the tiny
    UNet's largest has 73,728 elements, under the default of 100,000, so the default would partition none.
    """
    config = json.loads((REPO_ROOT / "ds_configs" / "zero1_bf16.json").read_text())
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    path.write_text(json.dumps(config))
    return path


def profile_kwargs(tiny_model: Path, synth_data: Path, out: Path) -> dict:
    return {
        "model": str(tiny_model),
        "data": synth_data,
        "out_dir": out,
        "grid": GridRequest(
            stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1,), ranks_per_node=(RANKS,)
        ),
        "base_config": base_config(out.parent / "base.json"),
        "steps": STEPS,
        "warmup_steps": WARMUP,
        "trial_timeout_s": TRIAL_TIMEOUT_S,
        "stall_timeout_s": 120.0,
        "train_args": ["--num-workers", "1"],
        "target_rel_halfwidth": None,
    }


def launch_folder(out: Path, trial_id: str) -> Path:
    """The folder of the launch that measured the trial (one launch per ladder, advisor.measure.launch)."""
    from advisor.measure.grid import TrialSpec
    from advisor.measure.launch import launch_name

    stage = int(trial_id[1])
    return out / "trials" / launch_name(TrialSpec(stage, "bf16", 1, "none", RANKS)) / "launch-0"


def processes_mentioning(text: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if proc.pid != os.getpid() and any(text in part for part in proc.info["cmdline"] or ()):
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def profiled(tiny_model, synth_data, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("profile") / "out"
    kwargs = profile_kwargs(tiny_model, synth_data, out)
    # First attempt, in its own process, stopped by SIGTERM once the first trial is recorded.
    script = (
        "import pickle, sys; from advisor.measure.profile import run_profile; "
        "run_profile(**pickle.loads(bytes.fromhex(sys.argv[1])))"
    )
    import pickle

    first = subprocess.Popen([sys.executable, "-c", script, pickle.dumps(kwargs).hex()], cwd=REPO_ROOT)
    csv = out / "trials.csv"
    deadline = time.monotonic() + 2 * TRIAL_TIMEOUT_S
    while not (csv.exists() and len(pd.read_csv(csv)) >= 1):
        assert first.poll() is None, "the first profile attempt ended before its first trial was recorded"
        assert time.monotonic() < deadline, "no trial recorded in time"
        time.sleep(0.5)
    time.sleep(5)  # the second trial's launcher and ranks are starting now
    first.send_signal(signal.SIGTERM)
    first.wait(timeout=120)
    after_interrupt = pd.read_csv(csv)
    leftovers = processes_mentioning(str(out))
    first_row = after_interrupt.iloc[0].to_dict()
    first_profile = launch_folder(out, IDS[0]) / "profile.json"
    first_mtime = first_profile.stat().st_mtime_ns
    started = time.monotonic()
    result = run_profile(**kwargs)  # the resumed profile
    return {
        "result": result,
        "out": out,
        "after_interrupt": after_interrupt,
        "leftovers": leftovers,
        "first_row": first_row,
        "first_profile_unchanged": first_profile.stat().st_mtime_ns == first_mtime,
        "resume_s": time.monotonic() - started,
    }


def test_interrupted_profile_resumes_without_redoing_finished_trials(profiled):
    result: ProfileResult = profiled["result"]
    assert list(profiled["after_interrupt"]["trial_id"]) == IDS[:1]  # only whole rows were written
    assert profiled["leftovers"] == []  # SIGTERM took the running trial's ranks down with the driver
    assert result.skipped == IDS[:1] and result.ran == IDS[1:]
    assert profiled["first_profile_unchanged"]
    row = result.table.set_index("trial_id").loc[IDS[0]]
    assert row["finished_at"] == profiled["first_row"]["finished_at"]


def test_one_row_per_trial_with_the_fields(profiled):
    table = profiled["result"].table
    on_disk = pd.read_csv(profiled["out"] / "trials.csv")
    assert tuple(on_disk.columns) == TRIAL_COLUMNS
    assert list(table["trial_id"]) == IDS and list(table["status"]) == ["ok"] * 3
    assert list(table["zero_stage"]) == [1, 2, 3]
    assert (table["world_size"] == RANKS).all() and (table["global_batch"] == RANKS).all()
    # at least STEPS timed steps, then until the launch's measuring time (6 s a config) is spent
    assert (table["measured_steps"] >= STEPS).all() and (table["warmup_steps"] == WARMUP).all()
    for column in (
        "samples_per_s",
        "step_time_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
        "ds_fwd_s",
        "ds_bwd_s",
        "ds_step_s",
        "comm_s",
        "comm_bytes",
        "activation_bytes",
        "peak_rss_bytes",
        "device_peak_bytes",
        "frozen_bytes",
    ):
        assert (table[column] > 0).all(), column
    # each median step with its interval, uncorrected without brackets, and what ended the measuring
    assert (table["step_s_lo"] <= table["step_time_median_s"]).all()
    assert (table["step_time_median_s"] <= table["step_s_hi"]).all()
    # each launch put on the first launch's machine speed by its tie (advisor.measure.launch)
    tied = table["step_s_raw"] / table["drift_factor"]
    assert ((tied - table["step_time_median_s"]).abs() < 1e-9 * tied).all() and table["drift_factor"].iloc[
        0
    ] == 1
    assert set(table["stopped_by"]) == {"launch"} and table["contended"].dtype == bool
    # throughput is what the step times say: global batch / mean step time
    expected = table["global_batch"] / table["step_time_s"]
    assert ((table["samples_per_s"] - expected).abs() < 1e-6 * expected).all()
    # DeepSpeed's backward is its inner pass plus its reduction epilogue
    assert ((table["ds_bwd_inner_s"] + table["ds_bwd_allreduce_s"]) <= table["ds_bwd_s"] * 1.001).all()
    for trial_id in IDS:
        folder = launch_folder(profiled["out"], trial_id)
        ds = json.loads((folder / "ds_config.json").read_text())
        assert ds["zero_optimization"]["stage"] == int(trial_id[1])
        assert ds["wall_clock_breakdown"] is True and ds["comms_logger"]["enabled"] is True
        assert (folder / "log.txt").is_file() and (folder / "profile.json").is_file()


def param_numels(tiny_model: Path) -> list[int]:
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model, subfolder="unet")
    return [p.numel() for p in unet.parameters() if p.requires_grad]


def expected_states(numels: list[int], stage: int, rank: int, n: int = RANKS) -> dict[str, int]:
    """Bytes per rank in bf16 with fp32 Adam, Ψ = sum(numels), with DeepSpeed's alignment.

    ZeRO-1/2 flatten all parameters into one buffer padded to a multiple of 2N elements (Ψp) and give
    rank r the slice [r·Ψp/N, (r+1)·Ψp/N). ZeRO-1 (overlap_comm off) holds every full gradient until the
    reduction; ZeRO-2 keeps, after reducing, the whole gradient of every parameter that overlaps its slice
    (a parameter cut by a partition boundary is held whole by both ranks). ZeRO-3 splits each parameter
    itself into N shards of ceil(numel/N) elements.
    """
    psi = sum(numels)
    padded = math.ceil(psi / (2 * n)) * 2 * n
    part = padded // n
    if stage == 3:
        shard = sum(math.ceil(k / n) for k in numels)
        return {"params": 2 * shard, "grads": 2 * shard, "master": 4 * shard, "optimizer": 8 * shard}
    lo, hi, overlap, offset = rank * part, (rank + 1) * part, 0, 0
    for k in numels:
        if offset < hi and offset + k > lo:
            overlap += k
        offset += k
    grads = 2 * psi if stage == 1 else 2 * overlap
    return {"params": 2 * padded, "grads": grads, "master": 4 * part, "optimizer": 8 * part}


def test_model_state_bytes_per_rank_match_the_zero_formulas(profiled, tiny_model):
    numels = param_numels(tiny_model)
    psi = sum(numels)
    table = profiled["result"].table
    assert (table["trained_params"] == psi).all()
    totals = {}
    for _, row in table.iterrows():
        per_rank = json.loads(row["model_state_bytes_per_rank"])
        assert len(per_rank) == RANKS
        for rank, states in enumerate(per_rank):
            assert states == expected_states(numels, row["zero_stage"], rank), (row["trial_id"], rank)
        totals[row["zero_stage"]] = sum(per_rank[0].values())
    # The paper's totals (2Ψ + 2Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N) up to padding and the ZeRO-2 boundary
    # overhang, each far below one percent of Ψ for this model.
    n = RANKS
    for stage, formula in ((1, 4 * psi + 12 * psi / n), (2, 2 * psi + 14 * psi / n), (3, 16 * psi / n)):
        assert totals[stage] == pytest.approx(formula, rel=0.01), stage
    assert totals[1] > totals[2] > totals[3]


def test_activation_and_peak_memory_are_consistent(profiled):
    for _, row in profiled["result"].table.iterrows():
        launch = json.loads((Path(row["trial_dir"]) / "profile.json").read_text())
        for rank in launch["configs"]["mb1-ga1"]["ranks"]:
            # On the CPU the device peak is what an accelerator would hold, summed from its parts.
            parts = (
                rank["model_state_total_bytes"]
                + rank["bucket_bytes"]
                - rank["offloaded_bytes"]
                + rank["frozen_bytes"]
                + rank["activation_bytes"]
            )
            assert rank["device_peak_bytes"] == parts
            assert rank["peak_rss_bytes"] > rank["model_state_total_bytes"]
        # ZeRO changes where states live, not what one micro-batch's forward saves
        assert row["activation_bytes"] == profiled["result"].table["activation_bytes"].iloc[0]


def test_communication_follows_the_stage(profiled, tiny_model):
    psi = sum(param_numels(tiny_model))
    for _, row in profiled["result"].table.iterrows():
        ops = json.loads(row["comm_ops"])
        reduced = sum(o["bytes_per_step"] for k, o in ops.items() if "reduce" in k)
        gathered = sum(o["bytes_per_step"] for k, o in ops.items() if "all_gather" in k)
        # every bf16 gradient is reduced once per step; every rank contributes its updated slice
        assert reduced >= 2 * psi, (row["trial_id"], ops)
        assert gathered >= 2 * psi / RANKS, (row["trial_id"], ops)
        assert row["comm_s"] == pytest.approx(sum(o["seconds_per_step"] for o in ops.values()))
    z3_ops = json.loads(profiled["result"].table.iloc[2]["comm_ops"])
    assert "reduce_scatter_tensor" in z3_ops  # ZeRO-3 reduce-scatters gradients to their owners
    # ZeRO-3 gathers parameters asynchronously: comms_logger times their launch, the trial their waits too
    gathers = [o for k, o in z3_ops.items() if "all_gather" in k]
    assert sum(o["waited_seconds_per_step"] for o in gathers) > 0, z3_ops
    assert all(0 <= o["waited_seconds_per_step"] <= o["seconds_per_step"] for o in z3_ops.values())


# --------------------------------------------------------------------------------------------------
# Failures are data


STALL_S = 10.0  # 20x a tiny step on 2 busy cores; the hang trial waits this out
CAP_GIB = 0.01  # far below the tiny model's ~110 MB device peak (the 50M-element reduce buckets)


def inject(spec: TrialSpec) -> dict[str, str]:
    """z1 crashes at its second step, z2 runs (and passes the memory cap), z3 hangs at its second step."""
    faults = {1: {CRASH_AT: "2"}, 2: {}, 3: {HANG_AT: "2"}}[spec.zero_stage]
    return fault_env(faults) if faults else {}


@pytest.fixture(scope="module")
def failures(tiny_model, synth_data, tmp_path_factory) -> ProfileResult:
    out = tmp_path_factory.mktemp("failures") / "out"
    kwargs = profile_kwargs(tiny_model, synth_data, out)
    # no data-loader workers: fewer processes on 2 cores, and a crashed rank exits at once
    kwargs.update(
        steps=1,
        warmup_steps=1,
        stall_timeout_s=STALL_S,
        mem_cap_gib=CAP_GIB,
        train_args=["--num-workers", "0"],
        trial_env=inject,
    )
    return run_profile(**kwargs)


def test_crash_oom_and_hang_are_recorded_and_the_grid_goes_on(failures):
    table = failures.table.set_index("trial_id")
    assert failures.ran == IDS  # every trial ran although the ones before it failed
    assert list(table["status"]) == ["crash", "oom", "timeout"]
    finished = pd.to_datetime(table["finished_at"])
    assert finished.is_monotonic_increasing


def test_crash_keeps_the_error_and_the_log_tail(failures):
    row = failures.table.set_index("trial_id").loc[IDS[0]]
    assert "InjectedCrash: injected crash at step 2" in row["reason"]
    assert "injected crash at step 2" in row["log_tail"] and len(row["log_tail"].splitlines()) <= 20
    assert pd.isna(row["samples_per_s"])


def test_cap_turns_a_measured_peak_into_oom(failures):
    row = failures.table.set_index("trial_id").loc[IDS[1]]
    assert row["reason"].startswith("memory cap: peak") and f"--mem-cap-gib {CAP_GIB:g}" in row["reason"]
    assert row["device_peak_bytes"] > CAP_GIB * 2**30
    assert row["samples_per_s"] > 0  # the trial's measurements are kept with its verdict


def test_hang_is_killed_at_the_stall_timeout(failures, tmp_path):
    row = failures.table.set_index("trial_id").loc[IDS[2]]
    assert row["reason"] == f"hung, no new step for {STALL_S:g} s after step 1 (--stall-timeout)"
    assert STALL_S < row["wall_s"] < TRIAL_TIMEOUT_S
    assert processes_mentioning(str(Path(row["trial_dir"]).parent)) == []  # ranks killed, none left behind


def test_fp16_support_is_asked_of_the_ranks_environment(monkeypatch):
    """fp16 trials are planned only where DeepSpeed's accelerator runs fp16, as seen by a fresh process
    started like the ranks: the test-only fp16 patch (tests/support/sitecustomize.py) turns it on."""
    from deepspeed.accelerator import get_accelerator

    from advisor.measure.profile import device_support

    assert device_support()["fp16"] == bool(get_accelerator().is_fp16_supported())
    monkeypatch.setenv("SDZERO_TEST_FP16_ON_CPU", "1")
    support = str(REPO_ROOT / "tests" / "support")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [support, os.environ.get("PYTHONPATH")])))
    assert device_support()["fp16"] is True
