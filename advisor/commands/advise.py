"""`sdzero advise`: its options, declared once here, become one advisor.stages.request.AdviseRequest, which
advisor.stages.advise.run_advise runs; the answer is printed by advisor.report.terminal."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from advisor.model.network import MACHINES, PRESETS
from advisor.stages.advise import run_advise
from advisor.stages.fine_tune import check_train_args
from advisor.stages.inputs import check_request_options
from advisor.stages.replan import replan_out
from advisor.stages.request import AdviseRequest
from advisor.stages.target import TARGET_GPUS
from sdzero.config.options import DEFAULTS, cli_option, input_option
from sdzero.config.output_folder import check_output_folder
from sdzero.config.output_lock import claim_output_dir

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
    Path | None,
    typer.Option(
        "--out",
        "-o",
        help="folder for trials, benchmark, predictions, recommendation, report (default reports/advise; "
        "with --replan, the replanned folder).",
        show_default=False,
    ),
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
        help=f"named inter-node fabric: {', '.join(PRESETS)}; or a whole machine (its NVLink domain, intra-node "
        f"link and NICs): {', '.join(MACHINES)} (figures and sources in advisor/model/network.py)."
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
Samples = Annotated[
    int | None,
    typer.Option(help="samples in one epoch, for the time to train (default: the images in --data)."),
]
Epochs = Annotated[float | None, typer.Option(help="epochs to train (default 1), for the time to train.")]
GpuHourPrice = Annotated[
    float | None, typer.Option(help="price of one GPU-hour: the cost to train beside the GPU-hours.")
]
DeadlineHours = Annotated[
    float | None,
    typer.Option(help="choose the node count with the fewest GPU-hours that finishes within these hours."),
]
MaxGpuHours = Annotated[
    float | None, typer.Option(help="choose the node count that finishes soonest within these GPU-hours.")
]
LoaderWorkers = Annotated[
    int | None,
    typer.Option(
        help="loader workers per rank of the planned run, for its input rate (default: the trials')."
    ),
]
CpuCoresPerNode = Annotated[
    int | None,
    typer.Option(help="cores a target node's loader workers may use (default: this machine's, if alike)."),
]
StorageGbps = Annotated[
    float | None,
    typer.Option(
        help="aggregate read rate of the shared storage holding --data, Gbit/s (all nodes together)."
    ),
]
Replan = Annotated[
    Path | None,
    typer.Option(
        metavar="OUT",
        help="answer again from OUT's trials, link probes and fits for other target, batch or training "
        "options, measuring nothing (seconds, no process group); OUT may also be a training run's folder "
        "(metrics.jsonl, ds_config.json) or a profile file (docs/advisor.md section 2c).",
        show_default=False,
    ),
]
TargetTflops = Annotated[
    float | None,
    typer.Option(
        help="the target's sustained TFLOP/s per GPU (assumed): its compute when the trials ran elsewhere."
    ),
]
SamplesRuleOption = Annotated[
    str,
    typer.Option(
        "--samples-rule",
        help="samples a larger global batch needs for the same quality: same, flux (8x batch: 2.1x samples), sd2.",
    ),
]
Checkpointing = Annotated[
    str,
    typer.Option(
        "--checkpointing",
        help="gradient checkpointing as a knob of the search: off, or both (each micro-batch with and "
        "without it, measured in the same launch; the answer says what it costs and what it allows).",
    ),
]
HostMemoryGib = Annotated[
    float | None,
    typer.Option(
        help="RAM of one target node, GiB: offloaded states, pinned buffers, a CPU EMA, loader workers and "
        "a latent cache's page cache must fit in it (default: a --preset's, else this machine's)."
    ),
]
Explain = Annotated[
    bool,
    typer.Option(
        "--explain",
        help="after the short answer, the full detail: node-count rule, LR, errors, where the intervals come "
        "from, runners-up, config and launch (the report holds the same; with --replan OUT: in seconds).",
    ),
]
TrainArgs = Annotated[
    str, cli_option("train_args", note="also in the recommended launch; checked by the trainer's parser")
]

ADVISE_LOG = "advise.log"
"""In --out: the library chatter kept off the terminal, and the progress lines."""
_ADVISE = AdviseRequest()
"""The request's defaults, which the command's options share."""


def advise_command(
    max_nodes: MaxNodes = _ADVISE.max_nodes,
    model: Model = _ADVISE.model,
    data: Data = _ADVISE.data,
    deepspeed_config: DeepspeedConfig = _ADVISE.deepspeed_config,
    out: Out = None,
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
    samples: Samples = _ADVISE.samples,
    epochs: Epochs = _ADVISE.epochs,
    gpu_hour_price: GpuHourPrice = _ADVISE.gpu_hour_price,
    deadline_hours: DeadlineHours = _ADVISE.deadline_hours,
    max_gpu_hours: MaxGpuHours = _ADVISE.max_gpu_hours,
    loader_workers: LoaderWorkers = _ADVISE.loader_workers,
    cpu_cores_per_node: CpuCoresPerNode = _ADVISE.cpu_cores_per_node,
    storage_gbps: StorageGbps = _ADVISE.storage_gbps,
    replan: Replan = _ADVISE.replan,
    target_tflops: TargetTflops = _ADVISE.target_tflops,
    samples_rule: SamplesRuleOption = _ADVISE.samples_rule,
    checkpointing: Checkpointing = _ADVISE.checkpointing,
    host_memory_gib: HostMemoryGib = _ADVISE.host_memory_gib,
    explain: Explain = False,
) -> None:
    """Measure a few trials and the network, predict 1..--max-nodes nodes with the time and GPU-hours to
    train, recommend a runnable config (--replan: answer again from an earlier run's measurements)."""
    import time

    from rich.console import Console

    from advisor.report.terminal import print_advice
    from sdzero.library_logs import library_chatter_to

    started = time.monotonic()
    out_dir = Path(out or (replan_out(replan) if replan is not None else _ADVISE.out_dir))
    console = Console(stderr=True)
    check_output_folder(out_dir, "--out")  # a folder of the user's: refused before advise.log is in it
    user_args = check_train_args(train_args)  # refused before anything is written
    request = AdviseRequest(
        max_nodes=max_nodes,
        model=model,
        data=data,
        deepspeed_config=deepspeed_config,
        out_dir=out_dir,
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
        train_args=user_args,
        min_efficiency=min_efficiency,
        nodes=nodes,
        target_gpu=target_gpu,
        lr_reference_batch=lr_reference_batch,
        samples=samples,
        epochs=epochs,
        gpu_hour_price=gpu_hour_price,
        deadline_hours=deadline_hours,
        max_gpu_hours=max_gpu_hours,
        loader_workers=loader_workers,
        cpu_cores_per_node=cpu_cores_per_node,
        storage_gbps=storage_gbps,
        replan=replan,
        target_tflops=target_tflops,
        samples_rule=samples_rule,
        checkpointing=checkpointing,
        host_memory_gib=host_memory_gib,
    )
    if replan is None:  # a bad value is refused before the folder or its log exists
        check_request_options(request)
    # sdzero's mark (the run's lock) before advise.log: the inputs stage's claim then finds the folder
    # ours, not one holding a file sdzero did not write (the lock is this process's; advise releases it)
    claim_output_dir(out_dir, "--out")
    with library_chatter_to(out_dir / ADVISE_LOG) as log:

        def say(message: str) -> None:
            log.write(message)
            console.print(f"[dim]{message}[/dim]", highlight=False)

        request = dataclasses.replace(request, log=say)
        result = run_advise(request)
        print_advice(
            result.recommendation,
            result.trials_run,
            result.full_grid,
            result.out_dir,
            result.report,
            explain=explain,
        )
    if replan is not None:
        console.print(
            f"[dim]replanned in {time.monotonic() - started:.1f} s from {replan}; nothing measured[/dim]",
            highlight=False,
        )
