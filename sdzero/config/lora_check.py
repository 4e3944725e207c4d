"""The LoRA options' own checks, made before anything loads (the targets are checked against the network
once its family is known: sdzero.models.lora.check_targets)."""

from __future__ import annotations

from typing import Any

from sdzero.errors import UserError

MAX_LORA_RANK = 4096
"""Above the width of every projection of the supported families: a rank past it is a typo, not a LoRA."""


def check_lora_numbers(cfg: Any) -> None:
    """--lora-rank, --lora-alpha, --lora-dropout and --lora-target-modules: one line per mistake."""
    rank = cfg.lora_rank
    if rank is None:
        given = [
            flag
            for flag, value in (
                ("--lora-alpha", cfg.lora_alpha is not None),
                ("--lora-dropout", cfg.lora_dropout != 0.0),
                ("--lora-target-modules", bool(cfg.lora_target_modules)),
                ("--export-merged", bool(getattr(cfg, "export_merged", False))),
            )
            if value
        ]
        if given:
            raise UserError(
                f"{', '.join(given)}: LoRA options without --lora-rank; add --lora-rank R (e.g. 16)"
            )
        return
    if getattr(cfg, "export_merged", False) and not getattr(cfg, "export_final", False):
        raise UserError("--export-merged writes into <output-dir>/final: add --export-final")
    if not 1 <= rank <= MAX_LORA_RANK:
        raise UserError(f"--lora-rank must be an integer in [1, {MAX_LORA_RANK}] (e.g. 4-64), got {rank}")
    if cfg.lora_alpha is not None and not cfg.lora_alpha > 0:
        raise UserError(f"--lora-alpha must be positive (scale = alpha / rank), got {cfg.lora_alpha}")
    if not 0 <= cfg.lora_dropout < 1:
        raise UserError(f"--lora-dropout must be in [0, 1), got {cfg.lora_dropout}")
    for name in cfg.lora_target_modules:
        if not name.strip() or name != name.strip() or "," in name:
            raise UserError(
                f"--lora-target-modules: {name!r} is not a module name; give names separated by spaces, "
                "e.g. --lora-target-modules to_q to_k to_v to_out.0"
            )
