"""The exact hostfile launch without a cluster: the rank entry (sdzero.process.rank_entry) run as a real
process from a real payload word, the secrets file's rules, the runner's environment and the env file's
literal values. The namespace-cluster proof is tests/multinode/test_launch_exact.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdzero.cluster import env_file, remote_launch
from sdzero.errors import UserError
from sdzero.process import rank_entry
from sdzero.process.rank_entry import Payload, decode_payload, encode_payload

ODD_VALUES = {
    "HF_HOME": "/data/hf cache",
    "QUOTES": 'it\'s "$HOME" `id` $(touch pwned) \\ ;',
    "LINES": "one\ntwo\r\nthree",
    "NOT_UTF8": os.fsdecode(b"caf\xe9"),  # a surrogate escape in os.environ: its bytes must survive
}
ECHO = "import json, os, sys; print(json.dumps({'cwd': os.getcwd(), 'argv': sys.argv[1:], 'env': {k: os.environ.get(k) for k in sys.argv[2:]}}))"


def run_entry(tmp_path: Path, payload: Payload, *extra: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONPATH": str(Path(rank_entry.__file__).parents[2])}
    return subprocess.run(
        [sys.executable, "-m", rank_entry.MODULE, *extra, encode_payload(payload)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=60,
    )


def echo_script(tmp_path: Path) -> Path:
    script = tmp_path / "echo.py"
    script.write_text(ECHO.replace("; ", "\n"))
    return script


def test_payload_round_trips_every_value_and_the_word_is_shell_safe():
    from sdzero.cluster.launch_command import SHELL_SAFE

    payload = Payload("/runs/my runs/x$(touch f)", ["train.py", "a b", "$x"], dict(ODD_VALUES), "/s/f.json")
    word = encode_payload(payload)
    assert SHELL_SAFE.match(word) and " " not in word  # nothing DeepSpeed wraps, nothing a shell changes
    assert decode_payload(word) == payload


@pytest.mark.parametrize(
    "word", ["not base64!", "aGVsbG8=", encode_payload(Payload("/", ["x"], {}, None))[:-4]]
)
def test_a_word_not_written_by_sdzero_is_one_line(word):
    with pytest.raises(UserError, match="rank_entry"):
        decode_payload(word)


def test_rank_runs_in_the_exact_folder_with_the_exact_values(tmp_path):
    folder = tmp_path / "my runs $(touch pwned) `touch pwned2`; it's"
    folder.mkdir()
    keys = sorted(ODD_VALUES)
    payload = Payload(str(folder), [str(echo_script(tmp_path)), "a b", *keys], dict(ODD_VALUES), None)
    done = run_entry(tmp_path, payload, "--local_rank=3")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["cwd"] == str(folder)
    assert got["argv"] == ["--local_rank=3", "a b", *keys]  # local rank right after the script
    for key in keys:
        # json.dumps of os.environ: a non-UTF-8 value comes back as its surrogate escape
        assert got["env"][key] == ODD_VALUES[key], key
    assert not list(tmp_path.rglob("pwned*"))


def test_secrets_come_from_a_private_file_only(tmp_path):
    secrets = tmp_path / "s.json"
    secrets.write_text(json.dumps({"HF_TOKEN": "hf_secret"}))
    secrets.chmod(0o600)
    payload = Payload(str(tmp_path), [str(echo_script(tmp_path)), "x", "HF_TOKEN"], {}, str(secrets))
    done = run_entry(tmp_path, payload)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["env"] == {"HF_TOKEN": "hf_secret"}
    secrets.chmod(0o644)  # readable by others: refused, the rank never starts
    refused = run_entry(tmp_path, payload)
    assert refused.returncode == 2 and b"must be this user's with mode 0600" in refused.stderr
    assert refused.stdout == b"" and len(refused.stderr.strip().splitlines()) == 1


def test_missing_secrets_file_says_the_folder_must_be_shared(tmp_path):
    payload = Payload(str(tmp_path), ["x.py"], {}, str(tmp_path / "gone.json"))
    done = run_entry(tmp_path, payload)
    assert done.returncode == 2 and b"storage every host shares" in done.stderr


def test_missing_launch_folder_is_one_line(tmp_path):
    done = run_entry(tmp_path, Payload(str(tmp_path / "nowhere"), ["x.py"], {}, None))
    assert done.returncode == 2 and b"not usable on this host" in done.stderr


def test_forwarded_values_never_replace_what_the_launcher_set_per_rank():
    payload = Payload("/", ["t.py"], {"RANK": "7", "CUDA_VISIBLE_DEVICES": "0,1", "A": "1"}, None)
    _, command, env = rank_entry.prepare(
        ["--local_rank=1", encode_payload(payload)], {"RANK": "3", "CUDA_VISIBLE_DEVICES": "1"}
    )
    assert env["RANK"] == "3" and env["CUDA_VISIBLE_DEVICES"] == "1" and env["A"] == "1"
    assert command[1:] == ["-u", "t.py", "--local_rank=1"]
    module = Payload("/", ["-m", "sdzero.cli", "cache", "--out", "x"], {}, None)
    assert rank_entry.rank_argv(module, ["--local_rank=0"], "py") == [
        "py",
        "-u",
        "-m",
        "sdzero.cli",
        "--local_rank=0",
        "cache",
        "--out",
        "x",
    ]


# -- the launching side


def test_secret_names_go_by_file_and_the_runner_environment_is_clean(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=1\n")
    environ = {"PATH": os.environ["PATH"], "PYTHONPATH": "/my $lib", "NCCL_DEBUG": "INFO", "HOME": "/h"}
    values = {"HF_HOME": "/data/hf cache", "HF_TOKEN": "hf_x", "WANDB_API_KEY": "k", "MY_PASSWORD": "p"}
    launch = remote_launch.remote_launch(
        ["--max-steps", "1"],
        tmp_path / "train.py",
        values,
        tmp_path,
        hostfile=hostfile,
        master_addr="10.0.0.1",
        environ=environ,
    )
    assert launch.secrets == {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "k", "MY_PASSWORD": "p"}
    assert launch.forwarded == {"HF_HOME": "/data/hf cache"}
    line = " ".join(launch.command)
    assert "hf_x" not in line and "HF_TOKEN" not in line and "/data/hf cache" not in line
    payload = decode_payload(launch.command[-1])
    assert payload.env == {"HF_HOME": "/data/hf cache"} and payload.secrets_file == str(launch.secrets_file)
    assert launch.secrets_file is not None and launch.secrets_file.parent == tmp_path
    # What DeepSpeed would export from the launching environment is gone; it reads no env file at all.
    assert "PYTHONPATH" not in launch.runner_env and "NCCL_DEBUG" not in launch.runner_env
    assert launch.runner_env["DS_ENV_FILE"] == os.devnull and launch.runner_env["HOME"] == "/h"
    assert launch.command[launch.command.index("--hostfile") + 1] == str(hostfile)  # absolute


def test_run_writes_secrets_0600_and_removes_them_with_the_runners_exit_code(tmp_path):
    seen = tmp_path / "seen"
    script = f"import os, stat, sys; p = sys.argv[1]; open({str(seen)!r}, 'w').write(oct(stat.S_IMODE(os.stat(p).st_mode)) + open(p).read()); sys.exit(3)"
    secrets = tmp_path / ".sdzero-launch-test.json"
    launch = remote_launch.RemoteLaunch(
        [sys.executable, "-c", script, str(secrets)],
        tmp_path,
        dict(os.environ),
        {},
        {"HF_TOKEN": "t"},
        secrets,
    )
    assert launch.run() == 3
    assert seen.read_text() == '0o600{"HF_TOKEN": "t"}' and not secrets.exists()


def test_a_planted_secrets_file_is_never_written_through(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    planted = tmp_path / ".sdzero-launch-x.json"
    planted.symlink_to(victim)
    launch = remote_launch.RemoteLaunch(["true"], tmp_path, {}, {}, {"HF_TOKEN": "t"}, planted)
    with pytest.raises(UserError, match="already exists"):
        launch.run()
    assert victim.read_text() == "untouched" and planted.is_symlink()  # nor removed


def test_run_reports_a_signalled_runner_as_128_plus_the_signal(tmp_path):
    launch = remote_launch.RemoteLaunch(
        [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"],
        tmp_path,
        dict(os.environ),
        {},
        {},
        None,
    )
    assert launch.run() == 137


def test_forwarded_values_follow_deepspeeds_order(tmp_path):
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    (home / ".deepspeed_env").write_text("A=home\nB=home\n")
    (work / ".deepspeed_env").write_text("B=work\n")
    environ = {
        "PYTHONX": "launch",
        "A": "ignored: not a name DeepSpeed exports",
        "MLFLOW_TRACKING_TOKEN": "m",
    }
    got = remote_launch.forwarded_values(work, environ, home=home)
    assert got == {"PYTHONX": "launch", "MLFLOW_TRACKING_TOKEN": "m", "A": "home", "B": "work"}
    named = remote_launch.forwarded_values(work, {"DS_ENV_FILE": ".other"}, home=home)
    assert named == {}  # DeepSpeed's DS_ENV_FILE names the file in both folders


def test_our_prefixes_cover_what_the_installed_deepspeed_exports():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.runner import EXCLUDE_ENVS, EXPORT_ENVS

    for prefix in [*EXPORT_ENVS, *get_accelerator().export_envs()]:
        assert prefix.startswith(remote_launch.DEEPSPEED_EXPORTED_PREFIXES), prefix
    assert {k: tuple(v) for k, v in EXCLUDE_ENVS.items()} == remote_launch.DEEPSPEED_EXCLUDED


@pytest.mark.parametrize("what", ["interpreter", "repo"])
def test_an_install_path_a_shell_would_change_is_refused(tmp_path, monkeypatch, what):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("n1 slots=1\n")
    if what == "interpreter":
        monkeypatch.setattr(remote_launch.sys, "executable", "/opt/my env/bin/python")
    else:
        monkeypatch.setattr(remote_launch, "REPO_ROOT", Path("/opt/x$(id)"))
    with pytest.raises(UserError, match="writes it unquoted into every node's command"):
        remote_launch.remote_launch([], tmp_path / "t.py", {}, tmp_path, hostfile=hostfile, master_addr="h")


# -- the env file: literal values


@pytest.mark.parametrize("line", ["HF_HOME='/data/hf cache'", 'HF_HOME="/data/hf cache"'])
def test_a_quoted_value_is_refused_with_the_unquoted_line(tmp_path, line):
    path = tmp_path / ".deepspeed_env"
    path.write_text(line + "\n")
    with pytest.raises(UserError, match="write HF_HOME=/data/hf cache"):
        env_file.read_env_file(path)


def test_values_a_line_cannot_hold_are_not_written_but_reported(tmp_path):
    path = tmp_path / ".deepspeed_env"
    merge = env_file.merge_env_file(path, {"A": "x\ny", "B": " padded", "C": "/data/hf cache"})
    assert path.read_text() == "C=/data/hf cache\n"
    assert merge.not_written == {"A": "x\ny", "B": " padded"} and merge.added == {"C": "/data/hf cache"}


def test_env_file_not_utf8_is_one_line(tmp_path):
    path = tmp_path / ".deepspeed_env"
    path.write_bytes(b"A=caf\xe9\n")
    with pytest.raises(UserError, match="byte 5 is not UTF-8"):
        env_file.read_env_file(path)
