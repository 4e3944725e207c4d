"""`sdzero report`: one self-contained HTML page per training run or per advise run.

    sdzero report --run TRAIN_OUTPUT_DIR [-o reports/NAME.html]
    sdzero report ADVISE_OUT [-o reports/NAME.html]

The page embeds everything (figures as SVG data URIs, CSS inline), fetches nothing and runs no script, so
it reads the same offline and when mailed around. It is written atomically: a failure at any point leaves
the previous report untouched. Layout and safety: advisor.report.page; training input: advisor.report.train_page;
advise input: advisor.report.advise_page; figures: advisor.report.figures.

Data contract of an advise output folder
----------------------------------------
Every file is optional; a section whose file is absent says so in one line. Files written by code that
exists today are read as that code writes them; the performance model's files (issue 6) follow the
contract below, which its writer must keep. Extra columns and keys are ignored.

``trials.csv`` (`sdzero profile`, one row per trial; also looked for in ``comm/``)
    Required: ``status`` (``ok``; ``oom`` / ``out_of_memory`` are drawn as out-of-memory; anything else
    is a failure shown as written), ``zero_stage``, ``dtype``, ``micro_batch``.
    Read when present: ``trial_id`` or ``config_id``, ``grad_accum``, ``offload``, ``world_size``,
    ``nodes`` (default 1), ``samples_per_s``, ``step_time_s``, ``reason``; memory per rank from the first
    of ``mem_per_rank_bytes``, ``device_peak_bytes``, ``peak_mem_bytes``, ``peak_rss_bytes``; device
    capacity from ``device_capacity_bytes`` or ``mem_cap_bytes`` (the `--mem-cap-gib` cap, in bytes).

``comm.csv`` and ``comm_fit.json`` (`sdzero comm`, advisor.measure.collectives_launch; in the folder or its ``comm/``)
    As advisor.measure.collectives_rank.Row and advisor.measure.alphabeta.fits_payload write them.

``predictions.csv`` (performance model: one row per node count and config)
    ``node_count`` (int >= 1), ``config_id`` (str, unique per config), ``zero_stage`` (int),
    ``dtype`` (bf16 | fp16 | fp32), ``micro_batch`` (int, per rank), ``samples_per_s`` (global),
    ``step_time_s`` (per optimizer step), ``compute_s`` and ``exposed_comm_s`` (the step time split into
    compute and the communication not overlapped with it; they sum to ``step_time_s``),
    ``mem_per_rank_bytes``, ``efficiency`` (samples_per_s / (samples_per_s of the same config at its
    smallest node count x node_count / that node count): 1.0 is linear). Optional ``feasible`` (bool:
    fits the device with the headroom; rows with false are left out of the best-of curves).

``recommendation.json`` (performance model)
    ``{"config_id", "node_count", "samples_per_s", "step_time_s", "mem_per_rank_bytes", "global_batch",
    "grad_accum", "lr", "lr_scaling": "linear" | "sqrt", "launch_command": str,
    "error": {"step_time_mape": 0.06, "memory_mape": 0.03},  # fractions, on held-out trials
    "runners_up": [{"config_id", "node_count", "samples_per_s", "step_time_s", "mem_per_rank_bytes",
    "why_not": str}, ...]}``. Other keys are shown as details.

``recommended_ds_config.json``
    The DeepSpeed JSON the trainer runs unchanged (else ``recommendation.json``'s ``ds_config``).

``validation.csv`` (performance model: predicted against measured)
    ``config_id``, ``quantity`` (``step_time_s`` | ``mem_per_rank_bytes``), ``predicted``, ``measured``
    (same unit), ``held_out`` (bool: the trial was left out of the fit); optional ``node_count``.

``environment.json`` (optional, any writer)
    A JSON object shown as a table (versions, devices, network, hostfile); its ``device_memory_bytes``
    draws the capacity line when trials.csv has no capacity column. Without it the report lists the
    versions and devices of the machine that renders it, and says so. A training run's folder may hold
    one too.
"""

from __future__ import annotations

import re
from pathlib import Path

from advisor.report.page import Report, render_html
from sdzero.atomic import write_text_atomic
from sdzero.config.output_folder import check_replaceable_file

REPORTS_DIR = Path("reports")
_UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def default_output(source: Path, out: Path | None, reports_dir: Path = REPORTS_DIR) -> Path:
    """`-o` as given (a folder gets `<name>.html` inside), else reports/<source folder name>.html."""
    name = _UNSAFE_NAME.sub("_", Path(source).resolve().name).strip("._") or "report"
    if out is None:
        return reports_dir / f"{name}.html"
    out = Path(out)
    if out.is_dir() or str(out).endswith(("/", "\\")):
        return out / f"{name}.html"
    return out


REPORT_SIGNATURE = '<meta name="generator" content="sdzero report">'
"""In the head of every page written here: the only files a report ever replaces hold it."""


def check_report_target(out: Path) -> None:
    """`out` is new or an earlier report: never an input (`--out RUN/metrics.jsonl` once replaced the
    metrics with HTML), a file of the user's, a folder or a special file."""
    check_replaceable_file(Path(out), "--out", REPORT_SIGNATURE, "a report")


def write_report(report: Report, out: Path) -> Path:
    """Render in memory, then replace `out` atomically; a failure leaves any previous `out` as it was."""
    check_report_target(out)
    return write_text_atomic(out, render_html(report))


def write_training_report(run_dir: Path, out: Path | None = None) -> Path:
    """The training report of a run's output folder; returns the file written."""
    from advisor.report.train_page import build_training_report

    target = default_output(run_dir, out)
    check_report_target(target)  # before the page is built: a refusal costs nothing
    return write_report(build_training_report(Path(run_dir)), target)


def write_advise_report(advise_dir: Path, out: Path | None = None) -> Path:
    """The advise report of an advise/profile/comm output folder (what `sdzero advise` calls at its end)."""
    from advisor.report.advise_page import build_advise_report

    target = default_output(advise_dir, out)
    check_report_target(target)
    return write_report(build_advise_report(Path(advise_dir)), target)
