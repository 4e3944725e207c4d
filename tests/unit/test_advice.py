"""The advice a team acts on: one LR rule with a cap, the node count chosen by efficiency, the global batch
held fixed unless asked, provenance labels, the refusal to predict a different target's memory blind,
the budget note and one held-out error everywhere."""

from __future__ import annotations

import inspect
import json

import pandas as pd
import pytest
from test_advisor_model import BASE, advise_on_synthetic_trials
from typer.testing import CliRunner

from advisor.decide import recommend as recommend_module
from advisor.decide.recommend import recommend
from advisor.decide.scaling_table import choose_node_count, link_provenance, options_beside, scaling_table
from sdzero.config import train_config as config_module
from sdzero.config.lr_rule import DEFAULT_LR_SCALING, MAX_LR_FACTOR, WARMUP_STEPS, choose_lr
from sdzero.config.train_config import TrainConfig, load_ds_config
from sdzero.errors import UserError

# ------------------------------------------------------------------------------------------ learning rate


def test_lr_is_capped_with_a_warning_and_a_warmup():
    issue = choose_lr(1e-4, 512, 8, "linear")  # the issue's 64x
    assert issue.uncapped_factor == 64 and issue.factor == MAX_LR_FACTOR and issue.capped
    assert issue.lr == pytest.approx(1e-4 * MAX_LR_FACTOR) and "capped" in issue.warning
    assert issue.warmup_steps == WARMUP_STEPS and "capped from x64" in issue.describe()
    gentle = choose_lr(1e-4, 32, 8, "sqrt")
    assert gentle.factor == pytest.approx(2.0) and gentle.warning is None and not gentle.capped
    same = choose_lr(1e-4, 8, 8, "linear")  # scaling only when the batch differs from the reference
    assert same.lr == 1e-4 and same.factor == 1.0 and same.warmup_steps == 0
    with pytest.raises(UserError, match="--lr-scaling"):
        choose_lr(1e-4, 8, 8, "cubic")


def test_trainer_and_advisor_share_one_rule_and_its_defaults(tmp_path):
    import advisor.commands.advise as advise_command_module
    import advisor.stages.advise as advise

    assert not hasattr(config_module, "scaled_lr") and not hasattr(recommend_module, "scaled_lr")
    assert TrainConfig.__dataclass_fields__["lr_scaling"].default == DEFAULT_LR_SCALING
    assert advise.AdviseRequest().lr_scaling == DEFAULT_LR_SCALING
    assert (
        inspect.signature(advise_command_module.advise_command).parameters["lr_scaling"].default
        == DEFAULT_LR_SCALING
    )
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(BASE))
    ds = load_ds_config(path, world_size=64)  # 4 x 1 x 64 = 256
    cfg = TrainConfig(
        deepspeed_config=path,
        model="m",
        data=tmp_path,
        output_dir=tmp_path / "o",
        lr_scaling="linear",
        lr_reference_batch=8,
    )
    with pytest.warns(UserWarning, match="capped"):
        assert cfg.effective_lr(ds) == pytest.approx(1e-4 * MAX_LR_FACTOR)


# ------------------------------------------------------------------------------------------- node choice


def _predictions(rates: dict[int, float], exposed_inter: float = 0.0) -> pd.DataFrame:
    rows = []
    for n, rate in rates.items():
        step = 64 / rate
        rows.append(
            {
                "node_count": n,
                "config_id": "z2-bf16-mb4-off-none",
                "zero_stage": 2,
                "dtype": "bf16",
                "micro_batch": 4,
                "offload": "none",
                "grad_accum": 1,
                "global_batch": 64,
                "world_size": 8 * n,
                "samples_per_s": rate,
                "step_time_s": step,
                "compute_s": step * 0.6,
                "exposed_comm_s": step * 0.4,
                "exposed_intra_s": step * 0.4 - exposed_inter,
                "exposed_inter_s": exposed_inter,
                "mem_per_rank_bytes": 1e9,
                "feasible": True,
            }
        )
    return pd.DataFrame(rows)


def test_node_count_is_the_largest_that_keeps_the_efficiency():
    # efficiency 1, 0.95, 0.85, 0.7, 0.45: the knee is at 4 nodes; 16 nodes is the fastest
    rates = {1: 100.0, 2: 190.0, 4: 340.0, 8: 560.0, 16: 720.0}
    predictions = _predictions(rates)
    table = scaling_table(predictions, [1, 2, 4, 8, 16, 32], 0.8, "preset ib-200 (x)", set())
    assert list(table["efficiency"].round(2))[:5] == [1.0, 0.95, 0.85, 0.7, 0.45]
    assert table.loc[table["node_count"] == 32, "status"].item() == "unreachable"
    assert choose_node_count(table, 0.8) == 4 and table.loc[table["knee"], "node_count"].tolist() == [4]
    assert options_beside(table) == {"fastest": 16, "most_efficient": 1, "fewest_gpu_hours": None}
    best, *_ = recommend(predictions, BASE, 1e12, "sqrt", 64)
    assert int(best["node_count"]) == 4
    best, *_ = recommend(predictions, BASE, 1e12, "sqrt", 64, min_efficiency=0.6)
    assert int(best["node_count"]) == 8
    best, *_ = recommend(predictions, BASE, 1e12, "sqrt", 64, node_count=16)  # --nodes
    assert int(best["node_count"]) == 16
    with pytest.raises(UserError, match="--nodes 32"):
        recommend(predictions, BASE, 1e12, "sqrt", 64, node_count=32)


def test_provenance_labels_name_the_source_of_each_link():
    assert link_provenance("measured, gloo, comm_fit.json") == "measured"
    assert link_provenance("preset ib-200 (nccl-tests threads)") == "assumed (preset ib-200)"
    assert (
        link_provenance("described by --inter-node-gbps/--inter-node-latency-us") == "assumed (user figure)"
    )
    table = scaling_table(
        _predictions({1: 100.0, 2: 190.0}, exposed_inter=0.3),
        [1, 2],
        0.8,
        "preset ib-200 (x)",
        {"z2-bf16-mb4-off-none"},
    )
    one, two = table["provenance"].tolist()
    assert one == "modelled from a measured config"
    assert two == "modelled from a measured config; inter-node link assumed (preset ib-200)"
    assert table["limiting_link"].tolist() == ["inter", "inter"]
    measured_link = scaling_table(_predictions({2: 190.0}), [2], 0.8, "measured, gloo", set())
    assert measured_link["provenance"].item() == "modelled, config not measured"
    assert measured_link["limiting_link"].item() == "intra"


# ---------------------------------------------------------------------------------- the whole pipeline


def test_global_batch_is_held_fixed_unless_asked(monkeypatch, tmp_path, tiny_model, synth_data):
    rec = advise_on_synthetic_trials(monkeypatch, tmp_path, tiny_model, synth_data).recommendation
    table = pd.DataFrame(rec["scaling_table"])
    larger = table["larger_batch"].astype(bool)
    reachable = table[(table["status"] == "ok") & ~larger]
    assert (reachable["global_batch"] == 8).all()  # micro 4 x accumulation 1 x 2 ranks, at every node count
    assert reachable["node_count"].tolist() == [
        1,
        2,
        4,
    ]  # 8 ranks at micro-batch 1 is the most it spreads over
    # beyond them each node count is answered at the smallest larger batch, marked so (issue #42)
    assert table.loc[larger, "node_count"].tolist() == [8, 16, 32]
    assert table.loc[larger, "global_batch"].tolist() == [16, 32, 64]
    assert (reachable["micro_batch"] * reachable["grad_accum"] * reachable["node_count"] * 2 == 8).all()
    assert rec["global_batch"] == 8 and rec["lr"] == 1e-4 and rec["lr_factor"] == 1.0
    assert "strong scaling" in rec["global_batch_rule"]
    assert "not reachable" not in rec["launch_command"] and "--lr-warmup-steps" not in rec["launch_command"]

    grown = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64"
    ).recommendation
    assert grown["global_batch"] == 64 and grown["lr_factor"] == pytest.approx(8**0.5)
    assert grown["lr"] == pytest.approx(1e-4 * 8**0.5) and "sqrt rule" in grown["launch_command"]
    config = json.loads((tmp_path / "out" / "recommended_ds_config.json").read_text())
    assert config["optimizer"]["params"]["lr"] == pytest.approx(grown["lr"])


def test_provenance_at_the_top_and_errors_that_agree(monkeypatch, tmp_path, tiny_model, synth_data):
    from advisor.model.prediction_error import error_summary
    from advisor.report.advise_page import build_advise_report
    from advisor.report.terminal import error_line

    rec = advise_on_synthetic_trials(
        monkeypatch, tmp_path, tiny_model, synth_data, global_batch="64"
    ).recommendation
    prov = rec["provenance"]
    assert prov["inter_node_link"].startswith("assumed (preset ib-200)")
    assert "Trials ran on a CPU" in prov["headline"] and prov["device_memory"].startswith("1 GiB, assumed")
    validation = pd.read_csv(tmp_path / "out" / "validation.csv")
    held = error_summary(validation)["held_out"]
    assert rec["error"]["trials"] == held["trials"] == len(rec["check_trials"]) > 0
    assert rec["error"]["step_time_mape"] == pytest.approx(held["step_time_mape"])
    figure = f"{held['step_time_mape']:.1%}"
    assert figure in error_line(rec)
    page = repr(build_advise_report(tmp_path / "out"))
    assert figure.replace("%", " %") in page  # the report's own percent format, the same figure
    assert "Leave-one-out refits" in page and "assumed (preset ib-200)" in page


def test_a_different_target_needs_its_device_memory(monkeypatch, tmp_path, tiny_model, synth_data):
    from advisor.cli import app

    with pytest.raises(UserError, match="--device-memory-gib"):
        advise_on_synthetic_trials(
            monkeypatch, tmp_path, tiny_model, synth_data, gpus_per_node=8, device_memory_gib=None
        )
    assert not (tmp_path / "out" / "recommendation.json").exists()  # refused before anything ran
    result = CliRunner().invoke(app, ["advise", "--gpus-per-node", "8", "--out", str(tmp_path / "cli")])
    assert result.exit_code == 2 and "--device-memory-gib" in result.output
    rec = advise_on_synthetic_trials(
        monkeypatch,
        tmp_path,
        tiny_model,
        synth_data,
        gpus_per_node=8,
        device_memory_gib=None,
        target_gpu="a100-80gb",
        global_batch="256",
    ).recommendation
    assert rec["provenance"]["target_differs"] and "a100-80gb" in rec["provenance"]["device_memory"]
    assert rec["usable_memory_bytes"] == pytest.approx(80 * 2**30 * 0.9)


def test_the_budget_note_when_the_recommended_config_was_not_measured(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    from test_advisor_model import COMPUTE

    from advisor.measure.grid import GridRequest

    # two ladders, every config 60 s of a 1-minute budget: the first launch (ZeRO-1) runs, ZeRO-2 is
    # predicted, and it is the faster one here
    monkeypatch.setitem(COMPUTE, 1, 0.4)
    ladders = GridRequest(stages=(1, 2), precisions=("bf16",), micro_batches=(1, 2, 4, 8))
    result = advise_on_synthetic_trials(
        monkeypatch,
        tmp_path,
        tiny_model,
        synth_data,
        wall_s=60.0,
        budget_minutes=1.0,
        global_batch="64",
        grid=ladders,
    )
    rec = result.recommendation
    note = rec["measured"]
    assert rec["trials_run"] == 5 and rec["config_id"].startswith("z2-")  # one launch: 4 configs, 1 check
    assert not note["recommended_config_measured"] and note["stopped_by_budget"]
    assert note["best_measured_config"].startswith("z1-") and "was not measured" in note["message"]
    assert note["suggested_budget_minutes"] >= 2
    assert rec["error"]["trials"] == 1  # the launch's accumulation check, held out of the fit
