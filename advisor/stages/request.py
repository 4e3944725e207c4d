"""What `sdzero advise` is asked: every option of the command in one typed object, with its default.

The typer command (advisor.commands.advise.advise_command) builds an AdviseRequest and hands it to
advisor.stages.advise.run_advise; tests and benches build one directly. Checking the values is the inputs stage's
work (advisor.stages.inputs), so a request can be written down before anything is asked of the machine.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from advisor.decide.scaling_table import DEFAULT_MIN_EFFICIENCY
from advisor.measure.grid import GridRequest
from sdzero.config.lr_rule import DEFAULT_LR_SCALING
from sdzero.config.options import DEFAULTS

CPU_GRID = GridRequest(stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8))
"""On a CPU: 12 grid points, of which the search measures about 5 (a few minutes on 2 cores)."""


@dataclass(frozen=True)
class AdviseRequest:
    """The options of one advise run; the command-line flag of each field is its name in dashes."""

    max_nodes: int = 32
    """Predict for 1, 2, 4, ... up to this many nodes."""
    model: str | None = None
    """diffusers pipeline folder or hub id; None: the embedded tiny model, written into `out_dir`."""
    data: Path | None = None
    """Image folder with metadata; None: synthetic data written into `out_dir`."""
    deepspeed_config: Path | None = None
    """The DeepSpeed JSON every trial starts from; None: the shipped ds_configs/zero2_bf16.json."""
    out_dir: Path = Path("reports/advise")
    """Folder for trials, benchmark, predictions, recommendation and report (--out); rerunning resumes."""
    budget_minutes: float | None = None
    """Wall-clock budget for trials and benchmark; None: 5 minutes on a CPU, 30 on GPUs."""
    hostfile: Path | None = DEFAULTS.hostfile
    """DeepSpeed hostfile: the benchmark measures the hosts' link, and the recommended config is run
    across them to check the scale-out prediction; the trials themselves run on this host."""
    gpus_per_node: int | None = None
    """Ranks per node of the target cluster; None: this machine's."""
    inter_node_gbps: float | None = None
    """Achievable inter-node bandwidth per NIC of the target, Gbit/s."""
    inter_node_latency_us: float | None = None
    """Inter-node latency per ring hop of the target, microseconds."""
    preset: str | None = None
    """Named inter-node fabric of the target (advisor.model.network.PRESETS)."""
    nics_per_node: int | None = None
    """Inter-node NICs per target node; None: the preset's, else 1."""
    tune_buckets: bool = False
    """Also measure overlap_comm and reduce bucket sizes for the recommended config, where the model says
    they matter."""
    global_batch: str | None = None
    """Global batch target, `256` or a range `256-1024`; None: the base config's on one target node, held
    at every node count (strong scaling)."""
    headroom: float = 0.1
    """Fraction of device memory left free, in [0, 1)."""
    device_memory_gib: float | None = None
    """Device memory per rank of the target; required when the target is not this machine (or give
    `target_gpu`)."""
    lr_scaling: str = DEFAULT_LR_SCALING
    """How the LR follows the global batch when it differs from the reference (sdzero.config.lr_rule)."""
    grid: GridRequest | None = None
    """The trial grid; None: CPU_GRID on a CPU, the full default GridRequest on GPUs."""
    comm_budget_s: float | None = None
    """Seconds for the collectives benchmark; None: 15 on a CPU, 60 on GPUs (not a command-line flag)."""
    log: Callable[[str], None] | None = None
    """Where progress lines go (the command prints them dimmed on stderr); None: nowhere."""
    train_args: Sequence[str] = ()
    """More trainer options for every trial and for the recommended launch, already split into words."""
    min_efficiency: float = DEFAULT_MIN_EFFICIENCY
    """Recommend the largest node count keeping this scaling efficiency, in (0, 1]."""
    nodes: int | None = None
    """Recommend for this node count instead of choosing by efficiency."""
    target_gpu: str | None = None
    """The target's GPU by name (advisor.stages.target.TARGET_GPUS), for its memory."""
    lr_reference_batch: int | None = DEFAULTS.lr_reference_batch
    """Global batch the base LR was tuned for; None: the base config's on one target node."""
    samples: int | None = None
    """Samples in one epoch of the fine-tune; None: the images in `data` (the embedded default: its
    fine-tune's, advisor.stages.fine_tune.EMBEDDED_FINE_TUNE)."""
    epochs: float | None = None
    """Epochs to train, for the time, GPU-hours and cost to train; None: one."""
    gpu_hour_price: float | None = None
    """Price of one GPU-hour (any currency): the cost to train beside the GPU-hours."""
    deadline_hours: float | None = None
    """Choose the node count with the fewest GPU-hours that finishes within this many hours."""
    max_gpu_hours: float | None = None
    """Choose the node count that finishes soonest within this many GPU-hours."""
    target_tflops: float | None = None
    """Sustained TFLOP/s per GPU of the target on this kind of network (assumed): with the model's FLOPs
    per sample it gives the target's compute when the trials ran on another device."""
    samples_rule: str = "same"
    """How the samples to reach the same quality grow with the global batch (advisor.model.batch_growth):
    `same`, or a rule from published results (`flux`, `sd2`)."""
    loader_workers: int | None = None
    """Loader workers per rank of the planned run, for its input rate; None: the trials' --num-workers."""
    cpu_cores_per_node: int | None = None
    """Cores a target node's loader workers may use (one worker per core at most); None: this machine's
    when the target is nodes like it, else not capped."""
    storage_gbps: float | None = None
    """Aggregate read rate of the shared storage the data is on, Gbit/s (declared); None: not known."""
    host_memory_gib: float | None = None
    """RAM of one target node, for the plan's host memory (offloaded states, pinned buffers, a CPU EMA,
    loader workers, the latent cache's page cache); None: a preset's, else this machine's when the target
    is nodes like it."""
    checkpointing: str = "off"
    """Gradient checkpointing as a knob of the search: `off` (the trials run as --train-args say) or
    `both` (each micro-batch with and without it, in the same launch)."""
    replan: Path | None = None
    """Answer again from this earlier run's trials, link probes and fits, measuring nothing
    (advisor.stages.replan); or from a training run's folder (metrics.jsonl and ds_config.json) or a profile file
    (advisor.stages.profile_source); its answer is written into `out_dir`."""
