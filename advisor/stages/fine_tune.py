"""The fine-tune the advisor plans for: the model and data (the embedded default when none is given), the
fine-tune the embedded default stands for, and the trainer options a user adds to every trial
(--train-args). (advisor.stages.inputs is the inputs *stage*, which reads these.)"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sdzero.errors import UserError


@dataclass(frozen=True)
class FineTune:
    """A fine-tune described by its global batch and its dataset: what the embedded default plans for."""

    global_batch: int
    """Held at every node count (strong scaling); also the batch its base LR is taken as tuned for."""
    dataset_images: int
    """Samples in one epoch."""
    synthetic_images: int
    """Images of the synthetic stand-in written into --out: at least one global batch, so the
    recommended launch trains on it as printed."""


EMBEDDED_FINE_TUNE = FineTune(global_batch=256, dataset_images=100_000, synthetic_images=256)
"""The embedded default plans a fine-tune of the kind the guides start from (a 100,000-image dataset,
global batch 256): a batch that 1 to 32 nodes of up to 8 ranks all reach, accumulating where a node
count has fewer ranks, so `sdzero advise --max-nodes 32` fills every row. Its trials still run the tiny
model on the synthetic images."""


def embedded_base(base: dict[str, Any], fine_tune: FineTune = EMBEDDED_FINE_TUNE) -> dict[str, Any]:
    """The shipped base JSON with the fine-tune's global batch as DeepSpeed's own `train_batch_size`: the
    one place the batch (and so the LR's reference batch, sdzero.config.lr_rule) is stated. Trials and the
    recommended JSON drop it again (advisor.measure.grid.trial_ds_config), since their batch follows
    micro-batch x accumulation x ranks."""
    return {**base, "train_batch_size": fine_tune.global_batch}


def dataset_images(data: Path) -> int:
    """Images listed in the folder's metadata.jsonl, or the samples of its tar shards (what one epoch
    trains on), 0 when unreadable: the trainer checks the data itself."""
    from sdzero.config.data_source import is_shard_source

    if is_shard_source(data):
        from sdzero.data.shards import read_records
        from sdzero.errors import UserError

        try:
            return len(read_records(data))  # the remembered index: no tar is read twice
        except UserError:
            return 0
    meta = Path(data) / "metadata.jsonl"
    try:
        with meta.open() as f:
            return sum(1 for line in f if line.strip() and isinstance(json.loads(line), dict))
    except (OSError, ValueError):
        return 0


ADVISOR_OWNED = (
    "--deepspeed_config",
    "--model",
    "--data",
    "--output-dir",
    "--max-steps",
    "--profile-out",
    "--profile-warmup-steps",
    "--local_rank",
)
"""Trainer options every trial sets itself: --train-args may not change them."""


def split_train_args(text: str, flag: str = "--train-args") -> list[str]:
    """The words of a shell-quoted option string; an unbalanced quote (once a traceback) is one line."""
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise UserError(
            f"{flag} {text!r}: {exc} (an unbalanced quote?); close the quote, or quote the whole value once"
        ) from None


def check_train_args(train_args: Sequence[str] | str) -> tuple[str, ...]:
    """The user's extra trainer options (--resolution, --cache-dir, --gradient-checkpointing, ...), which
    change what a step costs and so must be measured; checked by the trainer's own parser, and refused if
    they take over what the trials set."""
    from sdzero.config.train_config import build_parser, given_train_options

    args = tuple(split_train_args(train_args)) if isinstance(train_args, str) else tuple(train_args)
    given = given_train_options(args, "--train-args")
    owned = {build_parser()._option_string_actions[flag].dest for flag in ADVISOR_OWNED}
    for dest, name in given.items():
        if dest in owned:
            raise UserError(
                f"--train-args: {name} is set by the advisor for every trial (use --model, --data or "
                "--deepspeed-config of `sdzero advise` instead, or leave it out)"
            )
    return args


def default_inputs(out_dir: Path, model: str | None, data: Path | None) -> tuple[str, Path]:
    from sdzero.models.tiny import write_synthetic_dataset, write_tiny_model

    if model is None:
        model_dir = out_dir / "model"
        if not (model_dir / "model_index.json").exists():
            write_tiny_model(model_dir)
        model = str(model_dir)
    if data is None:
        data = out_dir / "data"
        if not (data / "metadata.jsonl").exists():
            write_synthetic_dataset(data, images=EMBEDDED_FINE_TUNE.synthetic_images, size=40)
    return model, Path(data)
