"""The `sdzero` command, composed on the top floor: the trainer's commands (sdzero.cli) and the advisor's
(advisor.commands: advise, profile, comm, report). The console script points here."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from sdzero import cli as trainer_cli
from sdzero.config.output_folder import check_output_folder
from sdzero.process.children import ending_children_on_signals as ends_children  # their ranks: on signals too

app = typer.Typer(
    name="sdzero",
    help="Fine-tune Stable Diffusion with DeepSpeed ZeRO, and find the config that scales.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.registered_commands.extend(trainer_cli.app.registered_commands)


def chatter_to_out_log(command: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`command` with library chatter diverted into <its --out>/`name` (sdzero.library_logs) while it runs;
    its signature, and so its options, unchanged."""

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        from sdzero.library_logs import library_chatter_to

        out = kwargs.get("out")
        if out is not None:  # a folder of the user's: refused before the log is in it
            check_output_folder(out, "--out")
        with library_chatter_to(Path(out) / name if out is not None else None):
            return command(*args, **kwargs)

    return run


def _register_advisor_commands() -> None:
    from advisor.commands.advise import advise_command
    from advisor.commands.comm import comm_command
    from advisor.commands.profile import profile_command
    from advisor.commands.report import report_command

    trainer_cli.command("advise", app)(ends_children(advise_command))
    trainer_cli.command("comm", app)(ends_children(comm_command))
    trainer_cli.command("profile", app)(ends_children(chatter_to_out_log(profile_command, "profile.log")))
    trainer_cli.command("report", app)(report_command)


_register_advisor_commands()


def main() -> None:
    trainer_cli.run_app(app)


if __name__ == "__main__":
    main()
