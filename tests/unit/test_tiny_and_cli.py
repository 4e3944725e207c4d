"""The embedded default (tiny pipeline, synthetic data) and the CLI's handling of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.models.tiny import COLOURS, build_tokenizer

runner = CliRunner()


def test_tiny_model_loads_through_from_pretrained(tiny_model):
    from diffusers import StableDiffusionPipeline

    index = json.loads((tiny_model / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    for part in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (tiny_model / part).is_dir(), part
    assert not list(tiny_model.rglob("*.bin"))  # safetensors only, no pickle
    pipe = StableDiffusionPipeline.from_pretrained(tiny_model)
    assert pipe.tokenizer.model_max_length == pipe.text_encoder.config.max_position_embeddings
    image = pipe("a red circle", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3) and np.isfinite(image).all()


def test_tokenizer_has_whole_word_tokens():
    tok = build_tokenizer()
    pieces = tok.convert_ids_to_tokens(tok("a small red circle").input_ids)
    assert pieces == ["<|startoftext|>", "a</w>", "small</w>", "red</w>", "circle</w>", "<|endoftext|>"]
    # Unknown words still tokenize, character by character.
    assert len(tok("zebra").input_ids) == 2 + 5


def test_synthetic_captions_describe_their_images(synth_data):
    rows = [json.loads(line) for line in (synth_data / "metadata.jsonl").read_text().splitlines()]
    assert len(rows) == 64
    for row in rows[:16]:
        words = row["text"].split()
        fg, bg = words[2], words[-2]
        img = np.asarray(Image.open(synth_data / row["file_name"]).convert("RGB")).astype(int)
        h, w, _ = img.shape
        assert tuple(img[h // 2, w // 2]) == COLOURS[fg], row
        assert tuple(img[0, 0]) == COLOURS[bg], row


def test_cli_refuses_to_overwrite_and_writes_nothing_half(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    result = runner.invoke(app, ["tiny-model", str(out)])
    assert result.exit_code == 2
    assert "already exists and is not empty" in result.output
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp folder left behind


def test_cli_nonsense_values(tmp_path):
    result = runner.invoke(app, ["synth-data", str(tmp_path / "d"), "--images", "0"])
    assert result.exit_code == 2 and "--images must be at least 1" in result.output
    result = runner.invoke(app, ["tiny-model", str(tmp_path / "m"), "--family", "sd99"])
    assert result.exit_code == 2 and "unknown --family 'sd99'" in result.output
    result = runner.invoke(app, ["train", "--num-gpus", "0", "--", "--model", "x"])
    assert result.exit_code == 2 and "--num-gpus" in result.output
    assert not Path(tmp_path / "d").exists()


def test_train_entrypoint_reports_bad_input_in_one_line(tmp_path, capsys, monkeypatch):
    from sdzero.train import main

    monkeypatch.setenv("RANK", "0")  # as under a launcher: main leaves this process's environment alone

    code = main(
        [
            "--deepspeed_config",
            str(tmp_path / "missing.json"),
            "--model",
            "m",
            "--data",
            str(tmp_path),
            "--output-dir",
            str(tmp_path / "o"),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        f"sdzero: error: --deepspeed_config {tmp_path / 'missing.json'}: no such file; pick one of ds_configs/*.json"
    ]


def test_advisor_commands_report_bad_input_through_the_cli(tmp_path):
    result = runner.invoke(app, ["report", "--run", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "--run" in result.output and "no such folder" in result.output
    result = runner.invoke(app, ["comm", "--ranks", "0", "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "sdzero: error:" in result.output


def test_an_error_every_rank_agreed_on_is_reported_once_without_the_wait(tmp_path):
    """AgreedError (one collective verdict, e.g. the storage check): rank 0 prints, both leave together
    at once; rank 1 does not sit out the grace it would give an error of its own."""
    import subprocess
    import sys

    script = (
        "import sys, torch.distributed as dist; from sdzero.errors import AgreedError; "
        "from sdzero.train import report_user_error; rank = int(sys.argv[1]); "
        "dist.init_process_group('gloo', init_method='file://' + sys.argv[2], rank=rank, world_size=2); "
        "report_user_error(AgreedError('node n2 does not see --output-dir'), rank, grace_s=600)"
    )
    store = str(tmp_path / "store")
    ranks = [
        subprocess.Popen([sys.executable, "-c", script, str(r), store], stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    errs = [p.communicate(timeout=120)[1] for p in ranks]  # a 600 s grace would overrun this
    assert [p.returncode for p in ranks] == [0, 0]
    assert "sdzero: error: node n2 does not see --output-dir" in errs[0] and "error" not in errs[1]


def test_a_bad_input_on_another_rank_waits_for_rank_0_then_names_its_rank(tmp_path):
    """The launcher kills every rank once one exits non-zero: rank 1 must not beat rank 0's message."""
    import signal
    import subprocess
    import sys
    import time

    # A SIGTERM handler that ignores the signal stands for the trainer's preemption flag.
    script = (
        "import signal, sys; from sdzero.errors import UserError; from sdzero.train import report_user_error; "
        "signal.signal(signal.SIGTERM, lambda *_: None); print('ready', flush=True); "
        "report_user_error(UserError('bad batch'), int(sys.argv[1]), grace_s=float(sys.argv[2]))"
    )
    rank0 = subprocess.run(
        [sys.executable, "-c", script, "0", "30"], capture_output=True, text=True, timeout=60
    )
    assert rank0.stderr == "sdzero: error: bad batch\n"  # at once: the grace is not rank 0's
    alone = subprocess.run(
        [sys.executable, "-c", script, "1", "0.2"], capture_output=True, text=True, timeout=60
    )
    assert alone.stderr == "sdzero: error: rank 1: bad batch\n"  # rank 0 did not find it: rank 1 says so
    # Rank 0 found it too, so the launcher SIGTERMs rank 1 during its wait: it dies silently.
    waiting = subprocess.Popen(
        [sys.executable, "-c", script, "1", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert waiting.stdout.readline() == "ready\n"
    time.sleep(0.5)  # into the wait
    waiting.send_signal(signal.SIGTERM)
    _, err = waiting.communicate(timeout=30)
    assert waiting.returncode == -signal.SIGTERM and "error" not in err
