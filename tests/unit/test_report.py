"""The HTML reports: every figure and table present, figures that decode, nothing fetched, hostile strings
shown as text, atomic writes, and one clear error for bad input.

Most tests render from hand-written inputs (tests/report_fixtures.py: fixtures of the data contract, not
results). The `dist` test at the end renders a real 2-rank fp16 run of the trainer.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import typer
from report_fixtures import (
    HOSTILE,
    HOSTILE_ATTR,
    HOSTILE_DIR,
    metrics_record,
    write_advise_folder,
    write_comm,
    write_lines,
    write_training_run,
    write_trials,
)
from report_page_reader import (
    ACTIVE_TAGS,
    ADVISE_CODE,
    ADVISE_FIGURES,
    ADVISE_TABLES,
    SVG_NS,
    TRAINING_CODE,
    TRAINING_FIGURES,
    TRAINING_TABLES,
    Page,
    svg_of,
)
from typer.testing import CliRunner

from advisor.commands.report import report_command
from advisor.report import figures
from advisor.report.build import default_output, write_advise_report, write_training_report
from advisor.report.train_page import ema, load_run
from sdzero.errors import UserError


@pytest.fixture(scope="module")
def training_html(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("training")
    run = write_training_run(root / HOSTILE_DIR)
    return write_training_report(run, root / "out" / "train.html").read_text()


@pytest.fixture(scope="module")
def advise_html(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("advise")
    return write_advise_report(write_advise_folder(root / "advise"), root / "out" / "advise.html").read_text()


# ------------------------------------------------------------------------------------------ structure


def test_training_report_has_every_figure_and_table(training_html):
    page = Page(training_html)
    assert page.ids("fig-") == TRAINING_FIGURES
    assert page.ids("table-") == TRAINING_TABLES
    assert page.ids("code-") == TRAINING_CODE
    assert len(page.images()) == len(TRAINING_FIGURES)
    assert all(img["alt"] for img in page.images())
    text = " ".join(page.text)
    assert "ZeRO-2 fp16" in text and "2 ranks × 4 × 1 = 8" in text
    assert "committed, latest" in text and "incomplete" in text  # checkpoint events, the staging one too
    assert page.ids("note-") == {"validation", "resumes"}  # no validation/ folder: one line, no empty grid


def test_advise_report_has_every_figure_and_table(advise_html):
    page = Page(advise_html)
    assert page.ids("fig-") == ADVISE_FIGURES
    assert page.ids("table-") == ADVISE_TABLES
    assert page.ids("code-") == ADVISE_CODE
    assert page.ids("note-") == set()  # every input is there, so no section stands in for a missing one
    assert "26 ok, 4 oom, 1 crashed, 1 timeout" in " ".join(page.text)


@pytest.mark.parametrize("kind", ["training", "advise"])
def test_figures_decode_as_svg_images_that_reference_nothing(kind, request):
    page = Page(request.getfixturevalue(f"{kind}_html"))
    for img in page.images():
        root = svg_of(img)
        assert root.tag == f"{SVG_NS}svg"
        width, height = (float(root.attrib[k].removesuffix("pt")) for k in ("width", "height"))
        assert width > 100 and height > 100
        assert len(root.findall(f".//{SVG_NS}path")) > 10  # something is drawn
        for element in root.iter():
            assert element.tag not in {f"{SVG_NS}script", f"{SVG_NS}foreignObject", f"{SVG_NS}image"}
            for name, value in element.attrib.items():
                if name.endswith("href"):
                    assert value.startswith("#"), (name, value)  # only links inside the same SVG


def test_every_figure_has_labelled_axes_with_units(monkeypatch, tmp_path):
    drawn = []
    real = figures.to_svg
    monkeypatch.setattr(figures, "to_svg", lambda fig: drawn.append(fig) or real(fig))
    write_training_report(write_training_run(tmp_path / "run"), tmp_path / "t.html")
    write_advise_report(write_advise_folder(tmp_path / "advise"), tmp_path / "a.html")
    assert len(drawn) == len(TRAINING_FIGURES) + len(ADVISE_FIGURES)
    unit = re.compile(r"\(.+\)")
    for fig in drawn:
        for ax in fig.axes:
            for get, siblings in (
                (lambda a: a.get_xlabel(), ax.get_shared_x_axes()),
                (lambda a: a.get_ylabel(), ax.get_shared_y_axes()),
            ):
                labels = [get(a) for a in siblings.get_siblings(ax)]
                assert any(labels), f"an axis without a label in {[a.get_title() for a in fig.axes]}"
                assert all(unit.search(label) for label in labels if label), labels


@pytest.mark.parametrize("kind", ["training", "advise"])
def test_nothing_external_is_referenced(kind, request):
    html = request.getfixturevalue(f"{kind}_html")
    page = Page(html)
    assert not re.search(r"https?://|//[a-z0-9.-]+\.[a-z]{2,}/", html, re.IGNORECASE)
    for tag, attrs in page.tags:
        assert tag not in ACTIVE_TAGS, tag
        for name, value in attrs.items():
            assert not name.startswith("on"), (tag, name)
            if name in {"src", "href", "srcset", "action", "poster", "background"}:
                assert value.startswith(("data:", "#")), (tag, name, value[:60])
    css = " ".join(page.css)
    assert "url(" not in css and "@import" not in css
    csp = next(
        a["content"] for t, a in page.tags if t == "meta" and a.get("http-equiv") == "Content-Security-Policy"
    )
    assert (
        "default-src 'none'" in csp and "img-src data:" in csp and "script-src" not in csp
    )  # no script allowed


def test_page_is_light_and_dark_friendly(training_html):
    page = Page(training_html)
    css = " ".join(page.css)
    assert "@media (prefers-color-scheme: dark)" in css
    assert any(
        t == "meta" and a.get("name") == "color-scheme" and "dark" in a["content"] for t, a in page.tags
    )
    assert any(t == "meta" and a.get("name") == "viewport" for t, a in page.tags)


# ------------------------------------------------------------------------------------------- escaping


@pytest.mark.parametrize("kind", ["training", "advise"])
def test_hostile_strings_are_shown_as_text_never_as_markup(kind, request):
    html = request.getfixturevalue(f"{kind}_html")
    page = Page(html)
    assert HOSTILE not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert [t for t, _ in page.tags].count("img") == len(page.images())
    assert all(img["src"].startswith("data:image/svg+xml") for img in page.images())  # no injected <img>
    text = "\n".join(page.text)
    assert HOSTILE in text  # shown to the reader, as text
    if kind == "training":
        assert page.raw_title() == "Training report: run&lt;img src=x onerror=alert(3)&gt;"
        assert HOSTILE_ATTR in text  # a validation prompt in the run options
    else:
        assert HOSTILE_ATTR in text  # the hostfile path in environment.json


def test_default_output_name_is_a_safe_file_name(tmp_path):
    assert default_output(tmp_path / HOSTILE_DIR, None) == Path("reports/run_img_src_x_onerror_alert_3.html")
    assert default_output(tmp_path / "run", tmp_path) == tmp_path / "run.html"  # -o a folder
    assert default_output(tmp_path / "run", tmp_path / "x.html") == tmp_path / "x.html"


# --------------------------------------------------------------------------------------- atomic writes


def test_a_failed_render_leaves_the_old_report_and_no_temp_file(tmp_path, monkeypatch):
    run = write_training_run(tmp_path / "run")
    out = write_training_report(run, tmp_path / "out" / "report.html")
    before = out.read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("figure failed")

    monkeypatch.setattr(figures, "memory_figure", broken)
    with pytest.raises(RuntimeError, match="figure failed"):
        write_training_report(run, out)
    assert out.read_bytes() == before
    assert [p.name for p in out.parent.iterdir()] == ["report.html"]


def test_a_failed_write_leaves_the_old_report_and_no_temp_file(tmp_path, monkeypatch):
    import sdzero.atomic as io_module

    run = write_training_run(tmp_path / "run")
    out = write_training_report(run, tmp_path / "out" / "report.html")
    before = out.read_bytes()

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(io_module.os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_training_report(run, out)
    assert out.read_bytes() == before
    assert [p.name for p in out.parent.iterdir()] == ["report.html"]


def test_bad_input_leaves_the_old_report(tmp_path):
    run = write_training_run(tmp_path / "run")
    out = write_training_report(run, tmp_path / "report.html")
    before = out.read_bytes()
    (run / "metrics.jsonl").write_text("{not json\n{}\n")
    with pytest.raises(UserError):
        write_training_report(run, out)
    assert out.read_bytes() == before


# ---------------------------------------------------------------------------------- training input


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no metrics.jsonl in it"),
        ("", "holds no optimizer step yet"),
        ("\n\n", "holds no optimizer step yet"),
        (
            '{"step": 1, "loss": 1.0, "samples_per_s": 2.0, "step_time_s": 1.0}\n{"step": 2, "lo\n{"step": 3}\n',
            r"metrics.jsonl:2: not valid JSON",
        ),
        ('{"step": 1, "loss": 1.0}\n', r"metrics.jsonl:1: missing samples_per_s, step_time_s"),
        ("[1, 2]\n", r"metrics.jsonl:1: expected one JSON object per line"),
        ('{"step": 1, "loss": "high", "samples_per_s": 2.0, "step_time_s": 1.0}\n', "loss must be a number"),
        (
            '{"step": 1.5, "loss": 1.0, "samples_per_s": 2.0, "step_time_s": 1.0}\n',
            "step must be a whole number",
        ),
    ],
)
def test_bad_metrics_give_one_clear_error(tmp_path, content, message):
    run = tmp_path / "run"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    with pytest.raises(UserError, match=message) as error:
        write_training_report(run, tmp_path / "report.html")
    assert "\n" not in str(error.value)
    assert not (tmp_path / "report.html").exists()


def test_missing_run_folder_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        write_training_report(tmp_path / "nope", tmp_path / "r.html")


def test_a_last_line_cut_short_is_left_out_and_said(tmp_path):
    run = write_training_run(tmp_path / "run", resumed_at=None)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 13, "loss": 0.')  # the run was killed mid-write
    assert load_run(run).metrics["step"].tolist() == list(range(1, 13))
    html = write_training_report(run, tmp_path / "r.html").read_text()
    assert "its last line was cut short" in html


def test_a_resumed_run_is_stitched_from_its_rotated_metrics(tmp_path):
    run = write_training_run(tmp_path / "run", steps=12, resumed_at=5)
    old = [json.loads(line) for line in (run / "metrics.1.jsonl").read_text().splitlines()]
    write_lines(run / "metrics.1.jsonl", [{**r, "loss": 99.0} if r["step"] >= 5 else r for r in old])
    loaded = load_run(run)
    assert loaded.metrics["step"].tolist() == list(range(1, 13))
    assert loaded.resume_steps == [5]
    assert (loaded.metrics["loss"] < 99).all()  # the repeated steps come from the resumed segment


def test_a_fresh_restart_ignores_the_earlier_run(tmp_path):
    run = write_training_run(tmp_path / "run", steps=4, resumed_at=None)
    write_lines(run / "metrics.1.jsonl", [metrics_record(s) for s in range(1, 30)])  # an older, longer run
    loaded = load_run(run)
    assert loaded.metrics["step"].tolist() == [1, 2, 3, 4] and loaded.resume_steps == []


def test_a_long_run_is_drawn_in_bins_not_a_point_per_step(tmp_path):
    run = write_training_run(tmp_path / "run", steps=6000, resumed_at=None, checkpoints=())
    html = write_training_report(run, tmp_path / "r.html").read_text()
    page = Page(html)
    assert page.ids("fig-") == TRAINING_FIGURES
    assert len(html) < 2_500_000  # a point per step would be several times this
    assert "The 6000 steps are drawn as 1500 bins" in " ".join(page.text)


def test_bf16_run_says_there_is_no_loss_scale(tmp_path):
    run = write_training_run(tmp_path / "run", fp16=False, checkpoints=())
    page = Page(write_training_report(run, tmp_path / "r.html").read_text())
    assert page.ids("fig-") == TRAINING_FIGURES - {"loss-scale"}
    assert {"loss-scale", "checkpoints"} <= page.ids("note-")
    assert "bf16 run: no dynamic loss scale" in " ".join(page.text)


def test_ema_is_bias_corrected_and_skips_nan():
    values = pd.Series([2.0, 2.0, float("nan"), 2.0]).to_numpy()
    assert ema(values, span=10).tolist() == pytest.approx([2.0, 2.0, 2.0, 2.0])
    steps = ema(pd.Series([0.0] * 5 + [1.0] * 200).to_numpy(), span=9)
    assert steps[4] == 0 and 0 < steps[5] < 0.5 and steps[-1] == pytest.approx(1.0, abs=1e-6)


# ------------------------------------------------------------------------------------ advise input


@pytest.mark.parametrize(
    ("present", "figures_left"),
    [
        ({"comm"}, {"bandwidth"}),
        ({"trials"}, {"trial-memory"}),
        ({"comm", "trials"}, {"bandwidth", "trial-memory"}),
    ],
)
def test_absent_inputs_are_one_line_each_not_empty_plots(tmp_path, present, figures_left):
    folder = tmp_path / "advise"
    folder.mkdir()
    if "comm" in present:
        write_comm(folder)
    if "trials" in present:
        write_trials(folder)
    page = Page(write_advise_report(folder, tmp_path / "r.html").read_text())
    assert page.ids("fig-") == figures_left
    notes = page.ids("note-")
    assert {"recommendation", "scaling", "validation"} <= notes
    assert ("bandwidth" in notes) == ("comm" not in present)
    assert ("trial-memory" in notes) == ("trials" not in present)
    for tag, attrs in page.tags:
        if attrs.get("class") == "absent":
            assert tag == "p"


def test_comm_files_in_a_comm_subfolder_are_found(tmp_path):
    (tmp_path / "advise" / "comm").mkdir(parents=True)
    write_comm(tmp_path / "advise" / "comm")
    page = Page(write_advise_report(tmp_path / "advise", tmp_path / "r.html").read_text())
    assert "bandwidth" in page.ids("fig-")


def test_an_empty_trials_file_is_said_not_drawn(tmp_path):
    folder = tmp_path / "advise"
    folder.mkdir()
    (folder / "trials.csv").write_text("trial_id,status,zero_stage,dtype,micro_batch\n")
    page = Page(write_advise_report(folder, tmp_path / "r.html").read_text())
    assert page.ids("fig-") == set() and "trials" in page.ids("note-")
    assert "lists no trial yet" in " ".join(page.text)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda f: (f / "predictions.csv").write_text("node_count,config_id\n1,a\n"),
            r"predictions.csv: missing column\(s\) zero_stage",
        ),
        (
            lambda f: (f / "validation.csv").write_text(
                "config_id,quantity,predicted,measured,held_out\na,step_time_s,fast,1,true\n"
            ),
            "column predicted must hold numbers",
        ),
        (lambda f: (f / "recommendation.json").write_text("[1]"), "expected a JSON object"),
        (
            lambda f: (f / "comm_fit.json").write_text('{"schema": "other"}'),
            "not a comm_fit.json this version reads",
        ),
        (lambda f: (f / "trials.csv").write_bytes(b'"status\n\xff'), "trials.csv"),
    ],
)
def test_bad_advise_input_gives_one_clear_error(tmp_path, damage, message):
    folder = write_advise_folder(tmp_path / "advise")
    damage(folder)
    with pytest.raises(UserError, match=message) as error:
        write_advise_report(folder, tmp_path / "r.html")
    assert "\n" not in str(error.value)


def test_a_folder_with_nothing_to_report_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="no such folder"):
        write_advise_report(tmp_path / "nope", tmp_path / "r.html")
    run = write_training_run(tmp_path / "run")
    with pytest.raises(UserError, match="for a training run use --run"):
        write_advise_report(run, tmp_path / "r.html")


# ------------------------------------------------------------------------------------------------ CLI


def cli() -> typer.Typer:
    app = typer.Typer()
    app.command()(report_command)
    return app


def test_cli_writes_the_report_where_asked_and_by_default(tmp_path, monkeypatch):
    run = write_training_run(tmp_path / "my-run")
    result = CliRunner().invoke(cli(), ["--run", str(run), "-o", str(tmp_path / "x.html")])
    assert result.exit_code == 0, result.output
    assert "wrote" in result.output and (tmp_path / "x.html").is_file()
    monkeypatch.chdir(tmp_path)
    advise = write_advise_folder(tmp_path / "adv-1")
    result = CliRunner().invoke(cli(), [str(advise)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "reports" / "adv-1.html").is_file()


@pytest.mark.parametrize("args", [[], ["a", "--run", "b"]])
def test_cli_wants_exactly_one_input(tmp_path, args):
    result = CliRunner().invoke(cli(), args)
    assert isinstance(result.exception, UserError)
    assert "either ADVISE_OUT" in str(result.exception)
