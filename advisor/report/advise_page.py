"""The advise report: read an advise/profile/comm output folder and lay out its page.

What each file must hold is the data contract in `advisor.report.build`'s docstring; this module checks it (a
missing column or a non-numeric value is one UserError naming the file and the column) and turns each file
into its sections. A section whose file is absent becomes one line saying which file, from which command,
would fill it: never an empty plot.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from advisor.measure.alphabeta import AlphaBetaFit, bus_factor, load_fits
from advisor.model.prediction_error import ERROR_EXPLAINED, is_check
from advisor.model.time_to_train import hours
from advisor.report import figures
from advisor.report.answer import (
    held_out_sentence,
    modelled_note,
    provenance_section,
    recommendation_notes,
    scaling_table_item,
    time_to_train_item,
    verdict_sentence,
)
from advisor.report.page import (
    CodeItem,
    FigureItem,
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
from sdzero.errors import UserError

KNOWN_FILES = ("trials.csv", "comm.csv", "predictions.csv", "recommendation.json", "validation.csv")
PREDICTION_COLUMNS = ("node_count", "config_id", "zero_stage", "dtype", "micro_batch", "samples_per_s")
PREDICTION_COLUMNS += ("step_time_s", "compute_s", "exposed_comm_s", "mem_per_rank_bytes", "efficiency")
VALIDATION_COLUMNS = ("config_id", "quantity", "predicted", "measured", "held_out")
TRIAL_COLUMNS = ("status", "zero_stage", "dtype", "micro_batch")
COMM_COLUMNS = ("backend", "library", "collective", "link_level", "size_bytes", "busbw_gbps", "correct")
MEMORY_COLUMNS = ("mem_per_rank_bytes", "device_peak_bytes", "peak_mem_bytes", "peak_rss_bytes")
"""trials.csv memory per rank: the first one present (a device peak before RSS, which counts the runtime)."""
CAPACITY_COLUMNS = ("device_capacity_bytes", "mem_cap_bytes")
OOM_STATUS = frozenset({"oom", "out_of_memory", "out-of-memory"})
TRIAL_SHOWN = (
    "trial_id",
    "config_id",
    "status",
    "zero_stage",
    "dtype",
    "micro_batch",
    "grad_accum",
    "offload",
)
TRIAL_SHOWN += ("world_size", "nodes", "samples_per_s", "step_time_s", "memory per rank", "reason")
MODEL = "the performance model (sdzero advise)"

CAPTIONS = {
    "recommendation": "The fastest config that fits in memory with the headroom at the chosen node count, and "
    "the runners-up at that count with why each lost.",
    "scaling": "Best feasible config per ZeRO stage and precision; dotted lines are linear scaling from the "
    "smallest node count and circles the best measured trial: the gap below a dotted line is time lost to "
    "communication. Shaded: the predictions' 95% intervals (where the run measured them).",
    "efficiency": "Predicted samples/s as a share of linear scaling from the smallest node count: where a line "
    "falls below about 80 %, more nodes mostly buy waiting.",
    "breakdown": "Compute and the communication not hidden behind it, per optimizer step, for {which}: the red "
    "share is what a faster network (or fewer nodes) would win back.",
    "validation": "One point per measured trial; inside the grey band is within 10 %. Circles were held out of "
    "the fit (check trials or leave-one-out).",
    "validation-errors": "Mean (MAPE) and worst absolute relative error of the predictions, per quantity. "
    + ERROR_EXPLAINED,
    "trial-memory": "Measured peak per rank for each ZeRO stage and precision, red crosses for out-of-memory "
    "trials; {capacity}: the largest micro-batch below it is the one to use.",
    "bandwidth": "Measured points and the fitted alpha-beta model, one panel per backend: the flat right end is "
    "the link's bandwidth, the rising left part is latency-bound; ZeRO buckets (tens of MiB) should sit on "
    "the flat part.",
    "alpha-beta": "t = alpha + bytes x beta; bandwidth is the asymptotic bus bandwidth (nccl-tests "
    "definition, GB/s with G = 1e9).",
}


# ----------------------------------------------------------------------------------------------- input


def read_table(path: Path, required: tuple[str, ...], numeric: tuple[str, ...] = ()) -> pd.DataFrame:
    """A CSV of the contract: required columns present, numeric ones numbers; else one UserError."""
    try:
        frame = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame(columns=list(required))
    except (pd.errors.ParserError, UnicodeDecodeError, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UserError(f"{path}: not a readable CSV ({first}); rewrite or remove it") from exc
    missing = [c for c in required if c not in frame.columns]
    if missing:
        raise UserError(
            f"{path}: missing column(s) {', '.join(missing)} (the contract is in advisor/report/build.py)"
        )
    for column in numeric:
        if column in frame:
            try:
                frame[column] = pd.to_numeric(frame[column])
            except (ValueError, TypeError) as exc:
                raise UserError(f"{path}: column {column} must hold numbers ({exc})") from exc
    return frame


def find(folder: Path, name: str) -> Path | None:
    """`name` in the folder, else in its comm/ subfolder (where `sdzero advise` may keep the benchmark)."""
    return next((p for p in (folder / name, folder / "comm" / name) if p.is_file()), None)


def check_folder(folder: Path) -> None:
    if not folder.is_dir():
        raise UserError(f"{folder}: no such folder; pass the --out folder of sdzero advise, profile or comm")
    if not any(find(folder, name) for name in KNOWN_FILES):
        hint = (
            " It holds a metrics.jsonl: for a training run use --run."
            if (folder / "metrics.jsonl").is_file()
            else ""
        )
        wanted = ", ".join(KNOWN_FILES)
        raise UserError(
            f"{folder}: none of {wanted} in it; pass the --out of sdzero advise, profile or comm.{hint}"
        )


def is_true(values: pd.Series) -> pd.Series:
    """CSV booleans as pandas reads them (bool) or as text ('true', '1', 'yes')."""
    if pd.api.types.is_bool_dtype(values):
        return values
    return values.astype(str).str.strip().str.lower().isin({"true", "1", "yes"})


def absent(key: str, title: str, note_key: str, text: str) -> Section:
    return Section(key, title, [NoteItem(note_key, text)])


def _percent(value: Any) -> str:
    return f"{100 * value:.1f} %" if isinstance(value, (int, float)) else str(value)


# -------------------------------------------------------------------------------------- recommendation


def _summary_row(entry: dict[str, Any], rank: str) -> dict[str, Any]:
    return {
        "rank": rank,
        "config": str(entry.get("config_id", "?")),
        "nodes": entry.get("node_count"),
        "samples/s": entry.get("samples_per_s"),
        "step time (s)": entry.get("step_time_s"),
        "memory per rank": human_bytes(entry.get("mem_per_rank_bytes")),
        "why not": str(entry.get("why_not", "")),
    }


def recommendation_section(folder: Path, rec: dict[str, Any] | None) -> Section:
    title = "Recommendation"
    if rec is None:
        return absent(
            "recommendation",
            title,
            "recommendation",
            f"No recommendation.json here: {MODEL} has not run on this folder.",
        )
    rows = [_summary_row(rec, "recommended")]
    rows += [_summary_row(other, str(i)) for i, other in enumerate(rec.get("runners_up") or [], start=2)]
    caption = CAPTIONS["recommendation"] + " " + held_out_sentence(rec)
    table_item = scaling_table_item(rec)  # the answer first: how it scales, where the knee is
    answer = [item for item in (table_item, time_to_train_item(rec)) if item]
    items: list[Item] = [
        *answer,
        frame_table("recommendation", "Recommended config and runners-up", caption, pd.DataFrame(rows)),
    ]
    why = dict(recommendation_notes(rec))
    if why:
        items.append(
            mapping_table(
                "recommendation-why",
                "How it was chosen",
                "The node-count rule, the global "
                "batch, the learning rate and whether the config was measured.",
                why,
            )
        )
    if rec.get("launch_command"):
        items.append(
            CodeItem("launch", "Launch command", "Runs the recommendation as is.", str(rec["launch_command"]))
        )
    ds = read_json_object(folder / "recommended_ds_config.json") or rec.get("ds_config")
    if ds:
        caption = "recommended_ds_config.json: the trainer runs it unchanged."
        items.append(
            CodeItem("recommended-ds-config", "Recommended DeepSpeed JSON", caption, json.dumps(ds, indent=2))
        )
    else:
        items.append(NoteItem("recommended-ds-config", "No recommended_ds_config.json here."))
    shown = {
        "runners_up",
        "ds_config",
        "error",
        "launch_command",
        "scaling_table",
        "provenance",
        "error_explained",
        "verdict",
    }
    details = {k: v for k, v in rec.items() if k not in shown}
    items.append(
        mapping_table("recommendation-details", "Details", "recommendation.json as written.", details)
    )
    return Section("recommendation", title, items)


# --------------------------------------------------------------------------------------------- scaling


def best_per_group(predictions: pd.DataFrame) -> pd.DataFrame:
    """Per (stage, dtype, node count), the feasible config with the highest predicted samples/s."""
    rows = predictions[is_true(predictions["feasible"])] if "feasible" in predictions else predictions
    if rows.empty:
        return rows
    index = rows.groupby(["zero_stage", "dtype", "node_count"])["samples_per_s"].idxmax()
    return rows.loc[index].sort_values(["zero_stage", "dtype", "node_count"])


def best_measured(trials: pd.DataFrame | None) -> pd.DataFrame:
    """Per (stage, dtype, nodes), the fastest trial that finished: the points the predictions start from."""
    empty = pd.DataFrame(columns=["nodes", "zero_stage", "dtype", "samples_per_s"])
    if trials is None or "samples_per_s" not in trials:
        return empty
    ok = trials[trials["status"].str.lower() == "ok"].copy()
    ok["nodes"] = pd.to_numeric(ok["nodes"], errors="coerce") if "nodes" in ok else 1
    ok["samples_per_s"] = pd.to_numeric(ok["samples_per_s"], errors="coerce")
    ok = ok.dropna(subset=["nodes", "samples_per_s"])
    if ok.empty:
        return empty
    return ok.loc[ok.groupby(["zero_stage", "dtype", "nodes"])["samples_per_s"].idxmax()]


def breakdown_config(predictions: pd.DataFrame, rec: dict[str, Any] | None) -> tuple[str, str]:
    """The recommended config, else the fastest at the largest node count; and how it was chosen."""
    wanted = str(rec.get("config_id")) if rec else None
    if wanted and (predictions["config_id"].astype(str) == wanted).any():
        return wanted, "the recommended config"
    top = predictions[predictions["node_count"] == predictions["node_count"].max()]
    return str(top.loc[top["samples_per_s"].idxmax(), "config_id"]), "the config fastest at the most nodes"


def scaling_section(folder: Path, rec: dict[str, Any] | None, trials: pd.DataFrame | None) -> Section:
    title = "Scaling to more nodes"
    path = find(folder, "predictions.csv")
    if path is None:
        return absent(
            "scaling", title, "scaling", f"No predictions.csv here: scaling predictions come from {MODEL}."
        )
    predictions = read_table(
        path, PREDICTION_COLUMNS, tuple(c for c in PREDICTION_COLUMNS if c not in ("config_id", "dtype"))
    )
    predictions = predictions.assign(
        dtype=predictions["dtype"].astype(str), config_id=predictions["config_id"].astype(str)
    )
    best = best_per_group(predictions)
    if best.empty:
        return absent("scaling", title, "scaling", f"{path} holds no feasible prediction to draw.")
    chosen, which = breakdown_config(predictions, rec)
    items: list[Item] = [
        FigureItem(
            "scaling",
            "Predicted throughput vs nodes",
            CAPTIONS["scaling"] + modelled_note(rec),
            figures.scaling_figure(best, best_measured(trials)),
        ),
        FigureItem(
            "efficiency",
            "Scaling efficiency vs nodes",
            CAPTIONS["efficiency"] + modelled_note(rec),
            figures.efficiency_figure(best),
        ),
        FigureItem(
            "breakdown",
            f"Step time vs nodes for {chosen}",
            CAPTIONS["breakdown"].format(which=which) + modelled_note(rec),
            figures.breakdown_figure(predictions[predictions["config_id"] == chosen]),
        ),
    ]
    return Section("scaling", title, items)


def validation_section(folder: Path) -> Section:
    title = "Predicted vs measured"
    path = find(folder, "validation.csv")
    if path is None:
        return absent(
            "validation", title, "validation", f"No validation.csv here: prediction errors come with {MODEL}."
        )
    pairs = read_table(path, VALIDATION_COLUMNS, ("predicted", "measured"))
    pairs = pairs.assign(held_out=is_true(pairs["held_out"]))
    pairs = pairs[pairs["quantity"].isin(["step_time_s", "mem_per_rank_bytes"]) & (pairs["measured"] > 0)]
    if pairs.empty:
        return absent(
            "validation", title, "validation", f"{path} holds no step_time_s or mem_per_rank_bytes pair."
        )
    kind = np.where(
        is_check(pairs),
        "held out (check trials)",
        np.where(pairs["held_out"], "leave-one-out", "used in fit"),
    )
    errors = pairs.assign(fit=kind, error=(pairs["predicted"] / pairs["measured"] - 1).abs())
    summary = errors.groupby(["quantity", "fit"])["error"].agg(["count", "mean", "max"]).reset_index()
    summary = summary.assign(mean=summary["mean"].map(_percent), max=summary["max"].map(_percent))
    summary = summary.rename(columns={"count": "trials", "mean": "MAPE", "max": "worst"})
    items: list[Item] = [
        FigureItem(
            "validation",
            "Predicted vs measured step time and memory",
            CAPTIONS["validation"] + " Provenance: measured (trials) against modelled (the fit).",
            figures.validation_figure(pairs),
        ),
        frame_table("validation-errors", "Prediction error", CAPTIONS["validation-errors"], summary),
    ]
    return Section("validation", title, items)


# ------------------------------------------------------------------------------------ trials and memory


def normalise_trials(trials: pd.DataFrame) -> pd.DataFrame:
    """Adds `oom` (bool) and `mem_bytes` (NaN when unknown); drops rows without stage or micro-batch."""
    out = trials.assign(status=trials["status"].astype(str), dtype=trials["dtype"].astype(str))
    out["oom"] = out["status"].str.lower().isin(OOM_STATUS)
    column = next((c for c in MEMORY_COLUMNS if c in out), None)
    out["mem_bytes"] = pd.to_numeric(out[column], errors="coerce") if column else np.nan
    for name in ("micro_batch", "zero_stage"):
        out[name] = pd.to_numeric(out[name], errors="coerce")
    return out.dropna(subset=["micro_batch", "zero_stage"])


def capacity_bytes(trials: pd.DataFrame, environment: dict[str, Any] | None) -> float | None:
    for column in CAPACITY_COLUMNS:
        values = (
            pd.to_numeric(trials[column], errors="coerce") if column in trials else pd.Series(dtype=float)
        )
        if values.notna().any():
            return float(values.max())
    value = (environment or {}).get("device_memory_bytes")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def read_trials(folder: Path) -> tuple[pd.DataFrame | None, str]:
    """The normalised trials, or None and the one line that replaces their sections."""
    path = find(folder, "trials.csv")
    if path is None:
        return None, "No trials.csv here: run sdzero profile (or advise) to measure trials."
    trials = normalise_trials(read_table(path, TRIAL_COLUMNS))
    return (trials, "") if not trials.empty else (None, f"{path} lists no trial yet.")


def trial_sections(
    trials: pd.DataFrame | None, why_absent: str, environment: dict[str, Any] | None
) -> list[Section]:
    if trials is None:
        return [
            absent("memory", "Memory per rank", "trial-memory", why_absent),
            absent("trials", "Trials", "trials", why_absent),
        ]
    if trials["mem_bytes"].notna().any() or trials["oom"].any():
        capacity = capacity_bytes(trials, environment)
        line = (
            f"the dashed line is the device capacity ({human_bytes(capacity)})"
            if capacity
            else "no device capacity is recorded"
        )
        svg = figures.trial_memory_figure(trials, capacity)
        memory: Item = FigureItem(
            "trial-memory",
            "Memory per rank vs micro-batch",
            CAPTIONS["trial-memory"].format(capacity=line) + " Provenance: measured (trials).",
            svg,
        )
    else:
        memory = NoteItem(
            "trial-memory", f"trials.csv records no memory column ({', '.join(MEMORY_COLUMNS)})."
        )
    shown = trials.assign(**{"memory per rank": trials["mem_bytes"].map(human_bytes)})
    shown = shown[[c for c in TRIAL_SHOWN if c in shown]]
    counts = ", ".join(f"{n} {status}" for status, n in trials["status"].value_counts().items())
    table = frame_table(
        "trials",
        "All trials",
        f"Every trial and its outcome ({counts}); all columns are in trials.csv.",
        shown,
    )
    return [Section("memory", "Memory per rank", [memory]), Section("trials", "Trials", [table])]


# ----------------------------------------------------------------------------------------- collectives


def fit_curves(fits: list[AlphaBetaFit], labels: dict[str, str]) -> pd.DataFrame:
    """Each fit's bus bandwidth over its measured size range, 48 sizes spaced evenly in log."""
    frames = []
    for fit in fits:
        sizes = np.geomspace(fit.min_bytes, fit.max_bytes, 48)
        busbw = (
            sizes / (fit.alpha_s + sizes * fit.beta_s_per_byte) / 1e9 * bus_factor(fit.collective, fit.ranks)
        )
        label = labels.get(fit.backend, fit.backend)
        frames.append(
            pd.DataFrame(
                {
                    "backend": label,
                    "collective": fit.collective,
                    "link_level": fit.link_level,
                    "size_bytes": sizes,
                    "busbw_gbps": busbw,
                }
            )
        )
    return (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["backend", "collective", "link_level", "size_bytes", "busbw_gbps"])
    )


def fit_table(fits: list[AlphaBetaFit]) -> pd.DataFrame:
    return pd.DataFrame(
        [
            {
                "backend": f.backend,
                "library": f.library,
                "collective": f.collective,
                "link": f.link_level,
                "ranks": f.ranks,
                "latency (µs)": f.latency_us,
                "bus bandwidth (GB/s)": f.bandwidth_gbps,
                "rel. RMSE": f.rel_rmse,
                "points": f.n_points,
                "clamped": ",".join(f.clamped) or "–",
            }
            for f in fits
        ]
    )


def comm_section(folder: Path) -> Section:
    title = "Collectives: bandwidth vs message size"
    csv_path, fit_path = find(folder, "comm.csv"), find(folder, "comm_fit.json")
    if csv_path is None:
        return absent(
            "collectives",
            title,
            "bandwidth",
            "No comm.csv here: run sdzero comm (or advise) to benchmark the collectives.",
        )
    points = read_table(csv_path, COMM_COLUMNS, ("size_bytes", "busbw_gbps"))
    points = points[is_true(points["correct"]) & (points["busbw_gbps"] > 0)]
    if "in_flight" in points:  # a burst's time per call is not a point of the size sweep's curve
        points = points[pd.to_numeric(points["in_flight"], errors="coerce").fillna(1) <= 1]
    if points.empty:
        return absent("collectives", title, "bandwidth", f"{csv_path} holds no correct measurement to draw.")
    labels = {
        b: f"{b} ({', '.join(sorted(g['library'].astype(str).unique()))})"
        for b, g in points.groupby("backend")
    }
    try:
        fits = load_fits(fit_path) if fit_path else []
        meta = json.loads(fit_path.read_text()).get("meta") if fit_path else None
    except (ValueError, KeyError, TypeError) as exc:
        raise UserError(
            f"{fit_path}: not a comm_fit.json this version reads ({exc}); rerun sdzero comm"
        ) from exc
    svg = figures.bandwidth_figure(
        points.assign(backend=points["backend"].map(labels)), fit_curves(fits, labels)
    )
    items: list[Item] = [
        FigureItem(
            "bandwidth",
            "Collective bus bandwidth vs message size",
            CAPTIONS["bandwidth"] + " Provenance: measured (sdzero comm) and the fit to it.",
            svg,
        )
    ]
    if fits:
        items.append(
            frame_table("alpha-beta", "Fitted alpha-beta parameters", CAPTIONS["alpha-beta"], fit_table(fits))
        )
    else:
        items.append(NoteItem("alpha-beta", "No comm_fit.json here: only the measured points are drawn."))
    if meta:
        items.append(
            mapping_table("comm-meta", "Benchmark settings", "The meta block of comm_fit.json.", meta)
        )
    return Section("collectives", title, items)


# ---------------------------------------------------------------------------------------------- report


def advise_facts(rec: dict[str, Any] | None, trials: pd.DataFrame | None) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    if rec:
        out.append(("recommended", str(rec.get("config_id", "?"))))
        if rec.get("node_count") is not None:
            out.append(("nodes", str(rec["node_count"])))
        if isinstance(rec.get("samples_per_s"), (int, float)):
            out.append(("predicted samples/s", f"{rec['samples_per_s']:.4g}"))
        t = rec.get("time_to_train") or {}
        if isinstance(t.get("seconds"), (int, float)):
            out.append(("time to train", hours(float(t["seconds"]))))
            out.append((str(t.get("unit", "GPU-h")), f"{float(t['gpu_hours']):.3g}"))
        error = rec.get("error") or {}
        for name in ("step_time_mape", "memory_mape"):
            if error.get(name) is not None:
                out.append((f"held-out {name.replace('_', ' ')}", _percent(error[name])))
    if trials is not None:
        out.append(("trials", ", ".join(f"{n} {s}" for s, n in trials["status"].value_counts().items())))
    return out


def build_advise_report(folder: Path) -> Report:
    """Read the folder (UserError on bad input) and lay out every section; nothing is written."""
    folder = Path(folder)
    check_folder(folder)
    environment = read_json_object(folder / "environment.json")
    rec = read_json_object(folder / "recommendation.json")
    trials, why_absent = read_trials(folder)
    provenance = provenance_section(rec)
    sections = [
        *([provenance] if provenance else []),
        recommendation_section(folder, rec),
        scaling_section(folder, rec, trials),
        validation_section(folder),
        *trial_sections(trials, why_absent, environment),
        comm_section(folder),
        Section("environment", "Environment", [environment_table(environment, "environment.json")]),
    ]
    return Report(
        title=f"Advisor report: {folder.resolve().name}",
        subtitle=verdict_sentence(rec)
        or "Which DeepSpeed config to run, how it scales, and how far the predictions can be trusted.",
        source=str(folder.resolve()),
        facts=advise_facts(rec, trials),
        sections=sections,
    )
