"""Issue #49: a profile file carries the node's input figures (`input:`, advisor.stages.input_schema), and a
replan from it is bounded by its input as one from an advise folder's input.json is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = (ROOT / "examples" / "profile.yaml").read_text()
INPUT = """input:
  loader_samples_per_s: 20.0
  workers_per_rank: 2
  cpu_count: 96
  storage_bytes_per_s: 2000000000.0
  storage_files_per_s: 8000.0
"""


def replan(tmp_path: Path, text: str) -> tuple[int, str, Path]:
    path = tmp_path / "profile.yaml"
    path.write_text(text)
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app, ["advise", "--replan", str(path), "--out", str(out), "--samples", "100000"]
    )
    return result.exit_code, result.output, out


def test_a_profile_with_input_figures_plans_input_bound_rows_and_says_so(tmp_path):
    code, output, out = replan(tmp_path, EXAMPLE + INPUT)
    assert code == 0, output
    rec = json.loads((out / "recommendation.json").read_text())
    ok = [r for r in rec["scaling_table"] if r["status"] == "ok"]
    # 2 workers x 8 ranks x 20 samples/s: 320 samples/s a node, below the node's measured 8 x 143.5
    assert ok and all(r["input_bound"] and r["input_link"] == "loader workers" for r in ok)
    first = next(r for r in ok if r["node_count"] == 1)
    assert first["samples_per_s"] == pytest.approx(320.0)
    assert "input-bound" in rec["verdict"] and "the loader workers give 320" in rec["verdict"]
    plan = json.loads((out / "input.json").read_text())["plan"]
    assert plan["cores_per_node"] == 96 and plan["bytes_per_sample"] == pytest.approx(250_000.0)


def test_a_profile_without_input_figures_plans_as_before(tmp_path):
    code, output, out = replan(tmp_path, EXAMPLE)
    assert code == 0, output
    rec = json.loads((out / "recommendation.json").read_text())
    first = next(r for r in rec["scaling_table"] if r["node_count"] == 1)
    assert first["samples_per_s"] == pytest.approx(8 * 143.5, rel=0.02)
    assert not any(r.get("input_bound") for r in rec["scaling_table"])
    assert "input-bound" not in rec["verdict"]
    assert json.loads((out / "input.json").read_text())["plan"] is None


BAD = {
    "a negative rate": (
        "loader_samples_per_s: 20.0",
        "loader_samples_per_s: -3",
        "input.loader_samples_per_s",
    ),
    "a NaN rate": ("loader_samples_per_s: 20.0", "loader_samples_per_s: .nan", "must be a finite number"),
    "a word for a rate": (
        "loader_samples_per_s: 20.0",
        "loader_samples_per_s: fast",
        "must be a valid number",
    ),
    "cores as a fraction": ("cpu_count: 96", "cpu_count: 9.5", "input.cpu_count: must be a valid integer"),
    "no cores": ("cpu_count: 96", "cpu_count: 0", "input.cpu_count: must be greater than or equal to 1"),
    "bytes/s without files/s": ("  storage_files_per_s: 8000.0\n", "", "storage_files_per_s together"),
    "an infinite storage rate": ("bytes_per_s: 2000000000.0", "bytes_per_s: .inf", "must be a finite number"),
    "a misspelt key": ("workers_per_rank", "workers_per_rnak", "did you mean workers_per_rank?"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_bad_input_figure_is_one_line_exit_2(tmp_path, case):
    old, new, words = BAD[case]
    assert old in INPUT
    code, output, out = replan(tmp_path, EXAMPLE + INPUT.replace(old, new))
    assert code == 2, output
    line = output.strip()
    assert "\n" not in line and "Traceback" not in line and words in line, line
    assert not (out / "recommendation.json").exists()
