"""One clear line for every bad input (issue #27): each is handed to the real command, which must exit 2
with a single `sdzero: error:` line naming what is wrong, print no traceback, and leave nothing behind.

The trainer cases run `sdzero/train.py`'s own `main` in this process (with launcher variables set, as
under `deepspeed`, so that it changes nothing in the environment), and one of them again as a real
`python sdzero/train.py` process; the other commands run as `python -m sdzero.cli ...` processes.
"""

from __future__ import annotations

import json
import os
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
