"""Time, GPU-hours and cost to train; the node-count rules; every row filled or saying what would fill it;
the embedded default's fine-tune; and plans redone from an earlier run's measurements (--replan)."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from test_advisor_model import advise_on_synthetic_trials

from advisor.decide.node_rules import node_rule
from advisor.decide.scaling_table import BatchReach, scaling_table
from advisor.model.time_to_train import (
    StartUp,
    TrainAmount,
    add_time_to_train,
    startup_s,
    trade_line,
    train_amount,
)
from sdzero.errors import UserError


def _rows(rates: dict[int, float], batch: int = 256, gpus: int = 8) -> pd.DataFrame:
    rows = []
    for n, rate in rates.items():
        step = batch / rate
        rows.append(
            {
                "node_count": n,
                "config_id": "z2-bf16-mb4-off-none",
                "zero_stage": 2,
                "dtype": "bf16",
                "micro_batch": 4,
                "offload": "none",
                "grad_accum": max(batch // (4 * gpus * n), 1),
                "global_batch": batch,
                "world_size": gpus * n,
                "samples_per_s": rate,
                "step_time_s": step,
                "compute_s": step * 0.7,
                "exposed_comm_s": step * 0.3,
                "exposed_intra_s": step * 0.3,
                "exposed_inter_s": 0.0,
                "mem_per_rank_bytes": 1e9,
                "feasible": True,
            }
        )
    return pd.DataFrame(rows)


# ------------------------------------------------------------------------------------------ the arithmetic


def test_time_is_steps_at_the_step_time_plus_the_start_up_and_gpu_hours_follow_the_ranks():
    amount = TrainAmount(100_000, 2.0, "test")
    table = add_time_to_train(_rows({1: 100.0, 4: 350.0}), amount, StartUp(30.0, 3))
    steps = math.ceil(200_000 / 256)
    assert table["optimizer_steps"].tolist() == [steps, steps]
    expected = [30.0 + steps * 256 / 100.0, 30.0 + steps * 256 / 350.0]
    assert table["time_to_train_s"].tolist() == pytest.approx(expected)
    assert table["gpu_hours"].tolist() == pytest.approx([expected[0] / 3600 * 8, expected[1] / 3600 * 32])


def test_start_up_is_what_trials_spent_beyond_their_steps():
    trials = pd.DataFrame(
        {
            "status": ["ok", "ok", "ok", "oom"],
            "wall_s": [20.0, 24.0, 30.0, 5.0],
            "step_time_s": [1.0, 2.0, 1.0, None],
            "measured_steps": [5, 5, 5, None],
            "warmup_steps": [1, 1, 1, 1],
        }
    )
    startup = startup_s(trials)
    assert startup.trials == 3 and startup.seconds == pytest.approx(np.median([14.0, 12.0, 24.0]))
    assert "median over 3 trials" in startup.describe()
    assert startup_s(trials.iloc[3:]).trials == 0  # no ok trial: said, counted as 0


def test_samples_and_epochs_multiply_and_bad_values_are_one_line():
    assert train_amount(None, None, 640, "data").samples == 640
    assert train_amount(1000, 3, 640, "data").samples == 3000
    assert train_amount(None, 0.5, 641, "data").samples == 321  # whole samples, rounded up
    with pytest.raises(UserError, match="--epochs"):
        train_amount(None, 0, 640, "data")
    with pytest.raises(UserError, match="--samples"):
        train_amount(0, None, 640, "data")


def test_the_trade_line_compares_the_choice_with_the_fastest():
    table = add_time_to_train(
        _rows({1: 100.0, 8: 700.0, 32: 1800.0}), TrainAmount(10**6, 1, "t"), StartUp(0, 0)
    )
    rows = table.assign(status="ok").to_dict("records")
    line = trade_line(rows, 8, 32, "GPU-h", None)
    t8, t32 = table["time_to_train_s"].iloc[1], table["time_to_train_s"].iloc[2]
    g8, g32 = table["gpu_hours"].iloc[1], table["gpu_hours"].iloc[2]
    assert line.startswith("8 nodes: ") and "; 32 nodes: " in line
    assert f"{t8 / t32:.2g}x sooner for {g32 / g8:.2g}x the GPU-h" in line
    priced = trade_line(rows, 8, 32, "GPU-h", 2.5)
    assert "at 2.5 per GPU-h" in priced
    alone = trade_line(rows, 32, 32, "GPU-h", None)  # the fastest chosen: against the fewest GPU-hours
    assert alone.startswith("1 node: ") and "32 nodes" in alone


# ---------------------------------------------------------------------------------------- the node rules


def _timed_table(rates: dict[int, float]) -> pd.DataFrame:
    predictions = add_time_to_train(_rows(rates), TrainAmount(10**6, 1, "t"), StartUp(60.0, 1))
    return scaling_table(predictions, sorted(rates), 0.8, "preset ib-200 (x)", set())


def test_each_rule_chooses_what_it_says():
    # efficiency 1, 0.9, 0.8, 0.6, 0.4 at 1..16 nodes
    table = _timed_table({1: 100.0, 2: 180.0, 4: 320.0, 8: 480.0, 16: 640.0})
    hours = dict(zip(table["node_count"], table["time_to_train_s"] / 3600, strict=True))
    gpu_hours = dict(zip(table["node_count"], table["gpu_hours"], strict=True))
    assert node_rule().choose(table) == (4, None) and "knee" in node_rule().describe()
    # the fewest GPU-hours finishing in time: 2 nodes make it by a hair, 1 does not
    deadline = (hours[1] + hours[2]) / 2
    assert node_rule(deadline_hours=deadline).choose(table) == (2, None)
    late, why = node_rule(deadline_hours=hours[16] / 2).choose(table)
    assert late == 16 and "no node count finishes within" in why
    # the soonest finish within the GPU-hours: 4 nodes, not 8
    budget = (gpu_hours[4] + gpu_hours[8]) / 2
    assert node_rule(max_gpu_hours=budget).choose(table) == (4, None)
    assert node_rule(nodes=8).choose(table) == (8, None)
    with pytest.raises(UserError, match="give one rule"):
        node_rule(nodes=8, deadline_hours=3)
    with pytest.raises(UserError, match="--max-gpu-hours"):
        node_rule(max_gpu_hours=0)


def test_an_unreachable_row_says_the_smallest_batch_that_reaches_it():
    reach = BatchReach(micro_batches=(1, 2, 4), gpus_per_node=2, lo=8)
    assert reach.smallest_batch(8) == 16 and reach.smallest_batch(32) == 64 and reach.smallest_batch(2) == 8
    assert (
        BatchReach((1, 2), 2, 24).smallest_batch(4) == 24 and BatchReach((4,), 2, 24).smallest_batch(4) == 32
    )
    table = scaling_table(_rows({1: 10.0}, batch=8, gpus=2), [1, 8], 0.8, "x", set(), reach)
    assert table.loc[table["node_count"] == 8, "smallest_batch"].item() == 16


# --------------------------------------------------------------------------------------- the pipeline


def test_every_row_answered_at_the_smallest_batch_that_reaches_it(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    """The base config's batch of 8 reaches 4 nodes at most: 8, 16 and 32 nodes are answered at the smallest
    global batch that reaches them (weak scaling), in the same columns, marked as a larger batch with the
    LR the one rule gives there and the samples the batch costs; no rule chooses them."""
    result = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, samples=64_000, epochs=2, samples_rule="flux"
    )
    rec = result.recommendation
    table = pd.DataFrame(rec["scaling_table"])
    assert (table["status"] == "ok").all()
    assert (table["time_to_train_s"] > 0).all() and (table["gpu_hours"] > 0).all()
    asked = table[~table["larger_batch"].astype(bool)]
    grown = table[table["larger_batch"].astype(bool)]
    assert (asked["optimizer_steps"] == 128_000 // 8).all()
    assert grown["node_count"].tolist() == [8, 16, 32]
    assert grown["global_batch"].tolist() == [16, 32, 64]  # micro-batch 1 x the ranks
    flux = [(b / 8) ** (math.log(2.1) / math.log(8)) for b in (16, 32, 64)]
    assert grown["samples_factor"].tolist() == pytest.approx(flux)
    assert grown["optimizer_steps"].tolist() == [
        math.ceil(math.ceil(128_000 * f) / b) for f, b in zip(flux, (16, 32, 64), strict=True)
    ]
    note = grown.iloc[0]["reach_note"]
    assert "larger batch: global batch 16" in note and "sqrt rule" in note and "x 1.41" in note
    assert "flux rule" in note and f"{flux[0]:.3g}x the samples" in note
    assert rec["node_count"] <= 4  # a larger-batch row is shown, not chosen
    t = rec["time_to_train"]
    chosen = asked[asked["node_count"] == rec["node_count"]].iloc[0]
    assert t["samples"] == 128_000 and t["seconds"] == pytest.approx(chosen["time_to_train_s"])
    assert (
        rec["verdict"].startswith(f"{rec['node_count']} node")
        and "to train 128,000 samples" in rec["verdict"]
    )
    assert rec["node_choice"]["rule_name"] == "efficiency" and rec["node_choice"]["trade"]
    if rec["node_choice"]["fastest"] > 4:  # the trade names what the larger batch costs in samples
        assert "larger than asked" in rec["node_choice"]["trade"]


def test_a_batch_above_the_lr_reference_trains_its_rules_samples(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    """--global-batch 64 against the base config's 8 under the sd2 rule (256 -> 2048: 2x): 2x the samples."""
    rec = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, samples=64_000, global_batch="64", samples_rule="sd2"
    ).recommendation
    t = rec["time_to_train"]
    assert t["samples_factor"] == pytest.approx(2.0) and t["samples"] == 128_000
    assert t["optimizer_steps"] == 128_000 // 64 and "x2 for global batch 64" in t["amount"]
    assert "to train 128,000 samples" in rec["verdict"]


def test_the_embedded_default_plans_a_fine_tune_every_node_count_reaches(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    """No --model and no --deepspeed-config: the embedded fine-tune's batch 256 is held at 1-32 nodes."""
    import advisor.stages.inputs
    from advisor.stages.fine_tune import EMBEDDED_FINE_TUNE

    monkeypatch.setattr(
        advisor.stages.inputs, "default_inputs", lambda out, m, d: (str(tiny_model), synth_data)
    )
    result = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, model=None, data=None, deepspeed_config=None
    )
    rec = result.recommendation
    table = pd.DataFrame(rec["scaling_table"])
    assert table["node_count"].tolist() == [1, 2, 4, 8, 16, 32]
    assert (table["status"] == "ok").all() and (
        table["global_batch"] == EMBEDDED_FINE_TUNE.global_batch
    ).all()
    assert (table["micro_batch"] * table["grad_accum"] * table["node_count"] * 2 == 256).all()
    assert rec["lr_factor"] == 1.0 and "embedded default fine-tune" in rec["global_batch_rule"]
    assert rec["time_to_train"]["samples"] == EMBEDDED_FINE_TUNE.dataset_images
    config = json.loads((tmp_path / "out" / "recommended_ds_config.json").read_text())
    assert "train_batch_size" not in config  # DeepSpeed derives it: the file runs on fewer ranks too


# ----------------------------------------------------------------------------------------------- replan


def _no_measuring(monkeypatch):
    """A replan must start no trial, no benchmark and load no model."""
    import advisor.measure.collectives_launch
    import advisor.stages.measure

    def refuse(*_args, **_kwargs):
        raise AssertionError("a replan measured something")

    monkeypatch.setattr(advisor.stages.measure, "trial_runner", refuse)
    monkeypatch.setattr(advisor.measure.collectives_launch, "run_comm", refuse)
    monkeypatch.setattr(advisor.stages.measure, "trained_numels", refuse)


def test_a_replan_with_the_same_options_gives_the_run_its_own_table(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    from advisor.stages.advise import AdviseRequest, run_advise

    run = advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64")
    _no_measuring(monkeypatch)
    again = run_advise(
        AdviseRequest(
            max_nodes=32,
            out_dir=tmp_path / "again",
            replan=tmp_path / "out",
            device_memory_gib=1.0,
            global_batch="64",
        )
    )
    first, second = run.recommendation, again.recommendation
    assert pd.DataFrame(second["scaling_table"]).equals(pd.DataFrame(first["scaling_table"]))
    for key in ("config_id", "node_count", "step_time_s", "mem_per_rank_bytes", "time_to_train", "error"):
        assert second[key] == first[key], key
    # the new folder stands on its own: its report, and a replan of the replan
    assert (tmp_path / "again" / "report.html").is_file() and (
        tmp_path / "again" / "plan_inputs.json"
    ).is_file()
    third = run_advise(
        AdviseRequest(
            out_dir=tmp_path / "again", replan=tmp_path / "again", device_memory_gib=1.0, global_batch="64"
        )
    )
    assert third.recommendation["scaling_table"] == second["scaling_table"]


def test_a_replan_answers_for_another_target_batch_and_amount(monkeypatch, tmp_path, tiny_model, synth_data):
    from advisor.stages.advise import AdviseRequest, run_advise

    run = advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64")
    _no_measuring(monkeypatch)
    other = run_advise(
        AdviseRequest(
            out_dir=tmp_path / "h100",
            replan=tmp_path / "out",
            gpus_per_node=8,
            target_gpu="h100-80gb",
            preset="dgx-h100",
            global_batch="1024",
            epochs=3,
            gpu_hour_price=2.0,
            max_nodes=32,
        )
    ).recommendation
    table = pd.DataFrame(other["scaling_table"])
    assert (table["status"] == "ok").all() and (table["global_batch"] == 1024).all()
    assert other["gpus_per_node"] == 8 and "h100-80gb" in other["provenance"]["device_memory"]
    assert other["time_to_train"]["cost"] == pytest.approx(2.0 * other["time_to_train"]["gpu_hours"])
    assert other["time_to_train"]["samples"] == 3 * run.recommendation["time_to_train"]["samples_per_epoch"]
    assert (
        "DGX H100" in other["network"]
        and "assumed (preset dgx-h100)" in other["provenance"]["inter_node_link"]
    )


def test_a_replan_refuses_what_it_cannot_answer_in_one_line(monkeypatch, tmp_path, tiny_model, synth_data):
    from advisor.stages.advise import AdviseRequest, run_advise

    advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data)
    _no_measuring(monkeypatch)
    out = tmp_path / "out"
    other_config = tmp_path / "other.json"
    base = json.loads((tmp_path / "base.json").read_text())
    other_config.write_text(json.dumps(base | {"gradient_clipping": 0.5}))
    cases = [
        ({"deepspeed_config": other_config}, "another base config (gradient_clipping differ)"),
        ({"train_args": ("--resolution", "64")}, "--train-args"),
        ({"hostfile": tmp_path / "hosts"}, "--hostfile"),
        ({"budget_minutes": 3.0}, "--budget-minutes"),
        ({"data": tmp_path}, "--samples N"),
        ({"gpus_per_node": 8}, "--device-memory-gib"),
    ]
    for options, words in cases:
        with pytest.raises(UserError, match=None) as err:
            run_advise(
                AdviseRequest(
                    out_dir=tmp_path / "r",
                    replan=out,
                    device_memory_gib=None if "gpus_per_node" in options else 1.0,
                    **options,
                )
            )
        message = str(err.value)
        assert words in message and "\n" not in message, (options, message)
    (out / "plan_inputs.json").unlink()
    with pytest.raises(UserError, match="no plan_inputs.json"):
        run_advise(AdviseRequest(out_dir=tmp_path / "r", replan=out, device_memory_gib=1.0))


def test_the_out_folder_is_refused_while_another_live_run_holds_it(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    """advise takes the trainer's one-live-run lock on --out (issue #27)."""
    import subprocess
    import sys

    out = tmp_path / "out"
    out.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from sdzero.checkpoint.output_lock import claim_output_dir; "
            f"claim_output_dir({str(out)!r}); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="in use by a live run"):
            advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data)
    finally:
        holder.kill()
        holder.wait()
    advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data)  # free again: it runs


def one_launch_with_halves() -> dict:
    """launches.json's record of one launch whose config ran 1.0, 1.0 s in its first rounds and 1.1, 1.1 s
    in its last: its two halves are the run's noise floor."""
    return {
        "name": "z1",
        "folder": "",
        "configs": [],
        "status": "ok",
        "wall_s": 1.0,
        "startup_s": 0.0,
        "steps_s": 1.0,
        "timed_s": 1.0,
        "timed_steps": 4,
        "tie_s": None,
        "others_cpu_share": None,
        "round_medians_s": {"mb1-ga1": [1.0, 1.0, 1.1, 1.1]},
    }


def test_the_held_out_error_stands_beside_the_runs_noise_floor(monkeypatch, tmp_path, tiny_model, synth_data):
    from advisor.report.terminal import error_line
    from advisor.stats import MEAN_ABS_TO_SIGMA

    # no launch of the replayed trials left repeats: no floor, and the line says none
    rec = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64"
    ).recommendation
    assert rec["noise_floor"] is None and "noise floor" not in error_line(rec)
    # one launch whose config ran 1.0, 1.0 s in its first rounds and 1.1, 1.1 s in its last: its halves
    launch = one_launch_with_halves()
    (tmp_path / "out" / "launches.json").write_text(json.dumps({"setup": "s", "launches": [launch]}))
    logs = [math.log(v) for v in (1.0, 1.1)]
    floor = math.sqrt(sum((v - sum(logs) / 2) ** 2 for v in logs) / 1) / MEAN_ABS_TO_SIGMA
    rec = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64"
    ).recommendation
    assert rec["noise_floor"] == pytest.approx(floor) and rec["error"]["trials"] > 0
    assert f"(this machine's noise floor {floor:.1%})" in error_line(rec)


def test_a_replan_into_another_folder_keeps_the_runs_noise_floor(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    """The launches' halves are the run's noise floor: a replan into another --out carries them over, so its
    intervals keep the drift (without them it said "no noise floor measured" and narrowed every range)."""
    from advisor.stages.advise import AdviseRequest, run_advise

    launch = one_launch_with_halves()
    advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64"
    )  # sdzero's folder
    (tmp_path / "out" / "launches.json").write_text(json.dumps({"setup": "s", "launches": [launch]}))
    run = advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64")
    assert run.recommendation["noise_floor"] is not None
    _no_measuring(monkeypatch)
    again = run_advise(
        AdviseRequest(
            max_nodes=32,
            out_dir=tmp_path / "again",
            replan=tmp_path / "out",
            device_memory_gib=1.0,
            global_batch="64",
        )
    )
    assert again.recommendation["noise_floor"] == run.recommendation["noise_floor"]
    assert again.recommendation["intervals"] == run.recommendation["intervals"]
    assert (tmp_path / "again" / "launches.json").is_file()
