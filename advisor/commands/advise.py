"""`sdzero advise`: its options are advisor.stages.request.AdviseRequest's fields, declared once there; the
command is generated from them (sdzero.config.command_options), hands the request to
advisor.stages.advise.run_advise, and prints the answer through advisor.report.terminal."""

from __future__ import annotations

import dataclasses

from advisor.stages.advise import run_advise
from advisor.stages.inputs import check_request_options
from advisor.stages.replan import replan_out
from advisor.stages.request import DEFAULT_OUT, AdviseRequest
from sdzero.config.command_options import command_of
from sdzero.config.output_folder import check_output_folder
from sdzero.config.output_lock import claim_output_dir

ADVISE_LOG = "advise.log"
"""In --out: the library chatter kept off the terminal, and the progress lines."""


@command_of(AdviseRequest)
def advise_command(request: AdviseRequest) -> None:
    """Measure a few trials and the network, predict 1..--max-nodes nodes with the time and GPU-hours to
    train, recommend a runnable config (--replan: answer again from an earlier run's measurements)."""
    import time

    from rich.console import Console

    from advisor.report.terminal import print_advice
    from sdzero.library_logs import library_chatter_to

    started = time.monotonic()
    replan = request.replan
    out_dir = request.out_dir or (
        replan_out(replan) if replan is not None else DEFAULT_OUT
    )  # --out's default
    request = dataclasses.replace(request, out_dir=out_dir)
    console = Console(stderr=True)
    check_output_folder(out_dir, "--out")  # a folder of the user's: refused before advise.log is in it
    if replan is None:  # a bad value is refused before the folder or its log exists
        check_request_options(request)
    # sdzero's mark (the run's lock) before advise.log: the inputs stage's claim then finds the folder
    # ours, not one holding a file sdzero did not write (the lock is this process's; advise releases it)
    claim_output_dir(out_dir, "--out")
    with library_chatter_to(out_dir / ADVISE_LOG) as log:

        def say(message: str) -> None:
            log.write(message)
            console.print(f"[dim]{message}[/dim]", highlight=False)

        result = run_advise(dataclasses.replace(request, log=say))
        print_advice(
            result.recommendation,
            result.trials_run,
            result.full_grid,
            result.out_dir,
            result.report,
            explain=request.explain,
        )
    if replan is not None:
        console.print(
            f"[dim]replanned in {time.monotonic() - started:.1f} s from {replan}; nothing measured[/dim]",
            highlight=False,
        )
