"""A command from a plain shell (no make, venv not activated) loads the ops `make venv` built, compiling
nothing: the first trainer run or advisor trial must not spend minutes building CPU Adam."""

from __future__ import annotations

import subprocess
import sys

import pytest

import sdzero

pytestmark = pytest.mark.dist

LOAD_CPU_ADAM = (
    "import sdzero\n"
    "from deepspeed.ops.op_builder import CPUAdamBuilder\n"
    "print('LOADED', CPUAdamBuilder().load().__file__)\n"
)


def test_plain_shell_loads_the_prebuilt_op_without_building(tmp_path):
    folder = sdzero.venv_extensions_dir()
    if folder is None or not (folder / "cpu_adam" / "cpu_adam.so").is_file():
        pytest.skip("CPU Adam is not prebuilt in this venv (run `make venv`)")
    before = {p: p.stat().st_mtime_ns for p in (folder / "cpu_adam").glob("*.[os]*")}
    home = tmp_path / "home"
    home.mkdir()
    # What a fresh login shell has: no TORCH_EXTENSIONS_DIR, no venv on PATH, an empty home.
    clean_env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    proc = subprocess.run(
        [sys.executable, "-c", LOAD_CPU_ADAM],
        env=clean_env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = proc.stdout.split("LOADED ", 1)[1].strip()
    assert loaded == str(folder / "cpu_adam" / "cpu_adam.so")
    assert not (home / ".cache" / "torch_extensions").exists()  # nothing built in the default place
    after = {p: p.stat().st_mtime_ns for p in before}
    assert after == before, "the prebuilt op was compiled again"
