"""The trial grid of `sdzero profile`: planning, per-trial DeepSpeed JSON, and what counts as done."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from advisor.measure.grid import (
    DEFAULT_FP16,
    GridRequest,
    TrialSpec,
    finished_trials,
    load_base_config,
    pending,
    plan_grid,
    setup_id,
    trial_ds_config,
    write_trial_config,
)
from sdzero.cluster.launch_command import REPO_ROOT
from sdzero.config.train_config import load_ds_config
from sdzero.errors import UserError

CONFIGS = REPO_ROOT / "ds_configs"
BOTH = {"bf16": True, "fp16": True}
CPU = {"bf16": True, "fp16": False}


def ids(specs) -> list[str]:
    return [s.trial_id for s in specs]


# --------------------------------------------------------------------------------------------------
# Planning


def test_default_grid_is_stage_x_precision_x_ladder():
    plan = plan_grid(GridRequest(max_micro_batch=8), BOTH)
    assert len(plan.ladders) == 4 * 2  # stages 0-3 x precisions; no offload, default ranks
    assert {ladder[0].zero_stage for ladder in plan.ladders} == {0, 1, 2, 3}  # plain data parallel too
    assert all([s.micro_batch for s in ladder] == [1, 2, 4, 8] for ladder in plan.ladders)
    assert plan.max_trials == 32 and not plan.notes
    assert len(set(ids(s for ladder in plan.ladders for s in ladder))) == 32  # ids are unique


def test_a_zero0_trial_config_is_plain_data_parallel():
    base = load_base_config(CONFIGS / "zero2_bf16.json")
    config = trial_ds_config(base, TrialSpec(0, "bf16", 2, "none", 2))
    assert config["zero_optimization"]["stage"] == 0
    assert "offload_optimizer" not in config["zero_optimization"]
    with pytest.raises(UserError, match="choose from 0, 1, 2, 3"):
        GridRequest(stages=(4,))


def test_fp16_is_skipped_and_said_where_unsupported():
    plan = plan_grid(GridRequest(stages=(2,), micro_batches=(1,)), CPU)
    assert {s.precision for ladder in plan.ladders for s in ladder} == {"bf16"}
    assert any(note.startswith("fp16: skipped") for note in plan.notes)


def test_only_fp16_on_a_device_without_it_is_an_empty_grid():
    with pytest.raises(UserError, match="grid is empty"):
        plan_grid(GridRequest(precisions=("fp16",)), CPU)


def test_parameter_offload_runs_at_stage_3_only():
    request = GridRequest(stages=(2, 3), micro_batches=(1,), offloads=("none", "optimizer+params"))
    plan = plan_grid(request, CPU)
    combos = {(s.zero_stage, s.offload) for ladder in plan.ladders for s in ladder}
    assert combos == {(2, "none"), (3, "none"), (3, "optimizer+params")}
    assert any("stage 3 only" in note for note in plan.notes)
    skipped = plan_grid(
        GridRequest(stages=(1,), micro_batches=(1,), offloads=("none", "optimizer+params")), CPU
    )
    assert any("skipped" in note for note in skipped.notes)


def test_comm_knobs_multiply_only_when_asked():
    request = GridRequest(
        stages=(2,),
        precisions=("bf16",),
        micro_batches=(2,),
        ranks_per_node=(1, 2),
        overlap_comm=(True, False),
        reduce_bucket_sizes=(1000, 2000),
    )
    specs = [s for ladder in plan_grid(request, CPU).ladders for s in ladder]
    assert len(specs) == 2 * 2 * 2
    assert "z2-bf16-mb2-off-none-r1-oc1-rb1000" in ids(specs)
    plain = plan_grid(GridRequest(stages=(2,), precisions=("bf16",), micro_batches=(2,)), CPU)
    assert ids(plain.ladders[0]) == ["z2-bf16-mb2-off-none-r2"]  # no knob suffix: base JSON values


def test_explicit_micro_batches_are_sorted_and_deduplicated():
    plan = plan_grid(GridRequest(stages=(1,), precisions=("bf16",), micro_batches=(8, 2, 8)), CPU)
    assert [s.micro_batch for s in plan.ladders[0]] == [2, 8]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"stages": (4,)}, "--stage"),
        ({"precisions": ("fp8",)}, "--precision"),
        ({"offloads": ("nvme",)}, "--offload"),
        ({"micro_batches": (0,)}, "--micro-batch"),
        ({"ranks_per_node": (0,)}, "--ranks"),
        ({"reduce_bucket_sizes": (1001,)}, "--reduce-bucket-size"),
    ],
)
def test_bad_requests_name_the_flag(kwargs, match):
    with pytest.raises(UserError, match=match):
        GridRequest(**kwargs)


# --------------------------------------------------------------------------------------------------
# Per-trial DeepSpeed JSON


def spec(**overrides) -> TrialSpec:
    fields = {
        "zero_stage": 3,
        "precision": "fp16",
        "micro_batch": 8,
        "offload": "optimizer+params",
        "ranks_per_node": 2,
    }
    return TrialSpec(**{**fields, **overrides})


def test_trial_config_writes_the_knobs_into_the_base():
    base = load_base_config(CONFIGS / "zero2_bf16.json")
    before = json.dumps(base, sort_keys=True)
    config = trial_ds_config(base, spec(overlap_comm=False, reduce_bucket_size=1000))
    assert json.dumps(base, sort_keys=True) == before  # the base is not modified
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["overlap_comm"] is False and zero["reduce_bucket_size"] == 1000
    assert zero["offload_optimizer"]["device"] == "cpu" and zero["offload_param"]["device"] == "cpu"
    assert config["train_micro_batch_size_per_gpu"] == 8 and "train_batch_size" not in config
    assert config["fp16"] == DEFAULT_FP16 and config["bf16"]["enabled"] is False
    assert config["optimizer"] == base["optimizer"]  # everything not varied is the user's
    assert config["wall_clock_breakdown"] is True and config["comms_logger"]["enabled"] is True


def test_trial_config_back_to_bf16_without_offload():
    base = load_base_config(CONFIGS / "zero3_offload_bf16.json")
    config = trial_ds_config(base, spec(zero_stage=1, precision="bf16", offload="none"))
    assert "offload_optimizer" not in config["zero_optimization"]
    assert "offload_param" not in config["zero_optimization"]
    assert config["bf16"]["enabled"] is True and not config.get("fp16", {}).get("enabled", False)


def test_users_own_offload_section_is_kept(tmp_path: Path):
    raw = json.loads((CONFIGS / "zero2_bf16.json").read_text())
    nvme = {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": False}
    raw["zero_optimization"]["offload_optimizer"] = nvme
    base = load_base_config(write(tmp_path / "base.json", raw))
    assert trial_ds_config(base, spec(offload="optimizer"))["zero_optimization"]["offload_optimizer"] == nvme


def test_fp16_base_keeps_its_loss_scaling(tmp_path: Path):
    base = load_base_config(CONFIGS / "zero2_fp16.json")
    config = trial_ds_config(base, spec(precision="fp16"))
    assert config["fp16"] == {**base["fp16"], "enabled": True}


def test_written_trial_config_passes_the_trainers_checks(tmp_path: Path):
    base = load_base_config(CONFIGS / "zero1_bf16.json")
    trial = spec(zero_stage=2, precision="bf16", micro_batch=4, offload="optimizer")
    path = write_trial_config(base, trial, tmp_path / "t", 4)
    assert path == tmp_path / "t" / "ds_config.json"
    ds = load_ds_config(path, world_size=4)
    assert (ds.zero_stage, ds.dtype, ds.micro_batch, ds.global_batch) == (2, "bf16", 4, 16)
    assert ds.offload_optimizer and not ds.offload_param


def write(path: Path, config: dict) -> Path:
    path.write_text(json.dumps(config))
    return path


def test_base_config_errors_are_one_line(tmp_path: Path):
    raw = json.loads((CONFIGS / "zero2_bf16.json").read_text())
    with pytest.raises(UserError, match='"auto"'):
        load_base_config(write(tmp_path / "auto.json", {**raw, "train_micro_batch_size_per_gpu": "auto"}))
    no_opt = {k: v for k, v in raw.items() if k != "optimizer"}
    with pytest.raises(UserError, match="no optimizer section"):
        load_base_config(write(tmp_path / "noopt.json", no_opt))


# --------------------------------------------------------------------------------------------------
# Done, pending, resumed


def table(*rows: tuple[str, str, str]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["trial_id", "setup_id", "status"])


LADDER_REQUEST = GridRequest(stages=(1, 2), precisions=("bf16",), micro_batches=(1, 2, 4))


def test_pending_skips_done_and_stops_a_ladder_at_its_first_oom():
    plan = plan_grid(LADDER_REQUEST, CPU)
    z1, z2 = plan.ladders
    done = {z1[0].trial_id: "ok", z1[1].trial_id: "oom", z2[0].trial_id: "crash"}
    assert ids(pending(plan, done)) == [z2[1].trial_id, z2[2].trial_id]  # z1 mb4 is never tried


def test_an_oom_recorded_while_iterating_stops_the_ladder():
    plan = plan_grid(LADDER_REQUEST, CPU)
    done: dict[str, str] = {}
    ran = []
    for s in pending(plan, done):
        ran.append(s.trial_id)
        done[s.trial_id] = "oom" if s.micro_batch == 2 else "ok"
    assert [r.split("-")[:3] for r in ran] == [
        ["z1", "bf16", "mb1"],
        ["z1", "bf16", "mb2"],
        ["z2", "bf16", "mb1"],
        ["z2", "bf16", "mb2"],
    ]


def test_finished_trials_match_setup_and_the_last_attempt_wins():
    rows = table(
        ("a", "s1", "crash"), ("a", "s1", "ok"), ("b", "s1", "timeout"), ("c", "s2", "ok"), ("d", "s1", "oom")
    )
    assert finished_trials(rows, "s1") == {"a": "ok", "b": "timeout", "d": "oom"}
    # --retry-failed runs crashes and timeouts again, never an OOM (a property of the config)
    assert finished_trials(rows, "s1", retry_failed=True) == {"a": "ok", "d": "oom"}
    assert finished_trials(table(), "s1") == {}


def test_setup_id_changes_with_anything_that_changes_results():
    parts = {"base": {"zero_optimization": {"stage": 2}}, "steps": 5, "model": "/m"}
    assert setup_id(parts) == setup_id(json.loads(json.dumps(parts)))
    assert setup_id(parts) != setup_id({**parts, "steps": 6})
    assert setup_id(parts) != setup_id({**parts, "base": {"zero_optimization": {"stage": 3}}})


def test_an_accumulation_check_trial_has_its_own_id_and_json():
    from advisor.measure.grid import accumulation_check

    base = load_base_config(CONFIGS / "zero2_bf16.json")
    spec = TrialSpec(2, "bf16", 4, "none", 2)
    check = accumulation_check(spec)
    assert check.trial_id == spec.trial_id + "-ga4" and check.ladder_key != spec.ladder_key
    assert trial_ds_config(base, check)["gradient_accumulation_steps"] == 4
    assert trial_ds_config(base, spec)["gradient_accumulation_steps"] == base["gradient_accumulation_steps"]
    plan = plan_grid(GridRequest(stages=(1,), micro_batches=(1,), grad_accums=(1, 4)), CPU)
    assert [s.grad_accum for ladder in plan.ladders for s in ladder] == [1, 4]
    with pytest.raises(UserError, match="--grad-accum"):
        GridRequest(grad_accums=(0,))
