"""`make gpu-bundle` (bench/gpu_bundle.py) and bench/gpu_first_run.py's refusals, without a registry or a
GPU: versions pinned from the lock, a bundle over the size limit refused with nothing left behind, a
wheelhouse that does not match its manifest refused, no CUDA refused, in one line each."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_scripts import load_bench

REPO = Path(__file__).resolve().parents[2]


def test_packages_are_pinned_to_the_tested_versions(tmp_path):
    bundle = load_bench("gpu_bundle")
    lock = tmp_path / "lock.txt"
    lock.write_text("# tested\nDiffusers==0.42.1\npydantic_core==2.50.5\n")
    assert bundle.pinned(("diffusers", "pydantic-core", "hjson"), lock) == [
        "diffusers==0.42.1",
        "pydantic-core==2.50.5",
        "hjson",
    ]
    shipped = bundle.pinned(bundle.BUILT_HERE + bundle.MISSING_ON_IMAGE, REPO / "requirements" / "lock.txt")
    assert all("==" in spec for spec in shipped)  # every bundled package at a tested version
    assert not any(spec.startswith("torch") for spec in shipped)  # the image's own torch stays


def test_a_bundle_over_the_limit_is_refused_and_leaves_no_folder(tmp_path, monkeypatch):
    bundle = load_bench("gpu_bundle")

    def fake_pip(*args):  # what pip wheel / download leave in the -w / -d folder: a 3 MiB wheel each
        import zipfile

        dest = Path(args[args.index("-w" if "-w" in args else "-d") + 1])
        with zipfile.ZipFile(dest / f"{args[0]}-1.0-py3-none-any.whl", "w") as z:
            z.writestr(f"{args[0]}-1.0.dist-info/METADATA", "Name: x\nVersion: 1.0\n")
            z.writestr("payload.bin", b"x" * (3 * 2**20 - 400))

    monkeypatch.setattr(bundle, "pip", fake_pip)
    out = tmp_path / "wheelhouse"
    with pytest.raises(SystemExit, match=r"the wheelhouse is 6.0 MiB, over --max-mib 5"):
        bundle.build(out, 5.0, REPO / "requirements" / "lock.txt")
    assert not out.exists() and list(tmp_path.iterdir()) == []
    record = bundle.build(out, 40.0, REPO / "requirements" / "lock.txt")
    assert abs(record["total_bytes"] - 6 * 2**20) < 2**12 and set(record["files"]) == {
        "wheel-1.0-py3-none-any.whl",
        "download-1.0-py3-none-any.whl",
    }
    assert json.loads((out / "manifest.json").read_text()) == record


def test_first_run_refuses_a_wheelhouse_that_does_not_match_its_manifest(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"changed")
    entry = {"bytes": 3, "sha256": "0" * 64}
    (wheels / "manifest.json").write_text(
        json.dumps({"python": "3.12", "files": {"a-1.0-py3-none-any.whl": entry}})
    )
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_first_run.py"), "--out", str(tmp_path / "o"),
         "--work", str(tmp_path / "w"), "--wheelhouse", str(wheels)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"gpu_first_run: {wheels / 'a-1.0-py3-none-any.whl'} does not match its manifest; run make gpu-bundle"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_first_run_refuses_without_cuda_after_checking_the_modules(tmp_path, monkeypatch):
    monkeypatch.setenv("SDZERO_GPU_FIRST_RUN_SITE", str(tmp_path))  # as if installed: skip to the checks
    work = tmp_path / "w"
    work.mkdir()
    (work / "install.json").write_text(json.dumps({"installed": True}))
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_first_run.py"), "--out", str(tmp_path / "o"), "--work", str(work)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "gpu_first_run: no CUDA device visible to torch (--cpu-rehearsal checks the script on a CPU)"
    ]


def fake_wheel(folder: Path, name: str, requires: list[str]) -> None:
    import zipfile

    with zipfile.ZipFile(folder / f"{name}-1.0-py3-none-any.whl", "w") as z:
        lines = [f"Name: {name}", "Version: 1.0", *(f"Requires-Dist: {r}" for r in requires)]
        z.writestr(f"{name}-1.0.dist-info/METADATA", "\n".join(lines) + "\n")


def test_a_requirement_neither_bundled_nor_on_the_image_is_named(tmp_path):
    """importlib-metadata 10 needs lazy-importer on Python < 3.15: a bundle without it failed to import
    there. Each wheel's requirements, under the image's markers, must be bundled or on the image."""
    bundle = load_bench("gpu_bundle")
    fake_wheel(tmp_path, "importlib_metadata", ["zipp>=3.20", 'lazy-importer>=0.1; python_version < "3.15"'])
    fake_wheel(tmp_path, "zipp", ['pytest; extra == "test"', 'colorama; sys_platform == "win32"'])
    fake_wheel(tmp_path, "diffusers", ["numpy", "Pillow", "huggingface-hub<3.0,>=1.32.0"])
    assert bundle.requirements_met(tmp_path) == [
        'lazy-importer>=0.1; python_version < "3.15" (for importlib_metadata)'
    ]
    fake_wheel(tmp_path, "lazy_importer", [])
    assert bundle.requirements_met(tmp_path) == []


WHEELHOUSE = REPO / "build" / "gpu-wheelhouse"
PY312 = Path.home() / ".pyenv" / "versions" / "3.12.1" / "bin" / "python"


@pytest.mark.skipif(not (WHEELHOUSE / "manifest.json").is_file(), reason="no wheelhouse: make gpu-bundle")
@pytest.mark.skipif(not PY312.is_file(), reason="no Python 3.12 on this machine")
def test_the_built_wheelhouse_installs_offline_and_imports_on_python_3_12(tmp_path):
    """What installs there, as there (no index, no dependencies), and imports without torch."""
    wheels = sorted(str(w) for w in WHEELHOUSE.glob("*.whl"))
    subprocess.run(
        [str(PY312), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(tmp_path), *wheels],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    code = "import pydantic, pydantic_core, hjson, importlib_metadata; print(importlib_metadata.version('diffusers'))"
    out = subprocess.run(
        [str(PY312), "-c", code],
        env={"PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.strip() == "0.42.1"
