"""`sdzero advise --replan` of a stored advise folder (tests/support/advise_folder: the files a real
`sdzero advise` left on a CPU, the ones a replan reads) and of examples/profile.yaml gives, byte for byte,
the recommendation.json that the code before the advisor's refactor (issue #54) gave: the refactors of the
floors, the GPU catalogue, the node-count rules and the inputs' builder change no answer.

The goldens hold three paths as placeholders (<OUT>: --out; <FOLDER>: the stored folder; <ROOT>: the
checkout, in train.py's path and the profile's), which differ per checkout. They were made by the code
before issue #54 with `sdzero advise <CASES' options> --out X`, those paths then replaced by the
placeholders; a change that alters an answer on purpose makes them again the same way."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from advisor.cli import app

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "tests" / "support" / "advise_folder"
GOLDEN = FOLDER / "golden"
CASES = {
    "folder": ["--replan", "{folder}"],
    "folder-h100-gpu-hours": [
        "--replan",
        "{folder}",
        "--target-gpu",
        "h100-80gb",
        "--gpus-per-node",
        "8",
        "--max-gpu-hours",
        "5",
        "--max-nodes",
        "32",
    ],
    "profile-deadline": [
        "--replan",
        "{profile}",
        "--samples",
        "2000000",
        "--preset",
        "hgx-h200",
        "--deadline-hours",
        "3",
        "--max-nodes",
        "64",
    ],
}
"""Golden name -> the options after `sdzero advise` (--out is added)."""


def placeholders(text: str, out: Path) -> str:
    return text.replace(str(out), "<OUT>").replace(str(FOLDER), "<FOLDER>").replace(str(ROOT), "<ROOT>")


@pytest.mark.parametrize("name", list(CASES))
def test_a_replan_gives_the_stored_answer_byte_for_byte(tmp_path, name):
    out = tmp_path / "out"
    args = [a.format(folder=FOLDER, profile=ROOT / "examples" / "profile.yaml") for a in CASES[name]]
    result = CliRunner().invoke(app, ["advise", *args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    answer = placeholders((out / "recommendation.json").read_text(), out)
    assert answer == (GOLDEN / f"{name}.json").read_text()


def test_the_stored_folder_is_left_as_it_was(tmp_path):
    """A replan into another folder reads the stored one and writes nothing there."""
    before = {p: p.read_bytes() for p in FOLDER.rglob("*") if p.is_file()}
    result = CliRunner().invoke(app, ["advise", "--replan", str(FOLDER), "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert {p: p.read_bytes() for p in FOLDER.rglob("*") if p.is_file()} == before


def test_the_live_run_and_both_replan_sources_build_their_inputs_through_one_builder():
    """advisor.stages.inputs.build_inputs makes every AdviseInputs: the live run (read_inputs), an advise
    folder (advisor.stages.replan) and a profile file or run folder (advisor.stages.profile_source) give it
    an InputSource; nowhere else is the stages' input put together by hand."""
    import ast
    import inspect

    from advisor.stages import inputs, profile_source, replan

    def builds(module: object, name: str) -> list[str]:
        tree = ast.parse(inspect.getsource(module))  # type: ignore[arg-type]
        return [
            f.name
            for f in ast.walk(tree)
            if isinstance(f, ast.FunctionDef)
            for call in ast.walk(f)
            if isinstance(call, ast.Call) and getattr(call.func, "id", None) == name
        ]

    constructed = [
        (m.__name__, f) for m in (inputs, replan, profile_source) for f in builds(m, "AdviseInputs")
    ]
    assert constructed == [("advisor.stages.inputs", "build_inputs")]
    assert builds(inputs, "build_inputs") == ["read_inputs"]
    assert builds(replan, "build_inputs") == ["replan_inputs"]
    assert builds(profile_source, "build_inputs") == ["profile_inputs"]
    every = [p for p in (ROOT / "advisor").rglob("*.py") if "AdviseInputs(" in p.read_text()]
    assert every == [ROOT / "advisor" / "stages" / "inputs.py"]
