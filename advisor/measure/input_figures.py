"""The launches' input measurements (sdzero.data.input_probe): every "input" section of the launch
profiles under an advise folder, kept in <out>/input.json so that a replan into another folder has them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sdzero.atomic import write_json_atomic

INPUT_FILE = "input.json"


def launch_input_sections(out_dir: Path) -> list[dict[str, Any]]:
    """The "input" sections of the launch profiles under `out_dir`/profile, else those input.json kept."""
    found = []
    for path in sorted((Path(out_dir) / "profile").rglob("profile.json")):
        try:
            section = json.loads(path.read_text()).get("input")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(section, dict):
            found.append(section)
    if found:
        return found
    try:
        kept = json.loads((Path(out_dir) / INPUT_FILE).read_text()).get("sections", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [s for s in kept if isinstance(s, dict)]


def keep_input(out_dir: Path, sections: list[dict[str, Any]], plan: dict[str, Any] | None) -> None:
    write_json_atomic(Path(out_dir) / INPUT_FILE, {"sections": sections, "plan": plan})
