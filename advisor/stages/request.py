"""What `sdzero advise` is asked: every option of the command, declared once, in one typed object.

Each option is one field: its type, its default, its `--help` text and its check together (`option` and
`shared`, sdzero.config.options). The typer command (advisor.commands.advise) is generated from these fields
(sdzero.config.command_options), so the command, this request and `--help` cannot disagree; tests and benches
build a request directly. A field's check sees that value alone; the checks that need several values (the
target network, the node-count rule, --checkpointing with --train-args) are the inputs stage's
(advisor.stages.inputs.check_request_options), which also runs the fields' own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from advisor.decide.scaling_table import DEFAULT_MIN_EFFICIENCY
from advisor.measure.grid import GridRequest
from advisor.model.batch_growth import samples_rule
from advisor.model.network import MACHINES, PRESETS
from advisor.model.predict import node_counts
from advisor.stages.fine_tune import check_train_args
from advisor.stages.target import TARGET_GPUS, check_target_rate
from sdzero.config.lr_rule import DEFAULT_LR_SCALING, check_rule
from sdzero.config.options import INPUTS_PANEL, option, shared
from sdzero.errors import UserError

CPU_GRID = GridRequest(stages=(1, 2, 3), precisions=("bf16",), micro_batches=(1, 2, 4, 8))
"""On a CPU: 12 grid points, of which the search measures about 5 (a few minutes on 2 cores)."""
DEFAULT_OUT = Path("reports/advise")
CHECKPOINTING_CHOICES = ("off", "both")


def above(flag: str, low: float, fix: str, *, inclusive: bool = False) -> Callable[[Any], Any]:
    """The check of an optional number that must be above `low` (at least, with `inclusive`)."""

    def check(value: Any) -> Any:
        if value is not None and not (value >= low if inclusive else value > low):
            raise UserError(f"{flag} {value}: {fix}")
        return value

    return check


def fraction(flag: str, fix: str, *, upper: bool) -> Callable[[float], float]:
    """[0, 1) for a headroom (upper=False), (0, 1] for an efficiency (upper=True)."""

    def check(value: float) -> float:
        if not ((0 < value <= 1) if upper else (0 <= value < 1)):
            raise UserError(f"{flag} {value}: {fix}")
        return value

    return check


def passing(check: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A check made of a function that raises on a bad value (and returns something else): None passes."""

    def run(value: Any) -> Any:
        if value is not None:
            check(value)
        return value

    return run


def known_gpu(name: str | None) -> str | None:
    if name is not None and name.lower() not in TARGET_GPUS:
        raise UserError(
            f"--target-gpu {name!r}: unknown; choose from {', '.join(TARGET_GPUS)} or give --device-memory-gib"
        )
    return name


def checkpointing_choice(choice: str) -> str:
    if choice not in CHECKPOINTING_CHOICES:
        raise UserError(f"--checkpointing {choice!r}: choose off or both")
    return choice


@dataclass(frozen=True)
class AdviseRequest:
    """The options of one advise run, in `--help` order; the flag of each is its name in dashes unless
    `flags=` says otherwise (`out_dir` is `--out`)."""

    max_nodes: int = option(32, "Predict for 1, 2, 4, ... up to this many nodes.", check=passing(node_counts))
    model: str | None = shared(
        "model", None, note="default: the embedded tiny model, written into --out", panel=INPUTS_PANEL
    )
    data: Path | None = shared(
        "data", None, note="default: synthetic data written into --out", panel=INPUTS_PANEL
    )
    deepspeed_config: Path | None = shared(
        "deepspeed_config",
        None,
        note="the base of every trial; default ds_configs/zero2_bf16.json",
        panel=INPUTS_PANEL,
    )
    out_dir: Path = option(
        DEFAULT_OUT,
        "folder for trials, benchmark, predictions, recommendation, report (default reports/advise; "
        "with --replan, the replanned folder).",
        flags=("--out", "-o"),
        show_default=False,
        command_default=None,  # not given: the command picks reports/advise or the replanned folder
    )
    budget_minutes: float | None = option(
        None,
        "wall-clock budget for trials and benchmark (default 5 on a CPU, 30 on GPUs).",
        check=above("--budget-minutes", 0, "must be a positive number of minutes"),
    )
    hostfile: Path | None = shared(
        "hostfile",
        note="the benchmark and a run of the recommended config span its hosts (the inter-node link "
        "measured); the trials run on one host",
        panel=INPUTS_PANEL,
    )
    gpus_per_node: int | None = shared(
        "gpus_per_node",
        None,
        note="of the target cluster; default: this machine's",
        check=above("--gpus-per-node", 1, "must be at least 1", inclusive=True),
    )
    inter_node_gbps: float | None = option(
        None, "achievable inter-node bandwidth per NIC, Gbit/s (describes the target network)."
    )
    tune_buckets: bool = option(
        False, "also try overlap_comm and reduce bucket sizes, measured only where predicted to matter."
    )
    nics_per_node: int | None = option(
        None, "inter-node NICs per node (rail-optimised: one per GPU); default: preset's, else 1."
    )
    inter_node_latency_us: float | None = option(None, "inter-node latency per ring hop, microseconds.")
    preset: str | None = option(
        None,
        f"named inter-node fabric: {', '.join(PRESETS)}; or a whole machine (its NVLink domain, intra-node "
        f"link and NICs): {', '.join(MACHINES)} (figures and sources in advisor/model/network.py).",
    )
    global_batch: str | None = option(
        None,
        "global batch target, e.g. 256, or a range 256-1024; default: the base config's on one "
        "target node, kept at every node count (strong scaling).",
    )
    headroom: float = option(
        0.1,
        "fraction of device memory left free.",
        check=fraction("--headroom", "a fraction in [0, 1), e.g. 0.1 keeps 10% of memory free", upper=False),
    )
    device_memory_gib: float | None = option(
        None,
        "device memory per rank of the target; required when it is not this machine.",
        check=above("--device-memory-gib", 0, "must be a positive number of GiB"),
    )
    target_gpu: str | None = option(
        None, f"the target's GPU, for its memory: {', '.join(TARGET_GPUS)}.", check=known_gpu
    )
    min_efficiency: float = option(
        DEFAULT_MIN_EFFICIENCY,
        "recommend the largest node count keeping this scaling efficiency (0-1].",
        check=fraction("--min-efficiency", "a fraction in (0, 1], e.g. 0.8", upper=True),
    )
    nodes: int | None = shared(
        "nodes",
        None,
        note="recommend for this node count instead of choosing by efficiency",
        check=passing(node_counts),  # the same bounds as --max-nodes
    )
    lr_scaling: str = shared("lr_scaling", DEFAULT_LR_SCALING, check=check_rule)
    lr_reference_batch: int | None = shared(
        "lr_reference_batch",
        help="global batch the base LR was tuned for; default: the base config's on one node",
        check=above("--lr-reference-batch", 1, "must be at least 1", inclusive=True),
    )
    train_args: Sequence[str] = shared(
        "train_args",
        (),
        note="also in the recommended launch; checked by the trainer's parser",
        check=check_train_args,  # the words, split and checked
        command_type=str,
        command_default="",
    )
    samples: int | None = option(
        None,
        "samples in one epoch, for the time to train (default: the images in --data).",
        check=above("--samples", 1, "the samples in one epoch, at least 1", inclusive=True),
    )
    epochs: float | None = option(
        None,
        "epochs to train (default 1), for the time to train.",
        check=above("--epochs", 0, "must be a positive number of epochs"),
    )
    gpu_hour_price: float | None = option(
        None,
        "price of one GPU-hour: the cost to train beside the GPU-hours.",
        check=above("--gpu-hour-price", 0, "must be a positive price per GPU-hour"),
    )
    deadline_hours: float | None = option(
        None, "choose the node count with the fewest GPU-hours that finishes within these hours."
    )
    max_gpu_hours: float | None = option(
        None, "choose the node count that finishes soonest within these GPU-hours."
    )
    loader_workers: int | None = option(
        None,
        "loader workers per rank of the planned run, for its input rate (default: the trials').",
        check=above("--loader-workers", 0, "must be a positive number"),
    )
    cpu_cores_per_node: int | None = option(
        None,
        "cores a target node's loader workers may use (default: this machine's, if alike).",
        check=above("--cpu-cores-per-node", 0, "must be a positive number"),
    )
    storage_gbps: float | None = option(
        None,
        "aggregate read rate of the shared storage holding --data, Gbit/s (all nodes together).",
        check=above("--storage-gbps", 0, "must be a positive number"),
    )
    replan: Path | None = option(
        None,
        "answer again from OUT's trials, link probes and fits for other target, batch or training "
        "options, measuring nothing (seconds, no process group); OUT may also be a training run's folder "
        "(metrics.jsonl, ds_config.json) or a profile file (docs/advisor.md section 2c).",
        metavar="OUT",
        show_default=False,
    )
    target_tflops: float | None = option(
        None,
        "the target's sustained TFLOP/s per GPU (assumed): its compute when the trials ran elsewhere.",
        check=passing(check_target_rate),
    )
    samples_rule: str = option(
        "same",
        "samples a larger global batch needs for the same quality: same, flux (8x batch: 2.1x samples), sd2.",
        check=passing(samples_rule),
    )
    checkpointing: str = option(
        "off",
        "gradient checkpointing as a knob of the search: off, or both (each micro-batch with and "
        "without it, measured in the same launch; the answer says what it costs and what it allows).",
        check=checkpointing_choice,
    )
    host_memory_gib: float | None = option(
        None,
        "RAM of one target node, GiB: offloaded states, pinned buffers, a CPU EMA, loader workers and "
        "a latent cache's page cache must fit in it (default: a --preset's, else this machine's).",
        check=above("--host-memory-gib", 0, "give the RAM of one node in GiB, above 0"),
    )
    explain: bool = option(
        False,
        "after the short answer, the full detail: node-count rule, LR, errors, where the intervals come "
        "from, runners-up, config and launch (the report holds the same; with --replan OUT: in seconds).",
        flags=("--explain",),
    )
    # not options of the command: what tests, benches and the command itself set
    grid: GridRequest | None = None
    """The trial grid; None: CPU_GRID on a CPU, the full default GridRequest on GPUs."""
    comm_budget_s: float | None = None
    """Seconds for the collectives benchmark; None: 15 on a CPU, 60 on GPUs."""
    log: Callable[[str], None] | None = None
    """Where progress lines go (the command prints them dimmed on stderr); None: nowhere."""
