"""Plans for GPU clusters the trials did not run on (issue #42): the target's compute from the model's
counted FLOPs over a declared or published rate, machine presets, plans from a profile file or a training
run's folder, and answers that withhold what they cannot know."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from rich.console import Console

from advisor.model.model_cost import count_model_cost
from advisor.model.network import MACHINES, build_network
from advisor.model.target_compute import GPU_ANCHORS, compute_basis, shape_cost
from advisor.report.terminal import print_advice
from sdzero.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "profile.yaml"


def _printed(rec, out_dir) -> str:
    console = Console(width=250, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    print_advice(rec, rec["trials_run"], rec["full_grid"], out_dir, None, console)
    return console.export_text()


# ------------------------------------------------------------------------------------- the model's FLOPs


def test_flops_are_counted_per_sample_and_grow_with_the_resolution(tiny_model):
    small = count_model_cost(tiny_model, ("--resolution", "64"))
    large = count_model_cost(tiny_model, ("--resolution", "128"))
    assert small.forward_flops > 0 and small.backward_flops > small.forward_flops  # backward: 2 products
    # 4x the pixels: convolutions grow 4x, self-attention 16x
    assert 4.0 < large.flops_per_sample / small.flops_per_sample < 16.0
    again = count_model_cost(tiny_model, ("--resolution", "64", "--gradient-checkpointing"))
    assert again.flops_per_sample == pytest.approx(small.flops_per_sample + small.forward_flops)


def test_a_published_anchor_becomes_a_rate_through_the_same_counter():
    sd2 = shape_cost("sd2-base-unet")
    assert 2.0e12 < sd2.flops_per_sample < 3.0e12  # SD2's UNet at 64x64 latents: ~0.8 TFLOP forward, x3
    cost = shape_cost("sd2-base-unet")
    basis = compute_basis("trials on a CPU", "h200", None, cost)
    assert basis.kind == "assumed" and "assumed" in basis.line and "MLPerf Training v5.0" in basis.line
    # the same shape at the anchor's rate: its published samples/s again
    assert 1 / basis.target.seconds_per_sample == pytest.approx(GPU_ANCHORS["h200"].samples_per_s_per_gpu)
    declared = compute_basis("trials on a CPU", "l40s", 400.0, cost)
    assert declared.target.seconds_per_sample == pytest.approx(cost.flops_per_sample / 400e12)
    none = compute_basis("trials on a CPU", "l40s", None, cost)
    assert none.kind == "none" and not none.timed and "--target-tflops" in none.line


def test_a_small_network_is_bound_by_its_kernel_launches_not_its_flops(tiny_model):
    from advisor.model.step_time import TimeModel
    from advisor.model.target_compute import LAUNCH_S

    cost = count_model_cost(tiny_model, ("--resolution", "64"))
    basis = compute_basis("trials on a CPU", "h100-80gb", None, cost)
    assert cost.kernels > 100 and "kernel launches" in basis.line
    model = TimeModel({}, {}, {}, target=basis.target)
    one, eight = (model.compute_per_micro_s(1, "bf16", mb) for mb in (1, 8))
    assert one == eight == pytest.approx(cost.kernels * LAUNCH_S)  # the launches bound it, not the FLOPs
    sd2 = compute_basis("trials on a CPU", "h100-80gb", None, shape_cost("sd2-base-unet"))
    big = TimeModel({}, {}, {}, target=sd2.target).compute_per_micro_s(1, "bf16", 32)
    assert big == pytest.approx(32 / GPU_ANCHORS["h100-80gb"].samples_per_s_per_gpu)  # FLOP-bound


# ------------------------------------------------------------------------------------------ the presets


def test_machine_presets_carry_their_domain_link_and_nics():
    nvl72 = MACHINES["gb200-nvl72"]
    assert nvl72.gpus_per_node == 72 and nvl72.nics_per_node == 72  # one NVLink domain is the "node"
    for name, machine in MACHINES.items():
        assert machine.source and machine.nic_kind, name
    net, notes = build_network(None, 8, "dgx-b200", gpu_target="b200")
    assert (
        net.intra.busbw_bytes_s
        > build_network(None, 8, "dgx-h100", gpu_target="h100-80gb")[0].intra.busbw_bytes_s
    )
    assert net.inter.busbw_bytes_s == pytest.approx(8 * 48e9) and "NDR" in net.inter.source
    assert any("not this machine's measurement" in n for n in notes)
    with pytest.raises(UserError, match="gb200-nvl72"):
        build_network(None, 8, "nvl73")


# ------------------------------------------------------------------------------ CPU trials, GPU target


def test_a_cpu_plan_for_h100_times_only_from_labelled_assumptions(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    from test_advisor_model import advise_on_synthetic_trials

    result = advise_on_synthetic_trials(
        monkeypatch,
        tmp_path,
        tiny_model,
        synth_data,
        gpus_per_node=8,
        target_gpu="h100-80gb",
        preset="dgx-h100",
        device_memory_gib=None,
    )
    rec = result.recommendation
    assert rec["compute_basis"]["kind"] == "assumed"
    line = rec["compute_basis"]["line"]
    assert "TFLOP per sample" in line and "FlopCounterMode" in line and "Lambda" in line
    table = pd.DataFrame(rec["scaling_table"])
    assert (table["time_to_train_s"] > 0).all() and rec["time_to_train"]["gpu_hours"] > 0
    # the intra-node link is the DGX H100's NVLink, never the CPU's shared memory
    assert "dgx-h100 NVLink" in rec["provenance"]["intra_node_link"]
    assert "compute is scaled" not in rec["provenance"]["headline"]
    assert "target compute assumed" in rec["provenance"]["headline"]
    text = _printed(rec, tmp_path / "out")
    assert "target compute assumed" in text and "GPU-h" in text


def test_a_cpu_plan_for_a_gpu_without_a_rate_says_it_cannot_time_it(
    monkeypatch, tmp_path, tiny_model, synth_data
):
    from test_advisor_model import advise_on_synthetic_trials

    result = advise_on_synthetic_trials(
        monkeypatch,
        tmp_path,
        tiny_model,
        synth_data,
        gpus_per_node=8,
        target_gpu="l40s",
        device_memory_gib=None,
    )
    rec = result.recommendation
    assert rec["compute_basis"]["kind"] == "none" and rec["timed"] is False
    assert rec["verdict"].startswith("no time, GPU-hours or node count")
    assert rec["time_to_train"] is None and rec["node_choice"]["chosen"] is None
    table = pd.DataFrame(rec["scaling_table"])
    assert table["time_to_train_s"].isna().all() and table["gpu_hours"].isna().all()
    assert table["samples_per_s"].isna().all()
    assert (table["comm_s"] > 0).all() and table["config_id"].notna().all()  # ranking and communication stay
    assert "--num_nodes" not in rec["launch_command"] and "yours to choose" in rec["launch_command"]
    text = _printed(rec, tmp_path / "out")
    assert "no time, GPU-hours or node count" in text and "--target-tflops" in text
    assert "GPU-h to train" not in text and "\nnode count:" not in text and "samples/s" not in text


# ------------------------------------------------------------------------------- plans from what you have


def _no_measuring_at_all(monkeypatch):
    """A plan from a profile or a run's folder starts no trial and no benchmark: the seconds it takes
    (bench/published_replay.py prints them) are reading and arithmetic only."""
    import advisor.measure.collectives_launch
    import advisor.stages.measure

    def refuse(*_args, **_kwargs):
        raise AssertionError("a plan from a profile measured something")

    monkeypatch.setattr(advisor.stages.measure, "trial_runner", refuse)
    monkeypatch.setattr(advisor.measure.collectives_launch, "run_comm", refuse)


def test_the_documented_example_profile_plans_one_to_n_nodes_measuring_nothing(monkeypatch, tmp_path):
    from advisor.stages.advise import AdviseRequest, run_advise

    _no_measuring_at_all(monkeypatch)
    rec = run_advise(
        AdviseRequest(
            replan=EXAMPLE, out_dir=tmp_path / "p", preset="hgx-h200", samples=1_000_000, max_nodes=16
        )
    ).recommendation
    table = pd.DataFrame(rec["scaling_table"])
    assert table["node_count"].tolist() == [1, 2, 4, 8, 16] and (table["status"] == "ok").all()
    one = table.iloc[0]
    assert one["samples_per_s"] / 8 == pytest.approx(143.5)  # the profile's own point comes back
    assert table["samples_per_s"].is_monotonic_increasing and (table["efficiency"].iloc[1:] < 1).all()
    assert rec["compute_basis"]["kind"] == "profile" and "measured" in rec["compute_basis"]["line"]
    assert (tmp_path / "p" / "report.html").is_file()


def test_a_profile_measured_across_two_nodes_gives_its_own_figure_back_there(monkeypatch, tmp_path):
    """No 1-node rate at 32 per GPU is published for Lambda's H100 cluster: its profile is the 2-node run."""
    from advisor.stages.advise import AdviseRequest, run_advise

    _no_measuring_at_all(monkeypatch)
    profile = ROOT / "bench" / "published" / "mlperf-v4.1-lambda-h100.yaml"
    rec = run_advise(
        AdviseRequest(replan=profile, out_dir=tmp_path / "l", preset="dgx-h100", samples=10**6, max_nodes=4)
    ).recommendation
    per_gpu = {r["node_count"]: r["samples_per_s"] / (8 * r["node_count"]) for r in rec["scaling_table"]}
    assert per_gpu[2] == pytest.approx(119.1)  # its own point: the fixed point subtracts the 2-node links
    assert per_gpu[4] < per_gpu[2] < per_gpu[1]
    assert "2 nodes of 8 h100-80gb GPUs" in rec["notes"][0]


def test_a_profile_without_its_fields_is_refused_in_one_line(tmp_path):
    from advisor.stages.advise import AdviseRequest, run_advise

    cases = [
        ("device: h200\nconfigs: []\n", "gpus_per_node"),
        ("device: h900\ngpus_per_node: 8\n", "h900"),
        (
            "model: sd2-base-unet\ndevice: h200\ngpus_per_node: 8\nconfigs:\n  - zero_stage: 2\n    precision: bf16\n"
            "    micro_batch: 4\n",
            "no rate",
        ),
        (
            "device: h200\ngpus_per_node: 8\nconfigs:\n  - zero_stage: 2\n    precision: bf16\n    micro_batch: 4\n"
            "    step_time_s: 0.5\n",
            "parameters",
        ),
    ]
    for i, (text, words) in enumerate(cases):
        path = tmp_path / f"p{i}.yaml"
        path.write_text(text)
        with pytest.raises(UserError) as err:
            run_advise(AdviseRequest(replan=path, out_dir=tmp_path / f"o{i}", samples=1000))
        assert words in str(err.value) and "\n" not in str(err.value), (text, str(err.value))


def test_a_training_runs_folder_plans_from_its_metrics_and_effective_config(
    monkeypatch, tmp_path, tiny_model
):
    """The files the trainer writes (sdzero.training.run_output): metrics.jsonl, ds_config.json and
    run_config.json."""
    from advisor.stages.advise import AdviseRequest, run_advise

    run = tmp_path / "run"
    run.mkdir()
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 2, "overlap_comm": True},
    }
    (run / "ds_config.json").write_text(json.dumps(config))
    (run / "run_config.json").write_text(
        json.dumps({"model": str(tiny_model), "world_size": 8, "resolution": 64})
    )
    steps = [{"step": i, "step_time_s": 3.0 if i == 0 else 0.5, "peak_mem_bytes": 2e9} for i in range(20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(s) + "\n" for s in steps))
    _no_measuring_at_all(monkeypatch)
    rec = run_advise(
        AdviseRequest(
            replan=run, out_dir=tmp_path / "plan", target_gpu="h100-80gb", preset="dgx-h100", samples=10**6
        )
    ).recommendation
    table = pd.DataFrame(rec["scaling_table"])
    first = table.iloc[0]
    assert first["global_batch"] == 128 and first["samples_per_s"] == pytest.approx(
        128 / 0.5
    )  # warm-up left out
    assert "training run" in " ".join(rec["notes"]) and rec["compute_basis"]["kind"] == "profile"
    with pytest.raises(UserError, match="--target-gpu"):
        run_advise(AdviseRequest(replan=run, out_dir=tmp_path / "again", samples=10**6))


def test_the_samples_rules_follow_their_published_pairs():
    from advisor.model.batch_growth import samples_rule

    assert samples_rule("flux").factor(8 * 256, 256) == pytest.approx(2.1)
    assert samples_rule("sd2").factor(2048, 256) == pytest.approx(2.0)
    assert samples_rule("same").factor(4096, 256) == 1.0 and samples_rule("flux").factor(128, 256) == 1.0
    with pytest.raises(UserError, match="--samples-rule"):
        samples_rule("chinchilla")
    assert math.isclose(samples_rule("flux").exponent, math.log(2.1, 8))
