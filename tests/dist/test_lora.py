"""LoRA under ZeRO-2 and ZeRO-3 on 2 ranks (gloo, CPU), for SD 1.x, SDXL and SD3 tiny models.

One launch per (family, stage) serves every assertion about it: 4 steps with checkpoints at 2 and 4, an
EMA of the adapters, one validation image and `--export-final`. SD 1.x trains in fp32 with torch's AdamW
(so that a resume compares bit for bit, see ckpt_helpers.TORCH_ADAMW); SDXL and SD3 in bf16. ZeRO-3 runs
with `stage3_param_persistence_threshold` 0, so that the tiny adapters are really partitioned (above the
threshold they would be kept whole on every rank, and an ungathered save would not be caught here).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from ckpt_helpers import exact_config, ok, run
from launch import CONFIGS, metrics, write_config
from lora_helpers import lora_settings, network_inputs, output_of, trained_network
from safetensors import safe_open

from sdzero.checkpoint import checkpointer as ck
from sdzero.checkpoint.adapter import ADAPTER_DIR
from sdzero.models.families import detect_family
from sdzero.models.lora import LORA_EMA_WEIGHTS, LORA_WEIGHTS, add_lora, expected_adapter

pytestmark = pytest.mark.dist

RANK = 4
STEPS = 4
CASES = [(family, stage) for family in ("sd15", "sdxl", "sd3") for stage in (2, 3)]
OPTIONS = {"sd15": ("--export-merged",), "sdxl": (), "sd3": ("--max-sequence-length", "8")}
COMMON = (
    "--lora-rank",
    str(RANK),
    "--lr",
    "1e-2",  # LoRA's B starts at zero: a large LR moves the output within 4 steps
    "--checkpoint-every",
    "2",
    "--ema-decay",
    "0.9",
    "--validation-prompts",
    "a red circle",
    "--validation-inference-steps",
    "2",
    "--export-final",
)


def config_for(family: str, stage: int, folder: Path) -> Path:
    zero3 = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    if family == "sd15":
        return write_config(
            folder / f"exact{stage}.json",
            exact_config(stage) | {"zero_optimization": {"stage": stage, **zero3}},
        )
    raw = json.loads((CONFIGS / f"zero{stage}_bf16.json").read_text())
    raw["zero_optimization"].update(zero3)
    return write_config(folder / f"bf16_{stage}.json", raw)


@pytest.fixture(scope="module")
def lora_runs(tiny_model, synth_data, tmp_path_factory):
    """(family, stage) -> (model, run folder, config), launched once on first use."""
    from sdzero.models.tiny import write_tiny_model

    models: dict[str, Path] = {"sd15": tiny_model}
    made: dict[tuple[str, int], tuple[Path, Path, Path]] = {}
    base = tmp_path_factory.mktemp("lora")

    def get(family: str, stage: int) -> tuple[Path, Path, Path]:
        if family not in models:
            models[family] = write_tiny_model(base / f"{family}-model", family=family)
        if (family, stage) not in made:
            out = base / f"{family}-zero{stage}"
            config = config_for(family, stage, base)
            ok(run(config, models[family], synth_data, out, *COMMON, *OPTIONS[family], steps=STEPS))
            made[family, stage] = (models[family], out, config)
        return made[family, stage]

    get.base = base  # type: ignore[attr-defined]
    get.data = synth_data  # type: ignore[attr-defined]
    return get


def step_dir(out: Path, step: int) -> Path:
    return ck.checkpoint_root(out) / ck.step_tag(step)


def read_adapter(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def expected_keys(model: Path) -> dict[str, int]:
    family = detect_family(str(model))
    cls = family.network_class()
    with torch.device("meta"):
        net = cls.from_config(cls.load_config(str(model), subfolder=family.subfolder))
    return expected_adapter(add_lora(net, lora_settings(RANK, family)))


@pytest.mark.parametrize(("family", "stage"), CASES)
def test_lora_run_trains_and_saves_whole_adapters(family, stage, lora_runs):
    model, out, _ = lora_runs(family, stage)
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["zero_stage"] == stage for r in rows)
    expected = expected_keys(model)
    for step in (2, 4):
        adapter = read_adapter(step_dir(out, step) / ADAPTER_DIR / LORA_WEIGHTS)
        assert len(adapter) == len(expected) > 0
        assert all(t.numel() > 0 for t in adapter.values())
        assert sum(t.numel() for t in adapter.values()) == sum(expected.values())
        # trained: LoRA's B starts at zero, so a non-zero up/B matrix is the optimizer's work. SD3's last
        # block discards its context stream, so its context query (add_q_proj) gets no gradient.
        still = sorted(k for k, t in adapter.items() if (".lora.up." in k or ".lora_B." in k) and not t.any())
        assert still == ([] if family != "sd3" else [k for k in still if "add_q_proj" in k]), still
        assert len(still) <= 1
    # Only the adapters were handed to DeepSpeed's optimizer (param_shapes: the optimizer's parameters).
    states = torch.load(
        next(step_dir(out, 4).glob("*model_states.pt")), map_location="cpu", weights_only=False
    )
    assert sum(s.numel() for group in states["param_shapes"] for s in group.values()) == sum(
        expected.values()
    )
    # The frozen base is left out of the checkpoint (it comes from --model): the module state is the adapters'.
    saved = list(states["module"])  # the adapters and the network's buffers, no base weight
    assert len([k for k in saved if ".lora_" in k]) == len(expected)
    assert not [k for k in saved if "base_layer" in k or k.endswith((".to_q.weight", "conv_in.weight"))], (
        saved
    )
    assert not states.get("frozen_param_fragments")
    # The EMA holds the adapters only, and its export loads; validation sampled the LoRA network.
    assert (out / "final" / LORA_EMA_WEIGHTS).is_file()
    assert len(list((out / "validation").rglob("*.png"))) == 1


@pytest.mark.parametrize(("family", "stage"), CASES)
def test_export_loads_with_load_lora_weights_and_reproduces_the_trained_network(family, stage, lora_runs):
    model, out, _ = lora_runs(family, stage)
    fam = detect_family(str(model))
    pipe = fam.pipeline_class().from_pretrained(model)
    base_net = getattr(pipe, fam.network_attr)
    inputs = network_inputs(base_net, fam)
    before = output_of(base_net, inputs)
    pipe.load_lora_weights(out / "final")
    loaded = output_of(getattr(pipe, fam.network_attr), inputs)
    trained = output_of(trained_network(model, step_dir(out, 4), stage, RANK), inputs)
    moved = (trained - before).abs().max().item()
    assert moved > 1e-3, "the adapter changed nothing"
    # bf16 runs export bf16 adapters; the reference is DeepSpeed's fp32 master copy
    tol = 1e-5 if family == "sd15" else 2e-2 * max(trained.abs().max().item(), 1.0)
    torch.testing.assert_close(loaded, trained, rtol=0, atol=tol)
    assert (loaded - trained).abs().max().item() < 0.1 * moved


@pytest.mark.parametrize("stage", [2, 3])
def test_the_merged_export_is_the_trained_network(stage, lora_runs):
    """--export-merged: a plain pipeline (no adapter) whose UNet computes what the trained network does."""
    model, out, _ = lora_runs("sd15", stage)
    fam = detect_family(str(model))
    merged = fam.pipeline_class().from_pretrained(out / "final" / "merged")
    net = getattr(merged, fam.network_attr)
    assert not any(".lora_" in n for n, _ in net.named_parameters())
    inputs = network_inputs(net, fam)
    trained = output_of(trained_network(model, step_dir(out, 4), stage, RANK), inputs)
    torch.testing.assert_close(output_of(net, inputs), trained, rtol=0, atol=1e-4)


def test_sdzero_export_of_a_lora_checkpoint_writes_the_adapter(lora_runs, tmp_path):
    from sdzero.checkpoint.export import export_checkpoint

    model, out, _ = lora_runs("sd15", 3)
    result = export_checkpoint(out, tmp_path / "exported")
    assert result.step == STEPS and result.with_ema
    exported = read_adapter(tmp_path / "exported" / LORA_WEIGHTS)
    final = read_adapter(out / "final" / LORA_WEIGHTS)
    assert exported.keys() == final.keys()
    assert all(torch.equal(exported[k], final[k]) for k in final)
    fam = detect_family(str(model))
    pipe = fam.pipeline_class().from_pretrained(model)
    pipe.load_lora_weights(tmp_path / "exported", weight_name=LORA_EMA_WEIGHTS)  # the EMA's adapter loads


def test_sdzero_export_merged_of_a_lora_checkpoint_is_the_trained_network(lora_runs, tmp_path):
    """`sdzero export --merged`: the checkpoint's adapter fused into the base, a plain pipeline (and the EMA's
    as unet_ema) whose UNet computes what the trained network does; never written over a user's folder."""
    from typer.testing import CliRunner

    from sdzero.checkpoint.lora_export import export_merged
    from sdzero.cli import app
    from sdzero.config.output_folder import EXPORT_MARKER
    from sdzero.errors import UserError

    model, out, _ = lora_runs("sd15", 3)
    exported = tmp_path / "merged"
    result = CliRunner().invoke(app, ["export", str(out), str(exported), "--merged"])
    assert result.exit_code == 0, result.output
    assert (exported / EXPORT_MARKER).is_file() and (exported / "unet_ema").is_dir()
    fam = detect_family(str(model))
    net = getattr(fam.pipeline_class().from_pretrained(exported), fam.network_attr)
    assert not any(".lora_" in n for n, _ in net.named_parameters())
    inputs = network_inputs(net, fam)
    trained = output_of(trained_network(model, step_dir(out, STEPS), 3, RANK), inputs)
    torch.testing.assert_close(output_of(net, inputs), trained, rtol=0, atol=1e-4)
    base = fam.network_class().from_pretrained(str(model), subfolder=fam.subfolder).eval()
    assert (output_of(base, inputs) - trained).abs().max().item() > 1e-3  # the adapter is really in it
    user = tmp_path / "mine"
    user.mkdir()
    (user / "notes.txt").write_text("keep")
    with pytest.raises(UserError, match="is not a pipeline sdzero exported"):
        export_merged(out, user, overwrite=True)
    assert (user / "notes.txt").read_text() == "keep"


@pytest.mark.parametrize("stage", [3])
def test_resume_is_bit_exact(stage, lora_runs):
    """A copy of the reference's checkpoints without step 4, resumed: steps 3-4 repeat the uninterrupted
    run's losses and adapter bit for bit."""
    model, ref, config = lora_runs("sd15", stage)
    out = lora_runs.base / f"resumed{stage}"
    shutil.copytree(ck.checkpoint_root(ref), ck.checkpoint_root(out))
    shutil.rmtree(step_dir(out, 4))
    (ck.checkpoint_root(out) / ck.LATEST).write_text(ck.step_tag(2))
    log = ok(run(config, model, lora_runs.data, out, *COMMON, "--resume", "auto", steps=STEPS))
    assert f"resumed from {step_dir(out, 2)} (step 2)" in log
    losses = {r["step"]: r["loss"] for r in metrics(ref)}
    assert [(r["step"], r["loss"]) for r in metrics(out)] == [(s, losses[s]) for s in (3, 4)]
    a = read_adapter(step_dir(ref, 4) / ADAPTER_DIR / LORA_WEIGHTS)
    b = read_adapter(step_dir(out, 4) / ADAPTER_DIR / LORA_WEIGHTS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_elastic_resume_on_one_rank(lora_runs):
    """The ZeRO-2 run's step 2 continued on 1 rank through DeepSpeed's universal checkpoint."""
    model, ref, config = lora_runs("sd15", 2)
    out = lora_runs.base / "elastic"
    shutil.copytree(ck.checkpoint_root(ref), ck.checkpoint_root(out))
    shutil.rmtree(step_dir(out, 4))
    (ck.checkpoint_root(out) / ck.LATEST).write_text(ck.step_tag(2))
    log = ok(
        run(
            config,
            model,
            lora_runs.data,
            out,
            "--lora-rank",
            str(RANK),
            "--lr",
            "1e-2",
            "--checkpoint-every",
            "2",
            "--resume",
            "auto",
            "--resume-elastic",
            steps=STEPS,
            ranks=1,
        )
    )
    assert "2 -> 1 ranks" in log
    assert [r["step"] for r in metrics(out)] == [3, 4]
    adapter = read_adapter(step_dir(out, 4) / ADAPTER_DIR / LORA_WEIGHTS)
    assert len(adapter) == len(expected_keys(model)) and all(t.numel() for t in adapter.values())


def test_the_training_report_of_a_lora_run(lora_runs, tmp_path):
    """`sdzero report --run` renders a LoRA run: its losses, its validation image and its LoRA settings."""
    from advisor.report.build import write_training_report

    _, out, _ = lora_runs("sdxl", 2)
    page = write_training_report(out, tmp_path / "report.html").read_text()
    assert "<tr><td>lora_rank</td><td>4</td></tr>" in page
    assert "<img" in page
