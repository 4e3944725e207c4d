"""`sdzero profile`: its options, which it parses into advisor.measure.profile.run_profile's arguments, and the
table of trials it prints at the end."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import typer

from advisor.measure.grid import OFFLOADS, STAGES, GridRequest
from advisor.measure.profile import run_profile
from advisor.measure.trials import MAX_MEASURE_S, TARGET_REL_HALFWIDTH
from advisor.stages.fine_tune import split_train_args
from sdzero.config.options import DEFAULTS, cli_option, input_option
from sdzero.errors import UserError

# `sdzero profile`'s options, one alias each; profile_command's signature orders them in --help.
ModelIn = Annotated[str, input_option("model")]
DataIn = Annotated[Path, input_option("data")]
Out = Annotated[Path, typer.Option("--out", "-o", help="folder for trials.csv and one folder per trial.")]
DeepspeedConfig = Annotated[
    Path | None,
    input_option("deepspeed_config", note="the base of every trial [default: ds_configs/zero2_bf16.json]"),
]
Stage = Annotated[
    list[int] | None,
    typer.Option(help="ZeRO stage to try (0: plain data parallel); repeat. [default: 0 1 2 3]"),
]
Precision = Annotated[
    list[str] | None,
    typer.Option(help="bf16 and/or fp16; repeat. fp16 is skipped where the device lacks it. [default: both]"),
]
MicroBatch = Annotated[
    list[int] | None,
    typer.Option(help="micro-batch per rank; repeat. [default: 1, 2, 4, ... up to --max-micro-batch]"),
]
MaxMicroBatch = Annotated[int, typer.Option(help="top of the micro-batch ladder.")]
Offload = Annotated[
    list[str] | None,
    typer.Option(help=f"{', '.join(OFFLOADS)}; repeat. optimizer+params is ZeRO-3 only. [default: none]"),
]
Ranks = Annotated[
    list[int] | None,
    typer.Option("--ranks", "-n", help="ranks per node; repeat. [default: all GPUs, or 2 on a CPU]"),
]
Hostfile = Annotated[Path | None, input_option("hostfile", note="trials span its nodes")]
OverlapComm = Annotated[
    list[str] | None,
    typer.Option("--overlap-comm", help="on and/or off; repeat. [default: as in the base JSON]"),
]
ReduceBucketSize = Annotated[
    list[int] | None, typer.Option(help="elements; repeat. [default: as in the base JSON]")
]
AllgatherBucketSize = Annotated[
    list[int] | None, typer.Option(help="elements, ZeRO-1/2; repeat. [default: as in the base JSON]")
]
GradAccum = Annotated[
    list[int] | None, typer.Option(help="gradient accumulation steps; repeat. [default: as in the base JSON]")
]
Steps = Annotated[
    int, typer.Option(help="measured optimizer steps per trial (the least, with --target-halfwidth).")
]
TargetHalfwidth = Annotated[
    float,
    typer.Option(
        help="measure each trial until the 95% interval of its median step is within this fraction of it "
        "(0: exactly --steps steps)."
    ),
]
MaxTrialSteps = Annotated[
    int | None,
    typer.Option(help="with --target-halfwidth, the most steps a trial measures. [default: 4 x --steps]"),
]
MaxMeasureSeconds = Annotated[
    float, typer.Option(help="with --target-halfwidth, the most seconds of steps a trial measures (0: any).")
]
WarmupSteps = Annotated[int, typer.Option(help="steps per trial before measuring (not counted).")]
TrialTimeout = Annotated[float, typer.Option(help="seconds a trial may take in all, start-up included.")]
StallTimeout = Annotated[
    float | None,
    typer.Option(help="seconds without a new step, once training started, before a trial counts as hung."),
]
MemCapGib = Annotated[
    float | None,
    typer.Option(
        help="count a trial as out of memory when its per-rank peak passes this: the CUDA allocator's "
        "peak on GPUs; on CPUs the bytes a device would hold (model states, buckets, frozen models, "
        "activations)."
    ),
]
TrainArgs = Annotated[str, cli_option("train_args")]
RetryFailed = Annotated[bool, typer.Option(help="run crashed and timed-out trials again.")]


def profile_command(
    model: ModelIn,
    data: DataIn,
    out: Out = Path("reports/profile"),
    deepspeed_config: DeepspeedConfig = None,
    stage: Stage = None,
    precision: Precision = None,
    micro_batch: MicroBatch = None,
    max_micro_batch: MaxMicroBatch = 64,
    offload: Offload = None,
    ranks: Ranks = None,
    hostfile: Hostfile = None,
    overlap_comm: OverlapComm = None,
    reduce_bucket_size: ReduceBucketSize = None,
    allgather_bucket_size: AllgatherBucketSize = None,
    grad_accum: GradAccum = None,
    steps: Steps = 5,
    target_halfwidth: TargetHalfwidth = TARGET_REL_HALFWIDTH,
    max_trial_steps: MaxTrialSteps = None,
    max_measure_seconds: MaxMeasureSeconds = MAX_MEASURE_S,
    warmup_steps: WarmupSteps = 2,
    trial_timeout: TrialTimeout = 900.0,
    stall_timeout: StallTimeout = 300.0,
    mem_cap_gib: MemCapGib = None,
    train_args: TrainArgs = DEFAULTS.train_args,
    retry_failed: RetryFailed = False,
) -> None:
    """Measure throughput, memory and communication over a grid of ZeRO configs with short real runs."""
    from rich import get_console

    console = get_console()  # the progress bar's console too, so messages print above the live bar
    grid = grid_request(
        stage,
        precision,
        micro_batch,
        max_micro_batch,
        offload,
        ranks,
        overlap_comm,
        reduce_bucket_size,
        allgather_bucket_size,
        grad_accum,
    )
    from sdzero.config.output_lock import claim_output_dir, release_output_dir

    user_args = split_train_args(train_args)  # an unbalanced quote: one line, before the folder is made
    # every writer of a folder takes its lock: one profile at a time in a folder
    claim_output_dir(out, flag="--out")
    try:
        result = run_profile(
            model=model,
            data=data,
            out_dir=out,
            grid=grid,
            base_config=deepspeed_config,
            steps=steps,
            warmup_steps=warmup_steps,
            trial_timeout_s=trial_timeout,
            stall_timeout_s=stall_timeout,
            mem_cap_gib=mem_cap_gib,
            hostfile=hostfile,
            train_args=user_args,
            retry_failed=retry_failed,
            target_rel_halfwidth=target_halfwidth or None,
            max_steps=max_trial_steps,
            max_measure_s=max_measure_seconds or None,
            progress=True,
            log=lambda message: console.print(f"[dim]{message}[/dim]"),
        )
    except KeyboardInterrupt:
        console.print(
            f"[yellow]interrupted: finished trials are in {out / 'trials.csv'}; "
            "run the same command again to resume[/yellow]"
        )
        raise typer.Exit(130) from None
    finally:
        release_output_dir(out)
    console.print(results_table(result.table))
    console.print(
        f"{len(result.ran)} trials run, {len(result.skipped)} already done; results in {result.csv_path}"
    )


def grid_request(
    stage: Sequence[int] | None,
    precision: Sequence[str] | None,
    micro_batch: Sequence[int] | None,
    max_micro_batch: int,
    offload: Sequence[str] | None,
    ranks: Sequence[int] | None,
    overlap_comm: Sequence[str] | None,
    reduce_bucket_size: Sequence[int] | None,
    allgather_bucket_size: Sequence[int] | None,
    grad_accum: Sequence[int] | None,
) -> GridRequest:
    """The grid `sdzero profile`'s repeatable options ask for; an option not given is its default."""
    return GridRequest(
        stages=tuple(stage or STAGES),
        precisions=tuple(precision or ("bf16", "fp16")),
        micro_batches=tuple(micro_batch or ()),
        max_micro_batch=max_micro_batch,
        offloads=tuple(offload or ("none",)),
        ranks_per_node=tuple(ranks or ()),  # empty: all GPUs, or 2 on a CPU
        overlap_comm=tuple(parse_switch(v, "--overlap-comm") for v in overlap_comm or ()),
        reduce_bucket_sizes=tuple(reduce_bucket_size or ()),
        allgather_bucket_sizes=tuple(allgather_bucket_size or ()),
        grad_accums=tuple(grad_accum or ()),
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
