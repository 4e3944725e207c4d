"""The training report's validation images: a steps x prompts grid of small embedded thumbnails, each in
its own cell, captioned with its prompt (escaped), read from the folders sdzero.training.validation writes."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image
from report_fixtures import HOSTILE, HOSTILE_ATTR, validation_colour, write_training_run, write_validation
from report_page_reader import Page

from advisor.report import train_page
from advisor.report.build import write_training_report
from advisor.report.train_page import THUMBNAIL_PX, shown_steps
from sdzero.training.validation import PROMPTS_FILE, read_validation, step_folder

PROMPTS = [HOSTILE, HOSTILE_ATTR]
"""The fixture run's --validation-prompts."""
JPEG = "data:image/jpeg;base64,"


def thumbnails(page: Page) -> list[tuple[str, Image.Image, int]]:
    """(alt text, decoded image, encoded bytes) of every embedded raster image, in page order."""
    found = []
    for img in page.images():
        if img["src"].startswith(JPEG):
            data = base64.b64decode(img["src"][len(JPEG) :])
            found.append((img["alt"], Image.open(io.BytesIO(data)).convert("RGB"), len(data)))
    return found


def test_each_validation_step_is_a_row_of_thumbnails_one_per_prompt(tmp_path):
    run = write_training_run(tmp_path / "run", validation_steps=(4, 8, 12))
    originals = sum(p.stat().st_size for p in (run / "validation").rglob("*.png"))
    html = write_training_report(run, tmp_path / "r.html").read_text()
    page = Page(html)
    assert "validation" in page.ids("gallery-") and "validation" not in page.ids("note-")
    shown = thumbnails(page)
    # Rows are steps in order, columns the prompts in order; the prompt is text in the alt and heading.
    assert [alt for alt, _, _ in shown] == [f"step {s}: {p}" for s in (4, 8, 12) for p in PROMPTS]
    for alt, image, size in shown:
        step, prompt = int(alt.split(":")[0].removeprefix("step ")), alt.split(": ", 1)[1]
        assert max(image.size) == THUMBNAIL_PX  # downscaled from 384 px, aspect kept
        assert image.size[0] == image.size[1]
        expected = validation_colour(step, PROMPTS.index(prompt))
        mean = np.asarray(image, dtype=float).reshape(-1, 3).mean(axis=0)
        assert np.abs(mean - expected).max() < 6, (alt, mean, expected)  # the right image in each cell
        assert size < 40_000
    assert len(html.encode()) < originals / 2  # thumbnails, not the full files
    assert HOSTILE not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html


def test_many_validation_steps_are_thinned_to_the_first_last_and_evenly_between(tmp_path, monkeypatch):
    assert shown_steps(5, limit=12) == [0, 1, 2, 3, 4]
    picked = shown_steps(40, limit=12)
    assert len(picked) == 12 and picked[0] == 0 and picked[-1] == 39
    assert max(np.diff(picked)) - min(np.diff(picked)) <= 1  # evenly spaced
    monkeypatch.setattr(train_page, "MAX_VALIDATION_ROWS", 3)
    run = write_training_run(
        tmp_path / "run", resumed_at=None, checkpoints=(), validation_steps=(2, 4, 6, 8, 10)
    )
    page = Page(write_training_report(run, tmp_path / "r.html").read_text())
    assert [alt.split(":")[0] for alt, _, _ in thumbnails(page)][::2] == ["step 2", "step 6", "step 10"]
    assert "3 of the 5 validation steps are shown" in " ".join(page.text)


def test_a_damaged_image_or_prompt_list_is_said_and_the_rest_shown(tmp_path):
    run = write_training_run(tmp_path / "run", resumed_at=None, checkpoints=(), validation_steps=(2, 4))
    cut = step_folder(run / "validation", 4) / "00_script-alert-1-script.png"
    cut.write_bytes(cut.read_bytes()[:300])  # killed mid-write
    (step_folder(run / "validation", 2) / PROMPTS_FILE).write_text("[")  # the prompt list is damaged
    page = Page(write_training_report(run, tmp_path / "r.html").read_text())
    alts = [alt for alt, _, _ in thumbnails(page)]
    # Step 2's prompts come from the file names; step 4's first image is left out and its cell is empty.
    assert alts == [
        "step 2: script-alert-1-script",
        "step 2: img-src-x-onerror-alert-2",
        f"step 4: {HOSTILE_ATTR}",
    ]
    assert "validation/step_00000004/00_script-alert-1-script.png: not a readable image" in " ".join(
        page.text
    )


def test_read_validation_pairs_each_image_with_its_prompt(tmp_path):
    write_validation(tmp_path, 12, ["b", "a"])
    write_validation(tmp_path, 3, ["b", "a"])
    (tmp_path / "validation" / "step_notes").mkdir()  # not a step folder
    (step_folder(tmp_path / "validation", 3) / PROMPTS_FILE).write_text(json.dumps(["b prompt", "a prompt"]))
    steps = read_validation(tmp_path / "validation")
    assert [s.step for s in steps] == [3, 12]
    assert [(p, path.name) for p, path in steps[0].images] == [
        ("b prompt", "00_b.png"),
        ("a prompt", "01_a.png"),
    ]
    assert read_validation(tmp_path / "absent") == []
