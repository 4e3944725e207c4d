"""`sdzero advise --max-nodes 32` for real on the tiny default: 2 ranks through the deepspeed launcher.

One advise run (module fixture, ~70 s on 2 idle cores: the collectives benchmark and the first launch,
ZeRO-1's micro-batches and its accumulation check side by side, which runs whatever the budget; a
1-minute budget leaves no room for a second launch, whose choice tests/unit/test_stage_slopes.py
replays) serves every test here: its files, the memory model against the bytes its trials measured, and the recommended JSON trained
for 2 steps by the trainer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pandas as pd
import pytest
import typer
from launch import check_ok, metrics, run_trainer
from typer.testing import CliRunner

from advisor.commands.advise import advise_command
from advisor.model.memory import ZeroSettings, trained_numels
from sdzero.cluster.launch_command import shipped_config
from sdzero.config.lr_rule import DEFAULT_LR_SCALING
from sdzero.errors import EXIT_USER_ERROR, UserError

pytestmark = pytest.mark.dist


def cli() -> typer.Typer:
    """`advise` as sdzero.cli registers commands: a UserError is one line and exit code 2."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @functools.wraps(advise_command)
    def wrapper(*args, **kwargs):
        try:
            return advise_command(*args, **kwargs)
        except UserError as exc:
            typer.echo(f"sdzero: error: {exc}", err=True)
            raise typer.Exit(EXIT_USER_ERROR) from None

    app.command("advise")(wrapper)
    app.command("other")(lambda: None)  # two commands: typer then expects the command name
    return app


@pytest.fixture(scope="module")
def advised(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("advise") / "out"
    result = CliRunner().invoke(
        cli(), ["advise", "--max-nodes", "32", "--out", str(out), "--budget-minutes", "1"]
    )
    return {"out": out, "result": result}


def test_advise_end_to_end_writes_the_contract_files(advised):
    result, out = advised["result"], advised["out"]
    assert result.exit_code == 0, result.output + repr(result.exception)
    flat = " ".join(result.output.split())  # the terminal wraps the verdict at its width
    assert "held-out error" in flat
    assert "(the launch command and the full detail: there, or --explain)" in flat
    assert "trials on a CPU" in flat and "link assumed" in flat
    predictions = pd.read_csv(out / "predictions.csv")
    # the embedded default's fine-tune: global batch 256 at every node count, accumulating where needed
    assert sorted(predictions["node_count"].unique()) == [1, 2, 4, 8, 16, 32]
    assert set(predictions["global_batch"]) == {256} and (predictions["time_to_train_s"] > 0).all()
    parts = predictions["compute_s"] + predictions["exposed_comm_s"]
    assert ((parts - predictions["step_time_s"]).abs() < 1e-9 * predictions["step_time_s"]).all()
    rec = json.loads((out / "recommendation.json").read_text())
    assert rec["config_id"] in set(predictions["config_id"]) and rec["lr_scaling"] == DEFAULT_LR_SCALING
    assert rec["lr_factor"] == 1.0 and rec["lr"] == pytest.approx(1e-4)  # the batch did not change
    table = pd.DataFrame(rec["scaling_table"])
    assert table["node_count"].tolist() == [1, 2, 4, 8, 16, 32] and set(table["status"]) == {"ok"}
    assert rec["node_count"] == rec["node_choice"]["chosen"] and table["knee"].sum() == 1
    assert "<- recommended" in result.output and "not reachable" not in result.output
    assert result.stdout.startswith("answer: ") and "GPU-h" in result.stdout
    assert result.stdout.rstrip().splitlines()[-1].startswith("report: ")
    for chatter in ("Setting accelerator", "requires torchvision", "Writing model shards"):
        assert chatter not in result.output
    assert (out / "plan_inputs.json").is_file()
    # the launch's accumulation check, held out of the fit that predicts it
    assert rec["error"]["trials"] == len(rec["check_trials"]) == 1 and rec["leave_one_out"]["trials"] >= 3
    assert "budget: " in result.output and "start-up of" in result.output  # the plan, said up front
    assert rec["trials_run"] < rec["full_grid"] == 12  # the search measured a part of the grid
    # the detail the short answer leaves out: --explain on a replan of the same folder (measures nothing)
    explained = CliRunner().invoke(cli(), ["advise", "--max-nodes", "32", "--replan", str(out), "--explain"])
    assert explained.exit_code == 0, explained.output + repr(explained.exception)
    explained_flat = " ".join(explained.output.split())
    assert f"trials run: {rec['trials_run']} of a full grid of 12" in explained_flat
    assert "launch: deepspeed" in explained_flat and "Trials ran on a CPU" in explained_flat
    assert "assumed (preset ib-200)" in explained_flat
    validation = pd.read_csv(out / "validation.csv")
    assert validation["held_out"].any() and set(validation["quantity"]) >= {
        "step_time_s",
        "mem_per_rank_bytes",
    }
    assert (out / "comm" / "comm_fit.json").is_file() and (out / "environment.json").is_file()
    html = (out / "report.html").read_text()
    assert rec["config_id"] in html


def test_one_launch_measured_its_configs_side_by_side(advised):
    out = advised["out"]
    table = pd.read_csv(out / "profile" / "trials.csv").drop_duplicates("trial_id", keep="last")
    table = table.query("status == 'ok'")  # (a launch contended by a neighbour ran again: its last)
    assert set(table["stopped_by"]) == {"launch"} and table["measured_steps"].min() >= 5
    assert table["trial_dir"].nunique() == 1  # every config of the group in one launch
    launch = json.loads((Path(table["trial_dir"].iloc[0]) / "profile.json").read_text())["launch"]
    assert launch["rounds"] >= 3 and len(launch["tie_s"]) == launch["rounds"]
    raced = launch.get("raced") or {}  # advise races: a config clearly slower per sample leaves early
    for key, rounds in launch["round_medians_s"].items():  # interleaved: every config in every round
        least = 1 if key in raced else launch["rounds"] - 2
        assert least <= len(rounds) <= launch["rounds"] - 1, key
    record = json.loads((out / "launches.json").read_text())["launches"][-1]
    assert 0 < record["startup_s"] < record["wall_s"] and record["timed_s"] > 0
    assert (table["step_s_lo"] <= table["step_time_median_s"]).all()
    assert (table["step_time_median_s"] <= table["step_s_hi"]).all()
    assert table["contended"].dtype == bool


def test_memory_model_matches_the_real_trials(advised):
    out = advised["out"]
    trials = pd.read_csv(out / "profile" / "trials.csv")
    # at the base accumulation: at accumulation 4 (the check) ZeRO-1 was measured holding about twice
    # the gradient bytes the formulas give, which the memory model does not know (docs/advisor.md)
    ok = trials[(trials["status"] == "ok") & (trials["grad_accum"] == 1)]
    assert len(ok) >= 4  # the first launch's micro-batches at least
    from advisor.measure.grid import load_base_config

    zero = ZeroSettings.from_config(load_base_config(shipped_config("zero2_bf16.json")))
    from advisor.model.memory import fit_memory_model

    model = fit_memory_model(ok, trained_numels(out / "model"), zero)
    for _, row in ok.iterrows():
        per_rank = json.loads(row["model_state_bytes_per_rank"])
        predicted = model.state_bytes(row["zero_stage"], row["precision"], row["world_size"])
        for kind, value in predicted.items():
            assert value == max(r[kind] for r in per_rank), (row["trial_id"], kind)
    assert model.notes == []  # the formulas' bytes per element, no override needed
    validation = pd.read_csv(out / "validation.csv")
    held = validation[(validation["quantity"] == "activation_bytes") & validation["held_out"]]
    assert len(held) >= len(ok)  # every config's, the check's too
    assert ((held["predicted"] / held["measured"] - 1).abs() < 0.10).all(), held


def test_recommended_config_trains_two_steps(advised, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    out = advised["out"]
    config_path = out / "recommended_ds_config.json"
    config = json.loads(config_path.read_text())
    rec = json.loads((out / "recommendation.json").read_text())
    parsed = DeepSpeedConfig(config)  # no process group: world size 1
    assert parsed.zero_optimization_stage == rec["zero_stage"]
    assert config["optimizer"]["params"]["lr"] == pytest.approx(rec["lr"])
    proc = run_trainer(config_path, out / "model", out / "data", tmp_path / "run", steps=2)
    check_ok(proc)
    assert len(metrics(tmp_path / "run")) >= 2


def test_a_global_batch_no_config_reaches_is_refused(advised, tmp_path):
    # 2 ranks per node: every global batch is even, so 3 cannot be reached (fails before any trial)
    result = CliRunner().invoke(
        cli(),
        [
            "advise",
            "--out",
            str(tmp_path / "o"),
            "--global-batch",
            "3",
            "--model",
            str(advised["out"] / "model"),
            "--data",
            str(advised["out"] / "data"),
        ],
    )
    assert result.exit_code == EXIT_USER_ERROR
    assert "--global-batch 3: no config reaches it" in result.output
    assert not (tmp_path / "o" / "profile").exists()


def test_bad_flags_are_one_line_errors(tmp_path):
    for flags, message in (
        (["--max-nodes", "0"], "--max-nodes 0"),
        (["--preset", "ib-999"], "--preset 'ib-999'"),
        (["--headroom", "1.5"], "--headroom 1.5"),
        (["--gpus-per-node", "0"], "--gpus-per-node 0"),
    ):
        result = CliRunner().invoke(cli(), ["advise", "--out", str(tmp_path / "o"), *flags])
        assert result.exit_code == EXIT_USER_ERROR, flags
        assert message in result.output and "Traceback" not in result.output
    assert not Path(tmp_path / "o").exists()
