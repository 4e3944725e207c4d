"""Checkpoints under the real `deepspeed` launcher (2 ranks, gloo, CPU): exact resume, crash-safe commits,
fallback from damaged checkpoints, preemption, export, EMA and validation.

fp32 with torch's AdamW, so that a resumed run can be compared with an uninterrupted one bit for bit
(see ckpt_helpers.TORCH_ADAMW for why not DeepSpeed's CPU Adam).
"""

from __future__ import annotations

import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
from ckpt_helpers import (
    assert_same_state,
    exact_config,
    finish,
    ok,
    rank_process,
    run,
    start_trainer,
    tensors_in,
    wait_for_step,
    zero_optimizer_states,
)
from launch import fp32_config, metrics, write_config
from PIL import Image
from safetensors.torch import load_file

from sdzero import checkpoint as ck
from sdzero.ema import assemble
from sdzero.export import consolidated_weights

pytestmark = pytest.mark.dist

EMA = ("--ema-decay", "0.9")
PROMPTS = ("--validation-prompts", "a red circle", "a large blue square", "--validation-inference-steps", "2")


@pytest.fixture(scope="module")
def runs(tiny_model, synth_data, tmp_path_factory):
    """Launches that several tests share, each made once (one costs ~20-30 s on 2 cores)."""
    made: dict[str, Path] = {}
    base = tmp_path_factory.mktemp("ckpt")

    def config(stage: int) -> Path:
        return write_config(base / f"zero{stage}.json", exact_config(stage))

    def launch(out: Path, stage: int, *extra: str, steps: int, env=None):
        return run(config(stage), tiny_model, synth_data, out, *extra, steps=steps, env=env)

    def reference(stage: int) -> Path:
        """8 uninterrupted steps: checkpoints at 4 and 8, EMA, validation at 4 and 8, --export-final."""
        key = f"ref{stage}"
        if key not in made:
            out = base / key
            ok(
                launch(
                    out,
                    stage,
                    "--checkpoint-every",
                    "4",
                    *EMA,
                    *PROMPTS,
                    "--validation-every",
                    "4",
                    "--export-final",
                    steps=8,
                )
            )
            made[key] = out
        return made[key]

    def resumed(stage: int) -> tuple[Path, str]:
        """Run B: 4 steps and a checkpoint; then a new launch resumes it (--resume auto) to step 8."""
        key = f"resumed{stage}"
        if key not in made:
            out = base / key
            ok(launch(out, stage, "--checkpoint-every", "4", *EMA, steps=4))
            made[key] = out
            made[key + "_log"] = Path(f"{out}.resume.log")
            made[key + "_log"].write_text(
                ok(launch(out, stage, "--checkpoint-every", "4", *EMA, "--resume", "auto", steps=8))
            )
        return made[key], made[key + "_log"].read_text()

    def sgd_ema(stage: int) -> Path:
        """4 steps of SGD with momentum, EMA, --export-final (see test_ema_at_zero3_equals_ema_at_zero2)."""
        key = f"sgd{stage}"
        if key not in made:
            out = base / key
            sgd = fp32_config(stage, optimizer={"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}})
            ok(
                run(
                    write_config(base / f"{key}.json", sgd),
                    tiny_model,
                    synth_data,
                    out,
                    *EMA,
                    "--export-final",
                    steps=4,
                )
            )
            made[key] = out
        return made[key]

    runs_ = type("Runs", (), {})()
    runs_.base, runs_.launch, runs_.config = base, launch, config
    runs_.reference, runs_.resumed, runs_.sgd_ema = reference, resumed, sgd_ema
    runs_.model, runs_.data = tiny_model, synth_data
    return runs_


def step_dir(run_dir: Path, step: int) -> Path:
    return ck.checkpoint_root(run_dir) / ck.step_tag(step)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_exact(runs, stage):
    ref = runs.reference(stage)
    out, log = runs.resumed(stage)
    assert f"resumed from {step_dir(out, 4)} (step 4)" in log
    losses_ref = {r["step"]: r["loss"] for r in metrics(ref)}
    resumed_rows = metrics(out)
    assert [r["step"] for r in resumed_rows] == [5, 6, 7, 8]
    assert [r["loss"] for r in resumed_rows] == [losses_ref[s] for s in (5, 6, 7, 8)]  # identical floats

    a, b = step_dir(ref, 8), step_dir(out, 8)
    weights_a, weights_b = consolidated_weights(a, stage), consolidated_weights(b, stage)
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    at_4 = consolidated_weights(step_dir(ref, 4), stage)
    assert any(not torch.equal(at_4[k], weights_a[k]) for k in at_4)  # steps 5-8 changed the weights

    optim_a, optim_b = zero_optimizer_states(a), zero_optimizer_states(b)
    assert len(optim_a) == 2 and tensors_in(optim_a) >= 6  # per rank: fp32 partition, exp_avg, exp_avg_sq
    assert_same_state(optim_a, optim_b)
    ema_a, ema_b = assemble(a / ck.EMA_DIR), assemble(b / ck.EMA_DIR)
    assert ema_a[1] == ema_b[1] == 8
    assert all(torch.equal(ema_a[0][k], ema_b[0][k]) for k in ema_a[0])


def test_kill_between_shard_writes_and_commit_keeps_latest_on_the_previous_checkpoint(runs):
    out = runs.base / "killed"
    code, log = runs.launch(out, 3, "--checkpoint-every", "2", steps=4, env={ck.KILL_HOOK: "4"})
    assert code != 0, log[-3000:]
    root = ck.checkpoint_root(out)
    assert (root / ck.LATEST).read_text() == ck.step_tag(2)
    assert [m.step for _, m in ck.complete_checkpoints(root)] == [2]
    staging = root / f"{ck.STAGING_PREFIX}{ck.step_tag(4)}"
    # The kill came after every rank's shards were written, and before the manifest.
    assert len(list(staging.glob("*optim_states.pt"))) == 2 and not (staging / ck.MANIFEST).exists()

    log = ok(runs.launch(out, 3, "--checkpoint-every", "2", "--resume", "auto", steps=4))
    assert f"resumed from {step_dir(out, 2)} (step 2)" in log
    assert [r["step"] for r in metrics(out)] == [3, 4]
    assert (root / ck.LATEST).read_text() == ck.step_tag(4)
    assert [m.step for _, m in ck.complete_checkpoints(root)] == [4, 2] and not staging.exists()


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(runs, damage):
    ref = runs.reference(2)
    out = runs.base / f"damaged_{damage}"
    shutil.copytree(ck.checkpoint_root(ref), ck.checkpoint_root(out))
    shard = step_dir(out, 8) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    if damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
    else:
        shard.unlink()
    log = ok(runs.launch(out, 2, "--checkpoint-every", "4", *EMA, "--resume", "auto", steps=8))
    assert f"checkpoint {step_dir(out, 8)} is damaged: {shard} " in log  # the bad file, by name
    assert f"resumed from {step_dir(out, 4)} (step 4)" in log
    # It continued from step 4 as if nothing had happened, and replaced the damaged step 8.
    losses_ref = {r["step"]: r["loss"] for r in metrics(ref)}
    assert [(r["step"], r["loss"]) for r in metrics(out)] == [(s, losses_ref[s]) for s in (5, 6, 7, 8)]
    manifest = ck.load_manifest(step_dir(out, 8))
    assert ck.verify_files(step_dir(out, 8), manifest) == []


def test_sigterm_saves_at_the_step_boundary_and_exits_143(runs):
    out = runs.base / "preempted"
    target = random.randint(2, 4)
    proc = start_trainer(runs.config(2), runs.model, runs.data, out, *EMA, steps=40)
    rank1 = rank_process(proc, 1)
    wait_for_step(out, target, proc)
    rank1.send_signal(signal.SIGTERM)  # one rank only: the agreement must carry it to rank 0
    signalled = time.monotonic()
    code, log = finish(proc)
    assert code == 143, (target, log[-4000:])
    stopped = metrics(out)[-1]["step"]
    assert target <= stopped < 40, (target, stopped)
    complete = ck.complete_checkpoints(ck.checkpoint_root(out))
    assert [m.step for _, m in complete] == [stopped]
    assert ck.verify_files(*complete[0]) == []
    assert f"preempted: checkpoint of step {stopped} committed" in log
    print(
        f"SIGTERM after step {target}: stopped at {stopped}, exit {time.monotonic() - signalled:.1f} s later"
    )

    log = ok(runs.launch(out, 2, *EMA, "--resume", "auto", steps=stopped + 2))
    assert f"resumed from {step_dir(out, stopped)} (step {stopped})" in log
    assert [r["step"] for r in metrics(out)] == [stopped + 1, stopped + 2]


@pytest.mark.parametrize("stage", [2, 3])
def test_export_equals_the_engines_gathered_weights_and_generates(runs, stage, tmp_path):
    from diffusers import StableDiffusionPipeline
    from typer.testing import CliRunner

    from sdzero.cli import app

    ref = runs.reference(stage)
    result = CliRunner().invoke(app, ["export", str(ref), str(tmp_path / "pipe")])  # the run's newest
    assert result.exit_code == 0, result.output
    assert f"exported step 8 of {step_dir(ref, 8)}" in result.output
    for part in ("unet", "unet_ema"):
        exported = load_file(tmp_path / "pipe" / part / "diffusion_pytorch_model.safetensors")
        # `final` was written at the end of training from the live engine (a ZeRO-3 gather at stage 3).
        engine = load_file(ref / "final" / part / "diffusion_pytorch_model.safetensors")
        assert exported.keys() == engine.keys()
        assert all(torch.equal(exported[k], engine[k]) for k in engine), part
    assert not list((tmp_path / "pipe").rglob("*.bin")) and not list((tmp_path / "pipe").rglob("*.pt"))
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "pipe")
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3) and image.std() > 0


def test_ema_at_zero3_equals_ema_at_zero2(runs, tiny_model):
    """Same seed, fp32: the stages slice the EMA completely differently (ZeRO-2: pieces of flat buckets,
    ZeRO-3: per-parameter partitions), yet must agree to the precision the weights themselves agree.

    Tolerance rtol 1e-5, atol 1e-6, as for the trajectories in test_train: the only difference between the
    stages is float summation order. SGD with momentum, because Adam turns that ulp-level noise in
    near-zero gradients into lr-sized steps (its update is ~lr whatever the gradient's size): with Adam
    the stages' final weights already differ by up to 2.5e-5 after 8 steps, and so do their EMAs.
    """
    ema = {
        s: load_file(runs.sgd_ema(s) / "final" / "unet_ema" / "diffusion_pytorch_model.safetensors")
        for s in (2, 3)
    }
    final = load_file(runs.sgd_ema(3) / "final" / "unet" / "diffusion_pytorch_model.safetensors")
    initial = load_file(tiny_model / "unet" / "diffusion_pytorch_model.safetensors")
    assert ema[2].keys() == ema[3].keys() == initial.keys()
    for key in ema[2]:
        torch.testing.assert_close(ema[3][key], ema[2][key], rtol=1e-5, atol=1e-6, msg=key)
    # An average that lags the weights: neither the final weights nor the initial ones.
    assert max((ema[3][k] - final[k]).abs().max().item() for k in final) > 1e-3
    assert max((ema[3][k] - initial[k]).abs().max().item() for k in initial) > 1e-3


@pytest.mark.parametrize("stage", [2, 3])
def test_validation_writes_images(runs, stage):
    ref = runs.reference(stage)  # completing at all is the ZeRO-3 property: no rank waited forever
    for step in (4, 8):
        folder = ref / "validation" / ck.step_tag(step)
        images = sorted(folder.glob("*.png"))
        assert [p.name for p in images] == ["00_a-red-circle.png", "01_a-large-blue-square.png"]
        for path in images:
            with Image.open(path) as img:
                assert img.size == (32, 32) and img.mode == "RGB"


def test_zero3_bf16_export_loads_as_is_and_resume_refuses_what_it_cannot_continue(runs, tmp_path):
    """A ZeRO-3 bf16 run: `sdzero export` and --export-final both load with a bare from_pretrained and
    generate; a resume under another micro-batch and prediction type is refused in one line naming both;
    changing only what is safe (steps, cadence, validation) continues."""
    import json

    from diffusers import DiffusionPipeline
    from launch import CONFIGS
    from typer.testing import CliRunner

    from sdzero.cli import app

    bf16 = json.loads((CONFIGS / "zero3_bf16.json").read_text())
    config = write_config(tmp_path / "zero3_bf16.json", bf16)
    out = tmp_path / "run"
    ok(run(config, runs.model, runs.data, out, "--checkpoint-every", "2", "--export-final", steps=2))
    result = CliRunner().invoke(app, ["export", str(out), str(tmp_path / "pipe")])
    assert result.exit_code == 0, result.output
    for folder in (tmp_path / "pipe", out / "final"):
        dtypes = {t.dtype for f in folder.rglob("*.safetensors") for t in load_file(f).values()}
        assert dtypes == {torch.float32}, folder
        pipe = DiffusionPipeline.from_pretrained(folder)  # no torch_dtype: what users try first
        image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
        assert image.shape == (32, 32, 3) and image.std() > 0

    smaller = write_config(tmp_path / "micro2.json", {**bf16, "train_micro_batch_size_per_gpu": 2})
    code, log = run(
        smaller, runs.model, runs.data, out, "--resume", "auto", "--prediction-type", "v_prediction", steps=4
    )
    assert code == 2, log[-3000:]
    errors = [line for line in log.splitlines() if "sdzero: error:" in line]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert (
        "micro-batch (DeepSpeed JSON) 4 -> 2" in errors[0]
        and "--prediction-type epsilon -> v_prediction" in errors[0]
    )
    assert [m.step for _, m in ck.complete_checkpoints(ck.checkpoint_root(out))] == [2]  # nothing written

    log = ok(
        run(
            config,
            runs.model,
            runs.data,
            out,
            "--resume",
            "auto",
            "--checkpoint-every",
            "1",
            *PROMPTS,
            "--validation-every",
            "3",
            steps=3,
        )
    )
    assert f"resumed from {step_dir(out, 2)} (step 2)" in log and [r["step"] for r in metrics(out)] == [3]
