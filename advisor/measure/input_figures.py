"""The launches' input measurements (sdzero.data.input_probe): every "input" section of the launch
profiles under an advise folder, kept in <out>/input.json so that a replan into another folder has them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sdzero.atomic import write_json_atomic
from sdzero.config.user_file import read_user_json

INPUT_FILE = "input.json"


def launch_input_sections(out_dir: Path) -> list[dict[str, Any]]:
    """The "input" sections of the launch profiles under `out_dir`/profile, else those input.json kept."""
    found = []
    for path in sorted((Path(out_dir) / "profile").rglob("profile.json")):
        # read back through the regular-file reader: a FIFO or a link to /dev/zero planted there is one
        # line naming it, never a hang or a read without end
        record = read_user_json(path, "a launch's profile")
        section = record.get("input") if isinstance(record, dict) else None
        if isinstance(section, dict):
            found.append(section)
    if found:
        return found
    kept_path = Path(out_dir) / INPUT_FILE
    if not kept_path.exists() and not kept_path.is_symlink():
        return []
    kept = read_user_json(kept_path, "--replan's input figures")
    sections = kept.get("sections", []) if isinstance(kept, dict) else []
    return [s for s in sections if isinstance(s, dict)] if isinstance(sections, list) else []


def keep_input(out_dir: Path, sections: list[dict[str, Any]], plan: dict[str, Any] | None) -> None:
    write_json_atomic(Path(out_dir) / INPUT_FILE, {"sections": sections, "plan": plan})
