"""The DeepSpeed JSON checked by DeepSpeed's own config code before any process group or output exists.

DeepSpeed validates its blocks with pydantic models (zero_optimization, fp16/bf16, the monitors, comms,
compile, ...) and a few hand-written readers (checkpoint), but only inside `deepspeed.initialize`, on
every rank, after the process group and the output folder exist: an unknown nested key or a wrongly
typed value ended in a ValidationError traceback there. Here the same code runs on the JSON alone
(`DeepSpeedConfig._initialize_params`: the readers, without the world-size logic that needs a process
group), and its first complaint becomes one line naming the key and what DeepSpeed expects.

Two things DeepSpeed checks only when training starts are checked here too: the `scheduler` block (built
by DeepSpeed's engine from its `type` and `params`; here built the same way on a throw-away optimizer), and
`gradient_clipping`, which DeepSpeed reads as given (a string failed at the first optimizer step, a
negative number clipped every gradient to nothing without a word).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from sdzero.errors import UserError


def check_with_deepspeed(raw: dict[str, Any], path: Path) -> None:
    check_gradient_clipping(raw, path)
    check_deepspeed_models(raw, path)
    check_scheduler(raw, path)


def check_gradient_clipping(raw: dict[str, Any], path: Path) -> None:
    if "gradient_clipping" not in raw:
        return
    value = raw["gradient_clipping"]
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not (number and math.isfinite(value) and value >= 0):
        raise UserError(
            f'{path}: "gradient_clipping" must be a finite number >= 0 (0: no clipping), got {json.dumps(value)}; '
            "set it to a number such as 1.0"
        )


def _dotted(parts: tuple[Any, ...]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _deepspeed_complaint(raw: dict[str, Any]) -> BaseException | None:
    from deepspeed.runtime.config import DeepSpeedConfig

    reader = DeepSpeedConfig.__new__(DeepSpeedConfig)  # the readers only: no process group, no world size
    reader._param_dict = raw
    try:
        reader._initialize_params(copy.deepcopy(raw))
    except Exception as exc:  # pydantic's ValidationError, DeepSpeedConfigError, and plain Python errors
        return exc
    return None


def check_deepspeed_models(raw: dict[str, Any], path: Path) -> None:
    """One line for DeepSpeed's first complaint, naming the key: the pydantic error's location within the
    block, the block found by reading each top-level key alone."""
    from pydantic import ValidationError

    complaint = _deepspeed_complaint(raw)
    if complaint is None:
        return
    block = next((key for key in raw if _deepspeed_complaint({key: raw[key]}) is not None), None)
    if isinstance(complaint, ValidationError):
        error = complaint.errors()[0]
        inner = _dotted(tuple(error.get("loc", ())))
        within = block is not None and inner.split(".")[0] == block  # monitors' locations hold their block
        key = (inner if within else ".".join(filter(None, (block, inner)))) or complaint.title
        if error.get("type") == "extra_forbidden":
            what = "DeepSpeed has no such setting; remove it or correct its spelling"
        else:
            what = f"DeepSpeed expects: {error.get('msg', '')}; got {json.dumps(error.get('input'), default=str)[:80]}"
    else:
        key = block or "<config>"
        what = f"DeepSpeed's config reader says: {_first_line(complaint)}"
    if block is not None and not isinstance(raw[block], dict) and not isinstance(complaint, ValidationError):
        what += f' ("{block}" must be an object)'
    raise UserError(f'{path}: "{key}": {what}')


def check_scheduler(raw: dict[str, Any], path: Path) -> None:
    """The `scheduler` block built as DeepSpeed's engine builds it (deepspeed.runtime.lr_schedules, else
    torch.optim.lr_scheduler, called with the block's params), on a one-parameter optimizer."""
    if "scheduler" not in raw:
        return
    block = raw["scheduler"]
    if not isinstance(block, dict):
        raise UserError(
            f'{path}: "scheduler" must be an object such as {{"type": "WarmupLR", "params": {{}}}}'
        )
    import torch
    from deepspeed.runtime import lr_schedules

    kind = block.get("type")
    known = sorted(lr_schedules.VALID_LR_SCHEDULES)
    cls = None
    if isinstance(kind, str):
        cls = (
            getattr(lr_schedules, kind, None)
            if kind in known
            else getattr(torch.optim.lr_scheduler, kind, None)
        )
    if not isinstance(cls, type):
        raise UserError(
            f'{path}: "scheduler.type" {json.dumps(kind)} is not a scheduler DeepSpeed knows; use one of '
            f"{', '.join(known)} or a torch.optim.lr_scheduler class name"
        )
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise UserError(f'{path}: "scheduler.params" must be an object, got {json.dumps(params)[:80]}')
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    try:
        cls(optimizer, **params)
    except Exception as exc:  # TypeError for an unknown name, ValueError/AssertionError for a bad value
        raise UserError(
            f'{path}: "scheduler.params" do not build DeepSpeed\'s {kind} ({_first_line(exc)}); fix them'
        ) from None
