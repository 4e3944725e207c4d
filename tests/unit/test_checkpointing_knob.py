"""Gradient checkpointing as a knob of the search (issue #53, item 1): its configs in the grid and in the
same launch as those without it, its compute (the forward counted twice) and activations in the models,
weighed against micro-batch and stage, and an answer that says what it costs and allows."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
from test_advisor_model import (
    ACT_A,
    ACT_B,
    BASE,
    COMPUTE,
    NUMELS,
    SLOPE,
    ZERO,
    nets,
    replayer,
    trial,
    with_accumulation_checks,
)

from advisor.decide.checkpointing import FLAG, checkpointing_trade, with_checkpointing
from advisor.decide.ties import pick_config
from advisor.measure.grid import GridRequest, TrialSpec, plan_grid
from advisor.measure.launch import _sweep_config, group_key, launch_name
from advisor.measure.trial_table import LEGACY_COLUMNS, read_trials
from advisor.model.predict import Candidate, node_counts, predict_table
from advisor.model.prediction_error import fit_models
from advisor.model.recompute import MEASURED, MODELLED

RECOMPUTE = 0.3
"""The synthetic trials' recomputation: 30% more compute per sample with checkpointing."""
SAVED = 0.2
"""... and a fifth of the activations."""


def gc_trial(stage: int, mb: int, accum: int = 1) -> dict:
    """A trial with checkpointing: the per-sample compute x (1 + RECOMPUTE), activations x SAVED."""
    row = trial(stage, mb)
    comm = row["comm_s"]
    step = accum * (COMPUTE[stage] + SLOPE * mb * (1 + RECOMPUTE)) + comm
    act = (ACT_A + ACT_B * mb) * SAVED
    return row | {
        "trial_id": row["trial_id"] + (f"-ga{accum}" if accum > 1 else "") + "-gc",
        "checkpointing": True,
        "grad_accum": accum,
        "global_batch": mb * 2 * accum,
        "step_time_s": step,
        "samples_per_s": mb * 2 * accum / step,
        "activation_bytes": act,
        "device_peak_bytes": row["device_peak_bytes"] - row["activation_bytes"] + act,
    }


def trials_with_checkpointing() -> pd.DataFrame:
    plain = pd.DataFrame([trial(s, mb) | {"checkpointing": False} for s in (1, 2, 3) for mb in (1, 2, 4, 8)])
    plain = with_accumulation_checks(plain)
    gc = pd.DataFrame([gc_trial(s, mb) for s in (1, 2, 3) for mb in (1, 2, 4, 8)])
    return pd.concat([plain, gc], ignore_index=True)


def test_the_grid_puts_checkpointing_in_the_same_ladder_and_launch():
    plan = plan_grid(
        GridRequest(stages=(2,), precisions=("bf16",), micro_batches=(2, 8), checkpointing=(False, True)),
        {"bf16": True},
    )
    (ladder,) = plan.ladders
    assert [s.trial_id for s in ladder] == [
        "z2-bf16-mb2-off-none-r2",
        "z2-bf16-mb8-off-none-r2",
        "z2-bf16-mb2-off-none-r2-gc",
        "z2-bf16-mb8-off-none-r2-gc",
    ]
    assert {group_key(s) for s in ladder} == {group_key(ladder[0])}  # one engine: one launch
    assert {launch_name(s) for s in ladder} == {"z2-bf16-off-none-r2"}
    assert [_sweep_config(s, BASE) for s in ladder] == ["2:1", "8:1", "2:1:gc", "8:1:gc"]
    # the default grid, and every earlier folder's ids, have no checkpointing part
    assert TrialSpec(1, "bf16", 8, "none", 2).trial_id == "z1-bf16-mb8-off-none-r2"
    assert Candidate(1, "bf16", 8).config_id == "z1-bf16-mb8-off-none"
    assert Candidate(1, "bf16", 8, checkpointing=True).config_id == "z1-bf16-mb8-off-none-gc"


def test_a_trials_table_from_before_checkpointing_reads_as_configs_without_it(tmp_path: Path):
    path = tmp_path / "trials.csv"
    pd.DataFrame([{c: None for c in LEGACY_COLUMNS} | {"trial_id": "z1", "status": "ok"}]).to_csv(
        path, index=False
    )
    table = read_trials(path)
    assert list(table["checkpointing"]) == [False]


def test_recomputation_is_measured_from_trials_with_it_and_kept_out_of_the_plain_fit():
    measured_net, _ = nets()
    trials = trials_with_checkpointing()
    models = fit_models(trials, NUMELS, ZERO, measured_net)
    assert models.recompute.source == MEASURED and models.recompute.share == pytest.approx(RECOMPUTE, 1e-6)
    plain_only = fit_models(trials[~trials["checkpointing"].astype(bool)], NUMELS, ZERO, measured_net)
    # the plain configs' lines are those fitted without the checkpointed trials
    assert models.timing.compute_per_micro_s(2, "bf16", 4) == pytest.approx(
        plain_only.timing.compute_per_micro_s(2, "bf16", 4)
    )
    # the forward counted twice: the per-sample part grows by the share, the fixed part does not
    gc = models.timing.compute_per_micro_s(2, "bf16", 4, checkpointing=True)
    assert gc == pytest.approx(COMPUTE[2] + SLOPE * 4 * (1 + RECOMPUTE), rel=1e-6)
    assert models.memory.activation_bytes(4, True) == pytest.approx((ACT_A + ACT_B * 4) * SAVED)
    assert models.memory.activation_bytes(4) == pytest.approx(ACT_A + ACT_B * 4)
    # without a trial with it: the forward's share of the compute, modelled; activations as without
    timed = trials.assign(forward_s=0.01, backward_s=0.03)
    modelled = fit_models(timed[~timed["checkpointing"].astype(bool)], NUMELS, ZERO, measured_net)
    assert modelled.recompute.source == MODELLED and modelled.recompute.share == pytest.approx(0.25)
    assert modelled.memory.activation_bytes(4, True) == modelled.memory.activation_bytes(4)


def _table(usable: float) -> pd.DataFrame:
    measured_net, net = nets(gpus=2)
    models = fit_models(trials_with_checkpointing(), NUMELS, ZERO, measured_net)
    cands = [
        Candidate(s, "bf16", mb, checkpointing=gc)
        for s in (1, 2, 3)
        for mb in (1, 2, 4, 8)
        for gc in (False, True)
    ]
    return predict_table(cands, node_counts(1), models.memory, models.timing, net, usable, None), models


def test_the_search_weighs_checkpointing_against_micro_batch_and_the_answer_says_what_it_costs():
    roomy, models = _table(1e12)
    z2 = roomy[roomy["zero_stage"] == 2].set_index("config_id")
    # the memory budget that holds ZeRO-2 micro-batch 2 without checkpointing, not 4; with it, 8
    usable = float(z2.loc["z2-bf16-mb2-off-none", "mem_per_rank_bytes"]) * 1.01
    assert z2.loc["z2-bf16-mb8-off-none-gc", "mem_per_rank_bytes"] < usable
    assert z2.loc["z2-bf16-mb4-off-none", "mem_per_rank_bytes"] > usable
    tight, _ = _table(usable)
    pick = pick_config(tight[tight["feasible"].astype(bool)])
    assert pick.row["checkpointing"] and pick.row["micro_batch"] == 8
    trade = checkpointing_trade(tight, pick.row, models.recompute.share, models.recompute.source)
    assert trade["line"].startswith("+30% compute per sample (measured)")
    stage = int(pick.row["zero_stage"])
    same = tight[(tight["zero_stage"] == stage) & tight["feasible"].astype(bool) & ~tight["checkpointing"]]
    without = int(same["micro_batch"].max())
    assert without < 8
    assert f"allows micro-batch 8 where {without} fit without (ZeRO-{stage} bf16 at 1 node)" in trade["line"]
    assert trade["picked"] and with_checkpointing(("--resolution", "64"), pick.row)[-1] == FLAG
    # with room for every micro-batch, the 30% is not worth paying: the pick runs without it
    free = pick_config(roomy)
    assert not free.row["checkpointing"]
    assert with_checkpointing(("--resolution", "64"), free.row) == ("--resolution", "64")


def test_an_advise_run_measures_checkpointing_in_the_same_launch_and_picks_it_when_memory_needs_it(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    import advisor.measure.collectives_launch
    import advisor.measure.profile
    import advisor.stages.advise as advise
    import advisor.stages.measure

    full = trials_with_checkpointing().assign(wall_s=10.0).set_index("trial_id")
    launches: list[list[str]] = []
    replay = replayer(full)

    def run(specs, measure_s: float = 0.0):
        launches.append([s.trial_id for s in specs])
        return replay(specs, measure_s)

    def no_comm(*_args, **_kwargs):
        raise advisor.measure.collectives_launch.CommRunError("skipped in this test")

    monkeypatch.setattr(advisor.stages.measure, "trial_runner", lambda *_args: run)
    monkeypatch.setattr(advisor.stages.measure, "trained_numels", lambda model: NUMELS)
    monkeypatch.setattr(advisor.measure.collectives_launch, "run_comm", no_comm)
    monkeypatch.setattr(
        advisor.measure.profile,
        "device_support",
        lambda: {"device": "cpu", "count": 0, "bf16": True, "fp16": False},
    )
    zero = {"stage": 2, "reduce_bucket_size": ZERO.reduce_bucket_size, "overlap_comm": False}
    base_path = tmp_path / "base.json"
    base_path.write_text(
        json.dumps({**BASE, "zero_optimization": zero | {"stage3_param_persistence_threshold": 0}})
    )
    table, _ = _table(1e12)
    mb2 = table[table["config_id"] == "z2-bf16-mb2-off-none"]["mem_per_rank_bytes"].iloc[0]
    gib = float(mb2) * 1.01 / 0.9 / 2**30  # usable = memory x (1 - headroom 0.1)
    result = advise.run_advise(
        advise.AdviseRequest(
            model=str(tiny_model),
            data=synth_data,
            out_dir=tmp_path / "out",
            deepspeed_config=base_path,
            max_nodes=1,
            global_batch="16",
            device_memory_gib=gib,
            checkpointing="both",
        )
    )
    first = launches[0]
    assert any(t.endswith("-gc") for t in first) and any(not t.endswith("-gc") for t in first)
    rec = result.recommendation
    assert rec["config_id"].endswith("-gc") and rec["micro_batch"] == 8
    assert rec["checkpointing"]["line"].startswith("+30% compute per sample (measured)")
    assert re.search(r"allows micro-batch 8 where [12] fit without", rec["checkpointing"]["line"])
    assert f" {FLAG} " in rec["launch_command"]
    # a replan into another folder keeps the knob: the same pick from the same trials, in seconds
    again = advise.run_advise(
        advise.AdviseRequest(
            replan=tmp_path / "out",
            out_dir=tmp_path / "again",
            max_nodes=1,
            global_batch="16",
            device_memory_gib=gib,
        )
    )
    assert again.recommendation["config_id"] == rec["config_id"]
    assert again.recommendation["checkpointing"]["line"] == rec["checkpointing"]["line"]


def test_checkpointing_both_refuses_the_trainer_flag_beside_it():
    from advisor.stages.inputs import check_checkpointing
    from sdzero.errors import UserError

    check_checkpointing("both", ("--resolution", "64"))
    with pytest.raises(UserError, match="drop the trainer flag"):
        check_checkpointing("both", (FLAG,))
    with pytest.raises(UserError, match="choose off or both"):
        check_checkpointing("sometimes", ())


def test_recomputation_is_measured_per_stage_where_each_stage_ran_with_it():
    """At ZeRO-3 the recomputed forward gathers its parameters again: its share is its own, and a stage
    that ran no trial with checkpointing takes the median of the others'."""
    measured_net, _ = nets()
    trials = trials_with_checkpointing()
    z3 = (trials["zero_stage"] == 3) & trials["checkpointing"].astype(bool)
    extra = SLOPE * trials.loc[z3, "micro_batch"] * 0.5  # ZeRO-3: 80% instead of 30%
    trials.loc[z3, "step_time_s"] += extra
    no_z1 = trials[~((trials["zero_stage"] == 1) & trials["checkpointing"].astype(bool))]
    models = fit_models(no_z1, NUMELS, ZERO, measured_net)
    shares = models.recompute.by_group
    assert shares[(2, "bf16", "none")] == pytest.approx(RECOMPUTE, 1e-6)
    assert shares[(3, "bf16", "none")] == pytest.approx(RECOMPUTE + 0.5, 1e-6)
    assert (1, "bf16", "none") not in shares
    z1 = models.timing.compute_per_micro_s(1, "bf16", 4, checkpointing=True)
    median = (RECOMPUTE + RECOMPUTE + 0.5) / 2
    assert z1 == pytest.approx(COMPUTE[1] + SLOPE * 4 * (1 + median), rel=1e-6)
