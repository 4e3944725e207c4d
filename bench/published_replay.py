"""The scaling model against published clusters: predicted vs published per-GPU training throughput.

Each published series is replayed through the path a user takes, `sdzero advise --replan PROFILE --preset
MACHINE`: the profile file holds the series' single-node figure (what one node of the target measured),
the preset the cluster's machine (NVLink inside, NICs between; advisor/model/network.py). Every other point
of the series is a prediction from that one figure; the table sets its error beside the published noise
floor: identical single-node systems from different vendors differ by 2.6-2.8% in the same MLPerf round
(as stated in issue #42), so an error within that band is as close as the published figures themselves
agree.

A point whose per-GPU batch differs from the single-node figure's would need the single-node rate at its
own per-GPU batch; where that is not published the point is printed as skipped, with the reason, and
nothing is predicted for it.

    python bench/published_replay.py [--out DIR]

No GPU, no process group: each series answers in seconds on a laptop.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from advisor.stages.advise import run_advise  # noqa: E402
from advisor.stages.request import AdviseRequest  # noqa: E402

NOISE_FLOOR = (0.026, 0.028)
"""Identical single-node systems from different vendors, one MLPerf round: 2.6-2.8% apart (issue #42)."""
GOAL = 0.05
SECONDS: dict[str, float] = {}
"""Each series' replan, seconds (in this process: the interpreter's start-up and imports excluded)."""


@dataclass(frozen=True)
class Point:
    nodes: int
    per_gpu: float
    """Published samples/s per GPU."""
    skip: str = ""
    """Why no prediction is made ('' to predict)."""


@dataclass(frozen=True)
class Series:
    name: str
    profile: Path | None
    preset: str
    points: tuple[Point, ...]
    source: str
    network: str
    """How the cluster's network is known (published, or the assumption made)."""
    base_nodes: int = 1
    """The node count of the profile's own figure (1 unless no single-node rate is published)."""


SERIES = (
    Series(
        "MLPerf v4.1 Lambda H100 SXM, SD2 512 px, 32/GPU",
        ROOT / "bench" / "published" / "mlperf-v4.1-lambda-h100.yaml",
        "dgx-h100",
        (
            Point(
                1,
                0.0,
                "Lambda's 1-node rate at 32/GPU is unpublished (its 1-node run used 64/GPU, config_1cc_01x08x64): "
                "the series is replayed from its 2-node figure",
            ),
            Point(2, 119.1),
            Point(4, 116.7),
        ),
        "mlcommons/training_results_v4.1 Lambda/results/lambda_1cc_n{2,4}_H100-SXM-80GB_ngc24.04_nemo/"
        "stable_diffusion (config_1cc_02x08x32, config_1cc_04x08x32); per-GPU figures as given in issue #42",
        "8 x 400G InfiniBand per node (Lambda 1-Click Cluster)",
        2,
    ),
    Series(
        "MLPerf v5.0 Dell XE9680L H200, SD2 512 px, 32/GPU",
        ROOT / "examples" / "profile.yaml",
        "hgx-h200",
        (Point(1, 143.5), Point(2, 142.1)),
        "mlcommons/training_results_v5.0 Dell (config_XE9680lx8H200-SXM-141GB_01x08x32, _02x08x32); per-GPU "
        "figures as given in issue #42",
        "assumed: 8 x NDR 400G per node, the XE9680L's usual fabric (not in the submission's config)",
    ),
    Series(
        "MosaicML SD2 base A100-80GB, 512 px, 16/GPU, global batch 2048",
        ROOT / "bench" / "published" / "mosaicml-sd2-a100.yaml",
        "dgx-a100",
        (
            Point(1, 290 / 8),
            Point(2, 585 / 16),
            Point(4, 1195 / 32),
            Point(8, 2340 / 64),
            Point(16, 4590 / 128),
        ),
        "mosaicml/diffusion README, 'How many GPUs do I need?' (8-128 A100s: 290, 585, 1195, 2340, 4590 "
        "images/s at 512x512); yamls/hydra-yamls/SD-2-base-512.yaml",
        "assumed: 8 x HDR 200G per node (DGX A100's), MosaicML's cloud fabric is not published there",
    ),
)


def replay(series: Series, out: Path) -> list[dict[str, object]]:
    """One row per point: published and predicted per-GPU samples/s and the error."""
    rows: list[dict[str, object]] = []
    predicted: dict[int, float] = {}
    if series.profile is not None:
        largest = max(p.nodes for p in series.points)
        request = AdviseRequest(
            replan=series.profile,
            out_dir=out / series.profile.stem,
            preset=series.preset,
            max_nodes=largest,
            samples=1_000_000,  # the time to train is not compared here, only throughput
        )
        started = time.monotonic()
        table = run_advise(request).recommendation["scaling_table"]
        SECONDS[series.name] = time.monotonic() - started
        predicted = {int(r["node_count"]): float(r["samples_per_s"]) for r in table if r.get("samples_per_s")}
    for p in series.points:
        row: dict[str, object] = {
            "series": series.name,
            "nodes": p.nodes,
            "published": p.per_gpu,
            "base": p.nodes == series.base_nodes,
        }
        if p.skip or p.nodes not in predicted:
            row["skipped"] = p.skip or "no prediction at this node count"
        else:
            per_gpu = predicted[p.nodes] / (p.nodes * gpus_per_node(series))
            row |= {"predicted": per_gpu, "error": per_gpu / p.per_gpu - 1}
        rows.append(row)
    return rows


def gpus_per_node(series: Series) -> int:
    import yaml

    assert series.profile is not None
    return int(yaml.safe_load(series.profile.read_text())["gpus_per_node"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, default=None, help="where the replans' answers go (default: a temp dir)"
    )
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="published-replay-"))
    rows = [row for s in SERIES for row in replay(s, out)]
    lo, hi = NOISE_FLOOR
    print(
        f"| series | nodes | published samples/s/GPU | predicted | error | noise floor | within {GOAL:.0%} |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "skipped" in r:
            published = f"{r['published']:.1f}" if r["published"] else "unpublished"
            print(f"| {r['series']} | {r['nodes']} | {published} | skipped: {r['skipped']} | | | |")
            continue
        error = float(r["error"])  # type: ignore[arg-type]
        base = " (the profile's own point)" if r["base"] else ""
        print(
            f"| {r['series']} | {r['nodes']} | {r['published']:.1f} | {r['predicted']:.1f}{base} | {error:+.1%} | "
            f"{lo:.1%}-{hi:.1%} | {'yes' if abs(error) <= GOAL else 'NO'} |"
        )
    print()
    for s in SERIES:
        took = f"; answered in {SECONDS[s.name]:.1f} s" if s.name in SECONDS else ""
        print(f"- {s.name}: {s.source}; network {s.network}; preset {s.preset}{took}")
    scored = [r for r in rows if "error" in r and not r["base"]]
    within = sum(abs(float(r["error"])) <= GOAL for r in scored)  # type: ignore[arg-type]
    skipped = sum("skipped" in r for r in rows)
    print(f"\n{within} of {len(scored)} predicted points within {GOAL:.0%}; {skipped} skipped (unpublished)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
