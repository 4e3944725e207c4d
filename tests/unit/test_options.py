"""Options once: the trainer's argv parser, the `sdzero` commands' shared options and their --help all come
from the option dataclasses (sdzero.config.options); a default or help changed there changes every one of them."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from advisor.cli import app
from sdzero.config import options
from sdzero.config.options import DEFAULTS, INPUTS_PANEL, TRAIN_GROUPS, option_field
from sdzero.config.train_config import TrainConfig, build_parser, parse_train_args
from sdzero.errors import UserError

WIDE = {"TERMINAL_WIDTH": "400", "COLUMNS": "400"}  # one line per option in rich's help table


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_every_trainconfig_field_is_an_option_of_the_trainer_argv():
    parser = build_parser()
    dests = {a.dest for a in parser._actions} - {"help", "local_rank"}
    assert dests == {f.name for f in dataclasses.fields(TrainConfig)}
    # and each one is reachable: argv with a non-default value for every field sets every field
    argv, expected = [], {}
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        cli = f.metadata["cli"]
        flag, value = options.flags_of(f)[0], DEFAULTS.__getattr__(f.name)
        if hints[f.name] is bool:
            argv.append(f"--no-{f.name.replace('_', '-')}" if value else flag)
            expected[f.name] = not value
        elif cli.choices:
            expected[f.name] = next(c for c in cli.choices if c != value)
            argv += [flag, expected[f.name]]
        elif isinstance(value, list):
            argv += [flag, "a prompt", "another"]
            expected[f.name] = ["a prompt", "another"]
        else:
            kind = options._value_type(TrainConfig, f)
            new = kind((value or 0) + 3) if kind else f"/some/{f.name}"
            argv += [flag, str(new)]
            expected[f.name] = new
    parsed = vars(parser.parse_args(argv))
    assert {k: parsed[k] for k in expected} == expected


def test_trainer_help_shows_the_dataclass_help_and_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # argparse wraps at the terminal width, hyphenated words too
    text = _flat(build_parser().format_help())
    for group in TRAIN_GROUPS:
        assert (group.__doc__ or "").strip() in text  # one --help section per option group
        for f in dataclasses.fields(group):
            assert _flat(f.metadata["cli"].help) in text, f.name
    assert "--max-image-pixels MAX_IMAGE_PIXELS skip images over" in text and "(default: 67108864)" in text

    # a default changed in the dataclass is the parser's default and what --help says
    monkeypatch.setattr(option_field("num_workers"), "default", 7)
    monkeypatch.setattr(option_field("lr_scaling"), "default", "linear")
    text = _flat(build_parser().format_help())
    assert "data-loader worker processes per rank (default: 7)" in text
    assert "(sdzero/config/lr_rule.py; capped) (default: linear)" in text
    argv = ["--deepspeed_config", "c.json", "--model", "m", "--data", "d", "--output-dir", "o"]
    ns = build_parser().parse_args(argv)
    assert (ns.num_workers, ns.lr_scaling) == (7, "linear")


def test_every_spelling_the_launchers_and_users_pass_still_parses(tmp_path):
    (tmp_path / "d").mkdir()
    base = [
        "--model",
        str(tmp_path / "m"),
        "--data",
        str(tmp_path / "d"),
        "--output-dir",
        str(tmp_path / "o"),
    ]
    for spelling in ("--deepspeed_config", "--deepspeed-config"):
        cfg = parse_train_args([spelling, "c.json", *base, "--local_rank=1", "--no-tf32"])
        assert cfg.deepspeed_config == Path("c.json") and cfg.tf32 is False
    cfg = parse_train_args(
        ["--deepspeed-config", "c.json", *base, "--local-rank", "0", "--validation-prompts", "a", "b"]
    )
    assert cfg.validation_prompts == ["a", "b"] and cfg.output_dir == tmp_path / "o"


def _params(name: str) -> dict[str, typing.Any]:
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    return {p.name: p for p in command.params}


@pytest.mark.parametrize(
    "name", ["cache", "train", "launch", "doctor", "advise", "profile", "comm", "export", "slurm", "k8s"]
)
def test_every_command_shows_the_dataclass_help_and_defaults(name):
    text = _flat(CliRunner().invoke(app, [name, "--help"], env=WIDE).output)
    checked = 0
    for param_name, param in _params(name).items():
        try:
            f = option_field(param_name)
        except KeyError:
            continue  # the command's own option
        if param_name == "lr_reference_batch" and name == "advise":
            continue  # the advisor's reference is per node: its own help (the default still is the field's)
        assert param.help.startswith(f.metadata["cli"].help), (name, param_name)
        assert _flat(f.metadata["cli"].help) in text, (name, param_name)
        if f.default is not dataclasses.MISSING and param.required is False and param_name != "data":
            assert param.default == f.default, (name, param_name)
            shown = param_name if f.default is True else f.default  # typer shows a True switch by its name
            if f.default not in (None, False, ""):
                assert f"[default: {shown}]" in text, (name, param_name)
        checked += 1
    assert checked >= 1  # at least one option of this command comes from the dataclasses


def test_cache_profile_and_advise_share_one_inputs_group():
    for name, inputs in {
        "cache": {"model", "data", "hostfile"},
        "profile": {"model", "data", "deepspeed_config", "hostfile"},
        "advise": {"model", "data", "deepspeed_config", "hostfile"},
    }.items():
        params = _params(name)
        assert {p for p, v in params.items() if v.rich_help_panel == INPUTS_PANEL} == inputs, name
        assert INPUTS_PANEL in CliRunner().invoke(app, [name, "--help"], env=WIDE).output
    assert "--deepspeed_config" in _params("advise")["deepspeed_config"].opts  # DeepSpeed's own spelling too


def test_cache_takes_max_image_pixels_to_every_rank(monkeypatch, tmp_path):
    import sdzero.data.cache_build
    import sdzero.data.images
    from sdzero.cluster.remote_launch import RemoteLaunch

    seen: dict[str, typing.Any] = {}
    monkeypatch.setattr(RemoteLaunch, "run", lambda launch: seen.setdefault("cmd", launch.command) and 0)
    base = ["cache", "--model", "m", "--data", str(tmp_path), "--out", str(tmp_path / "c")]
    result = CliRunner().invoke(app, [*base, "--max-image-pixels", "1234", "--num-gpus", "2"])
    assert result.exit_code == 0, result.output
    cmd = seen["cmd"]
    assert cmd[cmd.index("--max-image-pixels") + 1] == "1234"  # the ranks' own `sdzero cache` gets it

    monkeypatch.setattr(sdzero.data.images, "set_max_image_pixels", lambda n: seen.setdefault("limit", n))
    monkeypatch.setattr(
        sdzero.data.cache_build, "build_cache", lambda *a, **k: (_ for _ in ()).throw(UserError("stop"))
    )
    result = CliRunner().invoke(app, [*base, "--max-image-pixels", "4321"])
    assert result.exit_code == 2 and seen["limit"] == 4321  # set before the build reads a single header


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ("--lr-scaling cube", "argument --lr-scaling: invalid choice: 'cube'"),
        ("--resolutoin 512", "unrecognized arguments: --resolutoin 512"),
        ("--output /x", "--output-dir is set by the advisor"),  # an abbreviation the trainer would accept
    ],
)
def test_advisor_train_args_are_checked_by_the_trainer_parser(args, said):
    from advisor.stages.fine_tune import check_train_args

    with pytest.raises(UserError, match=re.escape(said)):
        check_train_args(args)
