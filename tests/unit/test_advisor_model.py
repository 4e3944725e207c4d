"""The performance and memory model on synthetic trial rows: exact states, fitted activations and compute,
scaling properties, the recommendation's JSON and the search's economy."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from advisor.decide.recommend import recommend, what_would_fit
from advisor.decide.search import run_search
from advisor.measure.grid import GridRequest, plan_grid
from advisor.model.memory import ZeroSettings, fit_memory_model, state_elements
from advisor.model.network import PRESETS, build_network
from advisor.model.predict import (
    BatchTarget,
    Candidate,
    check_reachable,
    grad_accum_for,
    node_counts,
    predict_table,
)
from advisor.model.prediction_error import fit_models, mape, trial_predictions, validation_table
from sdzero.errors import UserError

RNG = np.random.default_rng(0)
NUMELS = tuple(int(k) for k in RNG.integers(10, 5000, size=60))
ZERO = ZeroSettings(reduce_bucket_size=1000, overlap_comm=False, persistence_threshold=0)
ACT_A, ACT_B = 50_000.0, 1_000_000.0
COMPUTE = {1: 0.10, 2: 0.12, 3: 0.20}
SLOPE = 0.05
COMM = {  # a comms_logger op mix per stage, as trials record it at 2 ranks
    1: {
        "all_reduce": {"count_per_step": 3, "bytes_per_step": 2 * sum(NUMELS), "seconds_per_step": 0.01},
        "all_gather_into_tensor": {
            "count_per_step": 1,
            "bytes_per_step": sum(NUMELS),
            "seconds_per_step": 0.005,
        },
    },
    2: {
        "all_reduce": {"count_per_step": 3, "bytes_per_step": 2 * sum(NUMELS), "seconds_per_step": 0.01},
        "all_gather_into_tensor": {
            "count_per_step": 1,
            "bytes_per_step": sum(NUMELS),
            "seconds_per_step": 0.005,
        },
    },
    3: {
        "all_gather_into_tensor": {
            "count_per_step": 60,
            "bytes_per_step": sum(NUMELS),
            "seconds_per_step": 0.01,
        },
        "reduce_scatter_tensor": {
            "count_per_step": 1,
            "bytes_per_step": 2 * sum(NUMELS),
            "seconds_per_step": 0.004,
        },
    },
}


def brute_force_states(numels, stage: int, n: int) -> dict[str, int]:
    """The largest rank's elements, rank by rank (the rules tests/dist/test_profile.py checks on the engine)."""
    psi = sum(numels)
    if stage == 3:
        shard = sum(math.ceil(k / n) for k in numels)
        return {"params": shard, "grads": shard, "master": shard, "optimizer": shard}
    padded = math.ceil(psi / (2 * n)) * 2 * n
    part = padded // n
    most = 0
    for rank in range(n):
        lo, hi, overlap, offset = rank * part, (rank + 1) * part, 0, 0
        for k in numels:
            if offset < hi and offset + k > lo:
                overlap += k
            offset += k
        most = max(most, overlap)
    return {"params": padded, "grads": psi if stage == 1 else most, "master": part, "optimizer": part}


def trial(stage: int, mb: int, precision: str = "bf16", world: int = 2, noise: float = 0.0, **over) -> dict:
    elements = brute_force_states(NUMELS, stage, world)
    states = {k: elements[k] * b for k, b in {"params": 2, "grads": 2, "master": 4, "optimizer": 8}.items()}
    states |= {k: over.pop(k) for k in list(over) if k in states}
    act = (ACT_A + ACT_B * mb) * (1 + noise)
    comm_s = sum(o["seconds_per_step"] for o in COMM[stage].values())
    step = COMPUTE[stage] + SLOPE * mb + comm_s
    bucket = 2 * ZERO.reduce_bucket_size
    row = {
        "trial_id": f"z{stage}-{precision}-mb{mb}-off-none-r{world}",
        "status": "ok",
        "zero_stage": stage,
        "precision": precision,
        "micro_batch": mb,
        "offload": "none",
        "ranks_per_node": world,
        "nodes": 1,
        "grad_accum": 1,
        "world_size": world,
        "global_batch": mb * world,
        "step_time_s": step,
        "samples_per_s": mb * world / step,
        "comm_s": comm_s,
        "comm_ops": json.dumps(COMM[stage]),
        **{f"{k}_bytes": v for k, v in states.items()},
        "model_state_bytes": sum(states.values()),
        "bucket_bytes": bucket,
        "frozen_bytes": 7000,
        "activation_bytes": act,
        "device_peak_bytes": sum(states.values()) + bucket + 7000 + act,
        "wall_s": 10.0,
    }
    return row | over


def grid_trials(noise: bool = True) -> pd.DataFrame:
    rows = [
        trial(s, mb, noise=(0.02 * RNG.standard_normal() if noise else 0.0))
        for s in (1, 2, 3)
        for mb in (1, 2, 4, 8)
    ]
    return pd.DataFrame(rows)


def with_accumulation_checks(trials: pd.DataFrame, accum: int = 4) -> pd.DataFrame:
    """`trials` plus each config at accumulation `accum` (the advise check trial): compute repeats per
    micro-step, the stage's collectives once per step (a synthetic rule, not the model's)."""
    rows = trials.copy()
    compute = rows["step_time_s"] - rows["comm_s"]
    rows["step_time_s"] = accum * compute + rows["comm_s"]
    rows["grad_accum"] = accum
    rows["global_batch"] = rows["global_batch"] * accum
    rows["samples_per_s"] = rows["global_batch"] / rows["step_time_s"]
    rows["trial_id"] = rows["trial_id"] + f"-ga{accum}"
    return pd.concat([trials, rows], ignore_index=True)


def nets(gpus: int = 2, preset: str = "ib-200"):
    return build_network(None, 2)[0], build_network(None, gpus, preset)[0]


# ------------------------------------------------------------------------------------------------- memory


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world", [1, 2, 3, 8, 64])
def test_state_elements_match_the_partitioning_rank_by_rank(stage, world):
    assert state_elements(NUMELS, stage, world, persistence_threshold=0) == brute_force_states(
        NUMELS, stage, world
    )


def test_zero3_keeps_small_parameters_whole_on_every_rank():
    shard = sum(math.ceil(k / 4) for k in NUMELS)
    persistent = sum(k for k in NUMELS if k < 1000)
    assert state_elements(NUMELS, 3, 4, persistence_threshold=1000)["params"] == shard + persistent


def test_memory_model_reproduces_measured_model_states_exactly():
    trials = grid_trials()
    model = fit_memory_model(trials, NUMELS, ZERO)
    for _, row in trials.iterrows():
        predicted = model.state_bytes(row["zero_stage"], row["precision"], row["world_size"])
        assert predicted == {k: row[f"{k}_bytes"] for k in ("params", "grads", "master", "optimizer")}
    assert model.notes == []


def test_bytes_per_element_the_trials_show_override_the_formula():
    # an optimizer with one moment (SGD with momentum): 4 bytes per element, not Adam's 8
    rows = [trial(2, 1, optimizer_bytes=4 * brute_force_states(NUMELS, 2, 2)["optimizer"])]
    model = fit_memory_model(pd.DataFrame(rows), NUMELS, ZERO)
    assert model.element_bytes(2, "bf16", "optimizer") == 4
    assert model.state_bytes(2, "bf16", 16)["optimizer"] == 4 * brute_force_states(NUMELS, 2, 16)["optimizer"]
    assert any("optimizer measured at 4 bytes" in note for note in model.notes)


def test_activations_within_ten_percent_on_held_out_micro_batches():
    validation = validation_table(grid_trials(noise=True), NUMELS, ZERO, nets()[0])
    held = validation[(validation["quantity"] == "activation_bytes") & validation["held_out"]]
    assert len(held) == 12
    assert ((held["predicted"] / held["measured"] - 1).abs() < 0.10).all()
    assert mape(validation, "model_state_bytes", which="leave_one_out") == 0.0


# --------------------------------------------------------------------------------------------- prediction


def test_predictions_reduce_to_the_measured_numbers_at_the_measured_node_count():
    trials = grid_trials(noise=False)
    measured_net = nets()[0]
    models = fit_models(trials, NUMELS, ZERO, measured_net)
    for _, row in trials.iterrows():
        predicted = trial_predictions(models, row, measured_net)
        assert predicted["step_time_s"] == pytest.approx(row["step_time_s"], rel=1e-9)
        assert predicted["mem_per_rank_bytes"] == pytest.approx(row["device_peak_bytes"], rel=1e-12)


def test_scaling_is_monotone_where_the_formulas_say_so():
    measured_net, target = nets(gpus=8)
    models = fit_models(grid_trials(), NUMELS, ZERO, measured_net)
    nodes = node_counts(1024)
    table = predict_table(
        [Candidate(s, "bf16", 4) for s in (1, 2, 3)], nodes, models.memory, models.timing, target, 1e12, None
    )
    psi = sum(NUMELS)
    for stage, rows in table.groupby("zero_stage"):
        mem = rows.sort_values("node_count")["mem_per_rank_bytes"].to_numpy()
        if stage == 3:  # more nodes never raise per-rank memory under ZeRO-3
            assert (np.diff(mem) <= 0).all()
        else:  # ZeRO-1/2: 16-bit params and (ZeRO-1) grads stay whole; only padding to 2N may add
            worlds = rows.sort_values("node_count")["world_size"].to_numpy()
            assert (np.diff(mem) <= 2 * 2 * worlds[1:] * 16).all()
            floor = 2 * psi + (2 * psi if stage == 1 else 0)
            assert mem.min() > floor
        comm = rows.sort_values("node_count")["exposed_comm_s"].to_numpy()
        assert (np.diff(comm) >= -1e-12).all()  # more nodes never communicate less per rank
        assert (rows["efficiency"] <= 1 + 1e-9).all()  # and never scale better than linear


@pytest.mark.parametrize(
    "args", ["--max-steps 3", "--output-dir=/tmp/x", "--deepspeed-config c.json", "--model m --resolution 64"]
)
def test_train_args_may_not_take_over_what_trials_set(args, tmp_path):
    from typer.testing import CliRunner

    from advisor.cli import app
    from advisor.stages.fine_tune import check_train_args

    with pytest.raises(UserError, match="--train-args"):
        check_train_args(args)
    result = CliRunner().invoke(app, ["advise", "--out", str(tmp_path / "o"), "--train-args", args])
    assert result.exit_code == 2 and "is set by the advisor" in result.output
    assert not (tmp_path / "o").exists()  # refused before anything is written


def test_train_args_reach_the_recommended_launch_command():
    from advisor.decide.recommend import launch_command
    from advisor.stages.fine_tune import check_train_args

    extra = check_train_args("--resolution 1024 --gradient-checkpointing")
    cmd = launch_command(Path("c.json"), "m", Path("d"), 1, 8, None, Path("run"), extra)
    assert cmd.endswith("--resolution 1024 --gradient-checkpointing")


def test_node_counts_and_bad_values():
    assert node_counts(32) == [1, 2, 4, 8, 16, 32]
    assert node_counts(48)[-2:] == [32, 48]
    assert node_counts(1024)[-1] == 1024
    with pytest.raises(UserError, match="--max-nodes 0"):
        node_counts(0)
    with pytest.raises(UserError, match="--preset"):
        build_network(None, 8, "ib-999")
    with pytest.raises(UserError, match="--global-batch"):
        BatchTarget.parse("lots")


def test_global_batch_target_picks_accumulation_and_refuses_the_unreachable():
    target = BatchTarget.parse("256")
    assert grad_accum_for(4, 16, target) == 4
    assert grad_accum_for(4, 128, target) is None  # 512 per step already
    assert grad_accum_for(4, 16, BatchTarget.parse("100-300")) == 4  # the largest inside the range
    check_reachable([1, 2, 4], 8, [1, 2, 4], BatchTarget.parse("96"))
    with pytest.raises(UserError, match="no config reaches it"):
        check_reachable([1, 2, 4], 8, [1, 2, 4], BatchTarget.parse("7"))


def test_inter_node_figures_from_flags_and_presets():
    net, _ = build_network(None, 8, inter_node_gbps=200, inter_node_latency_us=5)
    assert net.inter.busbw_bytes_s == pytest.approx(25e9) and net.inter.hop_latency_s == pytest.approx(5e-6)
    slow, fast = build_network(None, 8, "eth-25")[0], build_network(None, 8, "ib-400")[0]
    assert slow.inter.busbw_bytes_s < fast.inter.busbw_bytes_s
    assert set(PRESETS) == {"ib-100", "ib-200", "ib-400", "dgx-a100", "dgx-h100", "eth-25", "eth-100"}


# ---------------------------------------------------------------------------------------- recommendation

BASE = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
    "steps_per_print": 1000,
}


def _predictions(usable: float, target: BatchTarget | None = None) -> tuple[pd.DataFrame, object]:
    measured_net, net = nets(gpus=8)
    models = fit_models(grid_trials(), NUMELS, ZERO, measured_net)
    cands = [Candidate(s, "bf16", mb) for s in (1, 2, 3) for mb in (1, 2, 4, 8)]
    return predict_table(cands, node_counts(32), models.memory, models.timing, net, usable, target), models


def test_recommended_json_passes_deepspeed_config_parsing_with_scaled_lr():
    from deepspeed.runtime.config import DeepSpeedConfig

    table, _ = _predictions(1e12, BatchTarget.parse("1024"))
    best, config, runners, choice = recommend(table, BASE, 1e12, "sqrt", 256)
    assert int(best["global_batch"]) == 1024
    assert choice.lr == pytest.approx(1e-4 * math.sqrt(1024 / 256)) and not choice.capped
    assert config["optimizer"]["params"]["lr"] == choice.lr and "comms_logger" not in config
    assert config["gradient_accumulation_steps"] == best["grad_accum"]
    parsed = DeepSpeedConfig(json.loads(json.dumps(config)))  # no process group: world size 1
    assert parsed.zero_optimization_stage == best["zero_stage"]
    assert parsed.train_micro_batch_size_per_gpu == best["micro_batch"]
    assert runners and all(r["why_not"] for r in runners)
    assert best["samples_per_s"] >= max(r["samples_per_s"] for r in runners)


def test_memory_limit_decides_and_nothing_fitting_says_what_would():
    table, models = _predictions(1e12)
    zero3_mb8 = table[(table["config_id"] == "z3-bf16-mb8-off-none") & (table["node_count"] == 32)]
    usable = float(zero3_mb8["mem_per_rank_bytes"].iloc[0]) * 1.001
    tight, _ = _predictions(usable)
    best, _, runners, _ = recommend(tight, BASE, usable, "linear", 4)
    assert best["mem_per_rank_bytes"] <= usable
    memory_losers = [r for r in runners if r["why_not"].startswith("memory")]
    assert all(r["mem_per_rank_bytes"] > usable for r in memory_losers)
    message = what_would_fit(models.memory, [Candidate(1, "bf16", 8)], [1, 32], 8, 1000.0)
    assert "least predicted need" in message and "GiB" in message


# ------------------------------------------------------------------------------------------------- search


def test_one_micro_batch_per_stage_is_modelled_proportional_per_stage():
    """Seeds measure micro-batch 1 of each stage only: each stage keeps its own per-sample compute (a slope
    shared across stages would let a slow stage's seed pass for a fast one)."""
    trials = pd.DataFrame([trial(s, 1) for s in (1, 2, 3)])
    model = fit_models(trials, NUMELS, ZERO, nets()[0]).timing
    for stage in (1, 2, 3):
        per_sample = COMPUTE[stage] + SLOPE  # the seed's whole compute, at micro-batch 1
        assert model.compute_per_micro_s(stage, "bf16", 8) == pytest.approx(8 * per_sample, rel=1e-9)
    assert model.compute_per_micro_s(2, "fp16", 4) == pytest.approx(4 * (COMPUTE[2] + SLOPE), rel=1e-9)
    assert any("proportional" in note for note in model.notes)


def test_offload_trials_get_their_own_fixed_cost():
    """CPU offload adds a fixed optimizer cost per step; it must not leak into the configs without it."""
    plain = grid_trials(noise=False)
    offloaded = []
    for mb in (1, 4):
        row = trial(2, mb)
        extra = 0.3  # the CPU optimizer and the transfers, per step
        row |= {
            "trial_id": f"z2-bf16-mb{mb}-off-optimizer-r2",
            "offload": "optimizer",
            "step_time_s": row["step_time_s"] + extra,
        }
        offloaded.append(row)
    trials = pd.concat([plain, pd.DataFrame(offloaded)], ignore_index=True)
    models = fit_models(trials, NUMELS, ZERO, nets()[0])
    for _, row in trials.iterrows():
        predicted = trial_predictions(models, row, nets()[0])["step_time_s"]
        assert predicted == pytest.approx(row["step_time_s"], rel=1e-9)


def test_search_launches_every_group_with_every_micro_batch_and_finds_the_best():
    full = with_accumulation_checks(grid_trials(noise=False)).set_index("trial_id")
    plan = plan_grid(
        GridRequest(stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8), ranks_per_node=(2,)),
        {"bf16": True, "fp16": True},
    )
    measured_net, target = nets(gpus=2)
    result = run_search(
        plan, replayer(full), NUMELS, ZERO, measured_net, target, 32, 1e12, None, budget_s=600
    )
    checks = [f"z{s}-bf16-mb8-off-none-r2-ga4" for s in (1, 2, 3)]  # each launch's largest, at 4
    assert set(result.trials["trial_id"]) == {*grid_trials(noise=False)["trial_id"], *checks}
    best_id = full.loc[grid_trials(noise=False)["trial_id"], "samples_per_s"].idxmax()
    assert best_id in set(result.trials["trial_id"])
    assert result.check_ids == checks


def replayer(full: pd.DataFrame):
    """A trial runner answering from `full` (indexed by trial_id): the table of everything asked so far."""
    measured: list[str] = []

    def run(specs, measure_s: float = 0.0):
        measured.extend(s.trial_id for s in specs if s.trial_id not in measured)
        return full.loc[measured].reset_index()

    return run


def advise_on_synthetic_trials(
    monkeypatch,
    tmp_path: Path,
    tiny_model,
    synth_data,
    wall_s: float = 10.0,
    step_noise: float = 0.0,
    **options,
):
    """run_advise with trials answered from the synthetic grid (accumulation checks included) and no
    collectives benchmark. `step_noise`: a relative sigma of seeded noise on every trial's step time (the
    synthetic steps lie on the model's own lines, which held-out errors of zero would give intervals of
    zero width)."""
    import advisor.measure.collectives_launch
    import advisor.measure.profile
    import advisor.stages.advise as advise
    import advisor.stages.measure

    full = with_accumulation_checks(grid_trials()).assign(wall_s=wall_s)
    if step_noise:
        noisy = full["step_time_s"] * np.exp(step_noise * np.random.default_rng(7).standard_normal(len(full)))
        full = full.assign(step_time_s=noisy, samples_per_s=full["global_batch"] / noisy)
    full = full.set_index("trial_id")

    def no_comm(*_args, **_kwargs):
        raise advisor.measure.collectives_launch.CommRunError("skipped in this test")

    monkeypatch.setattr(advisor.stages.measure, "trial_runner", lambda *_args: replayer(full))
    monkeypatch.setattr(advisor.stages.measure, "trained_numels", lambda model: NUMELS)
    monkeypatch.setattr(advisor.measure.collectives_launch, "run_comm", no_comm)
    monkeypatch.setattr(
        advisor.measure.profile,
        "device_support",
        lambda: {"device": "cpu", "count": 0, "bf16": True, "fp16": False},
    )
    base = {
        **BASE,
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": ZERO.reduce_bucket_size,
            "overlap_comm": False,
            "stage3_param_persistence_threshold": 0,
        },
    }
    base_path = tmp_path / "base.json"
    base_path.write_text(json.dumps(base))
    options = {"max_nodes": 32, "device_memory_gib": 1.0} | options
    given = {"model": str(tiny_model), "data": synth_data, "out_dir": tmp_path / "out"}
    return advise.run_advise(advise.AdviseRequest(**(given | {"deepspeed_config": base_path} | options)))


def test_run_advise_writes_every_contract_file_and_the_report(monkeypatch, tmp_path, tiny_model, synth_data):
    """run_advise with trials answered from synthetic rows and no benchmark: the files the report reads."""
    from advisor.report.advise_page import build_advise_report
    from advisor.report.page import NoteItem

    result = advise_on_synthetic_trials(
        monkeypatch,
        tmp_path,
        tiny_model,
        synth_data,
        max_nodes=64,
        global_batch="512-2048",
        lr_scaling="sqrt",
    )
    rec = result.recommendation
    assert 512 <= rec["global_batch"] <= 2048 and rec["lr_scaling"] == "sqrt"
    # every group launched once: its 4 micro-batches and its accumulation check
    assert rec["trials_run"] == 15 and rec["full_grid"] == 12
    assert rec["error"]["memory_mape"] < 0.05 and rec["error"]["step_time_mape"] < 0.5
    assert any("collectives benchmark failed" in note for note in rec["notes"])
    validation = pd.read_csv(tmp_path / "out" / "validation.csv")
    accum_checks = validation[(validation["grad_accum"] == 4) & validation["check"]]
    assert accum_checks["config_id"].nunique() == 3  # each launch's check, never in the fit that predicts it
    for name in (
        "predictions.csv",
        "validation.csv",
        "recommendation.json",
        "recommended_ds_config.json",
        "trials.csv",
        "environment.json",
        "report.html",
    ):
        assert (tmp_path / "out" / name).is_file(), name
    report = build_advise_report(tmp_path / "out")
    notes = {s.key: [i.text for i in s.items if isinstance(i, NoteItem)] for s in report.sections}
    # every section the model feeds has content, not the one line that stands for an absent file
    for key in ("recommendation", "scaling", "validation"):
        assert key in notes and not notes[key], (key, notes.get(key))
    assert rec["config_id"] in repr(report)


def test_under_a_fixed_batch_a_launch_takes_the_micro_batches_some_judged_node_count_can_use():
    """Global batch 8 on 2-rank nodes: 4 nodes admit micro-batch 1 only, 1 node micro-batches 1 to 4.
    Judged at 4 nodes alone a launch measures micro-batch 1 (and its check); judged at 1, 2 and 4 nodes it
    takes every micro-batch the recommendation may choose, and never micro-batch 8, which no count uses."""
    from advisor.model.predict import BatchTarget

    full = with_accumulation_checks(grid_trials(noise=False)).set_index("trial_id")
    plan = plan_grid(
        GridRequest(stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8), ranks_per_node=(2,)),
        {"bf16": True, "fp16": True},
    )

    def searched(target_nodes):
        measured_net, target_net = nets(gpus=2)
        result = run_search(
            plan,
            replayer(full),
            NUMELS,
            ZERO,
            measured_net,
            target_net,
            target_nodes,
            1e12,
            BatchTarget(8, 8),
            budget_s=600,
        )
        return {int(m) for m in result.trials.loc[result.trials["grad_accum"] == 1, "micro_batch"]}

    assert searched(4) == {1}
    assert searched([1, 2, 4]) == {1, 2, 4}
