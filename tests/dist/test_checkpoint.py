"""Checkpoints under the real `deepspeed` launcher (2 ranks, gloo, CPU): exact resume, crash-safe commits,
fallback from damaged checkpoints, preemption, export, EMA and validation.

fp32 with torch's AdamW, so that a resumed run can be compared with an uninterrupted one bit for bit
(see ckpt_helpers.TORCH_ADAMW for why not DeepSpeed's CPU Adam).

Launches are the cost here (~10-15 s of start-up each on 2 cores), so the module makes few and several
tests read each: per stage an uninterrupted reference (also read for export, EMA and validation), and one resume of a
copy of its checkpoints whose newest is damaged (the fallback and the exact resume, proven by one run);
and one ZeRO-3 bf16 life (killed mid-commit, a refused resume, resumed and preempted by SIGTERM, resumed again
with other safe options and exported) for the crash, preemption and export tests.
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
from launch import metrics, write_config
from payloads import plant_in_torch_file, reseal
from PIL import Image
from safetensors.torch import load_file
from support.fault_callbacks import KILL_BEFORE_COMMIT, fault_env

from sdzero.checkpoint import checkpointer as ck
from sdzero.checkpoint.export import consolidated_weights
from sdzero.models.ema import assemble

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

    def resumed(stage: int) -> tuple[Path, str, Path]:
        """A copy of the reference's checkpoints (4 and 8) with step 8 damaged (ZeRO-2: a shard truncated,
        ZeRO-3: one deleted), resumed with --resume auto to step 8: it falls back to step 4 and continues.

        Step 4 of the reference is exactly what a run stopped after step 4 would have left (the same state,
        the same save), so this one launch proves the fallback and the exact resume both. Returns the
        folder, the log and the damaged file."""
        key = f"resumed{stage}"
        if key not in made:
            out = base / key
            shutil.copytree(ck.checkpoint_root(reference(stage)), ck.checkpoint_root(out))
            shard = step_dir(out, 8) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
            if stage == 2:
                with open(shard, "r+b") as f:
                    f.truncate(shard.stat().st_size // 2)
            else:
                shard.unlink()
            made[key], made[key + "_shard"] = out, shard
            made[key + "_log"] = Path(f"{out}.resume.log")
            made[key + "_log"].write_text(
                ok(launch(out, stage, "--checkpoint-every", "4", *EMA, "--resume", "auto", steps=8))
            )
        return made[key], made[key + "_log"].read_text(), made[key + "_shard"]

    def life() -> dict:
        """One ZeRO-3 bf16 run's life in one folder, what each launch left recorded as it happened:
        A: killed after step 4's shards were written, before its commit (checkpoints every 2);
        refused: a resume under another micro-batch and prediction type;
        B: resumed, then SIGTERM to rank 1 alone at a random step, saved there and exited;
        C: resumed with other safe options (cadence, validation, --export-final) for 2 steps."""
        if "life" in made:
            return made["life"]
        import json

        from launch import CONFIGS

        bf16 = json.loads((CONFIGS / "zero3_bf16.json").read_text())
        config = write_config(base / "zero3_bf16.json", bf16)
        smaller = write_config(base / "micro2.json", {**bf16, "train_micro_batch_size_per_gpu": 2})
        out = base / "life"
        root = ck.checkpoint_root(out)
        staging = root / f"{ck.STAGING_PREFIX}{ck.step_tag(4)}"

        def go(cfg: Path, *extra: str, steps: int, env=None):
            return run(cfg, tiny_model, synth_data, out, *EMA, *extra, steps=steps, env=env)

        rec: dict = {"out": out, "staging": staging}
        rec["killed"] = go(
            config, "--checkpoint-every", "2", steps=4, env=fault_env({KILL_BEFORE_COMMIT: "4"})
        )
        rec["after_kill"] = {
            "latest": (root / ck.LATEST).read_text(),
            "complete": [m.step for _, m in ck.complete_checkpoints(root)],
            "staged_optim": len(list(staging.glob("*optim_states.pt"))),
            "staged_manifest": (staging / ck.MANIFEST).exists(),
        }
        rec["refused"] = run(
            smaller,
            tiny_model,
            synth_data,
            out,
            "--resume",
            "auto",
            "--prediction-type",
            "v_prediction",
            steps=4,
        )
        rec["after_refusal"] = [m.step for _, m in ck.complete_checkpoints(root)]

        # B: SIGTERM after a step no earlier run reached (the old metrics file must not answer the wait).
        rec["target"] = random.randint(5, 6)
        proc = start_trainer(config, tiny_model, synth_data, out, *EMA, "--resume", "auto", steps=40)
        rank1 = rank_process(proc, 1)
        wait_for_step(out, rec["target"], proc)
        rank1.send_signal(signal.SIGTERM)  # one rank only: the agreement must carry it to rank 0
        signalled = time.monotonic()
        rec["preempted"] = finish(proc)
        rec["exit_s"] = time.monotonic() - signalled
        rec["preempted_steps"] = [r["step"] for r in metrics(out)]
        rec["after_preemption"] = {
            "latest": (root / ck.LATEST).read_text(),
            "complete": ck.complete_checkpoints(root),
            "staging_left": staging.exists(),
        }
        stopped = rec["preempted_steps"][-1]
        safe = ("--checkpoint-every", "1", *PROMPTS, "--validation-every", "3", "--export-final")
        rec["continued"] = go(config, "--resume", "auto", *safe, steps=stopped + 2)
        rec["continued_steps"] = [r["step"] for r in metrics(out)]
        made["life"] = rec
        return rec

    runs_ = type("Runs", (), {})()
    runs_.base, runs_.launch, runs_.config = base, launch, config
    runs_.reference, runs_.resumed, runs_.life = reference, resumed, life
    runs_.model, runs_.data = tiny_model, synth_data
    return runs_


def step_dir(run_dir: Path, step: int) -> Path:
    return ck.checkpoint_root(run_dir) / ck.step_tag(step)


@pytest.mark.parametrize("stage", [2, 3])
def test_resume_is_exact(runs, stage):
    ref = runs.reference(stage)
    out, log, _ = runs.resumed(stage)
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
    life = runs.life()
    code, log = life["killed"]
    assert code != 0, log[-3000:]
    # The kill came after every rank's shards were written, and before the manifest.
    assert life["after_kill"] == {
        "latest": ck.step_tag(2),
        "complete": [2],
        "staged_optim": 2,
        "staged_manifest": False,
    }
    code, log = life["preempted"]
    assert f"resumed from {step_dir(life['out'], 2)} (step 2)" in log, log[-3000:]
    assert life["preempted_steps"][0] == 3
    # The next commit moved `latest` on and cleared the interrupted save's staging folder.
    after = life["after_preemption"]
    assert after["latest"] == ck.step_tag(life["preempted_steps"][-1]) and not after["staging_left"]


@pytest.mark.parametrize("stage", [2, 3])  # ZeRO-2: a truncated shard; ZeRO-3: a deleted one
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(runs, stage):
    ref = runs.reference(stage)
    out, log, shard = runs.resumed(stage)
    assert f"checkpoint {step_dir(out, 8)} is damaged: {shard} " in log  # the bad file, by name
    assert f"resumed from {step_dir(out, 4)} (step 4)" in log
    # It continued from step 4 as if nothing had happened, and replaced the damaged step 8.
    losses_ref = {r["step"]: r["loss"] for r in metrics(ref)}
    assert [(r["step"], r["loss"]) for r in metrics(out)] == [(s, losses_ref[s]) for s in (5, 6, 7, 8)]
    manifest = ck.load_manifest(step_dir(out, 8))
    assert ck.verify_files(step_dir(out, 8), manifest) == []


def test_sigterm_saves_at_the_step_boundary_and_exits_143(runs):
    life = runs.life()
    target, out = life["target"], life["out"]
    code, log = life["preempted"]
    assert code == 143, (target, log[-4000:])
    stopped = life["preempted_steps"][-1]
    assert target <= stopped < 40, (target, stopped)
    complete = life["after_preemption"]["complete"]
    assert [m.step for _, m in complete] == [stopped, 2]  # the preemption's save, and A's step 2
    assert ck.verify_files(*complete[0]) == []
    assert f"preempted: checkpoint of step {stopped} committed" in log
    print(f"SIGTERM after step {target}: stopped at {stopped}, exit {life['exit_s']:.1f} s later")

    log = ok(life["continued"])
    assert f"resumed from {step_dir(out, stopped)} (step {stopped})" in log
    assert life["continued_steps"] == [stopped + 1, stopped + 2]


@pytest.mark.parametrize("stage", [2, 3])
def test_export_equals_the_engines_gathered_weights_and_generates(runs, stage, tmp_path):
    from diffusers import StableDiffusionPipeline
    from typer.testing import CliRunner

    from advisor.cli import app

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

    Read from the reference runs (8 steps of AdamW, EMA decay 0.9). The only difference between the stages
    is float summation order, and Adam turns that ulp-level noise in near-zero gradients into lr-sized
    steps (its update is ~lr whatever the gradient's size): the stages' final weights differ by up to
    ~2.5e-5. An EMA is a weighted average of the weights along the way, so the stages' EMAs may differ by
    about as much, and no more: allowed twice the weights' largest difference (+1e-6). A slicing error
    (a fragment averaged into the wrong place, or missed) moves values by the weights' own size, 1e-2+.
    """
    name = "diffusion_pytorch_model.safetensors"
    ema = {s: load_file(runs.reference(s) / "final" / "unet_ema" / name) for s in (2, 3)}
    final = {s: load_file(runs.reference(s) / "final" / "unet" / name) for s in (2, 3)}
    initial = load_file(tiny_model / "unet" / name)
    assert ema[2].keys() == ema[3].keys() == initial.keys()
    weights_apart = max((final[3][k] - final[2][k]).abs().max().item() for k in initial)
    assert weights_apart < 1e-3  # the premise: the stages trained the same weights
    # How far apart the stages' weights end depends on the CPU's kernels: 7.4e-6 on an Intel Xeon, 7.3e-5
    # on an AMD EPYC (both with AVX-512); the EMAs follow them.
    atol = 2 * weights_apart + 1e-6
    for key in ema[2]:
        torch.testing.assert_close(ema[3][key], ema[2][key], rtol=0, atol=atol, msg=key)
    # An average that lags the weights (8e-4 behind them on both CPUs), by several times `atol`: so the
    # comparison above tells an EMA from the weights (exporting the weights as the EMA would fail it), and
    # it has moved from the initial ones.
    assert max((ema[3][k] - final[3][k]).abs().max().item() for k in initial) > 3 * atol
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
    changing only what is safe (steps, cadence, validation, export) continues."""
    from diffusers import DiffusionPipeline
    from typer.testing import CliRunner

    from advisor.cli import app

    life = runs.life()
    out = life["out"]
    code, log = life["refused"]
    assert code == 2, log[-3000:]
    errors = [line for line in log.splitlines() if "sdzero: error:" in line]
    assert len(errors) == 1 and "Traceback" not in log, log[-3000:]
    assert (
        "micro-batch (DeepSpeed JSON) 4 -> 2" in errors[0]
        and "--prediction-type epsilon -> v_prediction" in errors[0]
    )
    assert life["after_refusal"] == [2]  # nothing written

    ok(life["continued"])  # with other cadence, validation and --export-final (the safe changes)
    result = CliRunner().invoke(app, ["export", str(out), str(tmp_path / "pipe")])
    assert result.exit_code == 0, result.output
    for folder in (tmp_path / "pipe", out / "final"):
        dtypes = {t.dtype for f in folder.rglob("*.safetensors") for t in load_file(f).values()}
        assert dtypes == {torch.float32}, folder
        pipe = DiffusionPipeline.from_pretrained(folder)  # no torch_dtype: what users try first
        image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
        assert image.shape == (32, 32, 3) and image.std() > 0


@pytest.mark.parametrize(
    ("stage", "planted"),
    [
        (2, "mp_rank_00_model_states.pt"),
        (2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        (3, "zero_pp_rank_1_mp_rank_00_model_states.pt"),  # ZeRO-3: only rank 1 loads it
    ],
)
def test_a_payload_in_a_resumed_checkpoint_never_runs(runs, stage, planted, tmp_path):
    """Issue #27 through the real launcher and DeepSpeed's own loaders: a pickle payload planted in the
    newest checkpoint (manifest resealed, so its sums match) is refused by --resume in one line, exit 2,
    on a run whose files stay as they were; under ZeRO-3, where each rank loads its own model states,
    every rank stops before DeepSpeed's loader (no rank left waiting in its collectives)."""
    out, marker = tmp_path / "handed", tmp_path / "PWNED"
    shutil.copytree(ck.checkpoint_root(runs.reference(stage)), ck.checkpoint_root(out))
    newest = step_dir(out, 8)
    plant_in_torch_file(newest / planted, marker)
    reseal(newest)
    marker.unlink(missing_ok=True)  # planting loads nothing, but be sure the marker starts absent
    root = ck.checkpoint_root(out)
    before = {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    code, output = runs.launch(out, stage, "--resume", "auto", steps=10)
    assert not marker.exists(), "the payload ran"
    assert code == 2, output[-4000:]
    refusals = [
        line for line in output.splitlines() if planted in line and "refused without running it" in line
    ]
    assert refusals, output[-4000:]
    assert "Traceback" not in output
    assert {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()} == before
