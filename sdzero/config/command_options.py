"""A `sdzero` command made from one dataclass of options, as the trainer's argv parser is made from its groups.

Each option of a command (`sdzero advise`, `profile`, `cache`, `slurm`, `k8s`) is one field declared with
`option(...)` or `shared(...)` (sdzero.config.options): its type, default, help and check together. From the
fields come the typer command's signature, and so its `--help`; the parsed values become the dataclass the
command's body receives, which runs the fields' checks (`check_options`) where it refuses bad input. Adding
an option is its field plus the line that reads it.

The typer settings are those `cli_option` gives the trainer's shared options: the dashed spelling first,
`--x/--no-x` for a negatable boolean, typer's own `--x/--no-x` for any other boolean without a spelling,
choices left to the check (so a bad value is the check's one line, not click's box).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from dataclasses import MISSING
from typing import Annotated, Any, TypeVar

from sdzero.config.options import FIELD_DEFAULT, Cli

T = TypeVar("T")


def option_fields(options: type) -> list[dataclasses.Field]:
    """The fields of `options` that are command-line options, in `--help` order."""
    return [f for f in dataclasses.fields(options) if "cli" in f.metadata]


def typer_option(f: dataclasses.Field) -> Any:
    """The `typer.Option` of one field: spellings, help, panel, metavar."""
    import typer

    cli: Cli = f.metadata["cli"]
    flags = tuple(sorted(cli.flags, key=lambda flag: "_" in flag))  # the dashed spelling first in --help
    if cli.negatable:
        dashed = f.name.replace("_", "-")
        flags = (f"--{dashed}/--no-{dashed}",)
    settings: dict[str, Any] = {"help": cli.help, "rich_help_panel": cli.panel}
    if not cli.show_default:
        settings["show_default"] = False
    if cli.metavar is not None:
        settings["metavar"] = cli.metavar
    return typer.Option(*flags, **settings)


def command_default(f: dataclasses.Field) -> Any:
    """The value a command passes when the option is not given; `inspect.Parameter.empty`: required."""
    cli: Cli = f.metadata["cli"]
    if cli.command_default is not FIELD_DEFAULT:
        return cli.command_default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return inspect.Parameter.empty if f.default is MISSING else f.default


def parameters(options: type) -> list[inspect.Parameter]:
    """One keyword parameter per option field: `Annotated[type, typer.Option(...)] = default`."""
    hints = typing.get_type_hints(options)
    params = []
    for f in option_fields(options):
        cli: Cli = f.metadata["cli"]
        hint = cli.command_type if cli.command_type is not None else hints[f.name]
        annotation = Annotated[hint, typer_option(f)]
        kind = inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=command_default(f), annotation=annotation))
    return params


def build(options: type[T], values: dict[str, Any]) -> T:
    """The options object from the command's values. An option whose command-line form is not its type
    (`command_type`) is parsed by its check here; the other checks run where the command asks for them
    (`check_options`), so that each command keeps the order in which it refuses things."""
    given = {}
    for f in option_fields(options):
        cli: Cli = f.metadata["cli"]
        parse = cli.check if cli.command_type is not None else None
        given[f.name] = parse(values[f.name]) if parse is not None else values[f.name]
    return options(**given)


def check_options(value: T) -> T:
    """Every option's check, in declaration order (a check that parses accepts its parsed form too)."""
    for f in option_fields(type(value)):
        check = f.metadata["cli"].check
        if check is not None:
            check(getattr(value, f.name))
    return value


def command_of(options: type[T]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate `body(lead..., opts: options)`: a function whose signature is body's leading parameters (such
    as `ctx: typer.Context`) and then one keyword parameter per option, which builds `opts` and calls body.
    typer reads its signature; called directly, an option left out takes its command-line default."""

    def decorate(body: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(body)
        lead = [
            p.replace(annotation=hints.get(p.name, p.annotation))
            for p in list(inspect.signature(body).parameters.values())[:-1]
        ]
        signature = inspect.Signature([*lead, *parameters(options)])

        @functools.wraps(body)
        def command(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = dict(bound.arguments)
            leading = [values.pop(p.name) for p in lead]
            return body(*leading, build(options, values))

        del command.__wrapped__  # inspect and typer read the signature below, not body's
        command.__signature__ = signature  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in signature.parameters.values()}
        return command

    return decorate
