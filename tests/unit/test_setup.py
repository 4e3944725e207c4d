"""Set-up that holds outside make: the venv's JIT-op folder and build tools are found from a plain shell."""

from __future__ import annotations

import os
import sys

import sdzero


def test_venv_folder_is_used_when_unset_and_present(monkeypatch, tmp_path):
    (tmp_path / "torch_extensions").mkdir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    env = {"PATH": "/usr/bin:/bin"}
    sdzero.use_venv_build_tools(env)
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "torch_extensions")
    # ninja (pip-installed into the venv) is found, after the user's own tools.
    assert env["PATH"].split(os.pathsep) == ["/usr/bin", "/bin", str(tmp_path / "bin")]
    sdzero.use_venv_build_tools(env)
    assert env["PATH"].count(str(tmp_path / "bin")) == 1


def test_users_own_folder_is_kept_and_nothing_set_without_a_built_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    env = {"PATH": "/bin"}
    sdzero.use_venv_build_tools(env)  # no torch_extensions folder yet: DeepSpeed's own default stays
    assert env == {"PATH": "/bin"}
    (tmp_path / "torch_extensions").mkdir()
    env = {"PATH": "/bin", "TORCH_EXTENSIONS_DIR": "/mine"}
    sdzero.use_venv_build_tools(env)
    assert env["TORCH_EXTENSIONS_DIR"] == "/mine"


def test_outside_a_venv_nothing_is_set(monkeypatch):
    monkeypatch.setattr(sys, "base_prefix", sys.prefix)
    assert sdzero.venv_extensions_dir() is None
    env: dict[str, str] = {}
    sdzero.use_venv_build_tools(env)
    assert env == {}
