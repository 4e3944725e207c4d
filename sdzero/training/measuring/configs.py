"""A launch's configs and its options: `--profile-configs MB:GA[:gc],...` with `--profile-out FILE`, parsed and
checked before the slow start-up (`plan_sweep`), and each config's standing in the launch (`Entry`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sdzero.constants import GIB
from sdzero.errors import UserError
from sdzero.training.measuring.config_probe import ConfigProbe
from sdzero.training.measuring.probe import StopRule, stop_rule


@dataclass(frozen=True)
class SweepConfig:
    """One config of a launch: the micro-batch fed to the engine, the accumulation it is told and whether
    the network recomputes its activations in the backward (gradient checkpointing)."""

    micro_batch: int
    grad_accum: int
    checkpointing: bool = False

    @property
    def key(self) -> str:
        return f"mb{self.micro_batch}-ga{self.grad_accum}" + ("-gc" if self.checkpointing else "")


def parse_configs(text: str) -> list[SweepConfig]:
    """`1:1,2:1,4:4,8:1:gc` -> configs (`:gc`: with gradient checkpointing); one clear line for anything
    else."""
    configs: list[SweepConfig] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        pieces = part.split(":")
        gc = len(pieces) == 3 and pieces[2].strip() == "gc"
        try:
            mb, ga = (int(pieces[0]), int(pieces[1]) if len(pieces) > 1 else 1)
        except ValueError:
            mb, ga = 0, 0
        if len(pieces) > (3 if gc else 2) or mb < 1 or ga < 1:
            raise UserError(
                f"--profile-configs {text!r}: write MICRO_BATCH:ACCUMULATION pairs, e.g. 1:1,4:1,4:4, and "
                "MICRO_BATCH:ACCUMULATION:gc for one with gradient checkpointing"
            )
        configs.append(SweepConfig(mb, ga, gc))
    if not configs or len(set(configs)) != len(configs):
        raise UserError(f"--profile-configs {text!r}: at least one config, each once")
    return configs


@dataclass(frozen=True)
class SweepPlan:
    """What a launch measures and how long: its options, checked."""

    configs: list[SweepConfig]
    out: Path
    """--profile-out: the configs' profiles (and OUT.partial.json after every round)."""
    warmup_steps: int
    """--profile-warmup-steps: uncounted steps of the launch's first config."""
    stop_rule: StopRule
    """--profile-min-steps, --profile-max-seconds and --profile-target-halfwidth."""
    race: bool = False
    """--profile-race: configs clearly slower per sample than their leader stop being measured."""
    memory_cap_bytes: float = 0.0
    """--profile-memory-cap-gib: a config whose device peak is over it cannot be the pick (0: no cap)."""


def plan_sweep(cfg: Any) -> SweepPlan | None:
    """The launch's plan for `--profile-configs` (with `--profile-out`); None without it. One clear line for
    options that cannot work together."""
    text = getattr(cfg, "profile_configs", None)
    out = getattr(cfg, "profile_out", None)
    if not text:
        return None
    if not out:
        raise UserError("--profile-configs needs --profile-out FILE (where the configs' profiles go)")
    if getattr(cfg, "buckets", False):
        raise UserError("--profile-configs with --buckets: measure bucketed data one config per launch")
    return SweepPlan(
        parse_configs(text),
        Path(out),
        int(getattr(cfg, "profile_warmup_steps", 0) or 0),
        stop_rule(cfg),
        bool(getattr(cfg, "profile_race", False)),
        float(getattr(cfg, "profile_memory_cap_gib", 0.0) or 0.0) * GIB,
    )


@dataclass
class Entry:
    """One config's standing in the launch."""

    config: SweepConfig
    probe: ConfigProbe
    visits: int = 0
    oom: str | None = None
    """Why the config left the launch for its memory (it, or a smaller micro-batch of its kind, ran out)."""
    round_medians: list[float] = field(default_factory=list)
    raced: str | None = None
    """Why the config stopped being measured (`--profile-race`): slower per sample than the leader."""
