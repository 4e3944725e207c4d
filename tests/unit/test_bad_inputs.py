"""One clear line for every bad input (issue #27): each is handed to the real command, which must exit 2
with a single `sdzero: error:` line naming what is wrong, print no traceback, and leave nothing behind.

The trainer cases run `sdzero/train.py`'s own `main` in this process (with launcher variables set, as
under `deepspeed`, so that it changes nothing in the environment), and one of them again as a real
`python sdzero/train.py` process; the other commands run as `python -m sdzero.cli ...` processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from launch import CONFIGS

from sdzero.config.ds_json import known_optimizer
from sdzero.config.train_config import load_ds_config
from sdzero.errors import EXIT_USER_ERROR, UserError

BASE = json.loads((CONFIGS / "zero2_bf16.json").read_text())


def changed(**edits: Any) -> dict[str, Any]:
    """The shipped ZeRO-2 config with dotted keys set (`optimizer__params__lr` is optimizer.params.lr)."""
    config = json.loads(json.dumps(BASE))
    for dotted, value in edits.items():
        *parents, last = dotted.split("__")
        node = config
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return config


# (what is written to the file, a fragment the line must hold: the key, and where useful the fix)
BAD_DS_JSON = {
    "optimizer type unknown": (changed(optimizer__type="AdamWW"), '"optimizer.type" "AdamWW"'),
    "optimizer not an object": (changed(optimizer="adamw"), '"optimizer" must be an object'),
    "lr negative": (changed(optimizer__params__lr=-1e-3), '"optimizer.params.lr"'),
    "lr zero": (changed(optimizer__params__lr=0), '"optimizer.params.lr" must be a finite number > 0'),
    "lr a string": (changed(optimizer__params__lr="1e-4"), '"optimizer.params.lr"'),
    "lr true": (changed(optimizer__params__lr=True), '"optimizer.params.lr"'),
    "lr NaN": (changed(optimizer__params__lr=float("nan")), 'lr" must be a finite number > 0, got NaN'),
    "lr infinite": (changed(optimizer__params__lr=float("inf")), "got Infinity"),
    "eps negative": (changed(optimizer__params__eps=-1.0), '"optimizer.params.eps"'),
    "weight_decay a string": (changed(optimizer__params__weight_decay="x"), "weight_decay"),
    "betas one number": (changed(optimizer__params__betas=[0.9]), '"optimizer.params.betas" must be two'),
    "betas at 1": (changed(optimizer__params__betas=[0.9, 1.0]), "[0, 1)"),
    "betas strings": (changed(optimizer__params__betas=["a", 0.9]), '"optimizer.params.betas"'),
    "bf16 true": (changed(bf16=True), '"bf16" must be an object such as {"enabled": true}'),
    "fp16 enabled a string": (changed(fp16={"enabled": "yes"}), '"fp16.enabled" must be true or false'),
    "stage true": (changed(zero_optimization__stage=True), '"zero_optimization.stage"'),
    "stage a float": (changed(zero_optimization__stage=2.0), '"zero_optimization.stage"'),
    "stage a string": (changed(zero_optimization__stage="2"), "an integer"),
    "auto in a list": (changed(optimizer__params__betas=["auto", 0.999]), '"optimizer.params.betas[0]"'),
    "not UTF-8": (b'{"train_micro_batch_size_per_gpu": 4, "comment": "caf\xe9"}', "not UTF-8"),
    "a JSON list": ([1, 2], "must be a JSON object, not a list"),
}


def write_bad(path: Path, content: Any) -> Path:
    path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return path


def files_under(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")}


@pytest.fixture
def launched(monkeypatch):
    """As if under a launcher with one rank: the trainer then leaves the environment as it is."""
    for var, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(var, value)


@pytest.mark.parametrize("case", list(BAD_DS_JSON), ids=list(BAD_DS_JSON))
def test_a_nonsense_deepspeed_json_does_not_train(case, tmp_path, tiny_model, launched, capsys):
    from sdzero.train import main

    content, fragment = BAD_DS_JSON[case]
    config = write_bad(tmp_path / "ds.json", content)
    (tmp_path / "data").mkdir()
    before = files_under(tmp_path)
    out = tmp_path / "run"
    argv = ["--deepspeed_config", str(config), "--model", str(tiny_model), "--data", str(tmp_path / "data")]
    code = main([*argv, "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR
    assert err.startswith("sdzero: error:") and "\n" not in err, err
    assert fragment in err and str(config) in err, err
    assert not out.exists() and files_under(tmp_path) == before  # nothing written, nothing changed


def test_the_real_trainer_process_says_one_line_for_bf16_true(tmp_path, tiny_model):
    """The same through `python sdzero/train.py` without a launcher: exit 2, one line, no traceback."""
    from sdzero.cluster.launch_command import TRAIN_SCRIPT

    config = write_bad(tmp_path / "ds.json", changed(bf16=True))
    (tmp_path / "data").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run(
        [
            sys.executable,
            str(TRAIN_SCRIPT),
            "--deepspeed_config",
            str(config),
            "--model",
            str(tiny_model),
            "--data",
            str(tmp_path / "data"),
            "--output-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    errors = [line for line in done.stderr.splitlines() if line.startswith("sdzero: error:")]
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    assert len(errors) == 1 and '"bf16" must be an object' in errors[0], done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["AdamW", "adamw", "Adam", "LAMB", "Lion", "SGD", "RMSprop"])
def test_optimizers_deepspeed_accepts_are_accepted(name, tmp_path):
    path = write_bad(tmp_path / "ds.json", changed(optimizer__type=name))
    assert load_ds_config(path, world_size=1).zero_stage == 2


def test_torch_optim_names_that_are_not_optimizers_are_refused():
    # torch.optim holds modules and functions too; DeepSpeed would call them with the parameters.
    assert not known_optimizer("lr_scheduler") and not known_optimizer("Optimizer2")
    assert known_optimizer("adagrad")


def test_a_json_without_an_optimizer_block_is_fine(tmp_path):
    path = write_bad(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}})
    ds = load_ds_config(path, world_size=1)
    assert (ds.dtype, ds.zero_stage) == ("bf16", 0)


def test_the_auto_check_reaches_into_lists_and_names_the_item(tmp_path):
    config = changed(zero_optimization__stage=2)
    config["tensorboard"] = {"runs": [{"name": "a"}, {"name": "auto"}]}
    with pytest.raises(UserError, match=r'"tensorboard\.runs\[1\]\.name" is "auto"'):
        load_ds_config(write_bad(tmp_path / "ds.json", config), world_size=1)


# ------------------------------------------------------------------ other inputs read before a launch


def trainer_line(tmp_path: Path, tiny_model: Path, data: Path, capsys, model: Path | None = None) -> str:
    """Run the trainer's main (launcher variables set by the caller) on a good config: its one line."""
    from launch import fp32_config, write_config

    from sdzero.train import main

    config = write_config(tmp_path / "good.json", fp32_config(2))
    argv = ["--deepspeed_config", str(config), "--model", str(model or tiny_model), "--data", str(data)]
    code = main([*argv, "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == EXIT_USER_ERROR and err.startswith("sdzero: error:") and "\n" not in err, err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    return err


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ('["000000.png", "a caption"]', "line 2: a JSON list, not an object"),
        ("42", "line 2: a JSON int, not an object"),
        (
            '{"file_name": "000000.png\\u0000.png", "text": "x"}',
            "row 2: file_name '000000.png\\x00.png' holds a NUL",
        ),
        ('{"file_name": "000000.png", "text": "x"', "line 2: not valid JSON"),
    ],
    ids=["array", "number", "NUL in file_name", "broken line"],
)
def test_a_bad_metadata_line_is_one_line_naming_it(
    line, says, tmp_path, tiny_model, synth_data, launched, capsys
):
    data = tmp_path / "data"
    data.mkdir()
    (data / "000000.png").write_bytes((synth_data / "000000.png").read_bytes())
    (data / "metadata.jsonl").write_text('{"file_name": "000000.png", "text": "a"}\n' + line + "\n")
    err = trainer_line(tmp_path, tiny_model, data, capsys)
    assert f"{data / 'metadata.jsonl'}" in err and says in err, err


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'["StableDiffusionPipeline"]', "is a JSON list, not an object"),
        (b'{"_class_name": "\xff"}', "unreadable"),
    ],
    ids=["a list", "not UTF-8"],
)
def test_a_model_index_that_is_not_an_object_is_one_line(
    content, says, tmp_path, tiny_model, synth_data, launched, capsys
):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model_index.json").write_bytes(content)
    err = trainer_line(tmp_path, tiny_model, synth_data, capsys, model=model)
    assert f"--model {model}: model_index.json" in err and says in err, err


def test_the_cache_command_refuses_a_list_model_index_in_one_line(
    tmp_path, tiny_model, synth_data, monkeypatch, capsys
):
    from sdzero import cli

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "model_index.json").write_text("[1, 2]")
    out = tmp_path / "cache"
    argv = ["sdzero", "cache", "--model", str(model), "--data", str(synth_data), "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == EXIT_USER_ERROR and err.startswith("sdzero: error:") and "\n" not in err
    assert "model_index.json is a JSON list, not an object" in err and not out.exists()


def png_header_claiming(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height pixels and whose data is empty: PIL reads the size from the
    header alone (what a decompression bomb relies on)."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize(
    ("side", "says"),
    [(100_000, "could be decompression bomb"), (9_000, "its header claims 9000x9000 pixels, over the")],
    ids=["PIL's own limit", "the report's limit"],
)
def test_a_validation_image_claiming_a_huge_size_is_skipped_and_the_report_written(side, says, tmp_path):
    from report_fixtures import write_training_run
    from typer.testing import CliRunner

    from advisor.cli import app
    from sdzero.training.validation import step_folder

    run = write_training_run(tmp_path / "run", resumed_at=None, checkpoints=(), validation_steps=(2, 4))
    bomb = step_folder(run / "validation", 4) / "00_script-alert-1-script.png"
    bomb.write_bytes(png_header_claiming(side, side))
    out = tmp_path / "report.html"
    result = CliRunner().invoke(app, ["report", "--run", str(run), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.is_file() and "Traceback" not in result.output
    page = out.read_text()
    assert "validation/step_00000004/00_script-alert-1-script.png: not a readable image" in page
    assert says in page
    assert page.count("data:image/jpeg;base64,") >= 3  # the other images are still shown


def test_a_checkpoint_zero_to_fp32_cannot_read_is_one_line_in_export(
    tmp_path, tiny_model, monkeypatch, capsys
):
    """DeepSpeed's own ValueError (a ZeRO-2 checkpoint of 2 ranks holding 1 optimizer shard, sealed by a
    matching manifest) reached the user as a traceback; now: one line naming the checkpoint, exit 2."""
    import torch
    from payloads import reseal

    from sdzero import cli
    from sdzero.checkpoint.manifest import MANIFEST

    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000001"
    checkpoint.mkdir(parents=True)
    model_states = {"module": {}, "buffer_names": [], "param_shapes": [{}], "shared_params": {}}
    torch.save(model_states, checkpoint / "mp_rank_00_model_states.pt")
    optimizer = {"zero_stage": 2, "partition_count": 2, "single_partition_of_fp32_groups": [torch.zeros(4)]}
    torch.save({"optimizer_state_dict": optimizer}, checkpoint / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    manifest = {
        "zero_stage": 2,
        "dtype": "fp32",
        "world_size": 2,
        "seed": 0,
        "model": str(tiny_model),
        "prediction_type": "epsilon",
        "tag": checkpoint.name,
        "step": 1,
        "serial": 1,
        "ema": False,
        "files": {},
    }
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))
    reseal(checkpoint)
    out = tmp_path / "exported"
    monkeypatch.setattr(sys, "argv", ["sdzero", "export", str(checkpoint), str(out)])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == EXIT_USER_ERROR and err.startswith("sdzero: error:") and "\n" not in err, (
        err
    )
    assert f"{checkpoint}: DeepSpeed's zero_to_fp32 cannot consolidate" in err and "Expected 2 of" in err
    assert not out.exists()


def test_a_model_index_that_is_not_an_object_is_one_line_for_every_reader(tmp_path):
    """detect_family (export, advise --model) reads model_index.json too: a list is one UserError."""
    from sdzero.models.families import detect_family, read_model_index

    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="holds a JSON list, not an object"):
        detect_family(str(model))
    (model / "model_index.json").write_bytes(b'{"_class_name": "\xff"}')
    with pytest.raises(UserError, match="unreadable model_index.json"):
        read_model_index(str(model))
