"""The reports in a real browser: headless Chromium opens each file from disk, in light and dark mode, at a
laptop's viewport. No console error, every image loaded, nothing fetched, no script run, no sideways
scrolling; a full-page screenshot of each is saved (to $SDZERO_SCREENSHOTS when set, else the test's
tmp folder).

Skipped, with the reason, where Debian's `chromium` is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chromium import CHROMIUM, Chromium
from PIL import Image
from report_fixtures import HOSTILE, HOSTILE_DIR, write_advise_folder, write_comm, write_training_run

from advisor.report.build import write_advise_report, write_training_report

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason=f"headless Chromium not found at {CHROMIUM}: install Debian's `chromium` package "
        "(apt-get install -y chromium) to run the browser tests",
    ),
]

LAPTOP = (1366, 768)
PAGE_FACTS = """(() => {
  const images = [...document.images];
  const style = getComputedStyle(document.body);
  return {
    images: images.length,
    figures: document.querySelectorAll("figure").length,
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.alt),
    widest_image: Math.max(0, ...images.map(i => i.getBoundingClientRect().right)),
    scripts: document.scripts.length,
    overflow_x: document.documentElement.scrollWidth - window.innerWidth,
    height: document.documentElement.scrollHeight,
    text: document.body.innerText,
    background: style.backgroundColor,
  };
})()"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A training report (with validation images), a full advise report and one with only the collectives
    benchmark."""
    root = tmp_path_factory.mktemp("browser-reports")
    partial = root / "comm-only"
    partial.mkdir()
    write_comm(partial)
    out = root / "reports"
    return {
        "training": write_training_report(
            write_training_run(root / HOSTILE_DIR, validation_steps=(4, 8, 12)), out / "training.html"
        ),
        "advise": write_advise_report(write_advise_folder(root / "advise"), out / "advise.html"),
        "advise-partial": write_advise_report(partial, out / "advise-partial.html"),
    }


def screenshot_dir(tmp_path: Path) -> Path:
    folder = Path(os.environ.get("SDZERO_SCREENSHOTS", tmp_path))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def luminance(css_rgb: str) -> float:
    """Relative brightness 0..1 of a computed `rgb(r, g, b)` colour."""
    r, g, b = (int(v) for v in css_rgb[css_rgb.index("(") + 1 : css_rgb.index(")")].split(",")[:3])
    return (0.2126 * r + 0.7152 * g + 0.0722 * b) / 255


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("kind", ["training", "advise", "advise-partial"])
def test_report_renders_cleanly_in_chromium(reports, kind, scheme, tmp_path):
    url = reports[kind].resolve().as_uri()
    with Chromium() as browser:
        browser.open(url, *LAPTOP, dark=scheme == "dark")
        facts = browser.evaluate(PAGE_FACTS)
        shot = browser.screenshot(screenshot_dir(tmp_path) / f"report-{kind}-{scheme}.png")
        errors, requests, dialogs = browser.console_errors(), browser.requested_urls(), browser.dialogs()

    assert errors == [], errors
    assert dialogs == []  # no alert() ran: the hostile strings stayed text
    assert all(u == url or u.startswith("data:") for u in requests), [u[:80] for u in requests]
    assert facts["images"] == facts["figures"] >= 1
    assert facts["broken"] == [], f"images that did not load: {facts['broken']}"
    assert facts["scripts"] == 0
    assert facts["overflow_x"] <= 0, "the page scrolls sideways at a laptop's width"
    assert facts["widest_image"] <= LAPTOP[0]
    if kind != "advise-partial":
        assert HOSTILE in facts["text"]  # shown to the reader as text
    bright = luminance(facts["background"])
    assert bright < 0.2 if scheme == "dark" else bright > 0.8
    with Image.open(shot) as image:
        assert image.width == LAPTOP[0] and image.height >= min(facts["height"], 4 * LAPTOP[1]) > LAPTOP[1]


def test_the_harness_sees_errors_broken_images_and_fetches(tmp_path):
    """The checks above can fail: a page with a script error, a missing image and a remote fetch."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<!doctype html><html><head><title>bad</title></head><body>"
        '<img alt="missing" src="missing.png"><img alt="remote" src="http://127.0.0.1:9/x.png">'
        "<script>console.error('deliberate'); undefined_function();</script></body></html>"
    )
    with Chromium() as browser:
        browser.open(page.as_uri(), *LAPTOP)
        facts = browser.evaluate(PAGE_FACTS)
        errors, requests = browser.console_errors(), browser.requested_urls()
    assert "missing" in facts["broken"] and facts["scripts"] == 1
    assert any("deliberate" in e for e in errors) and any("undefined_function" in e for e in errors)
    assert any(u.startswith("http://127.0.0.1:9/") for u in requests)


EXAMPLE = Path(__file__).resolve().parents[2] / "reports" / "tiny-default-advise.html"


def test_the_example_advise_report_leads_with_provenance_and_the_scaling_table():
    """reports/tiny-default-advise.html (a real `sdzero advise --max-nodes 32` run): where the figures come
    from at the top, the scaling table with its knee and every node count filled (with its time and
    GPU-hours to train), the one held-out error
    and the LR with its rule, on a laptop's width without sideways scrolling."""
    with Chromium() as browser:
        browser.open(EXAMPLE.as_uri(), *LAPTOP)
        facts = browser.evaluate(PAGE_FACTS)
        headings = browser.evaluate("[...document.querySelectorAll('h2')].map(h => h.innerText)")
    assert headings[:2] == ["Where the figures come from", "Recommendation"], headings
    text = facts["text"]
    assert "Trials ran on a CPU" in text and "assumed (preset ib-200)" in text
    assert "Scaling table" in text and "knee" in text and "limiting link" in text
    # Every node count up to 32 reaches the embedded fine-tune's batch, and each row says its time to train.
    assert "unreachable" not in text and "GPU-h" in text and "Time and GPU-hours to train vs nodes" in text
    assert "Held-out error" in text or "No held-out error" in text
    # every predicted figure with its interval, and how sure the node count is (#28)
    assert "±" in text and "how sure" in text and "95% intervals:" in text
    assert "Leave-one-out refits" in text and ("rule: global batch" in text or "base LR unchanged" in text)
    assert facts["overflow_x"] <= 0, "the page scrolls sideways at a laptop's width"
