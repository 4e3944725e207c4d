"""The advisor's inputs: the model and data (the embedded default when none is given) and the trainer
options a user adds to every trial (--train-args)."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from sdzero.errors import UserError

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


def check_train_args(train_args: Sequence[str] | str) -> tuple[str, ...]:
    """The user's extra trainer options (--resolution, --cache-dir, --gradient-checkpointing, ...), which
    change what a step costs and so must be measured; checked by the trainer's own parser, and refused if
    they take over what the trials set."""
    from sdzero.config.train_config import build_parser, given_train_options

    args = tuple(shlex.split(train_args)) if isinstance(train_args, str) else tuple(train_args)
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
            write_synthetic_dataset(data, images=64, size=40)
    return model, Path(data)
