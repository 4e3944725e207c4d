"""The user guides say what is true now; measurement journals live in docs/calibration/.

The guides (README.md and docs/*.md, not docs/calibration/ or docs/plans/) must not tell how a figure came
about round by round or session by session, the README stays short enough to read, its headline cells
point to a doc instead of carrying a history, and its layout block matches the tree it describes.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_MAX_LINES = 220
HEADLINE_CELL_MAX_CHARS = 220
PACKAGE_ROOTS = ("sdzero", "advisor")

# Narrative a guide should not hold: numbered rounds ("round 4", "rounds 6-8", "round E1", but not the
# flag `--rounds 3`), sessions of work ("this session", "session 9"), clock times, "issue 13, round 4".
NARRATIVE = [
    re.compile(r"(?<![-\w])rounds? E?\d+\b", re.IGNORECASE),
    re.compile(r"\bsession \d+", re.IGNORECASE),
    re.compile(
        r"\b(this|next|last|previous|that|same|one|earlier|later) (work )?sessions?\b(?![- ]wide)",
        re.IGNORECASE,
    ),
    re.compile(r"\b\d{1,2}:\d{2}(-\d{1,2}:\d{2})? UTC\b"),
    re.compile(r"\b(calibration rounds?|rounds? of calibration)\b", re.IGNORECASE),
    re.compile(r"\bissue #?\d+,? round\b", re.IGNORECASE),
]


def user_guides() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def narrative_lines(text: str) -> list[str]:
    return [
        f"{n}: {line.strip()[:160]}"
        for n, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in NARRATIVE)
    ]


@pytest.mark.parametrize("guide", user_guides(), ids=lambda p: str(p.relative_to(ROOT)))
def test_guides_hold_no_round_or_session_narrative(guide: Path) -> None:
    found = narrative_lines(guide.read_text())
    assert not found, f"{guide.relative_to(ROOT)}: move these to docs/calibration/:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "line",
    [
        "Round 12: the final code on an AVX-512 host",
        "rounds 6-8 (every layout; round 8 hosts x 1 only)",
        "what it did in round E1",
        "Re-measured in the next session",
        "(session 9, run alone)",
        "between the chunks: 17:00-17:06 UTC",
        "### Transport and wait (issue 13, round 4)",
    ],
)
def test_narrative_patterns_catch_journal_lines(line: str) -> None:
    assert narrative_lines(line)


@pytest.mark.parametrize(
    "line",
    [
        "`bench/advisor_accuracy.py --rounds 2` runs the grid",
        "interleaved in rounds (A B C D A B C D ...)",
        "ssh sessions inside their host's quota",
        "one session-wide 2-host cluster",
        "12-16 rounds of 8 steps",
    ],
)
def test_narrative_patterns_spare_plain_usage(line: str) -> None:
    assert not narrative_lines(line)


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n < README_MAX_LINES, (
        f"README.md has {n} lines; keep it under {README_MAX_LINES} (details go to docs/)"
    )


def section(text: str, heading: str) -> str:
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def test_readme_headline_cells_are_short() -> None:
    rows = [
        line for line in section(README.read_text(), "Headline figures").splitlines() if line.startswith("|")
    ]
    assert len(rows) > 2, "the Headline figures table is missing"
    long = [
        f"{len(cell)} chars: {cell[:80]}..."
        for row in rows
        for cell in (c.strip() for c in row.strip().strip("|").split("|"))
        if len(cell) > HEADLINE_CELL_MAX_CHARS
    ]
    assert not long, "headline cells over {} characters (point to the doc instead):\n{}".format(
        HEADLINE_CELL_MAX_CHARS, "\n".join(long)
    )


def layout_folders(text: str) -> set[str]:
    """The folders the README's layout block names: each line's first token when it ends in '/'."""
    block = re.search(r"```\n(.*?)```", section(text, "Layout"), re.DOTALL)
    assert block, "README.md's Layout section has no fenced block"
    named = set()
    for line in block.group(1).splitlines():
        token = line.split(maxsplit=1)[0] if line.strip() else ""
        if token.endswith("/"):
            named.add(token.rstrip("/"))
    return named


def tracked_folders() -> tuple[set[str], set[str]]:
    """Top-level folders tracked by git (not hidden), and every package folder under sdzero/ and advisor/."""
    files = subprocess.run(
        ["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout.splitlines()
    top = {f.split("/", 1)[0] for f in files if "/" in f and not f.startswith(".")}
    packages = {
        str(Path(f).parent)
        for f in files
        if f.endswith("/__init__.py") and f.split("/", 1)[0] in PACKAGE_ROOTS and (ROOT / f).exists()
    }
    return top, packages


def test_readme_layout_matches_the_tree() -> None:
    named = layout_folders(README.read_text())
    missing_on_disk = sorted(f for f in named if not (ROOT / f).is_dir())
    assert not missing_on_disk, (
        f"the README's layout block names folders that do not exist: {missing_on_disk}"
    )
    top, packages = tracked_folders()
    unnamed = sorted((top | packages) - named)
    assert not unnamed, f"the README's layout block leaves out these folders: {unnamed}"
