"""Every option of `sdzero advise`, `profile`, `cache`, `slurm` and `k8s` is declared once, as a field of its
command's dataclass (type, default, help, check); the command, its --help and (for advise) the request all come
from those fields (sdzero.config.command_options), so the option list is held to the declarations here."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import typing
from dataclasses import dataclass
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from advisor.cli import app
from advisor.commands.profile import ProfileOptions
from advisor.stages.inputs import check_request_options
from advisor.stages.request import AdviseRequest
from sdzero.config.command_groups import CacheOptions, K8sOptions, SlurmOptions
from sdzero.config.command_options import check_options, command_default, command_of, option_fields
from sdzero.config.options import option, shared
from sdzero.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
WIDE = {"TERMINAL_WIDTH": "400", "COLUMNS": "400"}
DECLARED = {
    "advise": AdviseRequest,
    "profile": ProfileOptions,
    "cache": CacheOptions,
    "slurm": SlurmOptions,
    "k8s": K8sOptions,
}


def _spellings(declared: type, f: dataclasses.Field) -> set[str]:
    cli = f.metadata["cli"]
    dashed = "--" + f.name.replace("_", "-")
    if cli.negatable or (not cli.flags and typing.get_type_hints(declared)[f.name] is bool):
        return {dashed, dashed.replace("--", "--no-", 1)}
    return set(cli.flags or (dashed,))


def _help_spellings(name: str) -> set[str]:
    """The option spellings `sdzero NAME --help` lists (--help itself left out)."""
    text = CliRunner().invoke(app, [name, "--help"], env=WIDE).output
    return set(re.findall(r"(?<![\w-])(--?[a-z][a-z0-9_-]*)", text.split("╭", 1)[1])) - {"--help"}


@pytest.mark.parametrize("name", list(DECLARED))
def test_the_help_lists_exactly_the_declared_options(name):
    declared = DECLARED[name]
    spellings = set().union(*(_spellings(declared, f) for f in option_fields(declared)))
    listed = _help_spellings(name)
    # the help texts mention other commands' flags (--replan OUT, --random-flip): every declared one is listed,
    # and every listed one that is an option of this command is declared
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    opts = {o for p in command.params for o in (*p.opts, *p.secondary_opts)} - {"--help"}
    assert opts == spellings
    assert spellings <= listed


@pytest.mark.parametrize("name", list(DECLARED))
def test_each_option_has_help_a_type_and_a_default_or_is_required(name):
    declared = DECLARED[name]
    hints = typing.get_type_hints(declared)
    command = typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]
    params = {p.name: p for p in command.params if p.name != "help"}
    assert list(params) == [f.name for f in option_fields(declared)]  # the declarations' order is --help's
    for f in option_fields(declared):
        cli = f.metadata["cli"]
        assert cli.help.strip(), f.name
        assert hints[f.name] is not None, f.name
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        assert params[f.name].required is required, f.name
        if not required:
            assert params[f.name].default == command_default(f), f.name
            assert params[f.name].help == cli.help, f.name


def test_the_request_is_the_advise_command():
    """The advise command's parameters are the request's option fields; the other fields are not options."""
    from advisor.commands.advise import advise_command

    parameters = list(inspect.signature(advise_command).parameters)
    assert parameters == [f.name for f in option_fields(AdviseRequest)]
    not_options = {f.name for f in dataclasses.fields(AdviseRequest)} - set(parameters)
    assert not_options == {"grid", "comm_budget_s", "log"}
    assert len(parameters) >= 35


BAD = {
    "max_nodes": 0,
    "budget_minutes": 0.0,
    "gpus_per_node": 0,
    "headroom": 1.5,
    "device_memory_gib": -1.0,
    "target_gpu": "z100",
    "min_efficiency": 0.0,
    "lr_scaling": "cubic",
    "lr_reference_batch": 0,
    "train_args": "--model x",
    "samples": 0,
    "epochs": 0.0,
    "gpu_hour_price": 0.0,
    "loader_workers": 0,
    "cpu_cores_per_node": 0,
    "storage_gbps": -1.0,
    "target_tflops": 0.0,
    "samples_rule": "chinchilla",
    "checkpointing": "sometimes",
    "host_memory_gib": 0.0,
}


@pytest.mark.parametrize("name", list(BAD))
def test_each_checked_advise_option_refuses_a_bad_value_in_one_line_naming_it(name):
    request = AdviseRequest(**{name: BAD[name]})
    flag = "--" + name.replace("_", "-")
    for check in (check_options, check_request_options):  # its own check, and the inputs stage's
        with pytest.raises(UserError) as caught:
            check(request)
        assert str(caught.value).startswith(flag) and "\n" not in str(caught.value)


def test_the_checked_options_are_the_ones_declared_with_a_check():
    checked = {f.name for f in option_fields(AdviseRequest) if f.metadata["cli"].check is not None}
    assert checked == set(BAD) | {"nodes"}


def test_the_advise_command_refuses_before_writing(tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["advise", "--out", str(out), "--storage-gbps", "-1"])
    assert result.exit_code == 2
    assert "--storage-gbps -1.0: must be a positive number" in result.output
    assert not out.exists()


def _split(words: str | tuple[str, ...]) -> tuple[str, ...]:
    return tuple(words.split()) if isinstance(words, str) else words


@dataclass(frozen=True)
class Toy:
    """A command's options: a new option is one field here and the line that reads it."""

    nodes: int = shared("nodes")
    colour: str = option("red", "the colour", check=lambda c: c if c in ("red", "blue") else _bad(c))
    repeat: list[int] | None = option(None, "repeatable")
    words: tuple[str, ...] = option((), "split words", command_type=str, command_default="", check=_split)
    loud: bool = option(False, "shout")


def _bad(colour: str) -> str:
    raise UserError(f"--colour {colour!r}: red or blue")


def test_a_declared_option_reaches_the_help_the_command_and_its_check(tmp_path):
    seen = []

    @command_of(Toy)
    def toy(ctx: typer.Context, o: Toy) -> None:
        """The toy command."""
        check_options(o)
        seen.append((o, list(ctx.args)))

    one = typer.Typer()
    one.command("toy", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(toy)
    one.command("other")(lambda: None)
    help_text = CliRunner().invoke(one, ["toy", "--help"], env=WIDE).output
    for text in ("--nodes", "--colour", "the colour", "[default: red]", "--repeat", "--words", "--loud"):
        assert text in help_text
    result = CliRunner().invoke(
        one, ["toy", "--nodes", "3", "--repeat", "1", "--repeat", "2", "--words", "a b", "--loud", "--x"]
    )
    assert result.exit_code == 0, result.output
    assert seen == [(Toy(nodes=3, repeat=[1, 2], words=("a", "b"), loud=True), ["--x"])]
    with pytest.raises(UserError, match="--colour 'green'"):
        toy(None, nodes=1, colour="green")  # called as a function: the others take their defaults
    assert CliRunner().invoke(one, ["toy"]).exit_code == 2  # --nodes is required, as the trainer's


def _longest_function(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return max(
        (n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)), default=0
    )


def test_the_advise_command_is_small():
    path = ROOT / "advisor" / "commands" / "advise.py"
    assert len(path.read_text().splitlines()) < 120
    for module in (ROOT / "advisor" / "commands").glob("*.py"):
        assert _longest_function(module) <= 60, module.name
