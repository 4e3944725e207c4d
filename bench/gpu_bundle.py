"""`make gpu-bundle`: a wheelhouse for an offline GPU machine whose image lacks sdzero's DeepSpeed side.

The image it is for: Python 3.12 on x86-64 with CUDA torch (2.11, CUDA 13) and nvcc, and most of sdzero's
dependencies (numpy, pandas, matplotlib, transformers, accelerate, safetensors, typer, rich, jinja2, pyyaml,
huggingface-hub, einops, msgpack, ninja, psutil, py-cpuinfo, tqdm), but no deepspeed, diffusers, hjson or
pydantic and no network. The wheelhouse holds exactly what is missing, at the versions the tests passed
with (requirements/lock.txt):

- deepspeed, built here as a wheel from its sdist (`pip wheel --no-deps`: pure Python, its CUDA ops are
  built just in time there, where nvcc is);
- diffusers, hjson, pydantic and what those need that the image lacks (MISSING_ON_IMAGE), downloaded as
  Python 3.12 manylinux wheels with `--no-deps`, so nothing the image has (torch above all) is fetched.

    python bench/gpu_bundle.py [--out build/gpu-wheelhouse] [--max-mib 40]

Writes the wheels and `manifest.json` (each file's bytes and sha256, the total) into --out, replacing an
earlier bundle; refuses (exit 2, one line) a bundle over --max-mib. bench/gpu_first_run.py installs it
there with `pip install --no-index --no-deps --target`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "build" / "gpu-wheelhouse"
MAX_MIB = 40.0
PYTHON_VERSION = "3.12"
PLATFORMS = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
BUILT_HERE = ("deepspeed",)
"""sdists, built into wheels on this machine."""
MISSING_ON_IMAGE = (
    "diffusers",
    "hjson",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "importlib-metadata",
    "lazy-importer",
    "zipp",
    "typing-extensions",
)
"""Downloaded as wheels: diffusers, hjson and pydantic, and their requirements the image lacks
(importlib-metadata for diffusers, with its lazy-importer and a zipp new enough; pydantic-core,
annotated-types and typing-inspection for pydantic; a typing-extensions new enough for pydantic-core, which
shadows an older one only on the bundle's path). `requirements_met` checks the list is complete."""
ON_IMAGE = (
    "torch", "numpy", "pillow", "filelock", "huggingface-hub", "regex", "requests", "safetensors",
    "einops", "msgpack", "ninja", "packaging", "psutil", "py-cpuinfo", "tqdm",
)  # fmt: skip
"""What the bundle's wheels require that the image has (its package list): never bundled."""
TARGET_MARKERS = {
    "python_version": PYTHON_VERSION,
    "python_full_version": f"{PYTHON_VERSION}.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
"""The image's environment markers, for the wheels' conditional requirements."""


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pinned(names: tuple[str, ...], lock: Path) -> list[str]:
    """`name==version` for each name, at the lock's version (the tested one); a bare name where unpinned."""
    pins = {}
    for line in lock.read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==", 1)
            pins[normalize(name)] = version.strip()
    return [f"{n}=={pins[normalize(n)]}" if normalize(n) in pins else n for n in names]


def pip(*args: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = [line for line in proc.stderr.splitlines() if line.strip() and "is ignored" not in line][-3:]
        raise SystemExit(f"gpu_bundle: `{' '.join(cmd[2:5])} ...` failed: {' | '.join(tail)}")


def requirements_met(folder: Path) -> list[str]:
    """Requirements of the wheels in `folder`, on the image, that neither another wheel there nor the
    image's own packages (ON_IMAGE) provide: empty for a complete bundle."""
    import zipfile

    from packaging.requirements import Requirement

    bundled = {normalize(w.name.split("-")[0]) for w in folder.glob("*.whl")}
    have = bundled | {normalize(n) for n in ON_IMAGE}
    missing = []
    for wheel in sorted(folder.glob("*.whl")):
        with zipfile.ZipFile(wheel) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            lines = z.read(meta).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate(TARGET_MARKERS):
                continue  # an extra, or another Python or platform
            if normalize(req.name) not in have:
                missing.append(f"{req} (for {wheel.name.split('-')[0]})")
    return missing


def manifest(folder: Path) -> dict:
    files = {}
    for wheel in sorted(folder.glob("*.whl")):
        files[wheel.name] = {
            "bytes": wheel.stat().st_size,
            "sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
        }
    return {
        "python": PYTHON_VERSION,
        "platforms": list(PLATFORMS),
        "files": files,
        "total_bytes": sum(f["bytes"] for f in files.values()),
    }


def build(out: Path, max_mib: float, lock: Path) -> dict:
    """The wheelhouse in a temporary folder beside `out`, renamed into place once complete and in size."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as tmp:
        stage = Path(tmp) / "wheels"
        stage.mkdir()
        # --no-build-isolation: DeepSpeed's setup.py imports torch, which this venv has (an isolated build
        # would download a CUDA torch just to build a pure-Python wheel)
        pip("wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(stage), *pinned(BUILT_HERE, lock))
        platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
        pip(
            "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", PYTHON_VERSION,
            "--implementation", "cp", *platforms, "-d", str(stage), *pinned(MISSING_ON_IMAGE, lock),
        )  # fmt: skip
        missing = requirements_met(stage)
        if missing:
            raise SystemExit(
                f"gpu_bundle: the wheels need {', '.join(missing)}, neither bundled nor on the image; add "
                "them to MISSING_ON_IMAGE (or ON_IMAGE, if the image has them)"
            )
        record = manifest(stage)
        size_mib = record["total_bytes"] / 2**20
        if size_mib > max_mib:
            raise SystemExit(f"gpu_bundle: the wheelhouse is {size_mib:.1f} MiB, over --max-mib {max_mib:g}")
        (stage / "manifest.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the wheelhouse folder (replaced)")
    p.add_argument("--max-mib", type=float, default=MAX_MIB, help="refuse a bundle larger than this")
    p.add_argument("--lock", type=Path, default=REPO / "requirements" / "lock.txt", help="versions to pin")
    a = p.parse_args()
    try:
        record = build(a.out, a.max_mib, a.lock)
    except SystemExit as exc:
        print(exc, file=sys.stderr)
        return 2
    for name, entry in record["files"].items():
        print(f"{entry['bytes'] / 2**20:8.2f} MiB  {name}")
    print(f"{record['total_bytes'] / 2**20:8.2f} MiB  total in {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
