"""`sdzero cache --hostfile` across two namespace hosts (pdsh over ssh), from a hostile folder with hostile
values in its .deepspeed_env: both remote ranks build their shards in the exact folder (a relative
--data and --out mean what they mean there), every value arrives byte for byte, nothing in a name or value
runs, and the secret appears in no command line (the rank's own and each ancestor's, up to sshd) and no
log. Then one advisor trial through the same hostfile: its ranks run in the trial folder, whatever it is
called, and its profile comes back; and the collectives benchmark the same way.

Before #27 these paths called DeepSpeed's runner directly: `cd <folder>;` split `my runs` and ran
`$(touch pwned)` on every node, quoted values arrived with their quotes, and the token was on the pdsh
command line and in the runner's INFO log.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdzero.cluster.launch_command import REPO_ROOT
from sdzero.models.tiny import write_synthetic_dataset

pytestmark = pytest.mark.multinode

FOLDER = "my runs $(touch pwned) `touch pwned2`; it's"
HOOKS = "hooks $(touch pwned4)"
SECRET = "hf_FAKE_cache_token_5d1e"
ODD = 'it\'s "$HOME" `id` $(touch pwned3) back\\slash'
RECORD = """import json, os
from pathlib import Path

# Imported by every interpreter that has this folder on PYTHONPATH, which only the forwarded values give:
# the real rank (DeepSpeed's per-node launcher and sdzero's rank entry start without it).
def _ancestry():
    pid, lines = os.getpid(), []
    while pid > 1:
        lines.append(Path("/proc", str(pid), "cmdline").read_bytes().replace(b"\\0", b" ").decode("utf-8", "replace"))
        pid = int(Path("/proc", str(pid), "stat").read_text().rsplit(")", 1)[1].split()[1])
    return lines

if "RANK" in os.environ:
    try:
        with open(os.path.join({out!r}, "rank." + os.environ["RANK"] + ".json"), "x") as f:
            json.dump({{"cwd": os.getcwd(), "env": {{k: os.environ.get(k) for k in {keys!r}}},
                       "ancestry": _ancestry()}}, f)
    except FileExistsError:  # a child of the rank (a loader worker), already recorded
        pass
"""
SHARDS = 4


@pytest.fixture(scope="module")
def hostile_cache(cluster, tiny_model, tmp_path_factory):
    base = tmp_path_factory.mktemp("exact-cache")
    work = base / FOLDER
    work.mkdir()
    write_synthetic_dataset(work / "data set", images=4 * SHARDS, size=32)
    out = base / "records"
    out.mkdir()
    hooks = base / HOOKS
    hooks.mkdir()
    user_env = {
        "PYTHONPATH": f"{hooks}{os.pathsep}{REPO_ROOT}",
        "SDZERO_ODD": ODD,
        "HF_TOKEN": SECRET,
    }
    (hooks / "sitecustomize.py").write_text(RECORD.format(out=str(out), keys=sorted(user_env)))
    (work / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in user_env.items()))
    command = [sys.executable, "-m", "sdzero.cli", "cache", "--model", str(tiny_model), "--data", "data set"]
    command += ["--out", "cache out", "--dtype", "fp32", "--shard-size", "4", "--batch-size", "4"]
    done = subprocess.run(
        [*command, "--hostfile", str(cluster.hostfile)],
        cwd=work,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank.*.json"))]
    return {"done": done, "work": work, "base": base, "records": records, "env": user_env}


def test_both_hosts_build_their_shards_in_the_exact_folder(hostile_cache):
    done = hostile_cache["done"]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    index = json.loads((hostile_cache["work"] / "cache out" / "cache.json").read_text())
    assert len(index["samples"]) == 4 * SHARDS
    assert [s["rank"] for s in index["shards"]] == [0, 1] * (SHARDS // 2)  # shard k by rank k % 2
    assert sorted(r["cwd"] for r in hostile_cache["records"]) == [str(hostile_cache["work"])] * 2


def test_values_arrive_byte_for_byte(hostile_cache):
    assert len(hostile_cache["records"]) == 2
    for record in hostile_cache["records"]:
        assert record["env"] == hostile_cache["env"]


def test_nothing_in_a_name_or_value_ran(hostile_cache):
    places = {Path.home(), REPO_ROOT, hostile_cache["base"], hostile_cache["work"], Path("/"), Path.cwd()}
    for place in places:
        for name in ("pwned", "pwned2", "pwned3", "pwned4"):
            assert not (place / name).exists(), place / name


def test_the_secret_is_in_no_command_line_and_no_log(hostile_cache):
    done = hostile_cache["done"]
    logs = done.stdout + done.stderr
    assert "cmd = pdsh" in logs  # DeepSpeed's INFO line with the whole remote command was printed
    assert SECRET not in logs
    for record in hostile_cache["records"]:
        assert len(record["ancestry"]) >= 3  # the rank, deepspeed.launcher.launch, the remote shell
        assert not any(SECRET in line for line in record["ancestry"]), record["ancestry"]
    assert not list(hostile_cache["work"].glob(".sdzero-launch-*"))  # the secrets file is gone


TRIALS = "advise out $(touch pwned5) it's"


@pytest.fixture(scope="module")
def hostfile_trial(cluster, tiny_model, synth_data, exact_zero2, tmp_path_factory):
    """One advisor trial (as the scale-out check runs it) of 2 hosts x 1 rank, from a folder whose
    .deepspeed_env holds a secret, into a trial folder a shell would split and run."""
    from advisor.measure.grid import TrialSpec
    from advisor.measure.trials import TrialSettings, run_trial

    base = tmp_path_factory.mktemp("exact-trial")
    launched_from = base / FOLDER
    launched_from.mkdir()
    (launched_from / ".deepspeed_env").write_text(f"HF_TOKEN={SECRET}\nSDZERO_ODD={ODD}\n")
    trial_dir = base / TRIALS / "z2-fp32-mb1-2hosts"
    trial_dir.mkdir(parents=True)
    settings = TrialSettings(
        model=str(tiny_model),
        data=synth_data,
        steps=2,
        warmup_steps=1,
        trial_timeout_s=150,
        stall_timeout_s=None,
        hostfile=cluster.hostfile,
        hosts=2,
        train_args=("--num-workers", "0"),
    )
    here = os.getcwd()
    os.chdir(launched_from)  # the advisor reads the env file of the folder it runs in, as DeepSpeed did
    try:
        outcome = run_trial(
            TrialSpec(2, "fp32", 1, "none", 1),
            settings,
            exact_zero2,
            trial_dir,
            {"PYTHONPATH": str(REPO_ROOT)},
        )
    finally:
        os.chdir(here)
    return {"outcome": outcome, "base": base, "trial_dir": trial_dir, "launched_from": launched_from}


def test_a_hostfile_trial_measures_in_its_exact_folder(hostfile_trial):
    outcome = hostfile_trial["outcome"]
    assert outcome.status == "ok", f"{outcome.reason}\n{outcome.log_tail}"
    assert outcome.profile is not None and len(outcome.profile["ranks"]) == 2
    assert (hostfile_trial["trial_dir"] / "run" / "metrics.jsonl").is_file()


def test_a_hostfile_trial_runs_nothing_and_logs_no_secret(hostfile_trial):
    log = hostfile_trial["outcome"].log_path.read_text()
    assert "cmd = pdsh" in log and SECRET not in log
    for place in (hostfile_trial["base"], hostfile_trial["launched_from"], hostfile_trial["trial_dir"]):
        for name in ("pwned", "pwned2", "pwned3", "pwned5"):
            assert not (place / name).exists(), place / name
    assert not list(hostfile_trial["trial_dir"].glob(".sdzero-launch-*"))


def test_the_collectives_benchmark_runs_its_remote_ranks_in_a_hostile_work_folder(cluster, tmp_path):
    """`sdzero comm --hostfile` (torch ranks, one per host), its output folder named for a shell to split:
    both hosts' rank measures and rank 0's CSV comes back (before: the same split `cd`)."""
    from advisor.measure.collectives_launch import run_comm

    launched_from = tmp_path / FOLDER
    launched_from.mkdir()
    (launched_from / ".deepspeed_env").write_text(f"HF_TOKEN={SECRET}\n")
    here = os.getcwd()
    os.chdir(launched_from)
    try:
        result = run_comm(
            Path("comm out $(touch pwned6)"),  # relative, as `sdzero comm --out` takes it
            num_ranks=1,
            hostfile=cluster.hostfile,
            backends=["torch"],
            min_bytes=4096,
            max_bytes=65536,
            budget_s=3.0,
            torch_backend="gloo",
        )
    finally:
        os.chdir(here)
    assert result.all_correct and len(result.table) > 0
    log = result.log_paths["torch"].read_text()
    assert "cmd = pdsh" in log and SECRET not in log
    assert not list(tmp_path.rglob("pwned*")) and not (Path.cwd() / "pwned6").exists()
    assert not list(result.log_paths["torch"].parent.glob(".sdzero-launch-*"))
