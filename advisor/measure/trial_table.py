"""trials.csv: one row per finished trial of a setup, its columns, and reading and writing it.

Rows are added as trials end (`append_row`) and the whole table is written again, atomically, each time
(the runner also rewrites it when a bracket corrects the rows for drift): a killed run never leaves half a
row. A torn last row from anything else is left out on reading (advisor.measure.csv_tables).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import pandas as pd

from advisor.measure.contention import is_contended
from advisor.measure.csv_tables import read_whole_rows
from advisor.measure.grid import TrialSpec
from advisor.measure.trials import TrialOutcome, TrialSettings, profile_columns, trial_step_times
from sdzero.atomic import write_csv_atomic
from sdzero.errors import UserError

TRIAL_COLUMNS: tuple[str, ...] = (
    "trial_id",
    "setup_id",
    "status",
    "reason",
    "zero_stage",
    "precision",
    "micro_batch",
    "offload",
    "ranks_per_node",
    "nodes",
    "overlap_comm",
    "reduce_bucket_size",
    "allgather_bucket_size",
    "grad_accum",
    "checkpointing",
    "world_size",
    "global_batch",
    "samples_per_s",
    "step_time_s",
    "step_time_median_s",
    "data_s",
    "encode_s",
    "forward_s",
    "backward_s",
    "optimizer_s",
    "ds_fwd_s",
    "ds_bwd_s",
    "ds_bwd_inner_s",
    "ds_bwd_allreduce_s",
    "ds_step_s",
    "comm_s",
    "comm_bytes",
    "comm_ops",
    "comm_min_s",
    "comm_max_s",
    "trained_params",
    "params_bytes",
    "grads_bytes",
    "master_bytes",
    "optimizer_bytes",
    "model_state_bytes",
    "model_state_bytes_per_rank",
    "bucket_bytes",
    "offloaded_bytes",
    "frozen_bytes",
    "activation_bytes",
    "device_peak_bytes",
    "peak_rss_bytes",
    "cuda_peak_bytes",
    "warmup_steps",
    "measured_steps",
    "stopped_by",
    "step_s_raw",
    "step_s_raw_lo",
    "step_s_raw_hi",
    "step_s_lo",
    "step_s_hi",
    "drift_factor",
    "drift_uncertainty",
    "bracketed",
    "contended",
    "others_cpu_share",
    "measured_at",
    "wall_s",
    "finished_at",
    "trial_dir",
    "notes",
    "log_tail",
)
"""trials.csv, one row per finished trial. Bytes are per rank (the largest rank's where ranks differ);
`model_state_bytes_per_rank` holds every rank's bytes by kind as JSON. Times are per optimizer step.

Step times and noise: `step_s_raw` is the median measured step and `step_s_raw_lo`/`_hi` its 95% interval
(sdzero.telemetry.step_interval); `drift_factor` is how much slower the machine ran the row's launch's tie
than the first launch's (advisor.measure.launch; 1.0: none measured), `bracketed` whether it was applied.
`step_time_median_s` (what the models fit), `step_time_s` and `samples_per_s` are on the first launch's
machine speed; `step_s_lo`/`_hi` are that median's interval. `contended`: other processes took more than
CONTENDED_SHARE of the cores while its launch measured (`others_cpu_share`); `measured_at`: epoch seconds,
the median of its timed steps' ends; `stopped_by`: what ended its measuring (`launch`: its launch's time)."""

LEGACY_COLUMNS: tuple[str, ...] = tuple(c for c in TRIAL_COLUMNS if c != "checkpointing")
"""trials.csv as sdzero wrote it before gradient checkpointing was a knob of the grid."""

TEXT_COLUMNS: tuple[str, ...] = (
    "trial_id",
    "setup_id",
    "status",
    "reason",
    "precision",
    "offload",
    "notes",
    "stopped_by",
)
"""Read back as text: a setup hash such as '5e1234567890' would otherwise come back as a float (here
inf), match no setup, and make a resumed profile forget every finished trial."""


def read_trials(path: Path) -> pd.DataFrame:
    """The rows so far; an empty table with the right columns when there is no file yet. A torn last row
    (a writer killed mid-row) is left out (advisor.measure.csv_tables)."""
    if not path.exists():
        return pd.DataFrame(columns=list(TRIAL_COLUMNS))
    table = read_whole_rows(path, dtype={c: str for c in TEXT_COLUMNS})
    if table.empty and not len(table.columns):  # not even a whole header
        return pd.DataFrame(columns=list(TRIAL_COLUMNS))
    if tuple(table.columns) == LEGACY_COLUMNS:  # written before checkpointing was a knob: none had it
        table.insert(TRIAL_COLUMNS.index("checkpointing"), "checkpointing", False)
    if tuple(table.columns) != TRIAL_COLUMNS:
        raise UserError(
            f"{path}: its columns are not those this sdzero writes (another version made it); "
            "move it away or choose another --out"
        )
    return table


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Add one trial: the table is written again whole, atomically, so a killed run leaves the table as it
    was before the row or with it, never half a row."""
    frame = pd.DataFrame([row]).reindex(columns=list(TRIAL_COLUMNS))
    before = read_trials(path)
    write_trials(path, pd.concat([before, frame], ignore_index=True) if len(before) else frame)


def write_trials(path: Path, table: pd.DataFrame) -> None:
    """Replace trials.csv with `table` (atomically)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_csv_atomic(table.reindex(columns=list(TRIAL_COLUMNS)), path)


def trial_row(
    spec: TrialSpec, outcome: TrialOutcome, setup: str, settings: TrialSettings, trial_dir: Path
) -> dict[str, Any]:
    return {
        "trial_id": spec.trial_id,
        "setup_id": setup,
        "status": outcome.status,
        "reason": outcome.reason,
        **spec.as_row(),
        "nodes": settings.hosts,
        **profile_columns(
            outcome.profile, trial_step_times(outcome.profile, trial_dir, settings.warmup_steps)
        ),
        "warmup_steps": settings.warmup_steps,
        "contended": is_contended(outcome.others_cpu_share),
        "others_cpu_share": outcome.others_cpu_share,
        "measured_at": outcome.measured_at,
        "wall_s": round(outcome.wall_s, 2),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "trial_dir": str(trial_dir),
        "notes": "; ".join(outcome.notes),
        "log_tail": outcome.log_tail if outcome.status != "ok" else "",
    }


def latest_rows(table: pd.DataFrame, setup: str) -> pd.DataFrame:
    rows = table[table["setup_id"].astype(str) == setup]
    return rows.drop_duplicates("trial_id", keep="last").reset_index(drop=True)
