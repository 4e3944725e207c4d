"""A hostfile launch from a hostile folder with hostile values, across two namespace hosts (pdsh over ssh):
every remote rank runs in the exact folder with the exact values, nothing in a name runs, and secrets
appear in no command line (the rank's own and each of its ancestors', up to sshd) and no log.

Before sdzero.cluster.remote_launch, DeepSpeed's `cd <folder>;` split `my runs` and ran `$(touch pwned)`
on every node, and `/data/hf cache` arrived as `'/data/hf cache'` with the token printed in the log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdzero.cluster.launch_command import REPO_ROOT

pytestmark = pytest.mark.multinode

FOLDER = "my runs $(touch pwned) `touch pwned2`; it's"
USER_ENV = {
    "HF_HOME": "/data/hf cache",
    "SDZERO_ODD": 'it\'s "$HOME" `id` $(touch pwned3) back\\slash \u00fcber',
    "HF_TOKEN": "hf_FAKE_token_9f3a1c",
}
LAUNCH_ENV = {
    "PYTHON_SDZERO_LINES": "first line\nsecond $line",  # DeepSpeed would export it itself (PYTHON*)
    "MLFLOW_TRACKING_TOKEN": "mlflow_FAKE_secret_77b2",  # a secret DeepSpeed would export (MLFLOW*)
}
SECRETS = ("hf_FAKE_token_9f3a1c", "mlflow_FAKE_secret_77b2")
ECHO_RANK = """import json, os, sys
from pathlib import Path

def ancestry():
    pid, lines = os.getpid(), []
    while pid > 1:
        lines.append(Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\\0", b" ").decode("utf-8", "replace"))
        pid = int(Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[1])
    return lines

keys = {keys!r}
secrets_files = [str(p) for p in Path.cwd().glob(".sdzero-launch-*")]
record = {{
    "cwd": os.getcwd(),
    "argv": sys.argv[1:],
    "env": {{k: os.environ.get(k) for k in keys}},
    "ancestry": ancestry(),
    "secrets_modes": [oct(os.stat(p).st_mode & 0o777) for p in secrets_files],
}}
Path({out!r}, "rank." + os.environ["RANK"] + ".json").write_text(json.dumps(record))
"""
DRIVER = """import sys
from pathlib import Path
from sdzero.cluster.hostfile import describe, plan_launch
plan = plan_launch(Path(sys.argv[1]), ["--odd", "a b", "$x"], entry=Path(sys.argv[2]))
print("\\n".join(describe(plan)), flush=True)
print("+ " + " ".join(plan.command), flush=True)
sys.exit(plan.launch.run())
"""


@pytest.fixture(scope="module")
def hostile_launch(cluster, tmp_path_factory):
    base = tmp_path_factory.mktemp("exact")
    work = base / FOLDER
    work.mkdir()
    (work / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in USER_ENV.items()))
    out = base / "records"
    out.mkdir()
    script = base / "echo_rank.py"
    script.write_text(ECHO_RANK.format(keys=[*USER_ENV, *LAUNCH_ENV], out=str(out)))
    driver = base / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, **LAUNCH_ENV, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, str(driver), str(cluster.hostfile), str(script)],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    records = [
        json.loads((out / f"rank.{r}.json").read_text())
        for r in range(2)
        if (out / f"rank.{r}.json").exists()
    ]
    return {
        "done": done,
        "work": work,
        "base": base,
        "records": records,
        "env_file": (work / ".deepspeed_env"),
    }


def test_both_remote_ranks_ran(hostile_launch):
    done = hostile_launch["done"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert len(hostile_launch["records"]) == 2


def test_each_rank_runs_in_the_exact_folder(hostile_launch):
    for record in hostile_launch["records"]:
        assert record["cwd"] == str(hostile_launch["work"])
        assert record["argv"][1:] == ["--odd", "a b", "$x"] and record["argv"][0].startswith("--local_rank=")


def test_values_arrive_byte_for_byte(hostile_launch):
    for record in hostile_launch["records"]:
        assert record["env"] == {**USER_ENV, **LAUNCH_ENV}


def test_nothing_in_a_name_or_value_ran(hostile_launch):
    places = {Path.home(), REPO_ROOT, hostile_launch["base"], hostile_launch["work"], Path("/"), Path.cwd()}
    for place in places:
        for name in ("pwned", "pwned2", "pwned3"):
            assert not (place / name).exists(), place / name


def test_secrets_in_no_command_line_and_no_log(hostile_launch):
    done = hostile_launch["done"]
    logs = done.stdout + done.stderr
    assert "cmd = pdsh" in logs  # DeepSpeed's INFO line with the whole remote command was printed
    for secret in SECRETS:
        assert secret not in logs
        for record in hostile_launch["records"]:
            assert len(record["ancestry"]) >= 3  # the rank, deepspeed.launcher.launch, the remote shell
            assert not any(secret in line for line in record["ancestry"]), record["ancestry"]
    assert "by a 0600 file, not the command line: HF_TOKEN, MLFLOW_TRACKING_TOKEN" in logs


def test_secrets_file_was_private_and_is_gone(hostile_launch):
    for record in hostile_launch["records"]:
        assert record["secrets_modes"] == ["0o600"]
    assert not list(hostile_launch["work"].glob(".sdzero-launch-*"))


def test_the_users_env_file_is_unchanged_but_for_added_keys(hostile_launch):
    text = hostile_launch["env_file"].read_text()
    assert text.startswith("".join(f"{k}={v}\n" for k, v in USER_ENV.items()))
    assert "GLOO_SOCKET_IFNAME=eth0\n" in text and "'" not in text.split("HF_TOKEN=")[1].split("\n", 1)[1]
