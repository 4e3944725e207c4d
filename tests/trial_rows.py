"""One ok trial's row of trials.csv as the advisor's unit tests build them: the columns every fit and
interval reads, bf16 without offload at accumulation 1, and whatever the test adds."""

from __future__ import annotations

from typing import Any


def ok_trial(stage: int, micro_batch: int, **columns: Any) -> dict[str, Any]:
    return {
        "status": "ok",
        "zero_stage": stage,
        "precision": "bf16",
        "micro_batch": micro_batch,
        "offload": "none",
        "grad_accum": 1,
        **columns,
    }
