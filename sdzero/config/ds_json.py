"""Reading a DeepSpeed JSON and refusing nonsense in it before anything launches.

DeepSpeed checks little of its JSON itself, and what it does check it checks after the process group
exists: `"bf16": true` ends in an AttributeError traceback inside its config parser, an unknown optimizer
type in an assert on every rank, and a negative or string learning rate is handed to the optimizer as is
(a negative one trains in the wrong direction without a word). Each check here turns one of those into a
single line naming the key and the fix, raised by `sdzero.config.train_config.load_ds_config` before
`init_distributed`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from sdzero.config.user_file import read_user_bytes
from sdzero.errors import UserError

PRECISION_BLOCKS = ("fp16", "bf16", "bfloat16")
"""Top-level blocks DeepSpeed reads as {"enabled": bool, ...} objects (bfloat16: DeepSpeed's old name)."""


def read_ds_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or one UserError saying why it is not one (bytes that are not UTF-8 too:
    `Path.read_text` would decode them in the locale's encoding, or raise a UnicodeDecodeError traceback)."""
    flag = f"--deepspeed_config {path}"
    data = read_user_bytes(path, "--deepspeed_config")  # a FIFO or /dev/zero: one line, nothing read
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(
            f"{flag}: not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}); save it as UTF-8 "
            "JSON (e.g. `iconv -f latin1 -t utf-8`)"
        ) from None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{flag}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise UserError(
            f"{flag}: nested deeper than {MAX_JSON_DEPTH} levels; not a DeepSpeed config"
        ) from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise UserError(
            f"{flag}: holds an integer of more than {sys.get_int_max_str_digits()} digits; not a DeepSpeed config"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(f"{flag}: the top level must be a JSON object, not a {type(raw).__name__}")
    check_json_bounds(raw, flag)
    return raw


MAX_JSON_DEPTH = 32
"""DeepSpeed's configs nest a few levels; far deeper is not a config, and the recursive checks below
(and DeepSpeed's) would hit Python's recursion limit on it."""
MAX_JSON_INT = 2**63 - 1
"""Every integer DeepSpeed reads (sizes, counts, steps) is a 64-bit one in the end."""


def check_json_bounds(raw: Any, flag: str) -> None:
    """Depth and integer size, walked without recursion: one line naming the key that breaks a bound."""
    stack: list[tuple[Any, str, int]] = [(raw, "", 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise UserError(
                f'{flag}: "{where}" is nested deeper than {MAX_JSON_DEPTH} levels; not a DeepSpeed config'
            )
        if isinstance(node, int) and not isinstance(node, bool) and abs(node) > MAX_JSON_INT:
            raise UserError(
                f'{flag}: "{where}" is an integer of {len(str(abs(node)))} digits, beyond 64 bits; no DeepSpeed '
                "setting holds such a number"
            )
        if isinstance(node, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in node.items()]
        elif isinstance(node, list):
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(node)]


def find_auto(node: Any, where: str = "") -> str | None:
    """The dotted key (list items as [i]) of the first "auto" anywhere in `node`, or None."""
    if node == "auto":
        return where or "<root>"
    items: Any = ()
    if isinstance(node, dict):
        items = ((f"{where}.{key}" if where else str(key), value) for key, value in node.items())
    elif isinstance(node, list):
        items = ((f"{where}[{i}]", value) for i, value in enumerate(node))
    for key, value in items:
        found = find_auto(value, key)
        if found:
            return found
    return None


def _is_number(value: Any) -> bool:
    """A JSON number (bool is an int to Python, not to JSON)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_precision_blocks(raw: dict[str, Any], path: Path) -> None:
    for name in PRECISION_BLOCKS:
        if name not in raw:
            continue
        block = raw[name]
        if not isinstance(block, dict):
            raise UserError(
                f'{path}: "{name}" must be an object such as {{"enabled": true}}, got {json.dumps(block)}; '
                f'write "{name}": {{"enabled": {"true" if block is True else "false"}}}'
            )
        enabled = block.get("enabled", False)
        if not isinstance(enabled, bool):
            raise UserError(f'{path}: "{name}.enabled" must be true or false, got {json.dumps(enabled)}')


def zero_stage_of(raw: dict[str, Any], path: Path) -> int:
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise UserError(f'{path}: "zero_optimization" must be an object such as {{"stage": 2}}')
    stage = zero.get("stage", 0)
    # `true == 1` and `2.0 == 2` in Python: without the type check they would pass as stages 1 and 2.
    if not isinstance(stage, int) or isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise UserError(
            f'{path}: "zero_optimization.stage" must be 0, 1, 2 or 3 (an integer), got {json.dumps(stage)}'
        )
    return stage


def known_optimizer(name: str) -> bool:
    """What DeepSpeed's engine accepts: its own optimizers by any case, else a torch.optim class by its
    exact name (deepspeed.runtime.engine `_is_supported_optimizer`, after config.py lower-cases its own)."""
    import torch
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    if name.lower() in DEEPSPEED_OPTIMIZERS:
        return True
    found = getattr(torch.optim, name, None)
    return isinstance(found, type) and issubclass(found, torch.optim.Optimizer)


def check_optimizer(raw: dict[str, Any], path: Path) -> None:
    """The optimizer block: a known type, a finite positive lr, betas two numbers in [0, 1), and eps and
    weight_decay finite numbers (eps > 0, weight_decay >= 0). No block at all is fine: the trainer then
    builds torch's AdamW itself (sdzero.training.engine)."""
    if "optimizer" not in raw:
        return
    block = raw["optimizer"]
    if not isinstance(block, dict):
        raise UserError(
            f'{path}: "optimizer" must be an object such as {{"type": "AdamW", "params": {{...}}}}'
        )
    kind = block.get("type")
    if not isinstance(kind, str) or not known_optimizer(kind):
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

        raise UserError(
            f'{path}: "optimizer.type" {json.dumps(kind)} is not an optimizer DeepSpeed knows; use one of '
            f"{', '.join(DEEPSPEED_OPTIMIZERS)} (any case) or a torch.optim class name such as SGD"
        )
    params = block.get("params", {})
    if not isinstance(params, dict):
        raise UserError(f'{path}: "optimizer.params" must be an object such as {{"lr": 1e-4}}')
    for key, low, low_ok, example in (("lr", 0.0, False, "1e-4"), ("eps", 0.0, False, "1e-8")):
        _check_bound(params, key, low, low_ok, path, example)
    _check_bound(params, "weight_decay", 0.0, True, path, "0.01")
    if "betas" in params:
        betas = params["betas"]
        if not (
            isinstance(betas, list) and len(betas) == 2 and all(_is_number(b) and 0 <= b < 1 for b in betas)
        ):
            raise UserError(
                f'{path}: "optimizer.params.betas" must be two numbers in [0, 1), such as [0.9, 0.999]; '
                f"got {json.dumps(betas)}"
            )


def _check_bound(
    params: dict[str, Any], key: str, low: float, low_ok: bool, path: Path, example: str
) -> None:
    if key not in params:
        return
    value = params[key]
    fine = _is_number(value) and math.isfinite(value) and (value >= low if low_ok else value > low)
    if not fine:
        bound = f">= {low:g}" if low_ok else f"> {low:g}"
        raise UserError(
            f'{path}: "optimizer.params.{key}" must be a finite number {bound}, got {json.dumps(value)}; '
            f"set it to a number such as {example}"
        )


def check_ds_values(raw: dict[str, Any], path: Path) -> int:
    """Every check above, in the order a reader of the file meets the keys; returns the ZeRO stage."""
    auto = find_auto(raw)
    if auto:
        raise UserError(
            f'{path}: "{auto}" is "auto", which only Hugging Face accelerate resolves; DeepSpeed needs a '
            "number there"
        )
    check_precision_blocks(raw, path)
    stage = zero_stage_of(raw, path)
    check_optimizer(raw, path)
    return stage
