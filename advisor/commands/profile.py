"""`sdzero profile`: its options, declared once (ProfileOptions; the command is generated from them), which
become advisor.measure.profile.run_profile's arguments, and the table of trials it prints at the end."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import typer

from advisor.measure.grid import OFFLOADS, STAGES, GridRequest
from advisor.measure.profile import run_profile
from advisor.measure.trials import MAX_MEASURE_S, TARGET_REL_HALFWIDTH
from advisor.stages.fine_tune import split_train_args
from sdzero.config.command_options import check_options, command_of
from sdzero.config.options import INPUTS_PANEL, option, shared
from sdzero.errors import UserError


@dataclass(frozen=True)
class ProfileOptions:
    """`sdzero profile`'s options, declared once, in `--help` order (the command is generated from them)."""

    model: str = shared("model", panel=INPUTS_PANEL)
    data: Path = shared("data", panel=INPUTS_PANEL)
    out: Path = option(
        Path("reports/profile"), "folder for trials.csv and one folder per trial.", flags=("--out", "-o")
    )
    deepspeed_config: Path | None = shared(
        "deepspeed_config",
        None,
        note="the base of every trial [default: ds_configs/zero2_bf16.json]",
        panel=INPUTS_PANEL,
    )
    stage: list[int] | None = option(
        None, "ZeRO stage to try (0: plain data parallel); repeat. [default: 0 1 2 3]"
    )
    precision: list[str] | None = option(
        None, "bf16 and/or fp16; repeat. fp16 is skipped where the device lacks it. [default: both]"
    )
    micro_batch: list[int] | None = option(
        None, "micro-batch per rank; repeat. [default: 1, 2, 4, ... up to --max-micro-batch]"
    )
    max_micro_batch: int = option(64, "top of the micro-batch ladder.")
    offload: list[str] | None = option(
        None, f"{', '.join(OFFLOADS)}; repeat. optimizer+params is ZeRO-3 only. [default: none]"
    )
    ranks: list[int] | None = option(
        None, "ranks per node; repeat. [default: all GPUs, or 2 on a CPU]", flags=("--ranks", "-n")
    )
    hostfile: Path | None = shared("hostfile", note="trials span its nodes", panel=INPUTS_PANEL)
    overlap_comm: list[str] | None = option(
        None,
        "on and/or off; repeat. [default: as in the base JSON]",
        flags=("--overlap-comm",),
        check=lambda values: [parse_switch(v, "--overlap-comm") for v in values or ()],
    )
    reduce_bucket_size: list[int] | None = option(None, "elements; repeat. [default: as in the base JSON]")
    allgather_bucket_size: list[int] | None = option(
        None, "elements, ZeRO-1/2; repeat. [default: as in the base JSON]"
    )
    grad_accum: list[int] | None = option(
        None, "gradient accumulation steps; repeat. [default: as in the base JSON]"
    )
    steps: int = option(5, "measured optimizer steps per trial (the least, with --target-halfwidth).")
    target_halfwidth: float = option(
        TARGET_REL_HALFWIDTH,
        "measure each trial until the 95% interval of its median step is within this fraction of it "
        "(0: exactly --steps steps).",
    )
    max_trial_steps: int | None = option(
        None, "with --target-halfwidth, the most steps a trial measures. [default: 4 x --steps]"
    )
    max_measure_seconds: float = option(
        MAX_MEASURE_S, "with --target-halfwidth, the most seconds of steps a trial measures (0: any)."
    )
    warmup_steps: int = option(2, "steps per trial before measuring (not counted).")
    trial_timeout: float = option(900.0, "seconds a trial may take in all, start-up included.")
    stall_timeout: float | None = option(
        300.0, "seconds without a new step, once training started, before a trial counts as hung."
    )
    mem_cap_gib: float | None = option(
        None,
        "count a trial as out of memory when its per-rank peak passes this: the CUDA allocator's "
        "peak on GPUs; on CPUs the bytes a device would hold (model states, buckets, frozen models, "
        "activations).",
    )
    train_args: str = shared("train_args", check=split_train_args)
    retry_failed: bool = option(False, "run crashed and timed-out trials again.")


@command_of(ProfileOptions)
def profile_command(o: ProfileOptions) -> None:
    """Measure throughput, memory and communication over a grid of ZeRO configs with short real runs."""
    from rich import get_console

    from sdzero.config.output_lock import claim_output_dir, release_output_dir

    console = get_console()  # the progress bar's console too, so messages print above the live bar
    check_options(o)  # a bad --overlap-comm, an unbalanced quote: one line, before the folder is made
    grid = grid_request(o)  # a bad --stage, --precision, ...: the same
    # every writer of a folder takes its lock: one profile at a time in a folder
    claim_output_dir(o.out, flag="--out")
    try:
        result = run_profile(
            model=o.model,
            data=o.data,
            out_dir=o.out,
            grid=grid,
            base_config=o.deepspeed_config,
            steps=o.steps,
            warmup_steps=o.warmup_steps,
            trial_timeout_s=o.trial_timeout,
            stall_timeout_s=o.stall_timeout,
            mem_cap_gib=o.mem_cap_gib,
            hostfile=o.hostfile,
            train_args=split_train_args(o.train_args),
            retry_failed=o.retry_failed,
            target_rel_halfwidth=o.target_halfwidth or None,
            max_steps=o.max_trial_steps,
            max_measure_s=o.max_measure_seconds or None,
            progress=True,
            log=lambda message: console.print(f"[dim]{message}[/dim]"),
        )
    except KeyboardInterrupt:
        console.print(
            f"[yellow]interrupted: finished trials are in {o.out / 'trials.csv'}; "
            "run the same command again to resume[/yellow]"
        )
        raise typer.Exit(130) from None
    finally:
        release_output_dir(o.out)
    console.print(results_table(result.table))
    console.print(
        f"{len(result.ran)} trials run, {len(result.skipped)} already done; results in {result.csv_path}"
    )


def grid_request(o: ProfileOptions) -> GridRequest:
    """The grid `sdzero profile`'s repeatable options ask for; an option not given is its default."""
    return GridRequest(
        stages=tuple(o.stage or STAGES),
        precisions=tuple(o.precision or ("bf16", "fp16")),
        micro_batches=tuple(o.micro_batch or ()),
        max_micro_batch=o.max_micro_batch,
        offloads=tuple(o.offload or ("none",)),
        ranks_per_node=tuple(o.ranks or ()),  # empty: all GPUs, or 2 on a CPU
        overlap_comm=tuple(parse_switch(v, "--overlap-comm") for v in o.overlap_comm or ()),
        reduce_bucket_sizes=tuple(o.reduce_bucket_size or ()),
        allgather_bucket_sizes=tuple(o.allgather_bucket_size or ()),
        grad_accums=tuple(o.grad_accum or ()),
    )


def parse_switch(text: str, flag: str) -> bool:
    value = text.strip().lower()
    if value in ("on", "true", "1", "yes"):
        return True
    if value in ("off", "false", "0", "no"):
        return False
    raise UserError(f"{flag} {text!r}: use on or off")


def results_table(table: pd.DataFrame) -> Any:
    from rich.table import Table

    view = Table(
        title="trials (bytes per rank; MiB = 2^20 bytes; step s: the median step, drift-corrected, +- its "
        "95% interval, ! contended)"
    )
    for name in (
        "trial",
        "status",
        "samples/s",
        "step s",
        "+-",
        "comm s",
        "states MiB",
        "activ. MiB",
        "peak MiB",
        "reason",
    ):
        view.add_column(name)

    def num(value: Any, fmt: str, scale: float = 1.0) -> str:
        return "-" if pd.isna(value) else format(float(value) / scale, fmt)

    for _, row in table.iterrows():
        view.add_row(
            str(row["trial_id"]),
            str(row["status"]),
            num(row["samples_per_s"], ".2f"),
            num(row.get("step_time_median_s"), ".3f"),
            _halfwidth(row),
            num(row["comm_s"], ".3f"),
            num(row["model_state_bytes"], ".1f", 2**20),
            num(row["activation_bytes"], ".1f", 2**20),
            num(row["device_peak_bytes"], ".1f", 2**20),
            "" if pd.isna(row["reason"]) else str(row["reason"])[:80],
        )
    return view


def _halfwidth(row: pd.Series) -> str:
    """The median step's interval as +-% of it (drift correction included), '-' where there is none."""
    lo, hi, step = (
        pd.to_numeric(row.get(c), errors="coerce") for c in ("step_s_lo", "step_s_hi", "step_time_median_s")
    )
    if pd.isna(lo) or pd.isna(hi) or not step > 0:
        return "-"
    return f"{(hi - lo) / 2 / step:.1%}" + (" !" if str(row.get("contended")).lower() == "true" else "")
