"""The `sdzero` command, composed on the top floor: the trainer's commands (sdzero.cli) and the advisor's
(advise, profile, comm, report). The console script points here; `sdzero advise`'s options are declared
here and become one advisor.request.AdviseRequest, which advisor.advise.run_advise runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from advisor.advise import run_advise
from advisor.inputs import check_train_args
from advisor.model.network import PRESETS
from advisor.request import AdviseRequest
from advisor.target import TARGET_GPUS
from sdzero import cli as trainer_cli
from sdzero.config.options import DEFAULTS, cli_option, input_option
from sdzero.process.children import ending_children_on_signals as ends_children  # their ranks: on signals too

app = typer.Typer(
    name="sdzero",
    help="Fine-tune Stable Diffusion with DeepSpeed ZeRO, and find the config that scales.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.registered_commands.extend(trainer_cli.app.registered_commands)


# `sdzero advise`'s options, one alias each; advise_command's signature orders them in --help and gives the
# defaults (AdviseRequest's, so the command and the pipeline cannot disagree).
MaxNodes = Annotated[int, typer.Option(help="Predict for 1, 2, 4, ... up to this many nodes.")]
Model = Annotated[
    str | None, input_option("model", note="default: the embedded tiny model, written into --out")
]
Data = Annotated[Path | None, input_option("data", note="default: synthetic data written into --out")]
DeepspeedConfig = Annotated[
    Path | None,
    input_option("deepspeed_config", note="the base of every trial; default ds_configs/zero2_bf16.json"),
]
Out = Annotated[
    Path,
    typer.Option("--out", "-o", help="folder for trials, benchmark, predictions, recommendation, report."),
]
BudgetMinutes = Annotated[
    float | None,
    typer.Option(help="wall-clock budget for trials and benchmark (default 5 on a CPU, 30 on GPUs)."),
]
Hostfile = Annotated[
    Path | None,
    input_option("hostfile", note="trials and benchmark run across its hosts (measured inter-node link)"),
]
GpusPerNode = Annotated[
    int | None, cli_option("gpus_per_node", note="of the target cluster; default: this machine's")
]
InterNodeGbps = Annotated[
    float | None,
    typer.Option(help="achievable inter-node bandwidth per NIC, Gbit/s (describes the target network)."),
]
TuneBuckets = Annotated[
    bool,
    typer.Option(
        help="also try overlap_comm and reduce bucket sizes, measured only where predicted to matter."
    ),
]
NicsPerNode = Annotated[
    int | None,
    typer.Option(help="inter-node NICs per node (rail-optimised: one per GPU); default: preset's, else 1."),
]
InterNodeLatencyUs = Annotated[
    float | None, typer.Option(help="inter-node latency per ring hop, microseconds.")
]
Preset = Annotated[
    str | None,
    typer.Option(
        help=f"named inter-node fabric: {', '.join(PRESETS)} (figures in advisor/model/network.py)."
    ),
]
GlobalBatch = Annotated[
    str | None,
    typer.Option(
        help="global batch target, e.g. 256, or a range 256-1024; default: the base config's on one "
        "target node, kept at every node count (strong scaling)."
    ),
]
Headroom = Annotated[float, typer.Option(help="fraction of device memory left free.")]
DeviceMemoryGib = Annotated[
    float | None,
    typer.Option(help="device memory per rank of the target; required when it is not this machine."),
]
TargetGpu = Annotated[
    str | None, typer.Option(help=f"the target's GPU, for its memory: {', '.join(TARGET_GPUS)}.")
]
MinEfficiency = Annotated[
    float, typer.Option(help="recommend the largest node count keeping this scaling efficiency (0-1].")
]
Nodes = Annotated[
    int | None, cli_option("nodes", note="recommend for this node count instead of choosing by efficiency")
]
LrScaling = Annotated[str, cli_option("lr_scaling")]
LrReferenceBatch = Annotated[
    int | None,
    cli_option(
        "lr_reference_batch",
        help="global batch the base LR was tuned for; default: the base config's on one node",
    ),
]
TrainArgs = Annotated[
    str, cli_option("train_args", note="also in the recommended launch; checked by the trainer's parser")
]

_ADVISE = AdviseRequest()
"""The request's defaults, which the command's options share."""


def advise_command(
    max_nodes: MaxNodes = _ADVISE.max_nodes,
    model: Model = _ADVISE.model,
    data: Data = _ADVISE.data,
    deepspeed_config: DeepspeedConfig = _ADVISE.deepspeed_config,
    out: Out = _ADVISE.out_dir,
    budget_minutes: BudgetMinutes = _ADVISE.budget_minutes,
    hostfile: Hostfile = _ADVISE.hostfile,
    gpus_per_node: GpusPerNode = _ADVISE.gpus_per_node,
    inter_node_gbps: InterNodeGbps = _ADVISE.inter_node_gbps,
    tune_buckets: TuneBuckets = _ADVISE.tune_buckets,
    nics_per_node: NicsPerNode = _ADVISE.nics_per_node,
    inter_node_latency_us: InterNodeLatencyUs = _ADVISE.inter_node_latency_us,
    preset: Preset = _ADVISE.preset,
    global_batch: GlobalBatch = _ADVISE.global_batch,
    headroom: Headroom = _ADVISE.headroom,
    device_memory_gib: DeviceMemoryGib = _ADVISE.device_memory_gib,
    target_gpu: TargetGpu = _ADVISE.target_gpu,
    min_efficiency: MinEfficiency = _ADVISE.min_efficiency,
    nodes: Nodes = _ADVISE.nodes,
    lr_scaling: LrScaling = _ADVISE.lr_scaling,
    lr_reference_batch: LrReferenceBatch = _ADVISE.lr_reference_batch,
    train_args: TrainArgs = DEFAULTS.train_args,
) -> None:
    """Measure a few trials and the network, predict 1..--max-nodes nodes, recommend a runnable config."""
    from rich.console import Console

    from advisor.report.terminal import print_advice

    console = Console(stderr=True)
    request = AdviseRequest(
        max_nodes=max_nodes,
        model=model,
        data=data,
        deepspeed_config=deepspeed_config,
        out_dir=out,
        budget_minutes=budget_minutes,
        hostfile=hostfile,
        gpus_per_node=gpus_per_node,
        inter_node_gbps=inter_node_gbps,
        inter_node_latency_us=inter_node_latency_us,
        preset=preset,
        nics_per_node=nics_per_node,
        tune_buckets=tune_buckets,
        global_batch=global_batch,
        headroom=headroom,
        device_memory_gib=device_memory_gib,
        lr_scaling=lr_scaling,
        log=lambda message: console.print(f"[dim]{message}[/dim]"),
        train_args=check_train_args(train_args),
        min_efficiency=min_efficiency,
        nodes=nodes,
        target_gpu=target_gpu,
        lr_reference_batch=lr_reference_batch,
    )
    result = run_advise(request)
    print_advice(result.recommendation, result.trials_run, result.full_grid, result.out_dir, result.report)


def _register_advisor_commands() -> None:
    from advisor.measure.collectives_launch import comm_command
    from advisor.measure.profile_command import profile_command
    from advisor.report.build import report_command

    trainer_cli.command("advise", app)(ends_children(advise_command))
    trainer_cli.command("comm", app)(ends_children(comm_command))
    trainer_cli.command("profile", app)(ends_children(profile_command))
    trainer_cli.command("report", app)(report_command)


_register_advisor_commands()


def main() -> None:
    trainer_cli.run_app(app)


if __name__ == "__main__":
    main()
