"""The trainer's commands of `sdzero` (train, cache, launch, slurm, k8s, doctor, demo, export, ...).

Each command parses its options and calls a plain function. The `sdzero` command users run is composed
one floor up, in advisor.cli, which adds the advisor's commands (advise, profile, comm, report) to these:
this package never imports the advisor. `python -m sdzero.cli` runs these commands alone, as the ranks of
`sdzero cache` do.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from sdzero.config.command_groups import LAUNCH_PANEL, CacheOptions, K8sOptions, SlurmOptions, job_fields
from sdzero.config.command_options import check_options, command_of
from sdzero.config.options import DEFAULTS, cli_option
from sdzero.errors import EXIT_USER_ERROR, UserError

app = typer.Typer(
    name="sdzero",
    help="Fine-tune Stable Diffusion with DeepSpeed ZeRO (the trainer's commands).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def command(
    name: str, target: typer.Typer | None = None, **settings: Any
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register a command on `target` (default: this module's app) whose bad input (UserError) becomes one
    line on stderr and exit code 2."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except UserError as exc:
                typer.echo(f"sdzero: error: {exc}", err=True)
                raise typer.Exit(EXIT_USER_ERROR) from None

        (app if target is None else target).command(name, **settings)(wrapper)
        return fn

    return register


@command("tiny-model")
def tiny_model(
    out: Annotated[Path, typer.Argument(help="folder to write the diffusers pipeline into (must not exist)")],
    family: Annotated[str, typer.Option(help="model family: sd15, sdxl or sd3")] = "sd15",
    seed: Annotated[int, typer.Option(help="seed of the random weights")] = 0,
) -> None:
    """Write a tiny random-weight pipeline in diffusers format (the embedded default model)."""
    from sdzero.models.tiny import write_tiny_model

    write_tiny_model(out, family=family, seed=seed)
    typer.echo(f"wrote tiny {family} pipeline to {out}")


@command("synth-data")
def synth_data(
    out: Annotated[
        Path, typer.Argument(help="folder to write images and metadata.jsonl into (must not exist)")
    ],
    images: Annotated[int, typer.Option(help="number of images")] = 256,
    size: Annotated[int, typer.Option(help="approximate image side in pixels")] = 48,
    seed: Annotated[int, typer.Option(help="seed of shapes, colours and captions")] = 0,
) -> None:
    """Write coloured shapes on backgrounds, each with the caption that describes it."""
    from sdzero.models.tiny import write_synthetic_dataset

    write_synthetic_dataset(out, images=images, size=size, seed=seed)
    typer.echo(f"wrote {images} captioned images to {out}")


@command("shard")
def shard(
    data: Annotated[Path, typer.Argument(help="image folder with metadata.jsonl (or .csv / .parquet)")],
    out: Annotated[
        Path, typer.Argument(help="folder to write 000000.tar, 000001.tar, ... into (must not exist)")
    ],
    max_count: Annotated[int, typer.Option(help="samples per shard")] = 1000,
    max_size_mb: Annotated[int, typer.Option(help="bytes per shard, at most, in MiB")] = 1024,
) -> None:
    """Write an image folder as tar shards in img2dataset's layout (key.jpg + key.txt + key.json), which
    --data reads as a pattern or a folder (see docs/data.md)."""
    from sdzero.data.shard_writer import write_shards

    summary = write_shards(data, out, max_count=max_count, max_size_bytes=max_size_mb << 20)
    last = f"{summary.shards - 1:06d}"
    typer.echo(
        f"wrote {summary.samples} samples in {summary.shards} shards to {out} "
        f"(--data '{out}/{{000000..{last}}}.tar' or --data {out})"
    )


@command("cache")
@command_of(CacheOptions)
def cache(o: CacheOptions) -> None:
    """Encode latents and text embeddings once, into sharded safetensors files (see docs/caching.md)."""
    from sdzero.config.train_config import rank_from_env
    from sdzero.data.cache import read_build_record
    from sdzero.data.cache_build import build_cache, cache_launch
    from sdzero.data.images import set_max_image_pixels

    check_options(o)  # --resolution (the trainer's bound), --max-image-pixels: one line, before any launch
    # an interrupted build's record that is not sdzero's: one line, before any launch
    read_build_record(o.out)
    if o.num_gpus is not None or o.hostfile is not None:
        args = [
            *("--model", o.model, "--data", str(o.data), "--out", str(o.out), "--flip", o.flip),
            *("--dtype", o.dtype, "--shard-size", str(o.shard_size), "--batch-size", str(o.batch_size)),
            *("--max-bad-fraction", str(o.max_bad_fraction), "--max-image-pixels", str(o.max_image_pixels)),
        ]
        args += ["--resolution", str(o.resolution)] if o.resolution else []
        args += ["--max-sequence-length", str(o.max_sequence_length)] if o.max_sequence_length else []
        args += ["--buckets"] if o.buckets else []
        launch = cache_launch(args, o.num_gpus, o.hostfile)
        typer.echo("+ " + " ".join(launch.command), err=True)
        raise typer.Exit(launch.run())
    set_max_image_pixels(o.max_image_pixels)  # the header check before any image is decoded, as in training
    result = build_cache(
        o.model,
        o.data,
        o.out,
        resolution=o.resolution,
        buckets=o.buckets,
        flip=o.flip,
        dtype=o.dtype,
        max_sequence_length=o.max_sequence_length,
        shard_size=o.shard_size,
        batch_size=o.batch_size,
        max_bad_fraction=o.max_bad_fraction,
    )
    if rank_from_env() == 0:
        if result.already_complete:
            typer.echo(f"{o.out}: already a complete cache of {result.samples} samples for these settings")
        else:
            typer.echo(
                f"cached {result.samples} samples in {result.shards} shards to {o.out} in "
                f"{result.seconds:.1f} s (this rank: {result.built_here} built, {result.skipped_here} "
                "already there)"
            )


@command(
    "train",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def train(
    ctx: typer.Context,
    num_gpus: Annotated[int | None, cli_option("num_gpus", panel=LAUNCH_PANEL)] = DEFAULTS.num_gpus,
    hostfile: Annotated[Path | None, cli_option("hostfile", panel=LAUNCH_PANEL)] = DEFAULTS.hostfile,
    master_port: Annotated[int | None, cli_option("master_port", panel=LAUNCH_PANEL)] = DEFAULTS.master_port,
) -> None:
    """Launch sdzero/train.py through the deepspeed launcher; other options go to the trainer
    (`python sdzero/train.py --help` lists them). With --hostfile it is `sdzero launch`: the hosts are
    checked, and the launch folder and forwarded values reach every rank exactly."""
    from sdzero.cluster.launch_command import deepspeed_command

    if hostfile is not None:
        if num_gpus is not None:
            raise UserError(
                "--num-gpus with --hostfile: the hostfile's slots= say how many ranks each host runs; "
                "drop --num-gpus (or set slots= per host)"
            )
        launch(ctx, hostfile, DEFAULTS.launcher, DEFAULTS.master_addr, master_port)
    from sdzero.process.launch_signals import run_forwarding

    cmd = deepspeed_command(list(ctx.args), num_gpus=num_gpus, master_port=master_port)
    typer.echo("+ " + " ".join(cmd), err=True)
    sys.stderr.flush()
    from sdzero.process.stall_exit import output_dir_of

    # SIGTERM/SIGUSR1/SIGINT reach the ranks; their exit code is ours (EXIT_STALLED after a named stall)
    raise typer.Exit(run_forwarding(cmd, output_dir=output_dir_of(ctx.args)))


@command(
    "launch",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
def launch(
    ctx: typer.Context,
    hostfile: Annotated[Path, cli_option("hostfile", panel=LAUNCH_PANEL)],
    launcher: Annotated[str, cli_option("launcher", panel=LAUNCH_PANEL)] = DEFAULTS.launcher,
    master_addr: Annotated[str | None, cli_option("master_addr", panel=LAUNCH_PANEL)] = DEFAULTS.master_addr,
    master_port: Annotated[int | None, cli_option("master_port", panel=LAUNCH_PANEL)] = DEFAULTS.master_port,
    check_only: Annotated[
        bool, typer.Option(help="check the hosts and write .deepspeed_env, but start nothing")
    ] = False,
) -> None:
    """Check a hostfile, write the .deepspeed_env remote ranks need, then run sdzero/train.py on its hosts
    (the launch folder and forwarded values reach every rank exactly; secrets by a 0600 file)."""
    from sdzero.cluster.hostfile import describe, plan_launch

    plan = plan_launch(
        hostfile, list(ctx.args), launcher=launcher, master_addr=master_addr, master_port=master_port
    )
    for line in describe(plan):
        typer.echo(line, err=True)
    typer.echo("+ " + " ".join(plan.command), err=True)
    if check_only:
        return
    sys.stderr.flush()
    raise typer.Exit(plan.launch.run())  # the launcher's exit code is this command's


@command(
    "slurm",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
@command_of(SlurmOptions)
def slurm(ctx: typer.Context, o: SlurmOptions) -> None:
    """Print a Slurm batch script that trains across the allocation, checkpoints on preemption, requeues."""
    from sdzero.cluster.slurm import SlurmJob, render

    typer.echo(render(SlurmJob(train_args=list(ctx.args), **job_fields(o))), nl=False)


@command(
    "k8s",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
)
@command_of(K8sOptions)
def k8s(ctx: typer.Context, o: K8sOptions) -> None:
    """Print Kubernetes manifests (Indexed Job + headless Service, or a Kubeflow PyTorchJob) for N pods."""
    from sdzero.cluster.k8s import K8sJob, render

    text = render(K8sJob(train_args=list(ctx.args), **job_fields(o, "out")))
    if o.out is None:
        typer.echo(text, nl=False)
        return
    from sdzero.atomic import write_text_atomic
    from sdzero.cluster.k8s import HEADER_SIGNATURE
    from sdzero.config.output_folder import check_replaceable_file

    # A folder, a special file, or a file of the user's is never replaced; an earlier manifest file is.
    check_replaceable_file(o.out, "--out", HEADER_SIGNATURE, "a manifest file")
    write_text_atomic(o.out, text)
    typer.echo(f"wrote {o.out}: kubectl apply -f {o.out}", err=True)


@command("doctor")
def doctor(
    hostfile: Annotated[
        Path | None,
        cli_option(
            "hostfile",
            note="check these nodes over ssh (default: inside a Slurm allocation its nodes, else this one)",
        ),
    ] = DEFAULTS.hostfile,
    output_dir: Annotated[Path, cli_option("output_dir", note="checked: free disk, shared by all?")] = Path(
        "."
    ),
    data: Annotated[Path | None, cli_option("data", note="checked: the same on every node?")] = None,
    probe_mib: Annotated[float, typer.Option(help="all-reduce size of the pair bandwidth probe")] = 16,
) -> None:
    """Pre-flight check of the nodes: hardware, versions, shared storage, links; exit 1 on a blocker."""
    from sdzero.cluster.doctor import diagnose, render_report

    facts, _, pairs, found = diagnose(hostfile, output_dir, data, size_mib=probe_mib)
    code = render_report(facts, pairs, found)
    if data is not None:  # every node reads a sample of the data at once: per-node and aggregate rates
        from sdzero.cluster.data_reads import read_everywhere, render_reads
        from sdzero.cluster.doctor import _remote, doctor_hosts

        render_reads(read_everywhere(doctor_hosts(hostfile), data, _remote), data)
    raise typer.Exit(code)


@command("demo")
def demo(
    out: Annotated[Path, typer.Option(help="work folder for model, data and run")] = Path("demo"),
    ranks: Annotated[int, typer.Option(help="local ranks")] = 2,
    steps: Annotated[int, typer.Option(help="optimizer steps")] = 60,
    config: Annotated[
        Path | None, typer.Option(help="DeepSpeed JSON; default ds_configs/zero2_bf16.json")
    ] = None,
) -> None:
    """Train the tiny default model on synthetic data with 2 ranks under ZeRO-2 bf16."""
    from sdzero.cluster.launch_command import deepspeed_command, shipped_config
    from sdzero.library_logs import ChatterFilter, library_chatter_to
    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    model, data, run_dir = out / "model", out / "data", out / "run"
    # Library chatter (accelerator detection, the launcher's INFO lines, deprecation warnings, weights
    # written and loaded) goes to <out>/demo.log; the run's own lines and any error show.
    with library_chatter_to(out / "demo.log") as log:
        if not (model / "model_index.json").exists():
            write_tiny_model(model)
        if not (data / "metadata.jsonl").exists():
            write_synthetic_dataset(data, images=256)
        ds_config = config or shipped_config("zero2_bf16.json")
        args = [
            "--deepspeed_config",
            str(ds_config),
            "--model",
            str(model),
            "--data",
            str(data),
            "--output-dir",
            str(run_dir),
            "--max-steps",
            str(steps),
            "--lr",
            "3e-4",
            "--num-workers",
            "1",
        ]
        launcher = subprocess.Popen(
            deepspeed_command(args, num_gpus=ranks), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        assert launcher.stdout is not None
        ChatterFilter(log, sys.stdout).pump(launcher.stdout)
        code = launcher.wait()
    if code == 0:
        typer.echo(
            f"demo done: metrics in {run_dir / 'metrics.jsonl'}, effective DeepSpeed config in "
            f"{run_dir / 'ds_config.json'}; library messages in {out / 'demo.log'}"
        )
    raise typer.Exit(code)


@app.command("export")
def export(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="a checkpoint folder, a folder of them, or a run's output folder (newest complete)"
        ),
    ],
    out: Annotated[Path, typer.Argument(help="folder to write the diffusers pipeline into")],
    model: Annotated[
        str | None, cli_option("model", note="for the frozen parts; default: the one the run trained from")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="bf16, fp16 or fp32 for every component; default fp32 (loads as-is)")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="replace OUT if it exists")] = False,
    merged: Annotated[
        bool,
        typer.Option(help="a LoRA checkpoint: write the whole pipeline with the adapter fused in"),
    ] = False,
) -> None:
    """Write a checkpoint as a diffusers pipeline (safetensors), with the EMA as unet_ema when present;
    a LoRA checkpoint as its adapter, or with --merged as the pipeline with the adapter fused in."""
    from sdzero.checkpoint.export import export_checkpoint
    from sdzero.checkpoint.lora_export import export_merged

    write = export_merged if merged else export_checkpoint
    result = write(checkpoint, out, model=model, dtype=dtype, overwrite=overwrite)
    ema = " and unet_ema" if result.with_ema else ""
    typer.echo(f"exported step {result.step} of {result.checkpoint} to {result.out} (unet{ema})")


def run_app(target: typer.Typer) -> None:
    """Run a typer app as a console entry point: one line and exit 2 for bad input, a fast exit."""
    from sdzero.process.exit import freeze_heap_for_exit

    try:
        from sdzero.cluster.launch_command import decode_argv

        target(args=decode_argv(sys.argv[1:]))  # `sdzero cache` ranks through pdsh get one base64 word
    except UserError as exc:
        print(f"sdzero: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    finally:  # typer leaves through SystemExit, also on success
        freeze_heap_for_exit()


def main() -> None:
    run_app(app)


if __name__ == "__main__":
    main()
