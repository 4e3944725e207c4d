"""The inputs stage: the request checked, the base config read, the trials' device asked what it runs
(this machine's, or with --hostfile on a machine without an accelerator the hostfile's first host's), the
model and data in place, and the trial grid planned. Bad input raises UserError here, before any trial starts
and before anything but the default model and data is written."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from advisor.decide.node_rules import NodeRule, node_rule
from advisor.measure.grid import GridPlan, GridRequest, load_base_config
from advisor.measure.profile import TrialsHost
from advisor.measure.trials import TrialSettings
from advisor.model.model_cost import ModelCost, count_model_cost
from advisor.model.network import build_network
from advisor.model.predict import BatchTarget, check_reachable, node_counts
from advisor.model.time_to_train import TrainAmount, train_amount
from advisor.stages.fine_tune import (
    EMBEDDED_FINE_TUNE,
    check_train_args,
    dataset_images,
    default_inputs,
    embedded_base,
)
from advisor.stages.request import CPU_GRID, AdviseRequest, checkpointing_choice
from advisor.stages.scaleout_check import prepare_hostfile
from advisor.stages.target import (
    machine_target,
    target_differs,
    target_memory,
)
from sdzero.config.command_options import check_options as check_declared
from sdzero.config.lr_rule import reference_batch as lr_reference_batch_of
from sdzero.errors import UserError


@dataclass
class AdviseInputs:
    """What every later stage works from; nothing has been measured yet."""

    request: AdviseRequest
    """The options as given (the stages read the target's network, budgets and choice rules from it)."""
    say: Callable[[str], None]
    """Where progress lines go."""
    out_dir: Path
    """request.out_dir, absolute and created."""
    node_list: list[int]
    """Node counts to predict: 1, 2, 4, ... max_nodes, and --nodes."""
    user_args: tuple[str, ...]
    """The user's --train-args, checked: for every trial and the recommended launch."""
    target: BatchTarget
    """The global batch aimed at: --global-batch, else the base config's on one target node."""
    target_asked: bool
    """Whether --global-batch gave the target (else strong scaling of the base config's batch)."""
    base: dict[str, Any]
    """The base DeepSpeed config every trial starts from."""
    base_batch: int
    """The base config's global batch on one target node: the default target and LR reference."""
    device: dict[str, Any]
    """The trials' device as DeepSpeed's accelerator reports it (advisor.measure.profile.device_support):
    this machine's, or the trials host's."""
    ranks: int
    """Ranks per trial: this machine's default, or the trials host's slots=."""
    target_gpus: int
    """Ranks (GPUs) per target node."""
    differs: str | None
    """Why the target is not nodes like this one; None when it is."""
    memory_given: tuple[float, str] | None
    """(GiB, source) of the target's device memory when the user gave it; None: measured here."""
    model: str
    data: Path
    settings: TrialSettings
    """What every trial shares (model, data, steps, timeouts, trainer options)."""
    setup: str
    """The setup hash under which trials.csv keeps this run's trials (a rerun resumes them)."""
    hosts: list[Any]
    """The hostfile's hosts, checked; empty without --hostfile."""
    plan: GridPlan
    notes: list[str]
    """The grid plan's notes: the first of the run's notes."""
    started: float
    """time.monotonic() once the inputs were ready: the budget counts from here."""
    amount: TrainAmount
    """How much training the time, GPU-hours and cost are for."""
    rule: NodeRule
    """How the node count is chosen."""
    embedded: bool = False
    """The embedded default's fine-tune (advisor.stages.fine_tune.EMBEDDED_FINE_TUNE) sets the batch: no --model and
    no --deepspeed-config."""
    model_cost: ModelCost | None = None
    """The trained network's FLOPs per sample, counted here (advisor.model.model_cost); None: not counted."""
    trials_host: TrialsHost | None = None
    """Where the trials run when not on this machine: the hostfile's first host (this machine has no
    accelerator); None: here."""

    @property
    def lr_reference(self) -> int:
        """The global batch the base LR is for: --lr-reference-batch, else the base batch."""
        return self.request.lr_reference_batch or self.base_batch

    @property
    def on_cpu(self) -> bool:
        return bool(self.device["device"] == "cpu")

    @property
    def micro_batches(self) -> list[int]:
        return grid_micro_batches(self.plan)


def grid_micro_batches(plan: GridPlan) -> list[int]:
    """Every micro-batch of the grid, ladder by ladder (repeats kept)."""
    return [s.micro_batch for ladder in plan.ladders for s in ladder]


def read_inputs(request: AdviseRequest) -> AdviseInputs:
    """Check the request, then read and write what the measurements need; refuse a target out of reach."""
    # Late imports: tests stand in for these (a CPU device) on their modules.
    from advisor.measure.profile import default_ranks, device_support, trial_setup_id, trials_on_first_host
    from sdzero.cluster.launch_command import shipped_config

    r = request
    say = r.log or (lambda message: None)
    node_list, user_args, asked, rule = check_request_options(r)
    base = load_base_config(
        Path(r.deepspeed_config) if r.deepspeed_config else shipped_config("zero2_bf16.json")
    )
    # No model and no JSON of the user's: the embedded default plans its realistic fine-tune's batch.
    embedded = r.model is None and r.deepspeed_config is None
    if embedded:
        base = embedded_base(base)
    device = device_support()
    out_dir = Path(r.out_dir).resolve()
    hosts: list[Any] = []
    trials_host = None
    if r.hostfile is not None and device["device"] == "cpu":
        # A login node: the trials run where the GPUs are, the hostfile's first host, so the device the
        # plan describes is that host's. Its check and env file come first: the question travels through
        # the launcher as the trials will.
        claim_out(out_dir)
        hosts = prepare_hostfile(r.hostfile, say)
        trials_host = trials_on_first_host(Path(r.hostfile), out_dir)
        device = trials_host.device
        say(
            f"trials run on {trials_host.host} ({trials_host.slots} ranks) through the launcher: this "
            "machine has no accelerator"
        )
    on_cpu = device["device"] == "cpu"
    ranks = trials_host.slots if trials_host else default_ranks(device)
    gpus_per_node, target_gpu = machine_target(r.preset, r.gpus_per_node, r.target_gpu)
    differs = target_differs(device, ranks, gpus_per_node, target_gpu)
    memory_given = target_memory(differs, r.device_memory_gib, target_gpu)  # refuses before any trial
    target_gpus = ranks if gpus_per_node is None else gpus_per_node
    claim_out(out_dir)  # one live run per folder, as the trainer's (issue #27); released at the end
    model, data = default_inputs(out_dir, r.model, r.data)
    amount = amount_for(r, data, embedded)
    # With a hostfile the trials run on one host: this one, or (no accelerator here) the first host; the
    # hosts' link is measured by the benchmark, and the recommended config is then run across the hosts
    # to check the scale-out prediction.
    hosts = hosts or prepare_hostfile(r.hostfile, say)
    settings = _trial_settings(model, data, on_cpu, user_args, trials_host)
    plan = trial_plan(
        with_checkpointing_knob(r.grid or (CPU_GRID if on_cpu else GridRequest()), r), device, ranks
    )
    cost, cost_note = counted_cost(model, user_args)
    source = InputSource(
        base=base,
        device=device,
        ranks=ranks,
        target_gpus=target_gpus,
        differs=differs,
        memory_given=memory_given,
        model=model,
        data=data,
        settings=settings,
        setup=trial_setup_id(base, settings),
        plan=plan,
        notes=[*plan.notes, *cost_note],
        amount=amount,
        user_args=user_args,
        hosts=hosts,
        embedded=embedded,
        model_cost=cost,
        trials_host=trials_host,
    )
    return build_inputs(r, out_dir, (node_list, user_args, asked, rule), source)


@dataclass
class InputSource:
    """What one source of measurements says of the run: the live run (read_inputs: this machine or the
    trials host), an advise folder (advisor.stages.replan) or a profile file or run folder
    (advisor.stages.profile_source). `build_inputs` makes the stages' inputs of it, the same way for all."""

    base: dict[str, Any]
    device: dict[str, Any]
    ranks: int
    target_gpus: int
    differs: str | None
    memory_given: tuple[float, str] | None
    model: str
    data: Path
    settings: TrialSettings
    setup: str
    plan: GridPlan
    notes: list[str]
    amount: TrainAmount
    user_args: tuple[str, ...] = ()
    hosts: list[Any] = field(default_factory=list)
    started: float | None = None
    """time.monotonic() the run's budget counts from; None: now."""
    embedded: bool = False
    model_cost: ModelCost | None = None
    trials_host: TrialsHost | None = None


CheckedRequest = tuple[list[int], tuple[str, ...], BatchTarget | None, NodeRule]
"""check_request_options' answer: (node counts, --train-args, --global-batch, the node-count rule)."""


def build_inputs(
    r: AdviseRequest, out_dir: Path, checked: CheckedRequest, source: InputSource
) -> AdviseInputs:
    """The stages' inputs from a checked request and one source: the target's batch (--global-batch, else
    strong scaling of the base JSON's batch on one target node, the LR's reference too), refused where no
    grid micro-batch reaches it."""
    node_list, _, asked, rule = checked
    base_batch = lr_reference_batch_of(source.base, source.target_gpus)
    target = asked or BatchTarget(base_batch, base_batch)
    _refuse_unreachable(source.plan, source.target_gpus, node_list, target, asked is not None, base_batch)
    return AdviseInputs(
        request=r,
        say=r.log or (lambda message: None),
        out_dir=out_dir,
        node_list=node_list,
        user_args=source.user_args,
        target=target,
        target_asked=asked is not None,
        base=source.base,
        base_batch=base_batch,
        device=source.device,
        ranks=source.ranks,
        target_gpus=source.target_gpus,
        differs=source.differs,
        memory_given=source.memory_given,
        model=source.model,
        data=source.data,
        settings=source.settings,
        setup=source.setup,
        hosts=source.hosts,
        plan=source.plan,
        notes=source.notes,
        started=time.monotonic() if source.started is None else source.started,
        amount=source.amount,
        rule=rule,
        embedded=source.embedded,
        model_cost=source.model_cost,
        trials_host=source.trials_host,
    )


def counted_cost(model: str, user_args: tuple[str, ...]) -> tuple[ModelCost | None, list[str]]:
    """The model's FLOPs per sample, or None and a note saying why they could not be counted (a network
    the meta device cannot build): the answer then has no target compute from a rate."""
    try:
        return count_model_cost(model, user_args), []
    except (OSError, ValueError, RuntimeError, KeyError, TypeError, NotImplementedError, UserError) as exc:
        return None, [f"the model's FLOPs per sample could not be counted ({type(exc).__name__}: {exc})"]


def claim_out(out_dir: Path) -> None:
    """The trainer's one-live-run lock (sdzero.checkpoint.output_lock) on --out: two advise runs in one
    folder would append to one trials.csv and overwrite each other's answer."""
    from sdzero.checkpoint.output_lock import claim_output_dir

    try:
        claim_output_dir(out_dir)
    except UserError as exc:
        raise UserError(str(exc).replace("--output-dir", "--out")) from None


def amount_for(r: AdviseRequest, data: Path, embedded: bool) -> TrainAmount:
    """--samples x --epochs, an epoch being the data's images by default (see dataset_size)."""
    return train_amount(r.samples, r.epochs, *dataset_size(r, data, embedded))


def dataset_size(r: AdviseRequest, data: Path, embedded: bool) -> tuple[int, str]:
    """(images in one epoch, where that figure comes from): the data folder's, or for the embedded default
    its fine-tune's dataset, for which the synthetic images stand in."""
    if embedded and r.data is None:
        return EMBEDDED_FINE_TUNE.dataset_images, "the embedded default's fine-tune"
    return dataset_images(data), f"the images in {data}"


def check_request_options(
    r: AdviseRequest,
) -> CheckedRequest:
    """The checks that need nothing but the request: each option's own (declared with it in
    advisor.stages.request), then those of several options together. Returns (node counts, --train-args,
    --global-batch, the node-count rule)."""
    check_declared(r)
    node_list = sorted({*node_counts(r.max_nodes), *(() if r.nodes is None else (r.nodes,))})
    user_args = check_train_args(r.train_args)
    check_checkpointing(r.checkpointing, user_args)
    # the target network's flags together: a bad --preset fails before anything is written
    build_network(
        None,
        machine_target(r.preset, r.gpus_per_node, None)[0] or 1,
        r.preset,
        r.inter_node_gbps,
        r.inter_node_latency_us,
        r.nics_per_node,
    )
    rule = node_rule(r.min_efficiency, r.nodes, r.deadline_hours, r.max_gpu_hours)
    return node_list, user_args, BatchTarget.parse(r.global_batch), rule


def _trial_settings(
    model: str, data: Path, on_cpu: bool, user_args: tuple[str, ...], trials_host: TrialsHost | None = None
) -> TrialSettings:
    """Short trials on one host (this one, or `trials_host` through its one-host hostfile): 5 measured
    steps after 1 warm-up step on a CPU, 2 on GPUs."""
    from advisor.measure.profile import trial_settings

    steps, warmup = (5, 1) if on_cpu else (5, 2)
    # The user's options last: they override the CPU default (argparse keeps the last value).
    train_args = (*(("--num-workers", "1") if on_cpu else ()), *user_args)
    hostfile = trials_host.hostfile if trials_host else None
    settings = trial_settings(model, data, steps, warmup, 900.0, 300.0, None, hostfile, train_args)
    # advise races each launch's configs: the search needs the pick, not every config's figure to the end
    return replace(settings, race=True)


def with_checkpointing_knob(grid: GridRequest, r: AdviseRequest) -> GridRequest:
    """The grid with gradient checkpointing as a knob (`--checkpointing both`): every micro-batch with and
    without it."""
    return replace(grid, checkpointing=(False, True)) if r.checkpointing == "both" else grid


def check_checkpointing(choice: str, user_args: tuple[str, ...]) -> None:
    checkpointing_choice(choice)
    if choice == "both" and "--gradient-checkpointing" in user_args:
        raise UserError(
            "--checkpointing both with --train-args --gradient-checkpointing: the search measures each "
            "config with and without it; drop the trainer flag"
        )


def trial_plan(grid: GridRequest, device: dict[str, Any], ranks: int) -> GridPlan:
    """The grid at `ranks` per trial unless it names its own (the trials host's slots= where trials run
    there; plan_for_device's default, this machine's count, otherwise)."""
    from advisor.measure.profile import plan_for_device

    if not grid.ranks_per_node:
        grid = replace(grid, ranks_per_node=(ranks,))
    return plan_for_device(grid, device)


def _refuse_unreachable(
    plan: GridPlan, target_gpus: int, node_list: list[int], target: BatchTarget, asked: bool, base_batch: int
) -> None:
    """A global batch no grid micro-batch reaches at any node count: refused, naming where it came from."""
    try:
        check_reachable(grid_micro_batches(plan), target_gpus, node_list, target)
    except UserError as exc:
        if asked:
            raise
        raise UserError(
            f"the base config's global batch {base_batch} (kept at every node count unless "
            f"--global-batch says otherwise) is out of reach: {exc}"
        ) from None
