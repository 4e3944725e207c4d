"""The training report: read a run's output folder (metrics, configs, checkpoints) and lay out its page.

Input, as the trainer writes it (sdzero.training.trainer, sdzero.telemetry.metrics, sdzero.checkpoint.checkpointer):

- `metrics.jsonl`: one JSON object per optimizer step. Earlier segments of the same output folder were
  moved aside to `metrics.1.jsonl`, `metrics.2.jsonl`, ... (higher = newer); a segment that starts after
  step 1 is a resume, so the timeline is stitched: each newer segment replaces the steps it repeats, and
  an older segment is followed back only while the newer one is a resume.
- `ds_config.json` (the effective DeepSpeed JSON) and `run_config.json` (the run's options), optional.
- `checkpoints/<tag>/manifest.json` for each committed checkpoint still on disk (retention deletes
  older ones), `checkpoints/.incoming-*` for saves that never committed.
- `environment.json` (versions and devices), optional; without it the report shows this machine's.
- `validation/step_N/` (sdzero.training.validation): an image per validation prompt, shown as thumbnails.

A damaged metrics file stops the report with one line naming the file and line, except a last line cut
short without its newline, the trace a killed run leaves: that one is left out and the page says so.
"""

from __future__ import annotations

import base64
import io
import json
import math
import re
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from PIL import Image

from advisor.report import figures
from advisor.report.hosts_section import hosts_items
from advisor.report.page import (
    CodeItem,
    FigureItem,
    GalleryItem,
    Item,
    NoteItem,
    Report,
    Section,
    environment_table,
    frame_table,
    human_bytes,
    mapping_table,
    read_json_object,
)
from sdzero.config.user_file import read_user_text
from sdzero.constants import STEP_PHASES as PHASES
from sdzero.errors import UserError
from sdzero.training.validation import ValidationStep, read_validation

METRICS = "metrics.jsonl"
REQUIRED = ("step", "loss", "samples_per_s", "step_time_s")
NUMERIC = ("loss", "samples_per_s", "step_time_s", *PHASES, "loss_scale", "skipped_steps", "peak_mem_bytes")
MAX_POINTS = 1500
"""Longer runs are drawn in this many bins: an SVG with a point per step of a 100k-step run would weigh
megabytes and make the browser crawl."""
_SEGMENT = re.compile(r"^metrics\.(\d+)\.jsonl$")
THUMBNAIL_PX = 256
"""Longest side of a validation thumbnail (shown at 160 CSS px, sharp on a 1.5x screen): a JPEG of a few
tens of kB where the PNG the trainer wrote at 512-1024 px weighs 0.3-1.5 MB, so a page with dozens of
images stays a few MB."""
MAX_VALIDATION_ROWS = 12
"""Validation steps shown at most, evenly spaced with the first and last: the trend, not every sample."""


@dataclass
class Segment:
    name: str
    records: list[dict[str, Any]]
    cut_short: bool

    @property
    def first_step(self) -> int:
        return int(self.records[0]["step"])


@dataclass
class TrainingRun:
    folder: Path
    metrics: pd.DataFrame
    """Stitched timeline, one row per optimizer step, sorted by step."""
    resume_steps: list[int] = field(default_factory=list)
    ds_config: dict[str, Any] | None = None
    run_config: dict[str, Any] | None = None
    environment: dict[str, Any] | None = None
    checkpoints: pd.DataFrame = field(default_factory=pd.DataFrame)
    validation: list[ValidationStep] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------------------------- input


def read_segment(path: Path) -> Segment:
    """One metrics file, checked line by line; UserError names the file and line of any damage."""
    text = read_user_text(path, "--run")  # a FIFO or /dev/zero is named; a non-UTF-8 byte too
    lines = text.split("\n")
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records, cut_short = [], False
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:  # a line nested 100,000 deep: named, not a traceback
            raise UserError(
                f"{path}:{index + 1}: nested too deep to read; the metrics file is damaged"
            ) from None
        except json.JSONDecodeError as exc:
            if index == last and not text.endswith("\n"):
                cut_short = True  # a run killed mid-write: everything before it is whole
                continue
            raise UserError(
                f"{path}:{index + 1}: not valid JSON ({exc.msg}); the metrics file is damaged"
            ) from exc
        records.append(_check_record(record, path, index + 1))
    if not records:
        raise UserError(f"{path} holds no optimizer step yet; let the run take a step, or check its log")
    return Segment(path.name, records, cut_short)


def _check_record(record: Any, path: Path, line: int) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise UserError(f"{path}:{line}: expected one JSON object per line, got {type(record).__name__}")
    missing = [name for name in REQUIRED if name not in record]
    if missing:
        raise UserError(f"{path}:{line}: missing {', '.join(missing)}; is this an sdzero metrics file?")
    if not isinstance(record["step"], int) or isinstance(record["step"], bool) or record["step"] < 0:
        raise UserError(f"{path}:{line}: step must be a whole number, got {record['step']!r}")
    for name in ("loss", "samples_per_s", "step_time_s"):
        if record[name] is not None and not isinstance(record[name], (int, float)):
            raise UserError(f"{path}:{line}: {name} must be a number, got {record[name]!r}")
    return record


def stitch(segments: list[Segment]) -> tuple[list[dict[str, Any]], list[int]]:
    """Newest segment last in `segments`; returns the timeline's records and the steps where it resumed."""
    newest = segments[-1]
    records, resumes, cutoff = list(newest.records), [], newest.first_step
    for older in reversed(segments[:-1]):
        if cutoff <= 1:
            break  # the newer segment started fresh: older files are other runs
        resumes.append(cutoff)
        records = [r for r in older.records if r["step"] < cutoff] + records
        cutoff = min(cutoff, older.first_step)
    if cutoff > 1 and not resumes:
        resumes.append(cutoff)
    return records, sorted(set(resumes))


def metrics_frame(records: list[dict[str, Any]]) -> pd.DataFrame:
    frame = pd.DataFrame.from_records(records)
    frame = frame.drop_duplicates("step", keep="last").sort_values("step", ignore_index=True)
    for name in NUMERIC:
        if name in frame:
            frame[name] = pd.to_numeric(frame[name], errors="coerce")
    return frame


def read_checkpoints(folder: Path) -> pd.DataFrame:
    """Committed checkpoints still on disk, oldest first, and saves that never committed."""
    from sdzero.checkpoint.checkpointer import LATEST, STAGING_PREFIX, checkpoint_root, complete_checkpoints

    root = checkpoint_root(folder)
    latest = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    rows = []
    for path, manifest in reversed(complete_checkpoints(root)):
        rows.append(
            {
                "tag": manifest.tag,
                "step": manifest.step,
                "serial": manifest.serial,
                "size": human_bytes(manifest.total_bytes),
                "files": len(manifest.files),
                "saved at": _clock(manifest.created_unix_s),
                "EMA": manifest.ema,
                "state": "committed, latest" if path.name == latest else "committed",
            }
        )
    staging = (
        sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STAGING_PREFIX))
        if root.is_dir()
        else []
    )
    for path in staging:
        step = re.search(r"(\d+)$", path.name)
        state = "incomplete: never committed, never loaded"
        rows.append({"tag": path.name, "step": int(step.group(1)) if step else None, "state": state})
    return pd.DataFrame.from_records(rows)


def _clock(unix_s: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix_s)) if unix_s else "–"


def load_run(folder: Path) -> TrainingRun:
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"--run {folder}: no such folder; pass the --output-dir of a training run")
    if not (folder / METRICS).is_file():
        raise UserError(f"--run {folder}: no {METRICS} in it; pass the --output-dir the trainer wrote to")
    older = sorted(
        (p for p in folder.iterdir() if _SEGMENT.match(p.name)), key=lambda p: int(_SEGMENT.match(p.name)[1])
    )
    segments = [read_segment(p) for p in [*older, folder / METRICS]]
    records, resumes = stitch(segments)
    notes = [
        f"{s.name}: its last line was cut short (the run was stopped mid-write) and is left out."
        for s in segments
        if s.cut_short
    ]
    return TrainingRun(
        folder=folder,
        metrics=metrics_frame(records),
        resume_steps=resumes,
        ds_config=read_json_object(folder / "ds_config.json"),
        run_config=read_json_object(folder / "run_config.json"),
        environment=read_json_object(folder / "environment.json"),
        checkpoints=read_checkpoints(folder),
        validation=read_validation(folder / "validation"),
        notes=notes,
    )


# ----------------------------------------------------------------------------------------------- page

CAPTIONS = {
    "loss": "Mean loss over ranks and micro-steps per optimizer step, raw and smoothed: read the trend from "
    "the smoothed line; the raw line shows the step-to-step noise.",
    "throughput": "Global samples per second (top) and seconds per optimizer step split by phase (bottom): a "
    "flat top line is a steady run, and the widest band is where the time goes. Step 1 includes warm-up.",
    "phases": "Medians over the steps after the first. encode is the frozen VAE and text encoder; optimizer "
    "holds the gradient communication at the accumulation boundary; other is the rest (statistics, hooks).",
    "loss-scale": "fp16 dynamic loss scale (top) and optimizer steps skipped on gradient overflow (bottom): a "
    "few skips at the start are normal; a scale that keeps falling, or skips piling up, mean overflows "
    "(consider bf16).",
    "memory": "Peak memory each rank has held so far (CUDA allocator peak on GPUs, process peak RSS on CPUs): "
    "ranks should sit close together, and a line still climbing late in the run points at a leak.",
    "validation": "Images sampled from the weights at each validation step (rows) for each prompt (columns), "
    "with the same seed every time, so a row differs from the one above only by training: read how the "
    "samples change. Thumbnails; the full images are in validation/step_N/.",
    "checkpoints": "Checkpoints still on disk (--keep-last retention deletes older ones); committed ones are "
    "marked on the loss figure. An incomplete save is never loaded by a resume.",
}


def ema(values: np.ndarray, span: int) -> np.ndarray:
    """Bias-corrected exponential moving average (TensorBoard's smoothing); NaN steps are skipped."""
    weight = 1.0 - 2.0 / (span + 1.0)
    out = np.full(values.shape, np.nan)
    mean, norm = 0.0, 0.0
    for i, value in enumerate(values):
        if math.isfinite(value):
            mean, norm = weight * mean + (1 - weight) * value, weight * norm + (1 - weight)
        out[i] = mean / norm if norm else np.nan
    return out


def smoothing_span(steps: int) -> int:
    """About a tenth of the run, between 3 and 100 steps."""
    return int(min(100, max(3, round(steps / 10))))


def _last(frame: pd.DataFrame, name: str) -> Any:
    values = frame[name].dropna() if name in frame else pd.Series(dtype=float)
    return values.iloc[-1] if len(values) else None


def _after_warmup(frame: pd.DataFrame) -> pd.DataFrame:
    """Steps after the first, whose time includes one-off allocations, JIT builds and worker start-up."""
    return frame.iloc[1:] if len(frame) > 1 else frame


def binned(
    values: np.ndarray, bins: int = MAX_POINTS, reduce: Callable[..., np.ndarray] = np.nanmean
) -> np.ndarray:
    """`values` reduced over `bins` runs of consecutive steps (along axis 0); unchanged when short enough."""
    if len(values) <= bins:
        return values
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a bin of NaN losses stays NaN, a gap
        return np.array([reduce(chunk, axis=0) for chunk in np.array_split(values, bins)])


def bin_note(steps: int) -> str:
    if steps <= MAX_POINTS:
        return ""
    return f" The {steps} steps are drawn as {MAX_POINTS} bins of about {steps // MAX_POINTS} steps."


def committed_steps(checkpoints: pd.DataFrame) -> list[int]:
    if checkpoints.empty:
        return []
    done = checkpoints[checkpoints["state"].str.startswith("committed")]
    return done["step"].dropna().astype(int).tolist()


def loss_section(run: TrainingRun) -> Section:
    m = run.metrics
    loss = m["loss"].to_numpy(float)
    span = smoothing_span(len(m))
    band = (binned(loss, reduce=np.nanmin), binned(loss, reduce=np.nanmax)) if len(m) > MAX_POINTS else None
    steps = binned(m["step"].to_numpy(float))
    events = (committed_steps(run.checkpoints), run.resume_steps)
    svg = figures.loss_figure(steps, binned(loss), binned(ema(loss, span)), span, *events, band=band)
    caption = CAPTIONS["loss"] + bin_note(len(m))
    bad = int((~np.isfinite(loss)).sum())
    if bad:
        caption += f" {bad} step(s) had a non-finite loss and leave gaps."
    return Section("loss", "Loss", [FigureItem("loss", "Training loss", caption, svg)])


def step_phases(m: pd.DataFrame) -> dict[str, np.ndarray]:
    """Seconds per phase per step, plus `other_s`: step time the phase timers did not cover."""
    phases = {p: m[p].fillna(0).to_numpy(float) for p in PHASES if p in m}
    covered = sum(phases.values(), np.zeros(len(m)))
    phases["other_s"] = np.clip(m["step_time_s"].to_numpy(float) - covered, 0, None)
    return phases


def speed_section(run: TrainingRun) -> Section:
    m = run.metrics
    phases = step_phases(m)
    svg = figures.throughput_figure(
        binned(m["step"].to_numpy(float)),
        binned(m["samples_per_s"].to_numpy(float)),
        binned(m["step_time_s"].to_numpy(float)),
        {name: binned(values) for name, values in phases.items()},
        median=float(_after_warmup(m)["samples_per_s"].median()),
    )
    skip = 1 if len(m) > 1 else 0
    medians = {name: float(np.median(values[skip:])) for name, values in phases.items()}
    total = float(_after_warmup(m)["step_time_s"].median())
    table = pd.DataFrame(
        {
            "phase": [name.removesuffix("_s") for name in medians],
            "median s per step": list(medians.values()),
            "share of step time": [
                f"{100 * v / total:.1f} %" if total > 0 else "–" for v in medians.values()
            ],
        }
    )
    items: list[Item] = [
        FigureItem("throughput", "Throughput and step time", CAPTIONS["throughput"] + bin_note(len(m)), svg),
        frame_table("phases", "Step-time phases", CAPTIONS["phases"], table),
        *hosts_items(m),  # per-host compute time and the slow host named (sdzero.training.straggler)
    ]
    return Section("speed", "Speed", items)


def precision_section(run: TrainingRun) -> Section:
    m = run.metrics
    title = "fp16 loss scale"
    if "loss_scale" not in m or m["loss_scale"].isna().all():
        dtype = str(_last(m, "dtype") or "this")
        text = f"{dtype} run: no dynamic loss scale to show (only fp16 training scales the loss)."
        return Section("precision", title, [NoteItem("loss-scale", text)])
    skipped = m["skipped_steps"].ffill().fillna(0) if "skipped_steps" in m else pd.Series(np.zeros(len(m)))
    svg = figures.loss_scale_figure(
        binned(m["step"].to_numpy(float)),
        binned(m["loss_scale"].ffill().to_numpy(float), reduce=np.nanmin),
        binned(skipped.to_numpy(float), reduce=np.nanmax),
    )
    caption = f"{CAPTIONS['loss-scale']} {int(skipped.iloc[-1])} step(s) skipped in all.{bin_note(len(m))}"
    return Section(
        "precision", title, [FigureItem("loss-scale", "Loss scale and skipped steps", caption, svg)]
    )


def per_rank_memory(m: pd.DataFrame) -> np.ndarray | None:
    """Steps x ranks peak bytes; the max-over-ranks column alone when per-rank lists are missing or ragged."""
    if "peak_mem_bytes_per_rank" in m:
        lists = m["peak_mem_bytes_per_rank"].tolist()
        if all(isinstance(v, list) and v for v in lists) and len({len(v) for v in lists}) == 1:
            return np.array(lists, dtype=float)
    if "peak_mem_bytes" in m and m["peak_mem_bytes"].notna().any():
        return m["peak_mem_bytes"].to_numpy(float)[:, None]
    return None


def memory_section(run: TrainingRun) -> Section:
    per_rank = per_rank_memory(run.metrics)
    if per_rank is None:
        return Section("memory", "Memory", [NoteItem("memory", "metrics.jsonl records no peak memory.")])
    steps = binned(run.metrics["step"].to_numpy(float))
    svg = figures.memory_figure(steps, binned(per_rank, reduce=np.nanmax))
    caption = CAPTIONS["memory"] + bin_note(len(run.metrics))
    return Section("memory", "Memory", [FigureItem("memory", "Peak memory per rank", caption, svg)])


def shown_steps(count: int, limit: int = MAX_VALIDATION_ROWS) -> list[int]:
    """Indices of `limit` of `count` rows, evenly spaced, the first and the last always among them."""
    if count <= limit:
        return list(range(count))
    return sorted({round(i * (count - 1) / (limit - 1)) for i in range(limit)})


MAX_SOURCE_PIXELS = 64 * 1024 * 1024
"""Largest validation image the report decodes (64 Mpx, 8192x8192): the trainer writes images at the
training resolution, so a bigger one was put there by someone else; decoding a header that claims
100000x100000 would allocate 30 GB."""


def thumbnail_uri(path: Path) -> str:
    """A JPEG data URI of the image scaled to THUMBNAIL_PX at most (never enlarged); OSError if unreadable."""
    with warnings.catch_warnings():  # PIL's DecompressionBombWarning: the size is checked just below
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        opened = Image.open(path)
    with opened as image:
        if image.width * image.height > MAX_SOURCE_PIXELS:  # from the header alone, before any decode
            raise Image.DecompressionBombError(
                f"its header claims {image.width}x{image.height} pixels, over the {MAX_SOURCE_PIXELS} a "
                "validation image can have"
            )
        image.draft("RGB", (THUMBNAIL_PX, THUMBNAIL_PX))  # JPEG sources decode at a fraction of their size
        small = image.convert("RGB")
    small.thumbnail((THUMBNAIL_PX, THUMBNAIL_PX), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    small.save(buffer, "JPEG", quality=85, optimize=True)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def validation_section(run: TrainingRun) -> Section:
    title = "Validation images"
    if not run.validation:
        text = (
            "No validation images in validation/: the run had no --validation-prompts, or none was due yet."
        )
        return Section("validation", title, [NoteItem("validation", text)])
    steps = [run.validation[i] for i in shown_steps(len(run.validation), MAX_VALIDATION_ROWS)]
    prompts = list(dict.fromkeys(prompt for s in steps for prompt, _ in s.images))  # first-seen order
    rows: list[tuple[str, list[str | None]]] = []
    for s in steps:
        cells: dict[str, str | None] = {}
        for prompt, path in s.images:
            try:
                cells[prompt] = thumbnail_uri(path)
            # A PNG cut short by a killed run, or one whose header claims a huge size (PIL's decompression
            # bomb, which is neither an OSError nor a ValueError): said, not fatal.
            except (OSError, ValueError, Image.DecompressionBombError) as exc:
                run.notes.append(f"{path.relative_to(run.folder)}: not a readable image ({exc}); left out.")
        rows.append((f"step {s.step}", [cells.get(p) for p in prompts]))
    caption = CAPTIONS["validation"]
    if len(steps) < len(run.validation):
        caption += f" {len(steps)} of the {len(run.validation)} validation steps are shown, evenly spaced."
    grid = GalleryItem("validation", "Samples per validation step", caption, prompts, rows)
    return Section("validation", title, [grid])


def checkpoint_section(run: TrainingRun) -> Section:
    items: list[Item] = []
    if run.resume_steps:
        steps = ", ".join(str(s) for s in run.resume_steps)
        items.append(
            NoteItem("resumes", f"Resumed from a checkpoint at step {steps} (see the rotated metrics files).")
        )
    if run.checkpoints.empty:
        items.append(
            NoteItem(
                "checkpoints", "No checkpoints under checkpoints/: the run saved none, or they were removed."
            )
        )
    else:
        items.append(frame_table("checkpoints", "Checkpoints", CAPTIONS["checkpoints"], run.checkpoints))
    return Section("checkpoints", "Checkpoints", items)


def config_section(run: TrainingRun) -> Section:
    items: list[Item] = []
    if run.run_config:
        caption = "run_config.json: the trainer's options as resolved."
        items.append(mapping_table("run-options", "Run options", caption, run.run_config))
    else:
        items.append(NoteItem("run-options", "No run_config.json in the run folder."))
    if run.ds_config:
        caption = "ds_config.json: what DeepSpeed was given, with the resolved learning rate."
        text = json.dumps(run.ds_config, indent=2)
        items.append(CodeItem("ds-config", "Effective DeepSpeed JSON", caption, text))
    else:
        items.append(NoteItem("ds-config", "No ds_config.json in the run folder."))
    items.append(environment_table(run.environment, "environment.json"))
    return Section("configuration", "Configuration and environment", items)


def facts(run: TrainingRun) -> list[tuple[str, str]]:
    m = run.metrics
    steady = _after_warmup(m)
    first, last = int(m["step"].iloc[0]), int(m["step"].iloc[-1])
    out = [("steps", f"{first}–{last}" if last > first else str(first))]
    if {"zero_stage", "dtype"} <= set(m):
        out.append(("ZeRO / precision", f"ZeRO-{_last(m, 'zero_stage')} {_last(m, 'dtype')}"))
    if {"world_size", "micro_batch", "grad_accum"} <= set(m):
        world, micro, accum = (int(_last(m, k)) for k in ("world_size", "micro_batch", "grad_accum"))
        out.append(("global batch", f"{world} ranks × {micro} × {accum} = {world * micro * accum}"))
    finite = m["loss"][np.isfinite(m["loss"].to_numpy(float))]
    out.append(("last loss", f"{finite.iloc[-1]:.4g}" if len(finite) else "–"))
    out.append(("median samples/s", f"{steady['samples_per_s'].median():.4g}"))
    out.append(("median step time", f"{steady['step_time_s'].median():.3g} s"))
    if "peak_mem_bytes" in m:
        out.append(("peak memory (max rank)", human_bytes(m["peak_mem_bytes"].max())))
    if _last(m, "skipped_steps") is not None:
        out.append(("skipped steps (fp16)", str(int(_last(m, "skipped_steps")))))
    out.append(("time in steps", f"{m['step_time_s'].sum():.1f} s"))
    return out


def build_training_report(folder: Path) -> Report:
    """Read the run folder (UserError on bad input) and lay out every section; nothing is written."""
    run = load_run(folder)
    sections = [
        loss_section(run),
        validation_section(run),
        speed_section(run),
        precision_section(run),
        memory_section(run),
        checkpoint_section(run),
        config_section(run),
    ]
    return Report(
        title=f"Training report: {run.folder.resolve().name}",
        subtitle="Loss, validation images, speed, precision, memory and checkpoints of one sdzero training run.",
        source=str(run.folder.resolve()),
        facts=facts(run),
        sections=sections,
        notes=run.notes,
    )
